"""Every conformance vector (shared/vectors) through dcpmla.mla_attention, for several
shardings, pagings and routes: the answer must not depend on them (SPEC §5)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import dcpmla
from conftest import vectors_dir
from reference import assert_close, reference_attention
from split_cut import SPLIT_MIN_SEGMENT, cuttable

_DIR = vectors_dir()
CASES = [c["name"] for c in json.loads((_DIR / "index.json").read_text())] if _DIR else []
# The CUDA backend runs the vectors too where it is built and a GPU is present (ctest pytest_cuda
# selects these cases with -k cuda).
DEVICES = ["cpu"] + (["cuda"] if dcpmla.cuda_device_available() else [])

# (world_size, interleave, block_size, route, merge); two_stage falls back to one_stage
# outside verify, scatter_heads to all_heads where H % world_size != 0.
CONFIGS = [
    (1, 1, 64, "auto", "all_heads"),
    (1, 1, 16, "split_k", "all_heads"),
    (2, 1, 16, "one_stage", "all_heads"),
    (2, 1, 64, "auto", "scatter_heads"),
    (2, 1, 1, "two_stage", "all_heads"),
    (3, 2, 16, "split_k", "all_heads"),
    (4, 4, 64, "two_stage", "scatter_heads"),
    (5, 1, 1, "one_stage", "all_heads"),
    (6, 2, 2, "auto", "all_heads"),
    (7, 4, 16, "split_k", "all_heads"),
    (8, 2, 256, "auto", "scatter_heads"),
    (8, 1, 64, "two_stage", "all_heads"),
]


def test_vectors_are_found():
    """Locally the vectors may be absent (skip); under CI their absence is a failure."""
    if not CASES:
        if os.environ.get("CI"):
            pytest.fail("conformance vectors not found: set DCPMLA_VECTORS to shared/vectors")
        pytest.skip("conformance vectors not found (set DCPMLA_VECTORS to shared/vectors)")


def load(name):
    z = np.load(_DIR / f"{name}.npz")
    params = json.loads(str(z["params"]))
    return z, params


@pytest.mark.skipif(not CASES, reason="conformance vectors not found")
@pytest.mark.parametrize("name", CASES)
def test_reference_reproduces_vector(name):
    """The independent reference of tests/python agrees with the vectors' own answers."""
    z, params = load(name)
    out, lse = reference_attention(z["q"], z["kv"], z["seq_lens"], **params)
    assert_close(z["out"], z["lse"], out, lse, bound=1e-5, what=name)


@pytest.mark.skipif(not CASES, reason="conformance vectors not found")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "N{}-I{}-bs{}-{}-{}".format(*c))
@pytest.mark.parametrize("name", CASES)
def test_vector(name, config, device):
    world, interleave, block_size, route, merge = config
    z, params = load(name)
    heads = z["q"].shape[2]
    if route == "two_stage" and params["mode"] != "verify":
        route = "one_stage"
    if merge == "scatter_heads" and heads % world:
        merge = "all_heads"
    out, lse, routes, pieces = dcpmla._mla_attention_with_plans(
        z["q"], z["kv"], z["seq_lens"], world_size=world, interleave=interleave,
        block_size=block_size, route=route, merge=merge, seed=world * 131 + block_size,
        min_segment_tokens=SPLIT_MIN_SEGMENT if route == "split_k" else None, device=device, **params)
    assert out.dtype == np.float32 and lse.dtype == np.float32
    assert_close(out, lse, z["out"].astype(np.float64), z["lse"].astype(np.float64),
                 what=f"{name} N={world} I={interleave} bs={block_size} {route} {merge} {device}")
    if route != "auto":
        assert set(routes) == {route}, f"forced {route}, planners took {routes}"
    if route == "split_k":  # the vectors are short: only N = 1 holds rows long enough to cut
        rows = np.full(len(z["seq_lens"]), z["q"].shape[1])
        can_cut = cuttable(z["seq_lens"], rows, world, interleave)
        assert (max(pieces) > 1) == can_cut, f"pieces per rank {pieces}, expected a cut: {can_cut}"
    # Padding requests: out exactly 0, lse exactly -inf.
    pad = z["seq_lens"] == 0
    assert np.all(out[pad] == 0) and np.all(np.isneginf(lse[pad]))
