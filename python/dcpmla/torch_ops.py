"""The engine API as torch.library custom ops (``torch.ops.dcpmla.*``), with fake (meta)
implementations, so that torch.compile traces a model that calls them without a graph break
(``fullgraph=True`` works). Importing this module registers them; ``import dcpmla`` alone never
imports torch. Needs torch >= 2.4 (torch.library.register_fake).

An :class:`dcpmla.Attention` is not a tensor: the ops take its :attr:`~dcpmla.Attention.handle`
(a plain int, a constant of the traced graph). Plan outside the compiled region (plan() is host
work on host arrays, once per step), then call the compiled model:

    import dcpmla, dcpmla.torch_ops as ops
    att = dcpmla.Attention(heads=128, device="cuda")
    def layer(q, cache, latent, slots):
        ops.write_kv(cache, latent, slots)
        return ops.run(att, q, cache)          # (out, lse): this rank's partial
    step = torch.compile(layer, fullgraph=True)
    att.plan(seq_lens, block_tables, qlen)     # every step, outside the compiled code
    out, lse = step(q, cache, latent, slots)

Each op runs on torch's current stream, as the plain calls do. Outside a compiled region, call
the plain methods: torch's dispatch adds host time to every call (about 4 us, on an H100 host and
on the CPU machine alike, where torch.library.custom_op's wrappers had added 11-20;
bench/python_overhead.py, docs/perf.md).
The ops take no part in autograd (inference only, as the plain calls).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import _checks, _engine

Tensor = torch.Tensor


# Registered with torch.library.Library rather than torch.library.custom_op: custom_op's Python
# autograd and in-place wrappers run on every call (about 19 us of an H100 host's time over the
# plain run(), docs/perf.md), and these ops need neither (no gradients; the schemas' (a!)
# annotations are what torch.compile's functionalisation reads). One kernel for CPU and CUDA
# tensors alike (CompositeExplicitAutograd: every backend), and a fake kernel for tracing.
_LIB = torch.library.Library("dcpmla", "DEF")


def _define(schema, kernel, fake):
    name = schema[:schema.index("(")]
    _LIB.define(schema)
    _LIB.impl(name, kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(f"dcpmla::{name}", fake, lib=_LIB)


def _run(handle: int, q: Tensor, kv_cache: Tensor, kv_scale: float, kv_scale_tensor: Optional[Tensor], out: Tensor,
         lse: Tensor) -> None:
    _engine.attention_of(handle).run(q, kv_cache, kv_scale=kv_scale if kv_scale_tensor is None else kv_scale_tensor,
                                     out=out, lse=lse)


def _write_kv(kv_cache: Tensor, latent: Tensor, slot_mapping: Tensor, kv_dtype: str, kv_scale: float,
              kv_scale_tensor: Optional[Tensor]) -> None:
    _engine.write_kv(kv_cache, latent, slot_mapping, kv_dtype=kv_dtype,
                     kv_scale=kv_scale if kv_scale_tensor is None else kv_scale_tensor)


def _merge_states(out_parts: Tensor, lse_parts: Tensor) -> Tuple[Tensor, Tensor]:
    return _engine.merge_states(out_parts, lse_parts)


def _nothing(*_):
    return None


def _merge_states_fake(out_parts, lse_parts):
    return out_parts.new_empty(out_parts.shape[1:]), lse_parts.new_empty(lse_parts.shape[1:])


_define("run(int handle, Tensor q, Tensor kv_cache, float kv_scale, Tensor? kv_scale_tensor, Tensor(a!) out, "
        "Tensor(b!) lse) -> ()", _run, _nothing)
_define("write_kv(Tensor(a!) kv_cache, Tensor latent, Tensor slot_mapping, str kv_dtype, float kv_scale, "
        "Tensor? kv_scale_tensor) -> ()", _write_kv, _nothing)
_define("merge_states(Tensor out_parts, Tensor lse_parts) -> (Tensor, Tensor)", _merge_states, _merge_states_fake)


def _scale_args(kv_scale):
    # A float as the plain calls check it (a string or a bool is refused, not converted).
    return (1.0, kv_scale) if isinstance(kv_scale, Tensor) else (_checks._scale("kv_scale", kv_scale), None)


def run(att: "_engine.Attention", q: Tensor, kv_cache: Tensor, kv_scale=1.0, out: Optional[Tensor] = None,
        lse: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """:meth:`dcpmla.Attention.run` through ``torch.ops.dcpmla.run``: the same checks and result;
    outputs not given are allocated as run() allocates them (``[*q.shape[:-1], R]`` of q's
    dtype and ``q.shape[:-1]`` float32, for a q that can fit the engine; empty placeholders
    otherwise, and the op names q)."""
    if out is None or lse is None:
        lead = att._output_lead(tuple(q.shape))
        if out is None:
            out = q.new_empty((*lead, att.heads, att.kv_lora_rank))
        if lse is None:
            lse = q.new_empty((*lead, att.heads), dtype=torch.float32)
    torch.ops.dcpmla.run(att.handle, q, kv_cache, *_scale_args(kv_scale), out, lse)
    return out, lse


def write_kv(kv_cache: Tensor, latent: Tensor, slot_mapping: Tensor, kv_dtype: str = "bf16", kv_scale=1.0) -> None:
    """:func:`dcpmla.write_kv` through ``torch.ops.dcpmla.write_kv`` (in place on kv_cache)."""
    torch.ops.dcpmla.write_kv(kv_cache, latent, slot_mapping, kv_dtype, *_scale_args(kv_scale))


def merge_states(out_parts: Tensor, lse_parts: Tensor) -> Tuple[Tensor, Tensor]:
    """:func:`dcpmla.merge_states` through ``torch.ops.dcpmla.merge_states`` (new outputs)."""
    return torch.ops.dcpmla.merge_states(out_parts, lse_parts)
