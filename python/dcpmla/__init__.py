"""dcpmla: MLA (DeepSeek-V3 style latent) attention for LLM decoding with the KV cache
sharded across ranks (decode context parallelism, DCP) and speculative verify.

The engine API (SPEC §6) is what a serving engine calls every step on its own tensors:
:class:`Attention` (``plan`` once per step, ``run`` once per layer over that layer's
engine-owned cache), :func:`write_kv` and :func:`merge_states`; ``dcpmla.torch_ops`` registers
them as torch.library custom ops (import it to use them under torch.compile).

The conformance entry point :func:`mla_attention` runs the whole path on one machine
(shard -> page -> write -> plan -> per-rank attention -> cross-rank merge, each rank through
the same C++ engine API) so that anyone can check the system against an independent
reference. :func:`local_length`, :func:`row_local_lengths` and :func:`slot_mapping` expose
the DCP layout rules. ``python -m dcpmla`` prints the build.

Every input error raises ``ValueError`` whose message names the field, the value and
what was expected:
``dcpmla: field 'seq_lens[2]' = -3: expected >= 0 (0 marks a padding request)``.
"""

from __future__ import annotations

import numpy as np

from . import _dcpmla
from ._checks import (_INT64_MAX, _INT64_MIN, _contiguous, _copy_bytes, _error, _host_array, _int, _int_array,
                      _require_usable_cuda, _scale, _str, _typed_array)
from ._engine import Attention, merge_states, write_kv

__version__ = _dcpmla.__version__
cuda_available = bool(_dcpmla.cuda_available)
cuda_device_available = _dcpmla.cuda_device_available
cuda_architectures = _dcpmla.cuda_architectures  # nvcc target flags of the CUDA backend; "" without it

__all__ = [
    "__version__",
    "cuda_available",
    "cuda_device_available",
    "cuda_architectures",
    "Attention",
    "write_kv",
    "merge_states",
    "mla_attention",
    "local_length",
    "row_local_lengths",
    "slot_mapping",
]

def _device(device):
    device = _str("device", device)
    if device == "cuda":
        _require_usable_cuda("device", repr(device), "'cpu'")
    return device


def _one_value(x):
    """A 0-d or one-element float array as its value (what the engine API's run() and write_kv()
    take for kv_scale); anything else as given, for _scale to check."""
    if isinstance(x, np.ndarray) and x.size == 1 and x.dtype.kind == "f":
        return x.reshape(()).item()
    return x


def _copies_fit(q, kv):
    """Refuses, from the shapes alone, a call whose copies of strided q or kv and the library's
    bf16 copies of both (a floor of what check_mla_attention counts) pass the in-process limit:
    before seq_lens is converted or read, which for a broadcast batch of 10**9 requests took
    minutes before the exact check could run."""
    copies, limit = _copy_bytes(q) + _copy_bytes(kv), _dcpmla.max_in_process_bytes
    floor = copies + 2 * (q.size + kv.size)
    if copies and floor > limit:  # without a copy, the library's own check comes before it allocates
        raise _error("q and kv", f"{copies / 2**30:.3g} GiB of copies of strided arrays beside the library's "
                     f"bf16 copies of both ({floor / 2**30:.3g} GiB, {floor} bytes)",
                     f"at most {limit / 2**30:.3g} GiB in one process (pass C-contiguous float32 arrays, or "
                     f"a smaller batch)")


def _attention(q, kv, seq_lens, *, mode, world_size, interleave, block_size, kv_dtype, kv_scale,
               softmax_scale, kv_lora_rank, route, device, merge, seed, qlens=None, min_segment_tokens=None):
    # The shapes first, the values after: seq_lens and qlens are checked against the batch from
    # their shapes before they are copied or read (a broadcast view can describe 2**40 entries),
    # and where q or kv must be copied, everything the library would refuse before it allocates
    # is checked first, the copies counted (_copies_fit, from the shapes alone, before seq_lens
    # is even read; check_mla_attention, once it is).
    q, kv = _host_array("q", q), _host_array("kv", kv)
    kv = _typed_array("kv", kv, np.float32, 3, "[B, Lmax, D]")
    q = _typed_array("q", q, np.float32, *((4, "[B, qlen, H, D]") if qlens is None else (3, "[sum(qlens), H, D]")))
    _copies_fit(q, kv)
    if qlens is None:
        B, _, H, D = q.shape
        what = f"the batch B of q {tuple(q.shape)}"
        if kv.shape[0] != B:
            raise _error("kv.shape[0]", kv.shape[0], f"{B} ({what})")

        def seq_lens_rows(shape):
            if shape[0] != B:
                raise _error("seq_lens.shape[0]", shape[0], f"{B} ({what})")

        seq_lens = _int_array("seq_lens", seq_lens, np.int32, "[B]", check_shape=seq_lens_rows)
    else:
        # Per-request query rows: q [sum(qlens), H, D], packed by request; B is seq_lens'.
        def kv_rows(shape):
            if kv.shape[0] != shape[0]:
                raise _error("kv.shape[0]", kv.shape[0], f"{shape[0]} (the batch B of seq_lens {tuple(shape)})")

        seq_lens = _int_array("seq_lens", seq_lens, np.int32, "[B]", check_shape=kv_rows)
        B = seq_lens.shape[0]
        what = f"the batch B of seq_lens {tuple(seq_lens.shape)}"

        def qlens_rows(shape):
            if shape[0] != B:
                raise _error("qlens.shape[0]", shape[0], f"{B} ({what})")

        qlens = _int_array("qlens", qlens, np.int32, "[B]", check_shape=qlens_rows)
        # Each value before their sum is compared with q's rows: the sum of a bad one names q.
        bad = (qlens < 0) | (qlens > _dcpmla.max_qlen)
        if bad.any():
            b = int(np.argmax(bad))
            raise _error(f"qlens[{b}]", int(qlens[b]), f"in [0, {_dcpmla.max_qlen}] (request {b}'s query rows)")
        _, H, D = q.shape
        if q.shape[0] != int(qlens.sum(dtype=np.int64)):
            raise _error("q.shape[0]", q.shape[0], f"{int(qlens.sum(dtype=np.int64))} (sum(qlens))")
        q = q.reshape(q.shape[0], 1, H, D)  # a view: a unit axis added
    if kv.shape[2] != D:
        raise _error("kv.shape[2]", kv.shape[2], f"{D} (the latent dim D of q {tuple(q.shape)})")
    max_len = kv.shape[1]
    if seq_lens.size and seq_lens.max() > max_len:
        b = int(np.argmax(seq_lens > max_len))
        raise _error(f"seq_lens[{b}]", int(seq_lens[b]), f"<= {max_len} (Lmax = kv.shape[1])")

    # None is resolved here, so the library's "0 means default" is never reached from Python.
    if softmax_scale is None:
        softmax_scale = D ** -0.5 if D > 0 else 1.0  # D = 0 is refused below, naming kv_lora_rank
    options = dict(
        mode=_str("mode", mode),
        world_size=_int("world_size", world_size),
        interleave=_int("interleave", interleave),
        block_size=_int("block_size", block_size),
        kv_dtype=_str("kv_dtype", kv_dtype),
        kv_scale=_scale("kv_scale", _one_value(kv_scale)),
        softmax_scale=_scale("softmax_scale", softmax_scale, ", or None for D ** -0.5"),
        kv_lora_rank=_int("kv_lora_rank", kv_lora_rank),
        route=_str("route", route),
        merge=_str("merge", merge),
        device=_device(device),
        seed=_int("seed", seed, 0, 2**64 - 1),
        qlens=qlens,
        min_segment_tokens=None if min_segment_tokens is None else _int("min_segment_tokens", min_segment_tokens),
    )
    copies = _copy_bytes(q) + _copy_bytes(kv)
    if copies:  # else _mla_attention's own check, before it allocates, is the same
        _dcpmla._check_mla_attention(q.shape, kv.shape, seq_lens, **options, caller_bytes=float(copies))
    out, lse, routes, max_segments = _dcpmla._mla_attention(_contiguous(q), _contiguous(kv), seq_lens, **options)
    return out, lse, list(routes), list(max_segments)


def mla_attention(q, kv, seq_lens, *, mode="verify", world_size=1, interleave=1, block_size=64,
                  kv_dtype="bf16", kv_scale=1.0, softmax_scale=None, kv_lora_rank=512,
                  route="auto", device="cpu", merge="all_heads", seed=0, qlens=None):
    """Absorbed MLA attention over a DCP-sharded paged latent cache, end to end (SPEC §5).

    Shards ``kv`` over ``world_size`` ranks (round-robin in runs of ``interleave`` tokens),
    writes each shard into a paged cache of ``block_size``-token blocks through randomly
    drawn block tables (``seed``), plans, runs each rank's attention and merges the
    partials. The answer does not depend on world_size, interleave, block_size, route or
    merge beyond bf16 rounding.

    Args:
        q: float32 ``[B, qlen, H, D]`` queries; rounded to bf16 on entry.
        kv: float32 ``[B, Lmax, D]`` global latents (key = all D values, value = the first
            ``kv_lora_rank``); row b is valid up to ``seq_lens[b]``. Rounded to bf16, then
            stored as ``kv_dtype``.
        seq_lens: int32 ``[B]``: ``L_b``, the global length *including* the query block;
            0 marks a padding request.
        mode: ``"decode"`` (qlen = 1) or ``"verify"`` (causal: row t sees positions
            ``[0, L_b - qlen + t]``, needs ``L_b >= qlen``) or ``"draft"`` (every row sees
            ``[0, L_b)``).
        world_size, interleave: the DCP group size N and interleave I (``block_size % I == 0``).
        block_size: tokens per cache block, 1..65536.
        kv_dtype: ``"bf16"``, ``"fp8_e4m3"`` or ``"fp8_e5m2"``; fp8 stores
            ``rne(sat(bf16(x) / kv_scale))`` and reads ``stored * kv_scale``.
        kv_scale: the fp8 cache scale, a positive normal float32 (a Python or numpy float, or a
            one-element float array); must stay 1.0 for a bf16 cache.
        softmax_scale: score scale, a positive normal float32 up to 65536 (larger overflows the
            float32 scores); ``None`` means ``D ** -0.5``.
        kv_lora_rank: R, the value width (``R < D``; the rest of D is the rope part).
        route: ``"auto"`` (the planner decides), or force ``"one_stage"``,
            ``"two_stage"`` (verify only) or ``"split_k"``.
        device: ``"cpu"`` or ``"cuda"`` (only where the CUDA backend is built:
            see ``dcpmla.cuda_available``).
        merge: ``"all_heads"`` (every rank keeps all heads) or ``"scatter_heads"``
            (each rank keeps H/N heads; needs ``H % world_size == 0``); the returned
            arrays hold all heads either way.
        seed: draws the block tables.
        qlens: per-request query rows (int ``[B]``, each >= 0; qo_indptr style): ``q`` is then
            ``[sum(qlens), H, D]`` packed by request, and request b's row t sees the window of
            its own ``qlens[b]`` (``[0, L_b - qlens[b] + t]`` when causal). ``None``: ``q`` is
            ``[B, qlen, H, D]``. Not with ``route="two_stage"`` (uniform query blocks only).

    Returns:
        ``(out, lse)``: ``out`` float32 ``[B, qlen, H, kv_lora_rank]`` (with ``qlens``:
        ``[sum(qlens), H, kv_lora_rank]``; the values the bf16 output holds); ``lse`` float32
        ``[B, qlen, H]`` (``[sum(qlens), H]``), the **natural** log of the sum of
        exp(scores) over the row's window. An empty window (padding request) gives
        ``out = 0`` and ``lse = -inf``, never NaN.

    Raises:
        ValueError: on any bad input, naming the field, its value and what was expected.
    """
    out, lse, _, _ = _attention(q, kv, seq_lens, mode=mode, world_size=world_size,
                             interleave=interleave, block_size=block_size, kv_dtype=kv_dtype,
                             kv_scale=kv_scale, softmax_scale=softmax_scale,
                             kv_lora_rank=kv_lora_rank, route=route, device=device, merge=merge,
                             seed=seed, qlens=qlens)
    return out, lse


def _mla_attention_with_plans(q, kv, seq_lens, **options):
    """:func:`mla_attention` that also returns, per rank, the route its planner took and the most
    pieces its plan cut one request into (tests: a forced split_k must cut), and takes the
    planner's ``min_segment_tokens`` (None: the library's default; tests lower it to cut short
    rows)."""
    full = dict(mode="verify", world_size=1, interleave=1, block_size=64, kv_dtype="bf16",
                kv_scale=1.0, softmax_scale=None, kv_lora_rank=512, route="auto", device="cpu",
                merge="all_heads", seed=0, qlens=None, min_segment_tokens=None)
    unknown = set(options) - set(full)
    if unknown:
        raise TypeError(f"unexpected keyword arguments {sorted(unknown)}")
    full.update(options)
    return _attention(q, kv, seq_lens, **full)


def local_length(w, world_size, rank, interleave=1):
    """n_r(w): how many positions of the global window ``[0, w)`` rank ``rank`` holds,
    ``(w // (I*N)) * I + clamp(w % (I*N) - r*I, 0, I)``; summed over ranks it is ``w``."""
    w = _int("w", w, _INT64_MIN, _INT64_MAX)
    if w < 0:
        raise _error("w", w, ">= 0")
    return int(_dcpmla.local_length(w, _int("world_size", world_size), _int("rank", rank),
                                    _int("interleave", interleave)))


def row_local_lengths(mode, seq_len, qlen, world_size, rank, interleave=1):
    """int64 ``[qlen]``: row t's rank-local length ``n_r(w_t)``, counted from the *global*
    window end ``w_t`` (not ``n_r(L) - (qlen - 1 - t)``). A padding request (0) gives zeros."""
    lengths = _dcpmla.row_local_lengths(
        _str("mode", mode), _int("seq_len", seq_len, _INT64_MIN, _INT64_MAX), _int("qlen", qlen),
        _int("world_size", world_size), _int("rank", rank), _int("interleave", interleave))
    return np.asarray(lengths, dtype=np.int64)


def slot_mapping(positions, block_table, block_size, num_blocks, world_size, rank, interleave=1):
    """int64 ``[n]``: the rank-local cache slot of each global position of one request,
    ``table[local(p) // block_size] * block_size + local(p) % block_size`` on its owner, and
    ``-1`` (PAD: written nowhere) where ``rank`` does not own ``p``. The block table is the
    request's, shared by all ranks; its ids must lie in ``[0, num_blocks)``."""
    positions = _int_array("positions", positions, np.int64, "[n]", kept=8)  # and the int64 result
    block_table = _int_array("block_table", block_table, np.int32, "[table_width]")
    if positions.size and positions.min() < 0:
        bad = int(np.argmax(positions < 0))
        raise _error(f"positions[{bad}]", int(positions[bad]), ">= 0")
    return _dcpmla.slot_mapping(positions, block_table, _int("block_size", block_size),
                                _int("num_blocks", num_blocks, _INT64_MIN, _INT64_MAX),
                                _int("world_size", world_size), _int("rank", rank),
                                _int("interleave", interleave))
