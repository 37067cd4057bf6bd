"""scripts/cta_sm_pace.py compares the attention CTAs' pace per SM between traced runs: a pace
that belongs to the SM correlates across runs, one that follows the data does not; CTAs with
few tiles are left out, and a shape with fewer than two traced runs is refused."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def results(path, paces, tiles=64, extra=None):
    """A results file with one traced decode16 row: CTA k on SM k runs `tiles` tiles at paces[k]."""
    ctas = {"busy_us": [tiles / p for p in paces], "tiles": [tiles] * len(paces), "sm": list(range(len(paces))),
            "start_us": [0.0] * len(paces), "pieces": [1] * len(paces), "cut_pieces": [0] * len(paces)}
    if extra:
        for k, v in extra.items():
            ctas[k] += v
    path.write_text(json.dumps({"meta": {}, "rows": [{"name": "decode16", "trace": {"ctas": ctas}}]}))
    return str(path)


def run(*args):
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "cta_sm_pace.py"), *args], capture_output=True,
                          text=True)


def correlations(stdout):
    rows = stdout.split("correlation of the per-SM paces:\n")[1].splitlines()
    return [[float(x) for x in row.split(":")[1].split()] for row in rows]


def test_paces_per_sm_correlate_only_where_they_belong_to_the_sm(tmp_path):
    by_sm = [0.40, 0.45, 0.50, 0.42, 0.48, 0.46]
    a = results(tmp_path / "a.json", by_sm)
    b = results(tmp_path / "b.json", [p * 1.01 for p in by_sm])  # the same SMs slow and fast
    c = results(tmp_path / "c.json", list(reversed(by_sm)))      # the opposite
    out = run(a, b, c, "--shape", "decode16")
    assert out.returncode == 0, out.stderr
    corr = correlations(out.stdout)
    assert corr[0][1] > 0.99 and corr[1][0] > 0.99
    assert corr[0][2] < 0 and corr[1][2] < 0
    assert "6 SMs" in out.stdout and "slowest 0.879x" in out.stdout  # 0.40 against the median 0.455


def test_ctas_with_few_tiles_are_left_out(tmp_path):
    # A seventh CTA on SM 6 with 2 tiles: not counted at --min-tiles 8.
    extra = {"busy_us": [1.0], "tiles": [2], "sm": [6], "start_us": [0.0], "pieces": [1], "cut_pieces": [0]}
    a = results(tmp_path / "a.json", [0.4, 0.5, 0.45], extra=extra)
    b = results(tmp_path / "b.json", [0.4, 0.5, 0.45], extra=extra)
    out = run(a, b, "--shape", "decode16")
    assert out.returncode == 0, out.stderr
    assert "3 SMs" in out.stdout


def test_refuses_fewer_than_two_traced_runs(tmp_path):
    a = results(tmp_path / "a.json", [0.4, 0.5, 0.45])
    out = run(a, "--shape", "decode16")
    assert out.returncode != 0 and "fewer than two traced runs" in out.stderr


@pytest.mark.parametrize("text, wrong", [
    (None, "cannot be read (No such file or directory)"),
    ("", "not JSON (Expecting value: line 1 column 1 (char 0))"),
    ("[]", 'not a results file (a JSON object with a "rows" array)'),
    (json.dumps({"meta": {}, "rows": [None]}), "rows[0] is not an object"),
    (json.dumps({"meta": {}, "rows": [{"name": "decode16", "trace": {"ctas": {"busy_us": [1.0], "sm": [0]}}}]}),
     "rows[0] (decode16): trace.ctas lacks tiles"),
    (json.dumps({"meta": {}, "rows": [{"name": "decode16",
                                       "trace": {"ctas": {"busy_us": [1.0, 2.0], "tiles": [8], "sm": [0, 1]}}}]}),
     "rows[0] (decode16): trace.ctas's lists differ in length"),
], ids=["missing", "empty", "array", "row_not_object", "no_tiles", "lengths_differ"])
def test_refuses_a_bad_file_naming_it(tmp_path, text, wrong):
    """A missing or malformed results file: one line, `<path>: <what is wrong>`, no traceback."""
    good = results(tmp_path / "a.json", [0.4, 0.5, 0.45])
    bad = tmp_path / "bad.json"
    if text is not None:
        bad.write_text(text)
    out = run(good, str(bad), "--shape", "decode16")
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.startswith(f"{bad}: {wrong}"), out.stderr


def test_refuses_a_min_tiles_that_leaves_no_cta(tmp_path):
    a = results(tmp_path / "a.json", [0.4, 0.5, 0.45])
    b = results(tmp_path / "b.json", [0.4, 0.5, 0.45])
    out = run(a, b, "--shape", "decode16", "--min-tiles", "100000")
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.startswith(f"decode16: no CTA of at least 100000 tiles (and some time) in {a}, {b}; "
                                 "lower --min-tiles"), out.stderr
    out = run(a, b, "--shape", "decode16", "--min-tiles", "-1")
    assert out.returncode == 2 and "argument --min-tiles: -1 is negative" in out.stderr, out.stderr
