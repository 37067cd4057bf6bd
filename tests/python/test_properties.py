"""Property tests (hypothesis, derandomized so that CI is reproducible): the layout formulas
of SPEC §2 over wide ranges, and small random attention problems against the reference."""

from __future__ import annotations

import numpy as np
import pytest

import dcpmla
from reference import assert_close, reference_attention

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings, strategies as st  # noqa: E402

SETTINGS = dict(derandomize=True, database=None, deadline=None)


def n_r(w, N, r, I):
    """SPEC §2 verbatim: (w / (I N)) I + clamp(w mod (I N) - r I, 0, I)."""
    span = I * N
    return (w // span) * I + min(max(w % span - r * I, 0), I)


@settings(max_examples=300, **SETTINGS)
@given(N=st.integers(1, 8), I=st.integers(1, 64), w=st.integers(0, 2**45))
def test_local_length_formula_and_sum(N, I, w):
    got = [dcpmla.local_length(w, N, r, I) for r in range(N)]
    assert got == [n_r(w, N, r, I) for r in range(N)]
    assert sum(got) == w


@settings(max_examples=300, **SETTINGS)
@given(mode=st.sampled_from(["decode", "verify", "draft"]), N=st.integers(1, 8),
       I=st.integers(1, 16), qlen=st.integers(1, 8), extra=st.integers(0, 10**6),
       pad=st.booleans())
def test_row_local_lengths_from_global_window_end(mode, N, I, qlen, extra, pad):
    if mode == "decode":
        qlen = 1
    L = 0 if pad else qlen + extra
    total = np.zeros(qlen, dtype=np.int64)
    for r in range(N):
        got = dcpmla.row_local_lengths(mode, L, qlen, N, r, I)
        if L == 0:
            want = [0] * qlen
        elif mode == "draft":
            want = [n_r(L, N, r, I)] * qlen
        else:
            want = [n_r(L - qlen + t + 1, N, r, I) for t in range(qlen)]
        assert list(got) == want
        total += got
    if L and mode != "draft":
        assert list(total) == [L - qlen + t + 1 for t in range(qlen)]


@st.composite
def problems(draw):
    mode = draw(st.sampled_from(["decode", "verify", "draft"]))
    qlen = 1 if mode == "decode" else draw(st.integers(1, 6))
    world = draw(st.integers(1, 8))
    interleave = draw(st.sampled_from([1, 2, 3, 4]))
    block = interleave * draw(st.sampled_from([1, 2, 5, 16]))
    routes = ["auto", "one_stage", "split_k"] + (["two_stage"] if mode == "verify" else [])
    heads = draw(st.sampled_from([1, 2, 4, 8]))
    merge = draw(st.sampled_from(["all_heads", "scatter_heads"]))
    if heads % world:
        merge = "all_heads"
    lens = draw(st.lists(st.one_of(st.just(0), st.integers(qlen, qlen + 3 * world * interleave),
                                   st.integers(qlen, 400)), min_size=1, max_size=4))
    return dict(mode=mode, qlen=qlen, world_size=world, interleave=interleave, block_size=block,
                route=draw(st.sampled_from(routes)), heads=heads, merge=merge,
                kv_dtype=draw(st.sampled_from(["bf16", "fp8_e4m3", "fp8_e5m2"])),
                lens=lens, seed=draw(st.integers(0, 2**32)))


@settings(max_examples=40, **SETTINGS)
@given(p=problems())
def test_random_problems_match_reference(p):
    rng = np.random.default_rng(p["seed"])
    lens = np.array(p.pop("lens"), dtype=np.int32)
    qlen, heads = p.pop("qlen"), p.pop("heads")
    q = rng.standard_normal((len(lens), qlen, heads, 576), dtype=np.float32)
    kv = rng.standard_normal((len(lens), int(lens.max()) + 1, 576), dtype=np.float32)
    kv_scale = 0.5 if p["kv_dtype"] != "bf16" else 1.0
    out, lse = dcpmla.mla_attention(q, kv, lens, kv_scale=kv_scale, **p)
    ref_out, ref_lse = reference_attention(q, kv, lens, mode=p["mode"], kv_dtype=p["kv_dtype"],
                                           kv_scale=kv_scale)
    assert_close(out, lse, ref_out, ref_lse, what=str(p))
