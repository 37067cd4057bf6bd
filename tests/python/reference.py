"""An independent float64 reference of SPEC §1 and §3, written from the contract alone.

Attention over *global* windows: no ranks, no pages, no routes. Inputs are rounded the
way the system stores them: q and kv to bf16; kv then to fp8 when asked
(stored = rne(sat(bf16(x) / scale)) in float32, read = stored * scale).

Shapes: q [B, qlen, H, D], kv [B, Lmax, D], seq_lens [B];
out [B, qlen, H, R] float64, lse [B, qlen, H] float64 (natural log, -inf for an empty window).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

MODES = ("decode", "verify", "draft")
KV_DTYPES = ("bf16", "fp8_e4m3", "fp8_e5m2")

# Largest finite value of each fp8 format and its numpy type.
FP8 = {
    "fp8_e4m3": (448.0, ml_dtypes.float8_e4m3fn),
    "fp8_e5m2": (57344.0, ml_dtypes.float8_e5m2),
}


def round_bf16(x) -> np.ndarray:
    """float32 -> nearest bf16 (ties to even), returned as float32. NaN stays NaN."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    u = x.view(np.uint32).astype(np.uint64)
    # Add 0x7fff plus the lowest kept bit, then drop the low 16 bits (round to nearest even).
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).astype(np.uint32)
    out = rounded.view(np.float32).copy()
    nan = np.isnan(x)
    out[nan] = np.nan
    return out


def quantize_kv(kv, kv_dtype: str, kv_scale: float) -> np.ndarray:
    """The value a cache of `kv_dtype` returns for each latent, as float64."""
    b = round_bf16(kv)
    if kv_dtype == "bf16":
        return b.astype(np.float64)
    fmax, ftype = FP8[kv_dtype]
    # Division in float32, saturate to the format's range, then round to nearest even.
    scaled = (b / np.float32(kv_scale)).astype(np.float32)
    scaled = np.clip(scaled, -fmax, fmax)
    stored = scaled.astype(ftype)
    return stored.astype(np.float64) * np.float64(np.float32(kv_scale))


def row_window(mode: str, seq_len: int, qlen: int, t: int) -> int:
    """Global window length of row t: causal modes see [0, L - qlen + t], draft sees [0, L)."""
    if seq_len == 0:
        return 0
    if mode == "draft":
        return seq_len
    return seq_len - qlen + t + 1


def reference_attention(q, kv, seq_lens, *, mode="verify", kv_dtype="bf16", kv_scale=1.0,
                        softmax_scale=None, kv_lora_rank=512):
    """Float64 attention over global windows. Returns (out [B,qlen,H,R], lse [B,qlen,H])."""
    q = np.asarray(q, dtype=np.float32)
    kv = np.asarray(kv, dtype=np.float32)
    seq_lens = np.asarray(seq_lens)
    B, qlen, H, D = q.shape
    R = kv_lora_rank
    scale = D ** -0.5 if softmax_scale is None else float(np.float32(softmax_scale))
    qd = round_bf16(q).astype(np.float64)
    kd = quantize_kv(kv, kv_dtype, kv_scale)
    out = np.zeros((B, qlen, H, R), dtype=np.float64)
    lse = np.full((B, qlen, H), -np.inf, dtype=np.float64)
    for b in range(B):
        L = int(seq_lens[b])
        if L == 0:
            continue
        keys = kd[b, :L]                       # (L, D)
        s_all = scale * (qd[b] @ keys.T)       # (qlen, H, L)
        for t in range(qlen):
            w = row_window(mode, L, qlen, t)
            if w <= 0:
                continue
            s = s_all[t, :, :w]                # (H, w)
            m = s.max(axis=1, keepdims=True)
            p = np.exp(s - m)
            total = p.sum(axis=1, keepdims=True)
            out[b, t] = (p / total) @ keys[:w, :R]
            lse[b, t] = (m + np.log(total))[:, 0]
    return out, lse


def row_errors(out, lse, ref_out, ref_lse):
    """Per (request, row): relative L2 error of out over (H, R) (absolute where the reference
    row is 0), max |lse error| over heads (inf == inf counts as 0) and the absolute L2 error of
    out. Returns (rel, lse_err, abs_err)."""
    out = np.asarray(out, dtype=np.float64)
    lse = np.asarray(lse, dtype=np.float64)
    B, qlen = ref_out.shape[:2]
    diff = (out - ref_out).reshape(B, qlen, -1)
    num = np.sqrt((diff ** 2).sum(axis=2))
    den = np.sqrt((ref_out.reshape(B, qlen, -1) ** 2).sum(axis=2))
    rel = np.where(den > 0, num / np.where(den > 0, den, 1.0), num)
    both_inf = np.isinf(lse) & np.isinf(ref_lse) & (np.sign(lse) == np.sign(ref_lse))
    with np.errstate(invalid="ignore"):
        lerr = np.where(both_inf, 0.0, np.abs(lse - ref_lse))
    lerr = np.where(np.isnan(lerr), np.inf, lerr)
    return rel, lerr.max(axis=2), num


def assert_close(out, lse, ref_out, ref_lse, bound=1e-2, what="", slack=0.0):
    """The contract's bound: rel L2 of out per (request, row) and |lse err| within `bound`, no NaN.
    `slack`: an absolute L2 error of a row's out that passes whatever its relative size, for rows
    whose result cancels (see test_hypothesis.py)."""
    assert not np.isnan(out).any(), f"{what}: NaN in out"
    assert not np.isnan(lse).any(), f"{what}: NaN in lse"
    assert out.shape == ref_out.shape, f"{what}: out shape {out.shape} != {ref_out.shape}"
    assert lse.shape == ref_lse.shape, f"{what}: lse shape {lse.shape} != {ref_lse.shape}"
    rel, lerr, err = row_errors(out, lse, ref_out, ref_lse)
    rel = np.where(err <= slack, 0.0, rel)
    if rel.max() > bound or lerr.max() > bound:
        b, t = np.unravel_index(np.argmax(np.maximum(rel, lerr)), rel.shape)
        raise AssertionError(
            f"{what}: worst row (request {b}, row {t}): rel L2 {rel[b, t]:.3g}, "
            f"|lse err| {lerr[b, t]:.3g} (bound {bound}); "
            f"lse got {np.asarray(lse)[b, t][:4]} want {ref_lse[b, t][:4]}")
