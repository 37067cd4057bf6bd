"""examples/speculative_decode.py on the CPU (small sizes): every step's logits agree with the
dense PyTorch model. Skipped where torch is not installed; the GPU form is in test_engine_cuda.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import speculative_decode  # noqa: E402


def test_example_on_the_cpu(capsys):
    assert speculative_decode.main(["--steps", "3", "--layers", "2", "--batch", "2", "--prompt", "40"]) == 0
    assert "tokens/s" in capsys.readouterr().out
