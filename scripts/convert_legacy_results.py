#!/usr/bin/env python3
"""One-off: gives the results files written before the benches recorded their metadata (a bare
JSON array of rows) the shape the benches write now, {"meta": {...}, "rows": [...]}, with the
rows' values unchanged. What those runs did not record stays null; "date" is the time of the
commit that added the file (the run was before it), taken from git. A file that already has
"meta" is left alone, so running it twice changes nothing.

    scripts/convert_legacy_results.py bench/results/*.json
"""
import json
import subprocess
import sys
from pathlib import Path


def added_in(path):
    out = subprocess.run(["git", "log", "--diff-filter=A", "--format=%H %cI", "--", str(path)],
                         capture_output=True, text=True, check=True).stdout.split()
    return out[-2], out[-1]  # the first commit that added it


def convert(path):
    rows = json.loads(path.read_text(), parse_constant=lambda c: sys.exit(f"{path}: not strict JSON ({c})"))
    if isinstance(rows, dict):
        return False
    commit, date = added_in(path)
    gpus = {row.pop("gpu") for row in rows if "gpu" in row}  # the DCP rows named it in each row
    meta = {"date": date, "date_source": "the commit that added this file (the run itself was not dated)",
            "commit": None, "recorded_in_commit": commit, "version": None,
            "gpu": gpus.pop() if len(gpus) == 1 else "NVIDIA H200 (file name)",
            "clocks": None, "command": None,
            "note": "written before the benches recorded their metadata; fields they did not record are null"}
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    return True


if __name__ == "__main__":
    for name in sys.argv[1:]:
        print(f"{name}: {'converted' if convert(Path(name)) else 'already has meta'}")
