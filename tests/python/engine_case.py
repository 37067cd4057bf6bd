"""One step of the engine API (SPEC §6) as an engine drives it, on numpy data: random lengths
(with padding requests and rows some ranks hold nothing of), random block tables shared by all
ranks, caches poisoned with NaN (0xff bytes) beyond what is written, the new latents written
through write_kv with each rank's slot mapping (-1 where the rank does not own a token).
The answer comes from the float64 reference (reference.py), never from dcpmla itself.

The backend-specific parts (where the tensors live) are the caller's: `to_device` and
`empty_cache` turn numpy arrays into the arrays a backend takes."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

import dcpmla
from reference import reference_attention

D, R = 576, 512


class DLPackOnly:
    """An array producer known only through the DLPack protocol."""

    def __init__(self, a):
        self._a = a

    def __dlpack__(self, **kwargs):
        return self._a.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()



@dataclass(frozen=True)
class Step:
    mode: str = "verify"
    qlen: int = 3
    world: int = 1
    interleave: int = 1
    block: int = 16
    dtype: str = "bf16"
    heads: int = 16
    route: str = "auto"
    lengths: tuple = (37, 0, 5, 129)  # 0 = a padding request
    kv_scale: float = 1.0
    seed: int = 0

    def id(self):
        return (f"{self.mode}-q{self.qlen}-N{self.world}-I{self.interleave}-bs{self.block}-{self.dtype}-"
                f"H{self.heads}-{self.route}-L{'_'.join(map(str, self.lengths))}-s{self.seed}")


def scale_of(step):
    return step.kv_scale if step.dtype != "bf16" else 1.0


def tables(step, rng):
    """Block tables [B, width] shared by all ranks: a random permutation of the blocks, the entries
    past each request's need pointing at a spare block (NaN); returns (tables, num_blocks)."""
    per_rank = [dcpmla.local_length(L, step.world, 0, step.interleave) for L in step.lengths]  # rank 0 holds most
    need = [math.ceil(n / step.block) for n in per_rank]
    width = max(need) + 1
    num_blocks = sum(need) + 1
    ids = rng.permutation(num_blocks).astype(np.int32)
    spare = ids[-1]
    t = np.full((len(step.lengths), width), spare, dtype=np.int32)
    k = 0
    for b, n in enumerate(need):
        t[b, :n] = ids[k:k + n]
        k += n
    return t, num_blocks


def make_inputs(step):
    """q [B, qlen, H, D] and kv [B, Lmax, D] float32, the tables, the caches' block count, and the
    float64 reference (out, lse) of the merged result."""
    rng = np.random.default_rng(step.seed)
    B, Lmax = len(step.lengths), max(max(step.lengths), 1)
    q = rng.standard_normal((B, step.qlen, step.heads, D), dtype=np.float32)
    kv = rng.standard_normal((B, Lmax, D), dtype=np.float32)
    t, num_blocks = tables(step, rng)
    ref = reference_attention(q, kv, np.array(step.lengths), mode=step.mode, kv_dtype=step.dtype,
                              kv_scale=scale_of(step))
    return q, kv, t, num_blocks, ref


def slots_and_latents(step, kv, t, num_blocks, rank):
    """Every cached token of every request (the whole history, as prefill and earlier steps would
    have written it), its latent row and this rank's slot (-1 where it is not this rank's)."""
    latents, slots = [], []
    for b, L in enumerate(step.lengths):
        if L == 0:
            continue
        slots.append(dcpmla.slot_mapping(np.arange(L), t[b], step.block, num_blocks, step.world, rank,
                                         step.interleave))
        latents.append(kv[b, :L])
    return np.concatenate(latents).astype(np.float32), np.concatenate(slots).astype(np.int64)


def empty_rows(step, rank):
    """[B, qlen] bool: the rows whose rank-local window is empty on `rank` (their partial must be
    out 0, lse -inf)."""
    rows = [dcpmla.row_local_lengths(step.mode, L, step.qlen, step.world, rank, step.interleave)
            for L in step.lengths]
    return np.array(rows) == 0


def attention_kwargs(step, rank, **extra):
    return dict(heads=step.heads, kv_dtype=step.dtype, block_size=step.block, world_size=step.world, rank=rank,
                interleave=step.interleave, route=step.route, **extra)


def packed_case(step, qlens):
    """Per-request query rows (Attention.plan's qlens): q packed [sum(qlens), H, D] and the float64
    reference of each request with its own qlen, packed alike (out [rows, 1, H, R], lse [rows, 1, H]
    for assert_close)."""
    q, kv, t, num_blocks, _ = make_inputs(step)
    qlens = np.asarray(qlens, dtype=np.int32)
    packed = np.concatenate([q[b, :n] for b, n in enumerate(qlens)])
    outs, lses = [], []
    for b, n in enumerate(qlens):
        if n == 0:
            continue
        o, l = reference_attention(q[b:b + 1, :n], kv[b:b + 1], [step.lengths[b]], mode=step.mode,
                                   kv_dtype=step.dtype, kv_scale=scale_of(step))
        outs.append(o[0])
        lses.append(l[0])
    ref = (np.concatenate(outs)[:, None], np.concatenate(lses)[:, None])
    return packed, kv, t, num_blocks, ref
