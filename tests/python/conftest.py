"""Test helpers: where the dcpmla package and the conformance vectors are found."""

from __future__ import annotations

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent

sys.path.insert(0, str(HERE))  # reference.py
try:
    import dcpmla  # noqa: F401  (installed, or on the path through the venv's .pth)
except ImportError:
    sys.path.insert(0, str(REPO / "python"))  # the in-tree build


def vectors_dir() -> Path | None:
    """$DCPMLA_VECTORS, else shared/vectors inside or beside the repository."""
    candidates = []
    if os.environ.get("DCPMLA_VECTORS"):
        candidates.append(Path(os.environ["DCPMLA_VECTORS"]))
    candidates += [REPO / "shared" / "vectors", REPO.parent / "shared" / "vectors"]
    for c in candidates:
        if (c / "index.json").is_file():
            return c
    return None

