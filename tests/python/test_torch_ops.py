"""dcpmla.torch_ops on torch CPU tensors: the custom ops give the plain calls' answers, pass
torch.library.opcheck, and torch.compile(fullgraph=True) traces a two-rank, two-layer step that
calls them (fake implementations, functionalised mutation of the caches and outputs).
Skipped where torch is not installed."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import dcpmla  # noqa: E402
import dcpmla.torch_ops as ops  # noqa: E402
from engine_case import D, Step, attention_kwargs, make_inputs, slots_and_latents  # noqa: E402
from reference import assert_close  # noqa: E402

STEP = Step(mode="verify", qlen=2, world=2, block=16, dtype="fp8_e4m3", kv_scale=0.5, lengths=(40, 0, 3, 90))
LAYERS = 2


def setup():
    """Per layer its own inputs (seeded by layer); per rank an Attention and per (rank, layer) a cache."""
    layers = [make_inputs(Step(**{**STEP.__dict__, "seed": layer})) for layer in range(LAYERS)]
    _, _, t, num_blocks, _ = layers[0]
    atts = [dcpmla.Attention(**attention_kwargs(STEP, r, max_batch=4, max_qlen=4, max_local_len=1024, device="cpu"))
            for r in range(STEP.world)]
    for att in atts:
        att.plan(list(STEP.lengths), layers[0][2], STEP.qlen, mode=STEP.mode)
    caches = [[torch.full((num_blocks, STEP.block, D), 0xff, dtype=torch.uint8).view(torch.float8_e4m3fn)
               for _ in range(LAYERS)] for _ in range(STEP.world)]
    writes = [[tuple(map(torch.from_numpy, slots_and_latents(STEP, kv, t, num_blocks, r))) for (_, kv, *_rest) in layers]
              for r in range(STEP.world)]
    qs = [torch.from_numpy(q).to(torch.bfloat16) for (q, *_rest) in layers]
    return layers, atts, caches, writes, qs


def step_with(write, run, merge, atts, caches, writes, qs):
    """One decode step over every layer and rank with the given calls; returns each layer's merged (out, lse)."""
    results = []
    scale = torch.tensor([STEP.kv_scale], dtype=torch.float32)
    for layer in range(LAYERS):
        outs, lses = [], []
        for r, att in enumerate(atts):
            latent, slots = writes[r][layer]
            write(caches[r][layer], latent.to(torch.bfloat16), slots, "fp8_e4m3", scale)
            out, lse = run(att, qs[layer], caches[r][layer], scale)
            outs.append(out)
            lses.append(lse)
        results.append(merge(torch.stack(outs), torch.stack(lses)))
    return results


def plain(atts, caches, writes, qs):
    return step_with(lambda c, x, s, d, k: dcpmla.write_kv(c, x, s, kv_dtype=d, kv_scale=k),
                     lambda a, q, c, k: a.run(q, c, kv_scale=k), dcpmla.merge_states, atts, caches, writes, qs)


def through_ops(atts, caches, writes, qs):
    return step_with(lambda c, x, s, d, k: ops.write_kv(c, x, s, d, k), lambda a, q, c, k: ops.run(a, q, c, kv_scale=k),
                     ops.merge_states, atts, caches, writes, qs)


def test_ops_equal_the_plain_calls_and_the_reference():
    layers, atts, caches, writes, qs = setup()
    want = plain(atts, caches, writes, qs)
    got = through_ops(atts, caches, writes, qs)
    for layer, ((o, l), (wo, wl)) in enumerate(zip(got, want)):
        assert torch.equal(o, wo) and torch.equal(l, wl)
        assert_close(o.float().numpy(), l.numpy(), *layers[layer][4], what=f"layer {layer}")


def test_compiled_step_traces_the_ops_in_one_graph():
    layers, atts, caches, writes, qs = setup()
    want = plain(atts, caches, writes, qs)
    compiled = torch.compile(through_ops, fullgraph=True, backend="aot_eager")
    got = compiled(atts, caches, writes, qs)
    for (o, l), (wo, wl) in zip(got, want):
        assert torch.equal(o, wo) and torch.equal(l, wl)


def test_opcheck_merge_states():
    rng = np.random.default_rng(0)
    parts = torch.from_numpy(rng.standard_normal((3, 2, 4, 512), dtype=np.float32)).to(torch.bfloat16)
    lse = torch.from_numpy(rng.standard_normal((3, 2, 4), dtype=np.float32))
    torch.library.opcheck(torch.ops.dcpmla.merge_states.default, (parts, lse))


def test_opcheck_run_and_write_kv():
    # The mutating ops' schemas (registered by hand, not inferred: torch_ops._define) must name
    # exactly what each op writes; opcheck runs them eagerly, on fake tensors and through
    # AOTAutograd, and fails on a mutation the schema does not declare.
    att = dcpmla.Attention(heads=16, device="cpu", max_batch=4, max_qlen=2, max_local_len=64)
    att.plan([3], [[0]], 1, mode="decode")
    g = torch.Generator().manual_seed(0)
    cache = torch.randn((1, 64, D), generator=g).to(torch.bfloat16)
    q = torch.randn((1, 1, 16, D), generator=g).to(torch.bfloat16)
    out, lse = torch.empty((1, 1, 16, D - 64), dtype=torch.bfloat16), torch.empty((1, 1, 16))
    torch.library.opcheck(torch.ops.dcpmla.run.default, (att.handle, q, cache, 1.0, None, out, lse))
    latent = torch.randn((2, D), generator=g).to(torch.bfloat16)
    torch.library.opcheck(torch.ops.dcpmla.write_kv.default, (cache, latent, torch.tensor([5, 9]), "bf16", 1.0, None))


def test_a_dead_attention_handle_is_refused():
    att = dcpmla.Attention(heads=16, device="cpu")
    handle = att.handle
    del att
    with pytest.raises(ValueError, match=f"field 'handle' = {handle}: expected the handle of a live dcpmla.Attention"):
        torch.ops.dcpmla.run(handle, torch.zeros(1), torch.zeros(1), 1.0, None, torch.zeros(1), torch.zeros(1))


def test_run_sizes_its_outputs_only_from_a_q_that_can_fit():
    # The op sized out from q.shape[:-1] before any check: a q of the wrong last extent asked
    # torch for R times its size (an OOM, not a ValueError; the sixtieth session's audit). Now
    # it allocates what Attention.run would, placeholders for a q that cannot fit, and the op
    # names q.
    att = dcpmla.Attention(heads=16, device="cpu", max_batch=4, max_qlen=2, max_local_len=64)
    att.plan([3], [[0]], 1, mode="decode")
    cache = torch.zeros((1, 64, D), dtype=torch.bfloat16)
    wide = torch.zeros(1).expand(1 << 40, 1)  # one value, described as 2^40 rows (out: 2 PiB)
    with pytest.raises(ValueError, match="field 'q"):
        ops.run(att, wide, cache)
    q = torch.zeros((1, 1, 16, D), dtype=torch.bfloat16)
    out, lse = ops.run(att, q, cache)
    assert out.shape == (1, 1, 16, D - 64) and lse.shape == (1, 1, 16)


def test_kv_scale_is_checked_as_the_plain_calls_check_it():
    # float(kv_scale) took "0.5" and True (both valid fp8 scales once converted); the plain
    # calls refuse both.
    att = dcpmla.Attention(heads=16, kv_dtype="fp8_e4m3", device="cpu", max_batch=4, max_qlen=2, max_local_len=64)
    att.plan([3], [[0]], 1, mode="decode")
    cache = torch.zeros((1, 64, D), dtype=torch.uint8)
    q = torch.zeros((1, 1, 16, D), dtype=torch.bfloat16)
    for bad in ("0.5", True):
        with pytest.raises(ValueError, match="field 'kv_scale'"):
            ops.run(att, q, cache, kv_scale=bad)
