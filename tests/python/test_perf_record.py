"""The performance record is generated, not written by hand: docs/perf.md's current table must
be what bench/results/ holds, and every results file strict JSON with its metadata."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = sorted((ROOT / "bench" / "results").glob("*.json"))


def test_perf_table_is_current():
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "perf_record.py"), "table", "--check"],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


@pytest.mark.parametrize("path", RESULTS, ids=[p.name for p in RESULTS])
def test_results_files_are_strict_json_with_metadata(path):
    def refuse(token):
        raise ValueError(f"{token} is not JSON")

    data = json.loads(path.read_text(), parse_constant=refuse)
    if "benchmarks" in data:  # Google Benchmark's own format (make bench-plan): it dates itself
        assert data["benchmarks"] and "date" in data["context"] and "host_name" in data["context"]
        return
    assert set(data) == {"meta", "rows"} and data["rows"]
    for key in ("date", "commit", "gpu", "clocks", "command"):
        assert key in data["meta"], key
