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


META = {"date": "2026-12-03T00:00:00Z", "commit": "0", "gpu": "H200", "clocks": {}, "command": "dcpmla_bench"}


def row(name, us, **fields):
    """A dcpmla_bench row with what the table reads; its rates made up from us (None: not measured)."""
    rates = {"kv_GBps": None, "TFLOPs": None} if us is None else {"kv_GBps": 4000.0 / us, "TFLOPs": 1e5 / us}
    return {"name": name, "batch": 16, "context": 4096, "heads": 128, "qlen": 1, "kv_dtype": "bf16",
            "route": "one_stage", "variant": "wg64_n64", "us": us, **rates, **fields}


def dcp_row(world_size, attention_us):
    return {"name": f"dcp_rank_h16_q1_n{world_size}", "heads_local": 16, "qlen": 1, "world_size": world_size,
            "attention_us": attention_us}


@pytest.fixture
def perf_record(tmp_path, monkeypatch):
    """The script's module, reading tmp_path/results instead of bench/results."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import perf_record

    (tmp_path / "results").mkdir()
    monkeypatch.setattr(perf_record, "RESULTS", tmp_path / "results")
    monkeypatch.setattr(perf_record, "IMG", tmp_path / "img")
    return perf_record


def test_measuring_builds_stay_out_of_the_record(tmp_path, monkeypatch):
    """A DCPMLA_PROBE_NO_FILL build's records (meta.probe_no_fill) time kernels that load
    nothing, and a probe build's (meta.probe, such as the timeline's clock stamps) kernels
    that the probe slows: the record must never take them for a run."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import perf_record

    meta = {"date": "2026-12-03T00:00:00Z", "commit": "0", "gpu": "H200", "clocks": {}, "command": "dcpmla_bench"}
    (tmp_path / "run.json").write_text(json.dumps({"meta": meta, "rows": [row("decode128", 264.0)]}))
    (tmp_path / "nofill.json").write_text(
        json.dumps({"meta": {**meta, "probe_no_fill": True}, "rows": [{"name": "decode128", "us": 240.0}]}))
    (tmp_path / "stamps.json").write_text(json.dumps(
        {"meta": {**meta, "date": "2026-12-04T00:00:00Z", "probe": "timeline stamps"}, "rows": [row("decode128", 250.0)]}))
    monkeypatch.setattr(perf_record, "RESULTS", tmp_path)
    runs, dcp = perf_record.load()
    assert [path.name for path, _, _ in runs] == ["run.json"] and dcp == []


def test_other_cards_stay_out_of_the_record(perf_record):
    """The table divides by FlashMLA's H200 times: a newer file from another card (an H100 run)
    must not replace the H200 row of the same shape, nor add shapes of its own."""
    results = perf_record.RESULTS
    (results / "h200.json").write_text(json.dumps({"meta": META, "rows": [row("decode128", 226.0)]}))
    h100 = {**META, "date": "2026-12-04T00:00:00Z", "gpu": "NVIDIA H100 80GB HBM3"}
    (results / "h100.json").write_text(json.dumps({"meta": h100, "rows": [row("decode128", 242.0),
                                                                          row("b512_c1024_h128_q1", 289.0)]}))
    attention, _ = perf_record.load()
    assert [path.name for path, _, _ in attention] == ["h200.json"]
    table = perf_record.table(attention)
    assert "| decode128 |" in table and "226.0" in table and "242.0" not in table and "b512_c1024" not in table


@pytest.mark.parametrize("text, wrong", [
    ('{"meta": {"date": "2026-12-03', "not JSON (Unterminated string starting at: line 1 column 19 (char 18))"),
    ("", "empty"),
    ("[]", "not a JSON object but an array"),
    ('{"meta": {"date": 1}, "rows": [NaN]}', "not strict JSON (NaN)"),
    (json.dumps({"rows": [row("decode16", 150.0)]}), 'no "meta" object'),
    (json.dumps({"meta": {"gpu": "H200"}, "rows": [row("decode16", 150.0)]}), "meta.date is missing or not a string"),
    (json.dumps({"meta": {"date": 20261203}, "rows": []}), "meta.date is missing or not a string"),
    (json.dumps({"meta": META}), 'no "rows" array'),
    (json.dumps({"meta": META, "rows": None}), 'no "rows" array'),
    (json.dumps({"meta": META, "rows": [None]}), "rows[0] is not an object"),
    (json.dumps({"meta": META, "rows": [row("decode16", 150.0), {**row("x", 1.0), "name": None}]}),
     "rows[1].name is not a string"),
    (json.dumps({"meta": META, "rows": [{k: v for k, v in row("decode16", 150.0).items() if k != "name"}]}),
     "rows[0] (no name) lacks name"),
    (json.dumps({"meta": META, "rows": [row("decode16", 150.0), {k: v for k, v in row("decode128", 264.0).items()
                                                                 if k != "context"}]}),
     "rows[1] (decode128) lacks context"),
    (json.dumps({"meta": META, "rows": [{**row("decode16", 150.0), "us": "150"}]}),
     "rows[0] (decode16).us is a string, not a number or null"),
    (json.dumps({"meta": {"date": META["date"]}, "rows": [dcp_row(1, 283.0)]}), "meta.gpu is missing or not a string"),
    (json.dumps({"meta": META, "rows": [{k: v for k, v in dcp_row(1, 283.0).items() if k != "world_size"}]}),
     "rows[0] (dcp_rank_h16_q1_n1) lacks world_size"),
], ids=["truncated", "empty", "array", "nan", "no_meta", "no_date", "date_not_string", "no_rows", "rows_null",
        "row_not_object", "name_not_string", "no_name", "no_context", "us_string", "dcp_no_gpu", "dcp_no_world_size"])
@pytest.mark.parametrize("what", ["table", "plots"])
def test_a_bad_results_file_is_named_with_what_is_wrong(perf_record, text, wrong, what):
    """A bad file in bench/results/ stops the table and the plots with `<path>: <what is wrong>`
    (status 1, as sys.exit gives a message), not a traceback that names no file."""
    path = perf_record.RESULTS / "bad.json"
    path.write_text(text)
    with pytest.raises(SystemExit) as stop:
        perf_record.write_table(check=True) if what == "table" else perf_record.plots()
    assert stop.value.code == f"{path}: {wrong}"


def test_bad_file_exits_with_its_path_from_the_command_line(tmp_path):
    """The same from the command line: one line naming the file, exit status 1, no traceback.
    The script reads bench/results/ beside it, so it runs from a copy in tmp_path."""
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "perf_record.py").write_text((ROOT / "scripts" / "perf_record.py").read_text())
    (tmp_path / "bench" / "results").mkdir(parents=True)
    (tmp_path / "bench" / "results" / "bad.json").write_text('{"meta": {"date": "2026-12-03T00:00:00Z"}, "rows"')
    run = subprocess.run([sys.executable, str(tmp_path / "scripts" / "perf_record.py"), "table", "--check"],
                         capture_output=True, text=True)
    assert run.returncode == 1
    assert run.stderr.startswith(f"{tmp_path / 'bench' / 'results' / 'bad.json'}: not JSON (")
    assert "Traceback" not in run.stderr


def test_unmeasured_rows_show_a_dash_and_are_left_out_of_the_plots(perf_record):
    """null is "not measured": a shape FlashMLA anchors (decode16) with a null time shows "–"
    for its time, rates and ratio, FlashMLA's own time still; the roofline leaves it out and
    the DCP plot skips a null point."""
    results = perf_record.RESULTS
    (results / "run.json").write_text(json.dumps({"meta": META, "rows": [row("decode16", None),
                                                                         row("decode128", 264.0)]}))
    (results / "dcp.json").write_text(json.dumps({"meta": META, "rows": [
        dcp_row(1, 283.0), dcp_row(2, None), dcp_row(4, 75.0)]}))
    attention, dcp = perf_record.load()
    lines = {line.split(" | ")[0]: line.split(" | ") for line in perf_record.table(attention).splitlines()}
    decode16 = lines["| decode16"]
    assert decode16[8:13] == ["–"] * 5                  # µs, graph µs, sync µs, KV GB/s, TFLOP/s
    assert decode16[15:17] == ["150.6", "–"]            # FlashMLA µs (bench/anchors), ×FlashMLA
    assert lines["| decode128"][15:17] == ["226.8", f"{226.8 / 264.0:.2f}"]
    perf_record.plots()
    roofline = (perf_record.IMG / "roofline.svg").read_text()
    assert "decode128 (bf16)" in roofline and "decode16 (bf16)" not in roofline
    assert (perf_record.IMG / "dcp_scaling.svg").exists()
