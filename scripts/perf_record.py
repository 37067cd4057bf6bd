#!/usr/bin/env python3
"""The performance record, generated from the results files (bench/results/*.json, written by
dcpmla_bench and dcpmla_dcp_bench: {"meta": {...}, "rows": [...]}, null = not measured).

    scripts/perf_record.py table [--check]   the current table in docs/perf.md (between its markers)
    scripts/perf_record.py plots             docs/img/roofline.svg and docs/img/dcp_scaling.svg

The current table holds, for every shape, the row of the newest file (meta.date) that measured
it, with a link to that file. The record is the anchors' card's (CARD: FlashMLA's times were taken
on it, and the table divides by them): a file whose meta.gpu names another card stays out (its
comparisons of trees are bench/NOTES.md's). Files from before the metadata wrote 0 (baseline_us, speedup) or
-1 (rel_l2_vs_baseline) for a baseline that was not run; those count as not measured too.
"""
import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
ANCHORS = ROOT / "bench" / "anchors" / "flashmla_h200.json"
CARD = "H200"  # the card of the anchors and of the record
PERF_MD = ROOT / "docs" / "perf.md"
IMG = ROOT / "docs" / "img"
BEGIN, END = "<!-- perf_record.py table: begin -->", "<!-- perf_record.py table: end -->"


# What the table and the plots read of a row; a row without one fails here, naming its file.
ATTENTION_KEYS = ("name", "batch", "context", "heads", "qlen", "kv_dtype", "route", "variant", "us", "kv_GBps",
                  "TFLOPs")
DCP_KEYS = ("name", "heads_local", "qlen", "world_size", "attention_us")
NUMBERS = ("us", "graph_us", "sync_us", "kv_GBps", "TFLOPs", "copy_ratio", "gemm_ratio", "copy_GBps", "gemm_TFLOPs",
           "baseline_us", "speedup", "world_size", "attention_us")  # formatted or divided: a number or null
JSON_TYPES = {dict: "an object", list: "an array", str: "a string", int: "a number", float: "a number",
              bool: "a boolean", type(None): "null"}


def read(path):
    """A results file's (meta, rows), or None where it is not a run of the defaults. Exits with the
    file's name and what is wrong, rather than a traceback from the table that names no file."""
    def bad(what):
        sys.exit(f"{path}: {what}")

    try:
        data = json.loads(path.read_text(), parse_constant=lambda c: bad(f"not strict JSON ({c})"))
    except json.JSONDecodeError as e:
        bad(f"not JSON ({e})" if e.doc.strip() else "empty")
    except (OSError, UnicodeDecodeError) as e:
        bad(f"cannot be read ({e})")
    if not isinstance(data, dict):
        bad(f"not a JSON object but {JSON_TYPES.get(type(data), type(data).__name__)}")
    if "benchmarks" in data:  # Google Benchmark's own format (make bench-plan): its own section
        return None
    meta, rows = data.get("meta"), data.get("rows")
    if not isinstance(meta, dict):
        bad('no "meta" object')
    if not isinstance(meta.get("date"), str):
        bad("meta.date is missing or not a string")
    if not isinstance(rows, list):
        bad('no "rows" array')
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            bad(f"rows[{i}] is not an object")
    if rows and "form" in rows[0]:  # dcpmla_wgmma_probe's rates: bench/NOTES.md
        return None
    if rows and "schedule" in rows[0]:  # a schedule-cost grid, not the defaults: NOTES
        return None
    if rows and "tree" in rows[0]:  # an ab of several trees (device.sh ab): NOTES
        return None
    # A measuring build: no loads (probe_no_fill: wrong results) or stamps that perturb the
    # kernel (probe: the timeline's clock stamps): not the library's times, NOTES.
    if meta.get("probe_no_fill") or meta.get("probe"):
        return None
    if isinstance(meta.get("gpu"), str) and CARD not in meta["gpu"]:  # another card: NOTES
        return None
    dcp = bool(rows) and "attention_us" in rows[0]
    if dcp and not isinstance(meta.get("gpu"), str):
        bad("meta.gpu is missing or not a string")
    for i, row in enumerate(rows):
        missing = [key for key in (DCP_KEYS if dcp else ATTENTION_KEYS) if key not in row]
        if missing:
            bad(f"rows[{i}] ({row.get('name', 'no name')}) lacks {', '.join(missing)}")
        if not isinstance(row["name"], str):
            bad(f"rows[{i}].name is not a string")
        for key in NUMBERS:
            if not isinstance(row.get(key), (int, float, type(None))):
                bad(f"rows[{i}] ({row['name']}).{key} is {JSON_TYPES[type(row[key])]}, not a number or null")
    return meta, rows


def load():
    """(attention files, dcp files), each a list of (path, meta, rows), oldest first."""
    runs = []
    for path in sorted(RESULTS.glob("*.json")):
        record = read(path)
        if record is not None:
            runs.append((path, *record))
    runs.sort(key=lambda run: (run[1]["date"], run[0].name))
    dcp = [run for run in runs if run[2] and "attention_us" in run[2][0]]
    return [run for run in runs if run not in dcp], dcp


def measured(row, key):
    value = row.get(key)
    legacy_unset = key in ("baseline_us", "speedup") and value == 0 or key == "rel_l2_vs_baseline" and value == -1
    return None if value is None or legacy_unset else value


def current_rows(runs):
    """{shape: (row, path, meta)} from the newest run that measured each shape, in first-seen order."""
    newest = {}
    for path, meta, rows in runs:
        for row in rows:
            newest[row["name"]] = (row, path, meta)
    return newest


def fmt(value, spec):
    return "–" if value is None else format(value, spec)


def table(runs):
    """The current rows; FlashMLA's time (bench/anchors) and its ratio to ours (> 1: dcpmla is faster)
    where the anchors measured the same shape."""
    flashmla = json.loads(ANCHORS.read_text())["us"]
    lines = ["| shape | batch | context | heads | qlen | kv | route | variant | µs | graph µs | sync µs | KV GB/s "
             "| TFLOP/s | ×copy | ×GEMM | FlashMLA µs | ×FlashMLA | baseline µs | speedup | measured | results |",
             "|" + "---|" * 21]
    for name, (r, path, meta) in current_rows(runs).items():
        anchor = flashmla.get(name)
        lines.append("| " + " | ".join([
            name, str(r["batch"]), str(r["context"]), str(r["heads"]), str(r["qlen"]), r["kv_dtype"], r["route"],
            r["variant"], fmt(r["us"], ".1f"), fmt(r.get("graph_us"), ".1f"), fmt(r.get("sync_us"), ".1f"),
            fmt(r["kv_GBps"], ".0f"), fmt(r["TFLOPs"], ".1f"),
            fmt(measured(r, "copy_ratio"), ".2f"), fmt(measured(r, "gemm_ratio"), ".2f"),
            fmt(anchor, ".1f"), fmt(anchor / r["us"] if anchor and r["us"] else None, ".2f"),
            fmt(measured(r, "baseline_us"), ".1f"), fmt(measured(r, "speedup"), ".2f"),
            meta["date"][:16].replace("T", " "), f"[{path.name}](../bench/results/{path.name})"]) + " |")
    return "\n".join(lines)


def dcp_note(dcp):
    if not dcp:
        sys.exit(f"{RESULTS}: no DCP results file (dcpmla_dcp_bench --json)")
    path, meta, _ = dcp[-1]
    return (f"DCP scaling (plot below): [{path.name}](../bench/results/{path.name}), {meta['gpu']}, "
            f"{meta['date'][:16].replace('T', ' ')}.")


def write_table(check):
    attention, dcp = load()
    text = PERF_MD.read_text()
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    new = f"{head}{BEGIN}\n{table(attention)}\n\n{dcp_note(dcp)}\n{END}{tail}"
    if check:
        if new != text:
            sys.exit("docs/perf.md: the current table is not what bench/results/ holds; run `make perf-table`")
        return
    PERF_MD.write_text(new)


def plots():
    import matplotlib

    matplotlib.use("svg")
    import matplotlib.pyplot as plt

    plt.rcParams["svg.hashsalt"] = "dcpmla"  # the same SVG for the same data
    IMG.mkdir(exist_ok=True)
    attention, dcp = load()
    # A shape whose current row did not measure its rate (null: not measured) has no point to plot.
    shapes = [(name, run) for name, run in current_rows(attention).items()
              if run[0]["TFLOPs"] is not None and run[0]["kv_GBps"]]
    if not shapes or not dcp:
        sys.exit(f"{RESULTS}: " + ("no shape with a measured rate to plot" if dcp else "no DCP results file"))

    # Roofline per shape: achieved TFLOP/s at its arithmetic intensity (FLOP per KV byte)
    # under the ceilings its own run measured (device copy rate, cuBLAS bf16 GEMM).
    cols = 4
    fig, axes = plt.subplots((len(shapes) + cols - 1) // cols, cols, figsize=(4 * cols, 3.2 * ((len(shapes) + cols - 1) // cols)),
                             squeeze=False)
    for ax, (name, (r, path, meta)) in zip(axes.flat, shapes):
        intensity = r["TFLOPs"] * 1e3 / r["kv_GBps"]  # FLOP / byte
        copy, gemm = measured(r, "copy_GBps"), measured(r, "gemm_TFLOPs")
        if copy and gemm:
            xs = [intensity / 16, copy and gemm * 1e3 / copy, intensity * 16]
            xs = sorted(x for x in xs if x)
            ax.plot(xs, [min(copy * x / 1e3, gemm) for x in xs], color="grey", label="roof (copy, GEMM)")
        ax.plot([intensity], [r["TFLOPs"]], "o", color="C0", label="dcpmla")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(f"{name} ({r['kv_dtype']})", fontsize=9)
        ax.set_xlabel("FLOP per KV byte", fontsize=8)
        ax.set_ylabel("TFLOP/s", fontsize=8)
        ax.tick_params(labelsize=7)
        if r["us"] is not None:
            ax.annotate(f"{r['us']:.0f} µs", (intensity, r["TFLOPs"]), fontsize=7, xytext=(4, -10),
                        textcoords="offset points")
    for ax in axes.flat[len(shapes):]:
        ax.set_visible(False)
    axes.flat[0].legend(fontsize=7)
    fig.suptitle("Roofline per shape (the current table of docs/perf.md)")
    fig.tight_layout()
    fig.savefig(IMG / "roofline.svg", metadata={"Date": None})
    plt.close(fig)

    # DCP scaling: one rank's attention over its 1/N share, against 1/N of the N = 1 time.
    path, meta, rows = dcp[-1]
    fig, ax = plt.subplots(figsize=(6, 4))
    series = sorted({(r["heads_local"], r["qlen"]) for r in rows})
    for i, (h, q) in enumerate(series):
        pts = sorted((r["world_size"], r["attention_us"]) for r in rows
                     if (r["heads_local"], r["qlen"]) == (h, q) and r["attention_us"] is not None and r["world_size"])
        if not pts:
            continue
        ax.plot([n for n, _ in pts], [us for _, us in pts], "o-", color=f"C{i}", label=f"{h} heads/rank, qlen {q}")
        ax.plot([n for n, _ in pts], [pts[0][1] / n for n, _ in pts], ":", color=f"C{i}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("world size N")
    ax.set_ylabel("per-rank attention µs")
    ax.set_title(f"DCP: one rank's share (dotted: 1/N of N = 1)\n{path.name}, {meta['gpu']}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(IMG / "dcp_scaling.svg", metadata={"Date": None})
    plt.close(fig)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["table", "plots"])
    parser.add_argument("--check", action="store_true", help="table: fail if docs/perf.md is not current")
    args = parser.parse_args()
    write_table(args.check) if args.what == "table" else plots()
