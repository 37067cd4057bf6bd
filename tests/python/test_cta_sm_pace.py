"""scripts/cta_sm_pace.py compares the attention CTAs' pace per SM between traced runs: a pace
that belongs to the SM correlates across runs, one that follows the data does not; CTAs with
few tiles are left out, and a shape with fewer than two traced runs is refused."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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
