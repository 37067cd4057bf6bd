"""A benchmark results file (bench/results/*.json) as the analysis scripts read it: its rows, or
an exit naming the file and what is wrong with it, rather than a traceback that names neither."""
import json
import sys


def fail(path, what):
    sys.exit(f"{path}: {what}")


def rows_of(path):
    """The file's "rows", each checked to be an object."""
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as e:
        fail(path, f"cannot be read ({e.strerror})")
    except ValueError as e:  # not JSON, or not UTF-8
        fail(path, f"not JSON ({e})")
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
        fail(path, 'not a results file (a JSON object with a "rows" array)')
    for i, r in enumerate(data["rows"]):
        if not isinstance(r, dict):
            fail(path, f"rows[{i}] is not an object")
    return data["rows"]
