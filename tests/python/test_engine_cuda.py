"""The engine API on CUDA torch tensors (SPEC §6), a GPU test (CTest pytest_engine_cuda, label
gpu): every mode, dtype, route, N 1..8, interleave 1/2, several block sizes and head counts
against the float64 reference; a captured multi-layer DCP step (write_kv + run per layer and
rank, merge_states) replayed after re-plans with other lengths and equal to the eager calls;
bad input refused before any launch; the example end to end. Skipped without torch, a CUDA
build or a usable GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import dcpmla

torch = pytest.importorskip("torch")
if not (dcpmla.cuda_available and dcpmla.cuda_device_available() and torch.cuda.is_available()):
    pytest.skip("needs the CUDA backend, a usable GPU and torch with CUDA", allow_module_level=True)

from engine_case import (D, R, Step, attention_kwargs, empty_rows, make_inputs,  # noqa: E402
                         packed_case, scale_of, slots_and_latents)
from reference import assert_close, reference_attention  # noqa: E402

DEV = torch.device("cuda", torch.cuda.current_device())
LIMITS = dict(max_batch=8, max_qlen=8, max_local_len=1 << 15)
CACHE_DTYPES = {"bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}

STEPS = [
    Step(mode="decode", qlen=1, world=1, block=64, dtype="bf16", heads=128, lengths=(3000, 0, 1, 77)),
    Step(mode="decode", qlen=1, world=8, interleave=2, block=16, dtype="fp8_e4m3", kv_scale=0.37, heads=16,
         lengths=(5, 0, 3000, 200), seed=1),
    Step(mode="decode", qlen=1, world=2, block=256, dtype="fp8_e5m2", kv_scale=2.5, heads=1, route="split_k",
         lengths=(4000, 2, 0, 900), seed=2),
    Step(mode="verify", qlen=4, world=4, interleave=2, block=64, dtype="bf16", heads=128, route="split_k",
         lengths=(2100, 0, 9, 4), seed=3),
    Step(mode="verify", qlen=3, world=3, block=1, dtype="fp8_e4m3", kv_scale=0.5, heads=16, route="one_stage", seed=4),
    Step(mode="verify", qlen=2, world=5, block=16, dtype="fp8_e5m2", kv_scale=0.37, heads=5, seed=5),
    Step(mode="verify", qlen=4, world=2, interleave=2, block=16, dtype="fp8_e4m3", kv_scale=0.5, heads=16,
         route="one_stage", lengths=(300, 0, 4, 70), seed=6),
    Step(mode="verify", qlen=2, world=1, block=64, dtype="bf16", heads=64, seed=7),
    Step(mode="draft", qlen=3, world=6, block=64, dtype="bf16", heads=16, lengths=(1, 0, 2000, 6), seed=8),
    Step(mode="draft", qlen=2, world=7, interleave=2, block=256, dtype="fp8_e4m3", kv_scale=2.5, heads=128,
         route="split_k", lengths=(5000, 3, 0, 40), seed=9),
    Step(mode="draft", qlen=4, world=2, block=16, dtype="fp8_e5m2", kv_scale=0.5, heads=32, route="one_stage", seed=10),
    # Past 128 heads: 256 (whole 64-row groups) and 520 (a partial group).
    Step(mode="verify", qlen=2, world=2, block=64, dtype="bf16", heads=256, route="split_k",
         lengths=(1500, 0, 7, 300), seed=11),
    Step(mode="decode", qlen=1, world=1, block=16, dtype="fp8_e4m3", kv_scale=0.37, heads=520,
         lengths=(900, 3, 0, 200), seed=12),
]


def cache(num_blocks, step):
    """Engine-owned cache memory on the GPU, NaN (0xff bytes) until written."""
    raw = torch.full((num_blocks, step.block, D * (2 if step.dtype == "bf16" else 1)), 0xff, dtype=torch.uint8,
                     device=DEV)
    return raw.view(CACHE_DTYPES[step.dtype])


def bf16(x):
    return torch.from_numpy(np.ascontiguousarray(x)).to(device=DEV, dtype=torch.bfloat16)


def scale_arg(step, rank):
    """The fp8 scale as a float on even ranks and as a device tensor on odd ones."""
    s = scale_of(step)
    return torch.tensor([s], dtype=torch.float32, device=DEV) if step.dtype != "bf16" and rank % 2 else s




def rank_partial(step, q, kv, t, num_blocks, rank, qlens=None):
    """One rank's step on the GPU: its own cache written with its share of the history, a plan, a run."""
    c = cache(num_blocks, step)
    latents, slots = slots_and_latents(step, kv, t, num_blocks, rank)
    dcpmla.write_kv(c, bf16(latents), torch.from_numpy(slots).to(DEV), kv_dtype=step.dtype,
                    kv_scale=scale_arg(step, rank))
    att = dcpmla.Attention(**attention_kwargs(step, rank, **LIMITS, device=DEV))
    att.plan(np.array(step.lengths, dtype=np.int32), t, step.qlen, mode=step.mode, qlens=qlens)
    return att.run(q, c, kv_scale=scale_arg(step, rank))


@pytest.mark.parametrize("step", STEPS, ids=Step.id)
def test_step_against_reference(step):
    q, kv, t, num_blocks, ref = make_inputs(step)
    qd = bf16(q)
    outs, lses = [], []
    for rank in range(step.world):
        out, lse = rank_partial(step, qd, kv, t, num_blocks, rank)
        assert out.device == DEV and out.dtype == torch.bfloat16 and lse.dtype == torch.float32
        empty = torch.from_numpy(empty_rows(step, rank)).to(DEV)
        assert torch.all(torch.isneginf(lse[empty])) and torch.all(out[empty] == 0), f"rank {rank}: empty rows"
        outs.append(out)
        lses.append(lse)
    out, lse = dcpmla.merge_states(torch.stack(outs), torch.stack(lses))
    assert_close(out.float().cpu().numpy(), lse.cpu().numpy(), *ref, what=step.id())


@pytest.mark.parametrize("step,qlens", [
    (Step(mode="verify", qlen=4, world=2, block=16, dtype="bf16", heads=128, lengths=(3000, 0, 5, 129)), (4, 2, 0, 1)),
    (Step(mode="draft", qlen=3, world=3, interleave=2, block=64, dtype="fp8_e4m3", kv_scale=0.37, heads=16,
          route="split_k", lengths=(700, 3, 0, 1500), seed=3), (0, 3, 2, 3)),
    (Step(mode="decode", qlen=1, world=4, block=1, dtype="fp8_e5m2", kv_scale=2.5, heads=16, route="one_stage",
          lengths=(1, 90, 0, 2000), seed=4), (1, 0, 1, 1)),
    (Step(mode="verify", qlen=2, world=1, block=64, dtype="fp8_e4m3", kv_scale=0.5, heads=16,
          lengths=(2000, 1, 4000, 2), seed=5), (2, 1, 1, 2)),
], ids=lambda x: x.id() if isinstance(x, Step) else "q" + "_".join(map(str, x)))
def test_per_request_query_lengths(step, qlens):
    """plan(qlens=...) on the GPU: packed rows, each request's windows those of its own qlen."""
    q, kv, t, num_blocks, ref = packed_case(step, qlens)
    qd = bf16(q)
    outs, lses = [], []
    for rank in range(step.world):
        out, lse = rank_partial(step, qd, kv, t, num_blocks, rank, qlens=list(qlens))
        assert out.shape == (sum(qlens), step.heads, R)
        outs.append(out)
        lses.append(lse)
    out, lse = dcpmla.merge_states(torch.stack(outs), torch.stack(lses))
    assert_close(out.float().cpu().numpy()[:, None], lse.cpu().numpy()[:, None], *ref,
                 what=f"{step.id()} qlens {qlens}")


# ---- a captured multi-layer DCP step, replayed after re-plans --------------------------------------

LAYERS, RANKS, QLEN, HEADS, BLOCK = 3, 2, 3, 16, 16
GRAPH_STEP = Step(mode="verify", qlen=QLEN, world=RANKS, block=BLOCK, dtype="fp8_e4m3", kv_scale=0.5, heads=HEADS)
# Every batch is B = 4 (the captured shape); lengths, padding and which rank holds what change.
BATCHES = [(37, 0, 5, 129), (300, 3, 0, 64), (4, 1000, 77, 0), (0, 0, 3, 5)]


class GraphStep:
    """Per rank an Attention, per (rank, layer) a cache and a device scale; static inputs the graph
    reads (q and the new tokens' latents per layer, their slots per rank) and the merged outputs."""

    def __init__(self, num_blocks):
        self.atts = [dcpmla.Attention(**attention_kwargs(GRAPH_STEP, r, **LIMITS, device=DEV)) for r in range(RANKS)]
        self.caches = [[cache(num_blocks, GRAPH_STEP) for _ in range(LAYERS)] for _ in range(RANKS)]
        self.scales = [torch.tensor([0.5 + 0.25 * layer], device=DEV) for layer in range(LAYERS)]
        B = len(BATCHES[0])
        self.q = torch.zeros((LAYERS, B, QLEN, HEADS, D), dtype=torch.bfloat16, device=DEV)
        self.new = torch.zeros((LAYERS, B * QLEN, D), dtype=torch.bfloat16, device=DEV)
        self.slots = torch.full((RANKS, B * QLEN), -1, dtype=torch.int64, device=DEV)
        self.parts = torch.zeros((LAYERS, RANKS, B, QLEN, HEADS, R), dtype=torch.bfloat16, device=DEV)
        self.part_lse = torch.zeros((LAYERS, RANKS, B, QLEN, HEADS), dtype=torch.float32, device=DEV)
        self.out = torch.zeros((LAYERS, B, QLEN, HEADS, R), dtype=torch.bfloat16, device=DEV)
        self.lse = torch.zeros((LAYERS, B, QLEN, HEADS), dtype=torch.float32, device=DEV)

    def layers(self):
        """The step's per-layer calls: write the new tokens, attend, merge the ranks."""
        for layer in range(LAYERS):
            for r, att in enumerate(self.atts):
                dcpmla.write_kv(self.caches[r][layer], self.new[layer], self.slots[r], kv_dtype="fp8_e4m3",
                                kv_scale=self.scales[layer])
                att.run(self.q[layer], self.caches[r][layer], kv_scale=self.scales[layer], out=self.parts[layer, r],
                        lse=self.part_lse[layer, r])
            dcpmla.merge_states(self.parts[layer], self.part_lse[layer], out=self.out[layer], lse=self.lse[layer])


def prepare(g, lengths, t, num_blocks, seed):
    """Host side of one step: fresh inputs, the history (all but the new tokens) written eagerly,
    the new tokens' latents and slots staged for the graph, and the plans. Returns the references."""
    rng = np.random.default_rng(seed)
    B, Lmax = len(lengths), max(max(lengths), 1)
    refs = []
    for layer in range(LAYERS):
        q = rng.standard_normal((B, QLEN, HEADS, D), dtype=np.float32)
        kv = rng.standard_normal((B, Lmax, D), dtype=np.float32)
        scale = float(g.scales[layer].item())
        refs.append(reference_attention(q, kv, np.array(lengths), mode="verify", kv_dtype="fp8_e4m3", kv_scale=scale))
        g.q[layer].copy_(bf16(q))
        new = np.zeros((B * QLEN, D), dtype=np.float32)
        for b, L in enumerate(lengths):
            if L:
                new[b * QLEN:(b + 1) * QLEN] = kv[b, L - QLEN:L]
        g.new[layer].copy_(bf16(new))
        for r in range(RANKS):
            g.caches[r][layer].view(torch.uint8).fill_(0xff)
            hist, hist_slots = [], []
            for b, L in enumerate(lengths):
                if L > QLEN:
                    hist.append(kv[b, :L - QLEN])
                    hist_slots.append(dcpmla.slot_mapping(np.arange(L - QLEN), t[b], BLOCK, num_blocks, RANKS, r))
            if hist:
                dcpmla.write_kv(g.caches[r][layer], bf16(np.concatenate(hist)),
                                torch.from_numpy(np.concatenate(hist_slots)).to(DEV), kv_dtype="fp8_e4m3",
                                kv_scale=scale)
    for r in range(RANKS):
        slots = np.full(B * QLEN, -1, dtype=np.int64)
        for b, L in enumerate(lengths):
            if L:
                slots[b * QLEN:(b + 1) * QLEN] = dcpmla.slot_mapping(np.arange(L - QLEN, L), t[b], BLOCK, num_blocks,
                                                                     RANKS, r)
        g.slots[r].copy_(torch.from_numpy(slots))
        g.atts[r].plan(np.array(lengths, dtype=np.int32), t, QLEN, mode="verify")
    return refs


def test_captured_step_replays_after_replan():
    max_len = max(max(b) for b in BATCHES)
    width = -(-dcpmla.local_length(max_len, RANKS, 0) // BLOCK)
    num_blocks = len(BATCHES[0]) * width + 1
    rng = np.random.default_rng(11)
    t = rng.permutation(num_blocks)[:len(BATCHES[0]) * width].reshape(len(BATCHES[0]), width).astype(np.int32)
    g = GraphStep(num_blocks)
    prepare(g, BATCHES[0], t, num_blocks, seed=0)
    g.layers()  # eager warm-up (loads the kernels) before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g.layers()
    for k, lengths in enumerate(BATCHES):
        # Eager: the plain calls on this step's inputs.
        refs = prepare(g, lengths, t, num_blocks, seed=100 + k)
        g.layers()
        eager = (g.out.clone(), g.lse.clone())
        # Replay: the same host preparation (history rewritten, re-plan), then the captured graph.
        prepare(g, lengths, t, num_blocks, seed=100 + k)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(g.out, eager[0]) and torch.equal(g.lse, eager[1]), f"batch {lengths}: replay != eager"
        for layer in range(LAYERS):
            assert_close(g.out[layer].float().cpu().numpy(), g.lse[layer].cpu().numpy(), *refs[layer],
                         what=f"batch {lengths} layer {layer}")


def test_plan_inside_a_capture_is_refused():
    att = dcpmla.Attention(heads=16, device=DEV, max_batch=4)
    graph, x = torch.cuda.CUDAGraph(), torch.zeros(1, device=DEV)
    with torch.cuda.graph(graph):
        x.add_(1)  # the capture holds some work, so that it ends cleanly
        with pytest.raises(ValueError, match="field 'plan' = called while its stream captures a CUDA graph"):
            att.plan([5], [[0]], 1, mode="decode")


def test_a_plan_of_more_rows_than_the_captured_run_is_refused():
    """A replay writes the current plan's rows into the tensors of the captured run(): a plan of
    more rows (one more request here) would write past them, so it is refused; fewer rows plan."""
    step = Step(dtype="bf16")
    q, kv, t, num_blocks, _ = make_inputs(step)
    att = dcpmla.Attention(**attention_kwargs(step, 0, **LIMITS, device=DEV))
    c, qd = cache(num_blocks, step), bf16(q)
    lengths = list(step.lengths)
    att.plan(lengths, t, step.qlen)
    out, lse = att.run(qd, c)  # eager warm-up, and the captured run's outputs
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        att.run(qd, c, out=out, lse=lse)
    with pytest.raises(ValueError, match=r"field 'batch' = 15 query rows: expected at most 12 \(the rows of a run"):
        att.plan(lengths + [5], np.concatenate([t, t[:1]]), step.qlen)
    att.plan(lengths[:-1], t[:-1], step.qlen)  # fewer rows: planned, and the replay writes fewer
    graph.replay()
    torch.cuda.synchronize()


def test_bad_input_is_refused_before_launch():
    step = Step(dtype="fp8_e4m3", kv_scale=0.5)
    q, kv, t, num_blocks, _ = make_inputs(step)
    att = dcpmla.Attention(**attention_kwargs(step, 0, **LIMITS, device=DEV))
    att.plan(list(step.lengths), t, step.qlen)
    c, qd = cache(num_blocks, step), bf16(q)
    err = lambda m: pytest.raises(ValueError, match=m)  # noqa: E731
    with err(r"field 'q.device' = cpu: expected cuda:\d"):
        att.run(qd.cpu(), c, kv_scale=0.5)
    with err(r"field 'q.dtype' = float32: expected bfloat16"):
        att.run(qd.float(), c, kv_scale=0.5)
    with err(r"field 'kv_cache.stride'"):
        att.run(qd, c.view(torch.uint8)[:, :, ::2], kv_scale=0.5)
    with err(r"field 'kv_cache.dtype' = float8_e5m2"):
        att.run(qd, c.view(torch.float8_e5m2), kv_scale=0.5)
    with err(r"field 'kv_scale.device' = cpu"):
        att.run(qd, c, kv_scale=torch.tensor([0.5]))
    with err(r"field 'kv_scale.dtype' = float64"):
        att.run(qd, c, kv_scale=torch.tensor([0.5], dtype=torch.float64, device=DEV))
    with err(r"field 'out.shape'"):
        att.run(qd, c, kv_scale=0.5, out=torch.empty((4, 3, 16, 576), dtype=torch.bfloat16, device=DEV))
    with err(r"field 'stream' = 'x'"):
        att.run(qd, c, kv_scale=0.5, stream="x")
    # run() passes torch tensors as torch's own export (dcpmla._engine._once); one the export
    # refuses (a sparse layout) goes to the native import as it is, which names it.
    with err(r"field 'q'"):
        att.run(qd.to_sparse(), c, kv_scale=0.5)
    with err(r"field 'latent'"):
        dcpmla.write_kv(c, qd[0, 0].to_sparse(), torch.zeros(16, dtype=torch.int64, device=DEV),
                        kv_dtype=step.dtype, kv_scale=0.5)
    # torch's lazy negation is a flag DLPack does not carry: the call would read q, or write out,
    # un-negated (test_torch_tensors.py covers every argument on the CPU).
    with err(r"field 'q' = a torch tensor with its negative bit set"):
        att.run(torch._neg_view(qd), c, kv_scale=0.5)
    with err(r"field 'out' = a torch tensor with its negative bit set"):
        att.run(qd, c, kv_scale=0.5, out=torch._neg_view(torch.empty((4, 3, 16, R), dtype=torch.bfloat16, device=DEV)))
    with err(r"field 'q' = a nested torch tensor"):
        att.run(torch.nested.nested_tensor([qd[0], qd[1]]), c, kv_scale=0.5)
    with err(r"field 'batch' = 9"):
        att.plan([1] * 9, np.zeros((9, 1), np.int32), 1, mode="decode")
    # Views a whole value past 16 bytes, which the CPU backend takes: the kernels read 16 bytes at
    # a time, so q, out, the cache and the latents are refused by name (a fault would end the context).
    def off16(t, values=1):
        flat = torch.empty(t.numel() + 64, dtype=t.dtype, device=t.device)
        v = flat[values:values + t.numel()].view(t.shape)
        v.copy_(t)
        assert v.data_ptr() % 16 != 0
        return v
    with err(r"field 'q.data_ptr' = .*: expected 16-byte aligned memory"):
        att.run(off16(qd), c, kv_scale=0.5)
    with err(r"field 'kv_cache.data_ptr' = .*: expected 16-byte aligned memory"):
        att.run(qd, off16(c.view(torch.uint8), 2).view(torch.float8_e4m3fn), kv_scale=0.5)
    out = torch.empty((4, 3, 16, R), dtype=torch.bfloat16, device=DEV)
    with err(r"field 'out.data_ptr' = .*: expected 16-byte aligned memory"):
        att.run(qd, c, kv_scale=0.5, out=off16(out))
    latents, slots = slots_and_latents(step, kv, t, num_blocks, 0)
    with err(r"field 'latent.data_ptr' = .*: expected 16-byte aligned memory"):
        dcpmla.write_kv(c, off16(bf16(latents)), torch.from_numpy(slots).to(DEV), kv_dtype=step.dtype, kv_scale=0.5)
    # A tensor that requires grad is read as it is (inference: nothing is recorded for autograd).
    dcpmla.write_kv(c, bf16(latents), torch.from_numpy(slots).to(DEV), kv_dtype=step.dtype, kv_scale=0.5)
    out, lse = att.run(qd, c, kv_scale=0.5)
    out_g, lse_g = att.run(qd.clone().requires_grad_(), c, kv_scale=0.5)
    assert torch.isfinite(out).all() and torch.equal(out, out_g) and torch.equal(lse, lse_g)
    if torch.cuda.device_count() > 1:
        other = torch.device("cuda", (DEV.index + 1) % torch.cuda.device_count())
        with err(rf"field 'q.device' = cuda:{other.index}: expected cuda:{DEV.index}"):
            att.run(qd.to(other), c, kv_scale=0.5)


def test_explicit_streams_order_the_work():
    step = Step(dtype="bf16")
    q, kv, t, num_blocks, ref = make_inputs(step)
    side = torch.cuda.Stream()
    c = cache(num_blocks, step)
    latents, slots = slots_and_latents(step, kv, t, num_blocks, 0)
    lat, sl, qd = bf16(latents), torch.from_numpy(slots).to(DEV), bf16(q)
    side.wait_stream(torch.cuda.current_stream())
    att = dcpmla.Attention(**attention_kwargs(step, 0, **LIMITS, device=DEV))
    with torch.cuda.stream(side):  # the default: torch's current stream, here `side`
        dcpmla.write_kv(c, lat, sl)
        att.plan(list(step.lengths), t, step.qlen)
        out, lse = att.run(qd, c)
    out2, lse2 = att.run(qd, c, stream=side)  # explicit torch.cuda.Stream
    out3, lse3 = att.run(qd, c, stream=side.cuda_stream)  # explicit handle
    side.synchronize()
    assert torch.equal(out, out2) and torch.equal(out, out3) and torch.equal(lse, lse3)
    assert_close(out.float().cpu().numpy(), lse.cpu().numpy(), *ref)


def test_example_runs_on_the_gpu():
    example = Path(__file__).resolve().parents[2] / "examples" / "speculative_decode.py"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, str(example), "--device", "cuda", "--steps", "4"], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "tokens/s" in done.stdout
