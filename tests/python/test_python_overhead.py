"""bench/python_overhead.py, the Python engine API's host time per call, runs on the CPU too: it
must keep working (its CUDA rows run on the GPU machines) and write strict JSON with its metadata."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_python_overhead_bench_runs_on_the_cpu(tmp_path):
    out = tmp_path / "po.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python"))
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "python_overhead.py"), "--device", "cpu", "--calls",
                          "10", "--json", str(out)], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr

    def refuse(token):
        raise ValueError(f"{token} is not JSON")

    data = json.loads(out.read_text(), parse_constant=refuse)
    for key in ("date", "commit", "clocks", "command", "cpu"):
        assert key in data["meta"], key
    names = {r["name"] for r in data["rows"]}
    assert {"run", "run_native", "write_kv", "merge_states", "plan_b128_c4096"} <= names
    assert all(r["us"] > 0 for r in data["rows"])
