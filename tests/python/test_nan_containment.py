"""NaN containment through the Python entry point (docs/design.md, "Choices"): a NaN in one
request's q or kv makes exactly the (row, head) cells that read it NaN (out and lse), and
leaves every other cell of every request bit-identical to the clean run -- on each route,
with both merge forms, on one and on several ranks."""

from __future__ import annotations

import numpy as np
import pytest

import dcpmla
from split_cut import SPLIT_MIN_SEGMENT

LENS = np.array([300, 3, 0, 41], dtype=np.int32)  # long, exactly qlen, padding, medium
B, QLEN, H, D = len(LENS), 3, 4, 576


def run(q, kv, **kw):
    """The split_k runs cut the long request (rank 0 holds 76-300 of its tokens: two tiles or more)."""
    out, lse, _, pieces = dcpmla._mla_attention_with_plans(q, kv, LENS, mode="verify", block_size=16, seed=5,
                                                           min_segment_tokens=SPLIT_MIN_SEGMENT, **kw)
    assert kw["route"] != "split_k" or max(pieces) > 1, f"split_k cut nothing: {pieces}"
    return out, lse


def sees(b, t, p):
    """Row t of request b sees global positions [0, L - qlen + t] (verify)."""
    return LENS[b] > 0 and p <= LENS[b] - QLEN + t


# (what, where the NaN goes, which (b, t, h) cells read it)
POISONS = [
    ("q of one (row, head)", lambda q, kv: q.__setitem__((0, 1, 2, 9), np.nan),
     lambda b, t, h: (b, t, h) == (0, 1, 2)),
    ("q of the request exactly qlen long", lambda q, kv: q.__setitem__((1, 0, 3, 0), np.nan),
     lambda b, t, h: (b, t, h) == (1, 0, 3)),
    ("the last kv token (only the last row sees it)", lambda q, kv: kv.__setitem__((3, 40, 540), np.nan),
     lambda b, t, h: b == 3 and sees(b, t, 40)),
    ("an early kv token's value", lambda q, kv: kv.__setitem__((0, 17, 3), np.nan),
     lambda b, t, h: b == 0 and sees(b, t, 17)),
]


@pytest.mark.parametrize("world,interleave", [(1, 1), (4, 2), (3, 1)])
@pytest.mark.parametrize("merge", ["all_heads", "scatter_heads"])
@pytest.mark.parametrize("route", ["one_stage", "split_k", "two_stage"])
def test_nan_reaches_only_the_cells_that_read_it(route, merge, world, interleave):
    if merge == "scatter_heads" and H % world:
        pytest.skip("scatter_heads needs H % world_size == 0")
    rng = np.random.default_rng(3)
    q0 = rng.standard_normal((B, QLEN, H, D), dtype=np.float32)
    kv0 = rng.standard_normal((B, int(LENS.max()), D), dtype=np.float32)
    kw = dict(route=route, merge=merge, world_size=world, interleave=interleave)
    clean_out, clean_lse = run(q0, kv0, **kw)
    assert np.isfinite(clean_out).all()
    for what, poison, affected in POISONS:
        q, kv = q0.copy(), kv0.copy()
        poison(q, kv)
        out, lse = run(q, kv, **kw)
        mask = np.array([[[affected(b, t, h) for h in range(H)] for t in range(QLEN)] for b in range(B)])
        assert mask.any(), what
        assert np.isnan(lse[mask]).all(), f"{what}: lse of the affected cells {lse[mask]}"
        assert np.isnan(out[mask]).all(), f"{what}: out of the affected cells"
        # Every other cell: the same bits as the clean run (padding stays 0 / -inf).
        np.testing.assert_array_equal(out[~mask].view(np.uint32), clean_out[~mask].view(np.uint32), err_msg=what)
        np.testing.assert_array_equal(lse[~mask].view(np.uint32), clean_lse[~mask].view(np.uint32), err_msg=what)
