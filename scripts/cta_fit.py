#!/usr/bin/env python3
"""Fits each traced CTA's time to the work the plan gave it, per shape:

    busy_us = a * tiles + b * pieces + c * cut_pieces + d     (least squares)

from a dcpmla_bench --trace results file (each row's trace.ctas: start_us, busy_us, pieces,
cut_pieces, tiles). Prints, per shape: the kernel variant, the CTAs' median and largest time,
the ranges of their tiles and pieces, the fitted costs (a: µs a tile, b: µs a piece, c: µs more
for a piece of a cut request, d: µs a CTA), the fit's rms, the slowest CTA's work and the SMs'
clocks over the CTAs (recorded since the twentieth session). The schedule's cost model counts
a piece in tiles: b / a is the figure to compare with it (bench/NOTES.md, eleventh session),
printed beside the piece the row's plan was dealt with (the row's cost_model, recorded since
the twenty-second session) and flagged where they differ by more than a tile and a half. A
flag is a prompt, not a verdict: the piece that times best is what calibrated_schedule_cost
holds, found with `dcpmla_bench --schedule` (the fp8 64-row kernel's fitted 5 tiles was also
its best; the bf16 64-row kernel fits 3-4 tiles where 2 to 5 time the same; NOTES,
twenty-second session).

    scripts/cta_fit.py bench/results/h200_2026-12-02_s11.json [--only NAME ...]
"""
import argparse
import sys

import numpy as np

from results_file import fail, rows_of

CTA_KEYS = ("busy_us", "tiles", "pieces", "cut_pieces")  # one entry per CTA in each


def traced_rows(path):
    """The rows of a results file that carry trace.ctas; exits naming the file and what is wrong
    with it, rather than a traceback from numpy that names neither."""
    def bad(what):
        fail(path, what)

    rows = []
    for i, r in enumerate(rows_of(path)):
        what, trace = f"rows[{i}] ({r.get('name', 'no name')})", r.get("trace") or {}
        if not isinstance(trace, dict):
            bad(f"{what}: trace is not an object")
        c = trace.get("ctas")
        if not c:
            continue
        if not isinstance(c, dict):
            bad(f"{what}: trace.ctas is not an object")
        missing = [k for k in ("name", "variant") if not isinstance(r.get(k), str)]
        missing += [f"trace.ctas.{k}" for k in CTA_KEYS if k not in c]
        if missing:
            bad(f"{what} lacks {', '.join(missing)}")
        for k in CTA_KEYS + (("mhz",) if c.get("mhz") else ()):
            if not isinstance(c[k], list) or not all(isinstance(v, (int, float)) for v in c[k]):
                bad(f"{what}: trace.ctas.{k} is not a list of numbers")
        if len({len(c[k]) for k in CTA_KEYS}) != 1:
            bad(f"{what}: trace.ctas's lists differ in length")
        if not c["tiles"]:
            bad(f"{what}: trace.ctas holds no CTA")
        rows.append(r)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", help="a dcpmla_bench --json file written with --trace")
    ap.add_argument("--only", nargs="*", default=None, help="these shapes only")
    args = ap.parse_args()
    rows = traced_rows(args.results)
    if not rows:
        sys.exit(f"{args.results}: no row has trace.ctas (run dcpmla_bench with --trace)")
    for r in rows:
        if args.only and r["name"] not in args.only:
            continue
        c = r["trace"]["ctas"]
        busy = np.array(c["busy_us"], dtype=float)
        tiles, pieces, cut = (np.array(c[k], dtype=float) for k in ("tiles", "pieces", "cut_pieces"))
        a = np.stack([tiles, pieces, cut, np.ones_like(tiles)], axis=1)
        coef, _, rank, _ = np.linalg.lstsq(a, busy, rcond=None)
        rms = float(np.sqrt(np.mean((a @ coef - busy) ** 2)))
        k = int(np.argmax(busy))
        per_tile = coef[0] if coef[0] > 0 else float("nan")
        fitted = coef[1] / per_tile
        planned = (r.get("cost_model") or {}).get("piece")
        schedule = ""
        if planned is not None and rank == 4:
            off = abs(fitted - planned) > 1.5
            schedule = f" | schedule's piece {planned:g} tiles" + (" (differs: grid it with dcpmla_bench --schedule)" if off else "")
        print(f"{r['name']:32s} {r['variant']:9s} busy p50 {np.median(busy):7.1f} max {busy.max():7.1f} | "
              f"tiles {int(tiles.min())}-{int(tiles.max())} pieces {int(pieces.min())}-{int(pieces.max())} | "
              f"tile {coef[0]:.2f} piece {coef[1]:.2f} ({fitted:.1f} tiles) cut {coef[2]:+.2f} "
              f"cta {coef[3]:.1f} rms {rms:.2f}{schedule} | slowest: {int(tiles[k])} tiles, {int(pieces[k])} pieces"
              + (f" | clock p50 {np.median(c['mhz']):.0f} MHz ({min(c['mhz']):.0f}-{max(c['mhz']):.0f})" if c.get("mhz") else "")
              + ("" if rank == 4 else " | degenerate (a column is constant or follows the others: the split among them is arbitrary)"))


if __name__ == "__main__":
    main()
