"""The Python entry points on torch CPU tensors whose memory does not hold their values: a
negative view (x.is_neg(), torch's lazy negation, which DLPack does not carry: torch's own
export passes the memory un-negated) and a nested tensor are refused by name at every tensor
argument, where they were read (or written) as the memory holds them. Skipped where torch is
not installed (CI); the GPU machines run it (pytest_engine_cuda)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import dcpmla  # noqa: E402
import dcpmla.torch_ops as ops  # noqa: E402

D, R, H = 576, 512, 16


def neg(x):
    """x's values as a negative view of -x (x.is_neg()): what torch builds lazily, e.g. for the
    imaginary part of a conjugated complex view."""
    view = torch._neg_view(-x)
    assert view.is_neg()
    torch.testing.assert_close(view, x, rtol=0, atol=0, equal_nan=True)
    return view


def nested(x):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's prototype warning for nested tensors
        return torch.nested.nested_tensor(list(x))


@pytest.fixture
def step():
    att = dcpmla.Attention(heads=H, device="cpu", max_batch=2, max_qlen=2, max_local_len=64)
    att.plan([5, 3], [[0], [1]], 1, mode="decode")
    g = torch.Generator().manual_seed(np.random.SeedSequence().entropy % 2**63)  # fresh inputs each run
    cache = torch.randn((2, 64, D), generator=g).to(torch.bfloat16)
    cache[0, 5:] = cache[1, 3:] = float("nan")  # past each request's length: a read there shows as NaN
    q = torch.randn((2, 1, H, D), generator=g).to(torch.bfloat16)
    return att, cache, q


def test_the_imaginary_part_of_a_conjugate_is_a_negative_view():
    # The public way to build one (the tests use torch._neg_view for any dtype).
    assert torch.randn(3, dtype=torch.complex64).conj().imag.is_neg()


def test_negative_views_are_refused_at_every_argument(step):
    att, cache, q = step
    out, lse = att.run(q, cache)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    err = lambda field: pytest.raises(ValueError, match=f"field '{field}' = a torch tensor with its negative bit set")  # noqa: E731
    with err("q"):
        att.run(neg(q), cache)
    with err("kv_cache"):
        att.run(q, neg(cache))
    with err("out"):
        att.run(q, cache, out=neg(torch.zeros_like(out)), lse=torch.empty_like(lse))
    with err("lse"):
        att.run(q, cache, out=torch.empty_like(out), lse=neg(torch.zeros_like(lse)))
    with err("seq_lens"):
        att.plan(neg(torch.tensor([5, 3], dtype=torch.int32)), [[0], [1]], 1, mode="decode")
    with err("block_tables"):
        att.plan([5, 3], neg(torch.tensor([[0], [1]], dtype=torch.int32)), 1, mode="decode")
    with err("qlens"):
        att.plan([5, 3], [[0], [1]], 1, mode="decode", qlens=neg(torch.tensor([1, 1], dtype=torch.int32)))
    latent = torch.randn((2, D)).to(torch.bfloat16)
    slots = torch.tensor([2, 65])  # inside the lengths: a write there would change the run below
    with err("latent"):
        dcpmla.write_kv(cache, neg(latent), slots)
    with err("slot_mapping"):
        dcpmla.write_kv(cache, latent, neg(slots))
    with err("kv_cache"):
        dcpmla.write_kv(neg(cache), latent, slots)
    fp8 = torch.zeros((2, 64, D), dtype=torch.uint8)
    with err("kv_scale"):
        dcpmla.write_kv(fp8, latent, slots, kv_dtype="fp8_e4m3", kv_scale=neg(torch.tensor([0.5])))
    parts, lse_parts = torch.stack([out, out]), torch.stack([lse, lse])
    with err("out_parts"):
        dcpmla.merge_states(neg(parts), lse_parts)
    with err("lse_parts"):
        dcpmla.merge_states(parts, neg(lse_parts))
    with err("out"):
        dcpmla.merge_states(parts, lse_parts, out=neg(torch.zeros_like(out)), lse=torch.empty_like(lse))
    # Through the torch op, torch's dispatcher resolves a negative input before the call.
    assert torch.equal(ops.run(att, neg(q), cache)[0], out)
    qf, kv = torch.randn((1, 2, H, D)), torch.randn((1, 40, D))
    with err("q"):
        dcpmla.mla_attention(neg(qf), kv, [40])
    with err("kv"):
        dcpmla.mla_attention(qf, neg(kv), [40])
    # Nothing was written: the cache and the outputs hold what the good calls left.
    again, _ = att.run(q, cache)
    assert torch.equal(again, out)


def test_nested_tensors_are_refused_by_name(step):
    att, cache, q = step
    with pytest.raises(ValueError, match="field 'q' = a nested torch tensor"):
        att.run(nested(q), cache)
    with pytest.raises(ValueError, match="field 'kv_cache' = a nested torch tensor"):
        att.run(q, nested(cache))
    with pytest.raises(ValueError, match="field 'latent' = a nested torch tensor"):
        dcpmla.write_kv(cache, nested(torch.randn((2, 1, D)).to(torch.bfloat16)), torch.tensor([6, 70]))
    with pytest.raises(ValueError, match="field 'seq_lens' = a nested torch tensor"):
        att.plan(nested(torch.tensor([[5], [3]], dtype=torch.int32)), [[0], [1]], 1, mode="decode")


def test_the_values_a_negative_view_holds_run_once_resolved(step):
    # What the refusal tells the caller to pass gives the answer of the values themselves.
    att, cache, q = step
    want, _ = att.run(q, cache)
    assert torch.isfinite(want).all()
    got, _ = att.run(neg(q).resolve_neg(), cache)
    assert torch.equal(got, want)
    assert not np.array_equal(att.run(-q, cache)[0].float().numpy(), want.float().numpy())
