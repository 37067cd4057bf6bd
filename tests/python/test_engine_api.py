"""The engine API (SPEC §6) on the CPU: dcpmla.Attention / write_kv / merge_states on numpy
arrays (and torch CPU tensors where torch is installed), one step per case as an engine drives
it, merged over the ranks and compared with the float64 reference; bad input refused with
ValueError naming the argument."""

from __future__ import annotations

import numpy as np
import pytest

import dcpmla
from engine_case import (D, R, DLPackOnly, Step, attention_kwargs, empty_rows, make_inputs,
                         packed_case, scale_of, slots_and_latents)
from reference import assert_close

LIMITS = dict(max_batch=8, max_qlen=8, max_local_len=4096, device="cpu")

# Every mode, dtype, route, N 1..4, interleave 1/2, block 1/16/64/256; padding requests and rows
# that some ranks hold nothing of (short requests over several ranks) in every case.
STEPS = [
    Step(mode="decode", qlen=1, world=1, block=64, dtype="bf16", lengths=(300, 0, 1, 77)),
    Step(mode="decode", qlen=1, world=4, interleave=2, block=16, dtype="fp8_e4m3", kv_scale=0.37,
         lengths=(1, 0, 3, 200), seed=1),
    Step(mode="verify", qlen=4, world=2, block=1, dtype="fp8_e5m2", kv_scale=2.5, lengths=(4, 0, 9, 70), seed=2),
    Step(mode="verify", qlen=3, world=3, interleave=2, block=16, dtype="bf16", route="one_stage", seed=3),
    # The split_k steps' longest requests give rank 0 eight tiles (500 tokens): the planner cuts
    # them at its default min_segment_tokens (256), and run_step checks that it did.
    Step(mode="verify", qlen=2, world=4, block=64, dtype="fp8_e4m3", kv_scale=0.5, route="split_k",
         lengths=(700, 2, 0, 2000), seed=4),
    Step(mode="draft", qlen=3, world=2, interleave=2, block=256, dtype="bf16", route="split_k",
         lengths=(3, 1000, 0, 1), seed=5),
    Step(mode="draft", qlen=2, world=3, block=16, dtype="fp8_e5m2", kv_scale=0.37, heads=5, seed=6),
]


def numpy_cache(num_blocks, step):
    """An engine's cache memory, NaN everywhere (0xff bytes) until written: uint16 bf16 bits or fp8 bytes."""
    dtype = np.uint16 if step.dtype == "bf16" else np.uint8
    return np.full((num_blocks, step.block, D), np.iinfo(dtype).max, dtype=dtype)


def run_step(step, q, kv, t, num_blocks, *, cache_of=numpy_cache, convert=lambda x: x, qlens=None):
    """One step on every rank: write the history, plan (with per-request qlens when given), run;
    returns the ranks' partials. A forced split_k must have cut a request on some rank."""
    outs, lses, pieces = [], [], []
    for rank in range(step.world):
        cache = cache_of(num_blocks, step)
        latents, slots = slots_and_latents(step, kv, t, num_blocks, rank)
        dcpmla.write_kv(cache, convert(latents), convert(slots), kv_dtype=step.dtype, kv_scale=scale_of(step))
        att = dcpmla.Attention(**attention_kwargs(step, rank, **LIMITS))
        att.plan(np.array(step.lengths, dtype=np.int32), t, step.qlen, mode=step.mode, qlens=qlens)
        pieces.append(att._native.max_segments)
        out, lse = att.run(convert(q), cache, kv_scale=scale_of(step))
        outs.append(out)
        lses.append(lse)
    assert step.route != "split_k" or max(pieces) > 1, f"{step.id()}: split_k cut nothing ({pieces})"
    return outs, lses




def check_partials(step, outs, lses):
    for rank, (out, lse) in enumerate(zip(outs, lses)):
        empty = empty_rows(step, rank)
        assert np.all(np.isneginf(np.asarray(lse, dtype=np.float32)[empty])), f"rank {rank}: lse of empty rows"
        assert np.all(np.asarray(out, dtype=np.float32)[empty] == 0), f"rank {rank}: out of empty rows"


@pytest.mark.parametrize("step", STEPS, ids=Step.id)
def test_step_against_reference(step):
    q, kv, t, num_blocks, ref = make_inputs(step)
    outs, lses = run_step(step, q, kv, t, num_blocks)
    check_partials(step, outs, lses)
    out, lse = dcpmla.merge_states(np.stack(outs), np.stack(lses))
    assert out.dtype == np.float32 and out.shape == (len(step.lengths), step.qlen, step.heads, R)
    assert_close(out, lse, *ref, what=step.id())


def test_equals_the_conformance_entry_point():
    step = STEPS[4]
    q, kv, t, num_blocks, _ = make_inputs(step)
    out, lse = dcpmla.merge_states(*map(np.stack, run_step(step, q, kv, t, num_blocks)))
    want_out, want_lse = dcpmla.mla_attention(q, kv, np.array(step.lengths, dtype=np.int32), mode=step.mode,
                                              world_size=step.world, block_size=step.block, kv_dtype=step.dtype,
                                              kv_scale=step.kv_scale)
    assert_close(out, lse, want_out.astype(np.float64), want_lse.astype(np.float64), bound=1e-2)


@pytest.mark.parametrize("step,qlens", [
    (Step(mode="verify", qlen=4, world=2, block=16, route="auto", lengths=(37, 0, 5, 129)), (4, 2, 0, 1)),
    (Step(mode="draft", qlen=3, world=3, interleave=2, block=64, dtype="fp8_e4m3", kv_scale=0.37, route="split_k",
          lengths=(700, 3, 0, 1500), seed=3), (0, 3, 2, 3)),
    (Step(mode="decode", qlen=1, world=4, block=1, dtype="fp8_e5m2", kv_scale=2.5, route="one_stage",
          lengths=(1, 90, 0, 2), seed=4), (1, 0, 1, 1)),
], ids=lambda x: x.id() if isinstance(x, Step) else "q" + "_".join(map(str, x)))
def test_per_request_query_lengths(step, qlens):
    """plan(qlens=...): q, out and lse packed [sum(qlens), ...]; each request's windows those of
    its own qlen; a request without rows, a padding request with rows, ranks holding nothing."""
    q, kv, t, num_blocks, ref = packed_case(step, qlens)
    outs, lses = run_step(step, q, kv, t, num_blocks, qlens=list(qlens))
    for out, lse in zip(outs, lses):
        assert out.shape == (sum(qlens), step.heads, R) and lse.shape == (sum(qlens), step.heads)
    out, lse = dcpmla.merge_states(np.stack(outs), np.stack(lses))
    assert_close(out[:, None], lse[:, None], *ref, what=f"{step.id()} qlens {qlens}")
    att = dcpmla.Attention(**attention_kwargs(step, 0, **LIMITS))
    with pytest.raises(ValueError, match=r"'qlens.shape\[0\]' = 3"):
        att.plan(list(step.lengths), t, step.qlen, mode=step.mode, qlens=list(qlens)[:3])
    att.plan(list(step.lengths), t, step.qlen, mode=step.mode, qlens=list(qlens))
    with pytest.raises(ValueError, match=r"'q.shape"):
        att.run(q[:-1], numpy_cache(num_blocks, step), kv_scale=scale_of(step))


def test_a_slice_of_a_wider_table_is_read_in_place():
    """An engine keeps one persistent block table [max_batch, max_blocks] and passes its [:B, :W]
    slice each step: read in place at its row pitch (no copy a step) with the packed table's
    answer; its other columns (ids the planner would refuse) are never read. Columns past what a
    request can use are cut before anything is copied: a broadcast table 2**30 - 1 wide (16 GiB
    to copy: refused, or 19 s and 8 GiB at one request, before) plans at once."""
    from dcpmla._checks import _int_array

    step = STEPS[4]
    q, kv, t, num_blocks, ref = make_inputs(step)
    B, W = t.shape
    wide = np.full((B + 3, W + 9), -5, dtype=np.int32)
    wide[:B, :W] = t
    sliced = wide[:B, :W]
    assert np.shares_memory(_int_array("block_tables", sliced, np.int32, "", ndim=2, rows_in_place=True), wide)
    out, lse = dcpmla.merge_states(*map(np.stack, run_step(step, q, kv, sliced, num_blocks)))
    assert_close(out, lse, *ref, what="a [:B, :W] slice")
    # Rows that are not in place (columns apart) are copied, with the same answer.
    strided_cols = np.full((B, 2 * W), -5, dtype=np.int32)
    strided_cols[:, ::2] = t
    assert not np.shares_memory(_int_array("block_tables", strided_cols[:, ::2], np.int32, "", ndim=2,
                                           rows_in_place=True), strided_cols)
    out2, lse2 = dcpmla.merge_states(*map(np.stack, run_step(step, q, kv, strided_cols[:, ::2], num_blocks)))
    assert np.array_equal(out, out2) and np.array_equal(lse, lse2)
    att = dcpmla.Attention(**attention_kwargs(step, 0, **LIMITS))
    att.plan(list(step.lengths), np.broadcast_to(t[:, :1], (B, 2**31 - 1)), step.qlen, mode=step.mode)
    assert att.batch == B


def off_16_bytes(a):
    """A copy of `a` one value past a 16-byte boundary: aligned to its values (numpy's `aligned`
    flag), not to the CUDA kernels' 16 bytes."""
    a = np.asarray(a)
    buf = np.empty(a.nbytes + 32, dtype=np.uint8)
    start = (-buf.ctypes.data) % 16 + a.itemsize
    view = buf[start:start + a.nbytes].view(a.dtype).reshape(a.shape)
    view[...] = a
    assert view.flags.aligned and view.ctypes.data % 16 == a.itemsize
    return view


@pytest.mark.parametrize("step", [STEPS[0], STEPS[2], STEPS[5]], ids=Step.id)
def test_arrays_aligned_to_their_values_run_on_the_cpu(step):
    """The CPU backend reads whole values, so q, the cache, the latents, the slots, out, lse and
    the merge's inputs one value past a 16-byte boundary run (CUDA asks 16 bytes: its own test),
    with the aligned arrays' answer bit for bit; a view one byte past a value is refused."""
    q, kv, t, num_blocks, ref = make_inputs(step)
    want = run_step(step, q, kv, t, num_blocks)
    got = run_step(step, q, kv, t, num_blocks, cache_of=lambda n, s: off_16_bytes(numpy_cache(n, s)),
                   convert=off_16_bytes)
    for a, b in zip(want[0] + want[1], got[0] + got[1]):
        assert np.array_equal(a, b, equal_nan=True)
    out, lse = dcpmla.merge_states(off_16_bytes(np.stack(got[0])), off_16_bytes(np.stack(got[1])),
                                   out=off_16_bytes(np.zeros_like(got[0][0])),
                                   lse=off_16_bytes(np.zeros_like(got[1][0])))
    assert out.ctypes.data % 16 == 4
    assert_close(out, lse, *ref, what=step.id() + " off 16 bytes")
    att, q, cache, _ = planned(step)
    out = off_16_bytes(np.zeros((len(step.lengths), step.qlen, step.heads, R), dtype=np.float32))
    lse = off_16_bytes(np.zeros((len(step.lengths), step.qlen, step.heads), dtype=np.float32))
    got_out, got_lse = att.run(off_16_bytes(q), off_16_bytes(cache), out=out, lse=lse, kv_scale=scale_of(step))
    assert got_out is out and np.array_equal(out, want[0][0], equal_nan=True)
    if cache.itemsize > 1:
        raw = np.empty(cache.nbytes + 32, dtype=np.uint8)
        start = (-raw.ctypes.data) % 16 + 1
        odd = raw[start:start + cache.nbytes].view(cache.dtype).reshape(cache.shape)
        with pytest.raises(ValueError, match=r"'kv_cache.data_ptr' = .*: expected 2-byte aligned memory"):
            att.run(q, odd, kv_scale=scale_of(step))


def planned(step=Step(), **extra):
    q, kv, t, num_blocks, _ = make_inputs(step)
    att = dcpmla.Attention(**attention_kwargs(step, 0, **{**LIMITS, **extra}))
    att.plan(np.array(step.lengths, dtype=np.int32), t, step.qlen, mode=step.mode)
    cache = numpy_cache(num_blocks, step)
    latents, slots = slots_and_latents(step, kv, t, num_blocks, 0)
    dcpmla.write_kv(cache, latents, slots, kv_dtype=step.dtype, kv_scale=scale_of(step))
    return att, q, cache, t


def test_outputs_are_reused_and_plans_replace_each_other():
    att, q, cache, t = planned()
    out = np.zeros((4, 3, 16, R), dtype=np.float32)
    lse = np.zeros((4, 3, 16), dtype=np.float32)
    got = att.run(q, cache, out=out, lse=lse)
    assert got[0] is out and got[1] is lse
    first = out.copy()
    # A new plan with other lengths: same buffers' shapes for the same B and qlen, new answer.
    att.plan([30, 0, 5, 100], t, 3)
    att.run(q, cache, out=out, lse=lse)
    assert not np.array_equal(first, out)
    assert att.batch == 4 and att.qlen == 3 and att.route in ("one_stage", "split_k")


def test_the_calls_take_their_arguments_in_spec_order():
    """SPEC §6 writes run(q, kv_cache, kv_scale=1.0, out=None, lse=None, stream=None) and the
    constructor's arguments in one order: each may be passed by position as well as by name."""
    import inspect
    spec = {
        dcpmla.Attention.__init__: ["self", "heads", "kv_dtype", "block_size", "world_size", "rank", "interleave",
                                    "max_batch", "max_qlen", "max_local_len", "softmax_scale", "kv_lora_rank",
                                    "route", "device"],
        dcpmla.Attention.plan: ["self", "seq_lens", "block_tables", "qlen", "mode"],
        dcpmla.Attention.run: ["self", "q", "kv_cache", "kv_scale", "out", "lse", "stream"],
        dcpmla.write_kv: ["kv_cache", "latent", "slot_mapping", "kv_dtype", "kv_scale", "stream"],
        dcpmla.merge_states: ["out_parts", "lse_parts"],
    }
    for fn, names in spec.items():
        positional = [p.name for p in inspect.signature(fn).parameters.values()
                      if p.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD]
        assert positional[:len(names)] == names, fn.__qualname__
    step = Step(dtype="fp8_e4m3", kv_scale=0.37)
    q, kv, t, num_blocks, _ = make_inputs(step)
    by_name = dcpmla.Attention(**attention_kwargs(step, 0, **LIMITS))
    kw = attention_kwargs(step, 0, **LIMITS)
    by_position = dcpmla.Attention(kw["heads"], kw["kv_dtype"], kw["block_size"], kw["world_size"], kw["rank"],
                                   kw["interleave"], kw["max_batch"], kw["max_qlen"], kw["max_local_len"],
                                   kw.get("softmax_scale"), kw.get("kv_lora_rank", R), kw.get("route", "auto"),
                                   kw["device"])
    cache = numpy_cache(num_blocks, step)
    latents, slots = slots_and_latents(step, kv, t, num_blocks, 0)
    dcpmla.write_kv(cache, latents, slots, step.dtype, scale_of(step), None)
    got = []
    for att in (by_name, by_position):
        att.plan(np.array(step.lengths, dtype=np.int32), t, step.qlen, step.mode)
        out = np.zeros((len(step.lengths), step.qlen, step.heads, R), dtype=np.float32)
        lse = np.zeros((len(step.lengths), step.qlen, step.heads), dtype=np.float32)
        assert att.run(q, cache, scale_of(step), out, lse, None)[0] is out
        got.append((out, lse))
    np.testing.assert_array_equal(got[0][0], got[1][0])
    np.testing.assert_array_equal(got[0][1], got[1][1])
    np.testing.assert_array_equal(by_name.run(q, cache, kv_scale=scale_of(step))[0], got[0][0])


def test_plan_takes_lists_and_other_integer_arrays():
    att, q, cache, t = planned()
    att.plan([37, 0, 5, 129], t.tolist(), 3, mode="verify")
    a = att.run(q, cache)
    att.plan(np.array([37, 0, 5, 129], dtype=np.int64), t.astype(np.uint16), 3)
    b = att.run(q, cache)
    np.testing.assert_array_equal(a[0], b[0])


@pytest.mark.parametrize("scalar", [np.uint64, np.uint32, np.uint16, np.int64])
def test_numpy_integer_scalars_construct_as_plain_ints(scalar):
    """Integer arguments given as numpy scalars, unsigned among them (numpy 2 wraps or raises
    when one is negated), build the same object as plain ints and plan and run alike."""
    step = Step()
    q, kv, t, num_blocks, _ = make_inputs(step)
    cache = numpy_cache(num_blocks, step)
    latents, slots = slots_and_latents(step, kv, t, num_blocks, 0)
    dcpmla.write_kv(cache, latents, slots, kv_dtype=step.dtype, kv_scale=scale_of(step))
    outs = []
    for wrap in (int, scalar):
        kwargs = attention_kwargs(step, 0, **LIMITS)
        for key in ("heads", "block_size", "world_size", "interleave", "max_batch", "max_qlen", "max_local_len"):
            kwargs[key] = wrap(kwargs[key])
        att = dcpmla.Attention(**kwargs)
        assert att.heads == step.heads and type(att.heads) is int
        att.plan(np.array(step.lengths, dtype=np.int32), t, step.qlen, mode=step.mode)
        outs.append(att.run(q, cache))
    np.testing.assert_array_equal(outs[0][0], outs[1][0])
    np.testing.assert_array_equal(outs[0][1], outs[1][1])


def test_kv_scale_as_a_one_element_array():
    step = Step(dtype="fp8_e4m3", kv_scale=0.5)
    q, kv, t, num_blocks, ref = make_inputs(step)
    scale = np.array([0.5], dtype=np.float32)
    cache = numpy_cache(num_blocks, step)
    latents, slots = slots_and_latents(step, kv, t, num_blocks, 0)
    dcpmla.write_kv(cache, latents, slots, kv_dtype="fp8_e4m3", kv_scale=scale)
    att = dcpmla.Attention(**attention_kwargs(step, 0, **LIMITS))
    att.plan(list(step.lengths), t, step.qlen)
    assert_close(*att.run(q, cache, kv_scale=scale), *ref)


def error(match):
    return pytest.raises(ValueError, match=match)


def test_bad_input_names_the_argument():
    att, q, cache, t = planned()
    with error(r"field 'q.dtype' = float64"):
        att.run(q.astype(np.float64), cache)
    with error(r"field 'q.shape' = \[4, 3, 16, 512\]: expected \[B, qlen, H, D\]"):
        att.run(q[..., :512].copy(), cache)
    with error(r"field 'q.stride'"):
        att.run(np.asfortranarray(q), cache)
    with error(r"field 'kv_cache.stride'"):
        att.run(q, cache[:, ::2])
    with error(r"field 'kv_cache.dtype' = uint8: expected bfloat16"):
        att.run(q, cache.view(np.uint8))
    with error(r"field 'kv_cache block_size' = 32"):
        att.run(q, cache.reshape(cache.shape[0] // 2, 32, D) if cache.shape[0] % 2 == 0 else
                np.concatenate([cache, cache[:1]]).reshape(-1, 32, D))
    with error(r"field 'kv_cache num_blocks' = 1"):
        att.run(q, cache[:1])
    with error(r"field 'out.shape'"):
        att.run(q, cache, out=np.zeros((4, 3, 16, 576), np.float32))
    with error(r"field 'lse.dtype' = float64"):
        att.run(q, cache, lse=np.zeros((4, 3, 16)))
    with error(r"field 'kv_scale' = 0.5: expected 1.0 for a bf16 cache"):
        att.run(q, cache, kv_scale=0.5)
    with error(r"field 'stream' = 7: expected None on the cpu device"):
        att.run(q, cache, stream=7)
    out, lse = att.run(q, cache)
    with error(r"field 'q' = list: expected an array or tensor"):
        att.run(q.tolist(), cache, out=out, lse=lse)
    with error(r"field 'q' = memoryview: expected an array or tensor"):  # q is named before out is allocated
        att.run(memoryview(q), cache)

    # A DLPack producer that is neither numpy nor torch: outputs are not allocated for it.
    with error(r"field 'out' = None: expected a buffer"):
        att.run(DLPackOnly(q), cache)


def test_a_q_of_the_wrong_shape_is_named_before_outputs_are_sized():
    """run() sizes missing outputs from q only when q can fit: a q with other trailing extents
    (or a broadcast view of many rows) asked numpy for up to H x R times its own size, a
    MemoryError (here 32 PiB) instead of the ValueError naming q."""
    H = 4096
    att = dcpmla.Attention(heads=H, block_size=64, device="cpu", max_batch=1, max_qlen=8, max_local_len=64,
                           route="one_stage")
    att.plan([8], np.zeros((1, 1), np.int32), 8, mode="verify")
    cache = np.zeros((1, 64, D), np.float32)
    huge = np.broadcast_to(np.zeros((1, 1, 1, D), np.float32), (2**20, 4096, 1, D))
    with error(r"field 'q"):
        att.run(huge, cache)
    with error(r"field 'q.shape' = \[1, 8, 1, 576\]"):
        att.run(np.zeros((1, 8, 1, D), np.float32), cache)


def test_bad_plans_are_refused_and_keep_the_last_plan():
    att, q, cache, t = planned()
    with error(r"field 'seq_lens\[1\]' = 3000000000: expected a value that fits int32"):
        att.plan([37, 3_000_000_000, 5, 129], t, 3)
    with error(r"field 'seq_lens\[0\]' = 37.0: expected an integer"):
        att.plan([37.0, 0, 5, 129], t, 3)
    with error(r"field 'seq_lens.dtype' = float64"):
        att.plan(np.array([37.0, 0, 5, 129]), t, 3)
    with error(r"field 'block_tables' = list"):
        att.plan([37, 0, 5, 129], [[1, 2], [3]], 3)
    with error(r"field 'block_tables.shape\[0\]' = 3"):
        att.plan([37, 0, 5, 129], t[:3], 3)
    with error(r"field 'batch' = 9"):  # beyond the capture limit max_batch = 8
        att.plan([1] * 9, np.zeros((9, 1), np.int32), 1, mode="decode")
    with error(r"field 'qlen' = 9"):
        att.plan([37, 0, 5, 129], t, 9)
    with error(r"field 'mode' = 'sideways'"):
        att.plan([37, 0, 5, 129], t, 3, mode="sideways")
    assert att.batch == 4 and att.qlen == 3  # the last good plan stands
    att.run(q, cache)


def test_bad_construction_and_run_before_plan():
    with error(r"field 'device' = 'tpu'"):
        dcpmla.Attention(heads=16, device="tpu")
    with error(r"field 'rank' = 2"):
        dcpmla.Attention(heads=16, world_size=2, rank=2, device="cpu")
    with error(r"field 'kv_dtype' = 'fp16'"):
        dcpmla.Attention(heads=16, kv_dtype="fp16", device="cpu")
    att = dcpmla.Attention(heads=16, device="cpu", max_batch=4)
    with error(r"field 'plan' = none"):
        att.run(np.zeros((1, 1, 16, D), np.float32), np.zeros((4, 64, D), np.uint16))
    if not dcpmla.cuda_available:
        with error(r"field 'device' = cuda: expected 'cpu': the CUDA backend is not built"):
            dcpmla.Attention(heads=16, device="cuda")


def test_write_kv_and_merge_states_refuse_bad_input():
    cache = np.zeros((4, 16, D), np.uint16)
    latent = np.zeros((2, D), np.float32)
    with error(r"field 'slot_mapping\[1\]' = 64: expected -1 \(PAD\) or a slot in \[0, 64\)"):
        dcpmla.write_kv(cache, latent, [3, 64])
    with error(r"field 'slot_mapping.dtype' = int32"):
        dcpmla.write_kv(cache, latent, np.array([3, 4], np.int32))
    with error(r"field 'latent.shape' = \[2, 512\]"):
        dcpmla.write_kv(cache, latent[:, :512].copy(), [3, 4])
    with error(r"field 'kv_cache.dtype' = uint16: expected uint8 / int8 or float8_e4m3fn"):
        dcpmla.write_kv(cache, latent, [3, 4], kv_dtype="fp8_e4m3", kv_scale=0.5)
    parts = np.zeros((2, 3, 5, R), np.float32)
    with error(r"field 'lse_parts.shape' = \[2, 3\]"):
        dcpmla.merge_states(parts, np.zeros((2, 3), np.float32))
    with error(r"field 'out.dtype' = float64"):
        dcpmla.merge_states(parts, np.zeros((2, 3, 5), np.float32), out=np.zeros((3, 5, R)))
    with error(r"field 'out_parts.shape\[-1\]' = 0: expected W >= 1"):
        dcpmla.merge_states(np.zeros((2, 3, 0), np.float32), np.zeros((2, 3), np.float32))


def test_merge_states_follows_the_lse_rule():
    rng = np.random.default_rng(3)
    parts = rng.standard_normal((3, 7, R)).astype(np.float32)
    lse = rng.standard_normal((3, 7)).astype(np.float32)
    lse[:, 0] = -np.inf  # a row no rank holds anything of
    lse[1, 1] = -np.inf  # a rank with an empty window
    out, merged = dcpmla.merge_states(parts, lse)
    with np.errstate(invalid="ignore"):
        want_lse = np.logaddexp.reduce(lse.astype(np.float64), axis=0)
        w = np.exp(lse - want_lse)
    want = np.nan_to_num((w[..., None] * parts.astype(np.float64)).sum(axis=0))
    assert np.isneginf(merged[0]) and np.all(out[0] == 0)
    np.testing.assert_allclose(merged[1:], want_lse[1:], rtol=1e-5)
    np.testing.assert_allclose(out[1:], want[1:], atol=2e-2, rtol=1e-2)  # bf16 partials


# ---- torch CPU tensors (skipped where torch is not installed) ---------------------------------


def torch_cache(num_blocks, step):
    torch = pytest.importorskip("torch")
    dtype = {"bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[step.dtype]
    return torch.from_numpy(numpy_cache(num_blocks, step).view(np.int16 if step.dtype == "bf16" else np.int8)) \
        .view(dtype)


@pytest.mark.parametrize("step", STEPS[:5], ids=Step.id)
def test_torch_cpu_tensors(step):
    torch = pytest.importorskip("torch")
    q, kv, t, num_blocks, ref = make_inputs(step)

    def to_torch(x):
        x = torch.from_numpy(np.ascontiguousarray(x))
        return x.to(torch.bfloat16) if x.dtype == torch.float32 else x

    outs, lses = run_step(step, q, kv, t, num_blocks, cache_of=torch_cache, convert=to_torch)
    assert outs[0].dtype == torch.bfloat16 and lses[0].dtype == torch.float32
    out, lse = dcpmla.merge_states(torch.stack(outs), torch.stack(lses))
    assert_close(out.float().numpy(), lse.numpy(), *ref, what=step.id())


def test_torch_fp8_cache_of_the_other_format_is_refused():
    torch = pytest.importorskip("torch")
    att, q, _, t = planned(Step(dtype="fp8_e4m3", kv_scale=0.5))
    cache = torch.zeros((8, 16, D), dtype=torch.float8_e5m2)
    with error(r"field 'kv_cache.dtype' = float8_e5m2: expected a dtype holding fp8_e4m3 values"):
        att.run(torch.from_numpy(q), cache, kv_scale=0.5)


def test_plans_default_stream_is_cupys_where_runs_is(monkeypatch):
    """plan() takes no tensor, so its default stream is chosen by producer: with cupy imported
    (and torch's CUDA not set up) it is cupy's current stream, where run() on a cupy array queues
    its kernels. It was the legacy stream, which a non-blocking cupy stream is not ordered after:
    the kernels could read the previous device plan (the seventieth session's audit). A stand-in
    cupy module; the CUDA branch is reached with a device index, no GPU needed."""
    import sys
    import types

    from dcpmla._engine import _stream

    class FakeArray:
        pass

    current = types.SimpleNamespace(ptr=0xC0FFEE)
    fake = types.SimpleNamespace(ndarray=FakeArray, cuda=types.SimpleNamespace(get_current_stream=lambda: current))
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        pytest.skip("torch has set CUDA up: plan()'s default is torch's stream")
    monkeypatch.setitem(sys.modules, "cupy", fake)
    assert _stream(None, None, 0) == 0xC0FFEE  # plan()
    assert _stream(None, FakeArray(), 0) == 0xC0FFEE  # run() on a cupy array
    assert _stream(7, None, 0) == 7  # an explicit handle wins
    monkeypatch.delitem(sys.modules, "cupy")
    if torch is None:
        assert _stream(None, None, 0) == 0  # no producer imported: the legacy default stream
