#!/usr/bin/env python3
"""The hottest SASS instructions of an Nsight Compute source page, by warp-stall samples.

    ncu --import rep.ncu-rep --page source --csv --print-source sass > page.csv
    scripts/ncu_hot.py page.csv [--top 30]

Prints, for the instructions holding the most samples until --top rows, the share of all
samples, the samples not issued, and the SASS, so that a stall is named by the instruction
that waits (an mbarrier try-wait on a full stage, a named barrier, a wgmma wait) rather than
by the section's averages. Column names differ between Nsight versions: any column whose name
starts with "Warp Stall Sampling (All" / "(Not" counts, and the instruction text is the
"Source" column.
"""
import argparse
import csv
import sys


def number(text):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def positive(text):
    """A count of at least one, for argparse (a negative --top would slice from the end)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive count")
    return value


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("page", help="the CSV of ncu --page source --csv --print-source sass")
    ap.add_argument("--top", type=positive, default=30, help="rows to print")
    args = ap.parse_args()
    try:
        with open(args.page, newline="") as f:
            lines = [line for line in f if line.startswith('"')]  # ncu prints ==PROF== lines around the table
    except OSError as e:
        sys.exit(f"{args.page}: cannot be read ({e.strerror})")
    except UnicodeDecodeError as e:
        sys.exit(f"{args.page}: not text ({e})")
    # Each kernel's table follows a "Kernel Name" line; the first table is the first launch's.
    header = next((i for i, line in enumerate(lines) if "Warp Stall Sampling" in line), None)
    if header is None:
        sys.exit(f"{args.page}: no source table (ncu's output is in the file)")
    end = next((i for i in range(header + 1, len(lines)) if lines[i].startswith('"Kernel Name"')), len(lines))
    rows = list(csv.DictReader(lines[header:end]))
    if not rows:
        sys.exit(f"{args.page}: no source table (ncu's output is in the file)")
    cols = list(rows[0])
    all_col = next((c for c in cols if c.startswith("Warp Stall Sampling (All")), None)
    not_col = next((c for c in cols if c.startswith("Warp Stall Sampling (Not")), None)
    src_col = next((c for c in cols if c.strip() in ("Source", "# Source")), None)
    addr_col = next((c for c in cols if c.strip() == "Address"), None)
    if all_col is None or src_col is None:
        sys.exit(f"{args.page}: columns {cols} lack the stall samples or the source")
    total = sum(number(r[all_col]) for r in rows) or 1.0
    hot = sorted(rows, key=lambda r: number(r[all_col]), reverse=True)[: args.top]
    print(f"{len(rows)} instructions, {total:.0f} samples; the {len(hot)} hottest:")
    for r in hot:
        share = 100.0 * number(r[all_col]) / total
        not_issued = number(r[not_col]) if not_col else float("nan")
        print(f"{share:5.1f}%  not issued {not_issued:8.0f}  {r.get(addr_col, '') if addr_col else ''}  {r[src_col].strip()}")


if __name__ == "__main__":
    main()
