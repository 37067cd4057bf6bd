"""The DCP layout rules (SPEC §2, §3) through the Python API, against brute force."""

from __future__ import annotations

import numpy as np
import pytest

import dcpmla
from reference import reference_attention, round_bf16


def owner(p, N, I):
    return (p // I) % N


def local_index(p, N, I):
    return (p // (I * N)) * I + p % I


def brute_local_length(w, N, r, I):
    return sum(1 for p in range(w) if owner(p, N, I) == r)


@pytest.mark.parametrize("N", range(1, 9))
@pytest.mark.parametrize("I", [1, 2, 3, 4, 16])
def test_local_length_counts_and_sums_to_w(N, I):
    for w in list(range(0, 3 * N * I + 2)) + [1000, 4097]:
        got = [dcpmla.local_length(w, N, r, I) for r in range(N)]
        assert sum(got) == w, (w, N, I, got)
        if w < 200:
            assert got == [brute_local_length(w, N, r, I) for r in range(N)], (w, N, I)


def test_local_length_large_values():
    w = 3 * 2**40 + 5
    assert sum(dcpmla.local_length(w, 8, r, 4) for r in range(8)) == w


def windows(mode, L, qlen):
    if L == 0:
        return [0] * qlen
    if mode == "draft":
        return [L] * qlen
    return [L - qlen + t + 1 for t in range(qlen)]


@pytest.mark.parametrize("mode", ["decode", "verify", "draft"])
@pytest.mark.parametrize("N,I", [(1, 1), (2, 1), (3, 2), (4, 4), (8, 1), (8, 2), (5, 3)])
def test_row_local_lengths_match_brute_force(mode, N, I):
    qlens = [1] if mode == "decode" else [1, 2, 3, 5, 8]
    for qlen in qlens:
        for L in [0] + list(range(qlen, qlen + 2 * N * I + 3)) + [777]:
            total = np.zeros(qlen, dtype=np.int64)
            for r in range(N):
                got = dcpmla.row_local_lengths(mode, L, qlen, N, r, I)
                assert got.dtype == np.int64 and got.shape == (qlen,)
                want = [brute_local_length(w, N, r, I) for w in windows(mode, L, qlen)]
                assert list(got) == want, (mode, L, qlen, N, r, I)
                total += got
            assert list(total) == windows(mode, L, qlen)


def test_negative_control_numbers():
    """SPEC §2: N=2, r=1, L=10, qlen=3: the right rule gives [4, 4, 5]; subtracting qlen-1-t
    from n_r(L) = 5 would give [3, 4, 5]."""
    right = dcpmla.row_local_lengths("verify", 10, 3, 2, 1, 1)
    assert list(right) == [4, 4, 5]
    n_L = dcpmla.local_length(10, 2, 1, 1)
    subtracting = [n_L - (3 - 1 - t) for t in range(3)]
    assert subtracting == [3, 4, 5]
    assert list(right) != subtracting
    # Rank 0's share is [4, 5, 5], where subtracting from its n_r(L) = 5 would give [3, 4, 5]
    # too; the two ranks' shares sum to each row's window.
    r0 = dcpmla.row_local_lengths("verify", 10, 3, 2, 0, 1)
    assert list(r0) == [4, 5, 5]
    assert list(r0 + right) == [8, 9, 10]


def dcp_attention(q, kv, L, qlen, N, I, rule):
    """Numpy DCP simulation of one verify request: each rank attends over the first n of
    its local tokens for each row and the partials are LSE-merged. `rule` picks n."""
    D = q.shape[-1]
    R = 512
    scale = D ** -0.5
    qd = round_bf16(q).astype(np.float64)[0]          # (qlen, H, D)
    kd = round_bf16(kv).astype(np.float64)[0, :L]     # (L, D)
    H = q.shape[2]
    parts_o, parts_lse = [], []
    for r in range(N):
        local = kd[[p for p in range(L) if owner(p, N, I) == r]]   # in local-index order
        if rule == "right":
            lens = dcpmla.row_local_lengths("verify", L, qlen, N, r, I)
        else:
            n_L = dcpmla.local_length(L, N, r, I)
            lens = [max(n_L - (qlen - 1 - t), 0) for t in range(qlen)]
        o = np.zeros((qlen, H, R))
        lse = np.full((qlen, H), -np.inf)
        for t, n in enumerate(lens):
            if n == 0:
                continue
            s = scale * qd[t] @ local[:n].T               # (H, n)
            m = s.max(axis=1, keepdims=True)
            p = np.exp(s - m)
            o[t] = (p / p.sum(axis=1, keepdims=True)) @ local[:n, :R]
            lse[t] = (m + np.log(p.sum(axis=1, keepdims=True)))[:, 0]
        parts_o.append(o)
        parts_lse.append(lse)
    lse_all = np.stack(parts_lse)                         # (N, qlen, H)
    lse = np.logaddexp.reduce(lse_all, axis=0)
    w = np.exp(lse_all - lse)
    o = (w[..., None] * np.stack(parts_o)).sum(axis=0)
    return o[None], lse[None]


def test_negative_control_end_to_end():
    """The right per-row rule reproduces the global reference exactly; the subtracting rule
    does not (it drops one visible token per rank), on the same case."""
    rng = np.random.default_rng(2024)
    L, qlen, N, I, H = 10, 3, 2, 1, 2
    q = rng.standard_normal((1, qlen, H, 576)).astype(np.float32)
    kv = rng.standard_normal((1, L, 576)).astype(np.float32)
    ref_o, ref_lse = reference_attention(q, kv, np.array([L], np.int32), mode="verify")
    o, lse = dcp_attention(q, kv, L, qlen, N, I, "right")
    np.testing.assert_allclose(o, ref_o, rtol=0, atol=1e-12)
    np.testing.assert_allclose(lse, ref_lse, rtol=0, atol=1e-12)
    o_bad, lse_bad = dcp_attention(q, kv, L, qlen, N, I, "subtracting")
    assert np.abs(lse_bad - ref_lse)[0, 0].max() > 1e-2   # row 0 misses tokens
    assert np.abs(o_bad - ref_o)[0, 0].max() > 1e-2
    # And the library itself gets the right answer at world_size 2.
    out, lse_lib = dcpmla.mla_attention(q, kv, np.array([L], np.int32), world_size=2)
    assert np.abs(lse_lib - ref_lse).max() < 1e-2


@pytest.mark.parametrize("N,I,bs", [(1, 1, 1), (1, 1, 16), (2, 1, 4), (3, 2, 4), (4, 4, 16),
                                    (8, 1, 1), (8, 2, 64), (5, 4, 8), (7, 1, 3)])
def test_slot_mapping_bijection(N, I, bs):
    rng = np.random.default_rng(N * 1000 + I * 10 + bs)
    L = 3 * N * bs + 7
    width = -(-L // (bs * N))           # virtual blocks of bs * N global positions
    num_blocks = width + 5
    table = rng.permutation(num_blocks)[:width].astype(np.int32)
    positions = np.arange(L, dtype=np.int64)
    owners = np.full(L, -1)
    for r in range(N):
        slots = dcpmla.slot_mapping(positions, table, bs, num_blocks, N, r, I)
        assert slots.dtype == np.int64 and slots.shape == (L,)
        mine = owner(positions, N, I) == r
        assert np.all(slots[~mine] == -1)
        owned = slots[mine]
        assert np.all((owned >= 0) & (owned < num_blocks * bs))
        assert len(set(owned.tolist())) == owned.size       # injective
        # Onto exactly the rank's first n_r(L) local slots, through the table.
        n = dcpmla.local_length(L, N, r, I)
        want = {int(table[i // bs]) * bs + i % bs for i in range(n)}
        assert set(owned.tolist()) == want
        for p in positions[mine][:50]:
            i = local_index(int(p), N, I)
            assert slots[p] == table[i // bs] * bs + i % bs
        assert np.all(owners[mine] == -1)
        owners[mine] = r
    assert np.all(owners >= 0)                                # every position has one owner


def test_slot_mapping_accepts_lists_and_subsets():
    # Only the new tokens of a step (a verify block) are mapped.
    slots = dcpmla.slot_mapping([5, 6, 7], [3, 0], 4, 4, 2, 1, 1)
    # N=2, I=1: 5, 7 on rank 1 at local 2, 3 -> block table[0] = 3, slots 14, 15; 6 is rank 0's.
    assert list(slots) == [14, -1, 15]


def test_padding_request_has_no_rows():
    for r in range(3):
        assert list(dcpmla.row_local_lengths("verify", 0, 4, 3, r, 2)) == [0, 0, 0, 0]


@pytest.mark.parametrize("mode,seq_len", [("verify", 2**31 - 1), ("draft", 5), ("verify", 0)])
def test_row_local_lengths_bounds_qlen_before_allocating(mode, seq_len):
    # Probe finding 6: qlen = 2**31 - 1 asked for 16 GiB; it is refused before any allocation.
    with pytest.raises(ValueError, match=r"field 'qlen' = 2147483647: expected in \[1, 4096\]"):
        dcpmla.row_local_lengths(mode, seq_len, 2**31 - 1, 1, 0)
