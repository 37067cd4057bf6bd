#!/usr/bin/env python3
"""Compares the attention CTAs' pace per SM between traced runs of one shape:

    pace = tiles / busy_us of each CTA (CTAs of at least --min-tiles tiles), averaged per SM

from dcpmla_bench --trace results files (each row's trace.ctas: busy_us, tiles, sm). Prints
the correlation of the per-SM paces of every pair of runs (over the SMs both ran), and each
run's spread (slowest and fastest SM against the median). A pace that belongs to the SM
correlates across every pair; one that follows where the data lies correlates only between
runs of the same allocations (bench/NOTES.md, thirteenth session: 0.81-0.93 within a binary,
-0.70 to -0.74 across two).

    scripts/cta_sm_pace.py A.json B.json ... --shape decode16
"""
import argparse
import sys

import numpy as np

from results_file import fail, rows_of


def sm_paces(row, min_tiles):
    c = row["trace"]["ctas"]
    per_sm = {}
    for busy, tiles, sm in zip(c["busy_us"], c["tiles"], c["sm"]):
        if tiles >= min_tiles and busy > 0:
            per_sm.setdefault(sm, []).append(tiles / busy)
    return {sm: float(np.mean(v)) for sm, v in per_sm.items()}


def traced_runs(path, shape):
    """The rows of `shape` in a results file with trace.ctas and SM ids; exits naming the file and
    what is wrong with it, rather than a traceback that names neither."""
    def bad(what):
        fail(path, what)

    rows = []
    for i, r in enumerate(rows_of(path)):
        trace = r.get("trace") or {}
        ctas = trace.get("ctas") if isinstance(trace, dict) else None
        if r.get("name") != shape or not isinstance(ctas, dict) or "sm" not in ctas:
            continue
        missing = [k for k in ("busy_us", "tiles") if k not in ctas]
        if missing:
            bad(f"rows[{i}] ({shape}): trace.ctas lacks {', '.join(missing)}")
        for k in ("busy_us", "tiles", "sm"):
            if not isinstance(ctas[k], list) or not all(isinstance(v, (int, float)) for v in ctas[k]):
                bad(f"rows[{i}] ({shape}): trace.ctas.{k} is not a list of numbers")
        if len({len(ctas[k]) for k in ("busy_us", "tiles", "sm")}) != 1:
            bad(f"rows[{i}] ({shape}): trace.ctas's lists differ in length")
        rows.append(r)
    return rows


def count(text):
    """A non-negative integer, for argparse."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative")
    return value


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", help="dcpmla_bench --json files written with --trace")
    ap.add_argument("--shape", required=True, help="the shape (row name) to compare")
    ap.add_argument("--min-tiles", type=count, default=8, help="CTAs with fewer tiles are left out")
    args = ap.parse_args()
    runs = []
    for path in args.results:
        for r in traced_runs(path, args.shape):
            label = f"{path}" + (f" [{r['tree']} r{r.get('round', '?')}]" if "tree" in r else "")
            runs.append((label, sm_paces(r, args.min_tiles)))
    if len(runs) < 2:
        sys.exit(f"{args.shape}: fewer than two traced runs with SM ids in {args.results}")
    # A run with no CTA left has no pace to compare (numpy would fail on its empty median).
    empty = [label for label, paces in runs if not paces]
    if empty:
        sys.exit(f"{args.shape}: no CTA of at least {args.min_tiles} tiles (and some time) in {', '.join(empty)}; "
                 "lower --min-tiles")
    for i, (label, p) in enumerate(runs):
        v = np.array(list(p.values()))
        print(f"run {i}: {label}: {len(p)} SMs, pace median {np.median(v):.3f} tiles/us, "
              f"slowest {v.min() / np.median(v):.3f}x, fastest {v.max() / np.median(v):.3f}x")
    print("correlation of the per-SM paces:")
    for i in range(len(runs)):
        cells = []
        for j in range(len(runs)):
            sms = sorted(set(runs[i][1]) & set(runs[j][1]))
            a = np.array([runs[i][1][s] for s in sms])
            b = np.array([runs[j][1][s] for s in sms])
            cells.append(f"{np.corrcoef(a, b)[0, 1]:6.2f}" if len(sms) > 2 else "     -")
        print(f"  run {i}: " + " ".join(cells))


if __name__ == "__main__":
    main()
