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


def test_measuring_builds_stay_out_of_the_record(tmp_path, monkeypatch):
    """A DCPMLA_PROBE_NO_FILL build's records (meta.probe_no_fill) time kernels that load
    nothing: the record must never take them for a run."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import perf_record

    meta = {"date": "2026-12-03T00:00:00Z", "commit": "0", "gpu": "H200", "clocks": {}, "command": "dcpmla_bench"}
    (tmp_path / "run.json").write_text(json.dumps({"meta": meta, "rows": [{"name": "decode128", "us": 264.0}]}))
    (tmp_path / "nofill.json").write_text(
        json.dumps({"meta": {**meta, "probe_no_fill": True}, "rows": [{"name": "decode128", "us": 240.0}]}))
    monkeypatch.setattr(perf_record, "RESULTS", tmp_path)
    runs, dcp = perf_record.load()
    assert [path.name for path, _, _ in runs] == ["run.json"] and dcp == []
