"""scripts/cta_fit.py, on synthetic traces whose costs are known: it recovers a CTA's tile and
piece costs, and flags a row whose schedule counted a piece far from what the trace fits."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]


def traced_row(name, planned_piece, rng):
    """132 CTAs whose time is exactly 2 µs a tile and 10 µs a piece (5 tiles) plus 3 µs."""
    tiles = rng.integers(10, 60, 132)
    pieces = rng.integers(1, 5, 132)
    cut = np.minimum(pieces, rng.integers(0, 3, 132))
    busy = 2.0 * tiles + 10.0 * pieces + 3.0
    ctas = {"busy_us": busy.tolist(), "tiles": tiles.tolist(), "pieces": pieces.tolist(),
            "cut_pieces": cut.tolist(), "start_us": [0.1] * 132}
    return {"name": name, "variant": "wg64_n64", "trace": {"ctas": ctas},
            "cost_model": {"piece": planned_piece, "cut": 0.5, "slack": 0.05, "rows_per_unit": 64}}


def test_flags_a_piece_cost_the_trace_does_not_fit(tmp_path):
    rng = np.random.default_rng(3)
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"meta": {}, "rows": [traced_row("planned_2", 2.0, rng),
                                                     traced_row("planned_5", 5.0, rng)]}))
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "cta_fit.py"), str(path)],
                         capture_output=True, text=True, check=True)
    lines = {line.split()[0]: line for line in run.stdout.splitlines()}
    for name in ("planned_2", "planned_5"):
        assert "tile 2.00 piece 10.00 (5.0 tiles)" in lines[name], lines[name]
    assert "schedule's piece 2 tiles (differs" in lines["planned_2"]
    assert "schedule's piece 5 tiles" in lines["planned_5"] and "differs" not in lines["planned_5"]


def _without(mapping, key):
    return {k: v for k, v in mapping.items() if k != key}


_ROW = traced_row("decode16", 5.0, np.random.default_rng(0))
_CTAS = _ROW["trace"]["ctas"]


@pytest.mark.parametrize("text, wrong", [
    (None, "cannot be read (No such file or directory)"),
    ("", "not JSON (Expecting value: line 1 column 1 (char 0))"),
    ('{"meta": {}, "rows": [', "not JSON ("),
    ("[]", 'not a results file (a JSON object with a "rows" array)'),
    (json.dumps({"meta": {}}), 'not a results file (a JSON object with a "rows" array)'),
    (json.dumps({"meta": {}, "rows": [None]}), "rows[0] is not an object"),
    (json.dumps({"meta": {}, "rows": [{**_ROW, "trace": {"ctas": _without(_CTAS, "tiles")}}]}),
     "rows[0] (decode16) lacks trace.ctas.tiles"),
    (json.dumps({"meta": {}, "rows": [_without(_ROW, "variant")]}), "rows[0] (decode16) lacks variant"),
    (json.dumps({"meta": {}, "rows": [{**_ROW, "trace": {"ctas": {**_CTAS, "tiles": _CTAS["tiles"][1:]}}}]}),
     "rows[0] (decode16): trace.ctas's lists differ in length"),
    (json.dumps({"meta": {}, "rows": [{**_ROW, "trace": {"ctas": {**_CTAS, "busy_us": [None] * 132}}}]}),
     "rows[0] (decode16): trace.ctas.busy_us is not a list of numbers"),
    (json.dumps({"meta": {}, "rows": [{**_ROW, "trace": {"ctas": {k: [] for k in _CTAS}}}]}),
     "rows[0] (decode16): trace.ctas holds no CTA"),
], ids=["missing", "empty", "truncated", "array", "no_rows", "row_not_object", "no_tiles", "no_variant",
        "lengths_differ", "busy_null", "no_ctas"])
def test_refuses_a_bad_file_naming_it(tmp_path, text, wrong):
    """A missing or malformed results file: one line, `<path>: <what is wrong>`, no traceback."""
    path = tmp_path / "trace.json"
    if text is not None:
        path.write_text(text)
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "cta_fit.py"), str(path)],
                         capture_output=True, text=True)
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr
    assert run.stderr.startswith(f"{path}: {wrong}"), run.stderr
