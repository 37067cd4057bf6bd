"""Bad input gets a ValueError naming the field (SPEC §4 "Validation"), never a crash,
an assert or a silent wrong answer."""

from __future__ import annotations

import math

import numpy as np
import pytest

import dcpmla

D = 576


def inputs(B=2, qlen=2, H=2, lens=(5, 3), Lmax=6, dim=D):
    rng = np.random.default_rng(7)
    q = rng.standard_normal((B, qlen, H, dim)).astype(np.float32)
    kv = rng.standard_normal((B, Lmax, dim)).astype(np.float32)
    return q, kv, np.array(lens, dtype=np.int32)


def call(q=None, kv=None, seq_lens=None, **kw):
    q0, kv0, s0 = inputs()
    return dcpmla.mla_attention(q0 if q is None else q, kv0 if kv is None else kv,
                                s0 if seq_lens is None else seq_lens, **kw)


def test_valid_baseline_runs():
    out, lse = call()
    assert out.shape == (2, 2, 2, 512) and lse.shape == (2, 2, 2)


def raises(field, fn, *args, **kw):
    with pytest.raises(ValueError, match=field) as info:
        fn(*args, **kw)
    return str(info.value)


# --- attention: values the library checks -------------------------------------------------

def test_negative_seq_len():
    msg = raises(r"seq_lens", call, seq_lens=np.array([5, -1], np.int32))
    assert "-1" in msg


def test_seq_len_shorter_than_qlen_in_verify():
    raises(r"'seq_lens\[1\]' = 1: expected >= qlen \(2\) in verify mode", call, seq_lens=np.array([5, 1], np.int32))


def test_seq_len_shorter_than_qlen_in_decode_is_fine_only_for_padding():
    q, kv, _ = inputs(qlen=1)
    out, lse = dcpmla.mla_attention(q, kv, np.array([0, 1], np.int32), mode="decode")
    assert np.all(np.isneginf(lse[0])) and np.all(out[0] == 0)


def test_qlen_zero():
    q, kv, s = inputs(qlen=0)
    raises(r"qlen", dcpmla.mla_attention, q, kv, s)


def test_decode_with_qlen_above_one():
    raises(r"'qlen' = 2: expected 1 in decode mode", call, mode="decode")


def test_heads_zero():
    q, kv, s = inputs(H=0)
    raises(r"heads", dcpmla.mla_attention, q, kv, s)


def test_an_extent_past_int32_is_refused_not_narrowed():
    """q [1, 1, 2^31 + 4, 2] was read as heads = -2147483644 (2^32 + 3 heads as 3)."""
    try:
        q = np.zeros((1, 1, 2**31 + 4, 2), np.float32)  # 16 GiB of untouched zero pages
    except MemoryError:
        pytest.skip("this machine does not overcommit 16 GiB")
    kv = np.zeros((1, 8, 2), np.float32)
    raises(r"field 'q.shape\[2\]' = 2147483652: expected an extent that fits int32", dcpmla.mla_attention, q, kv,
           np.array([8], np.int32))


@pytest.mark.parametrize("value", [0, -1])
def test_world_size(value):
    raises(r"world_size", call, world_size=value)


@pytest.mark.parametrize("value", [0, -2])
def test_interleave(value):
    raises(r"interleave", call, interleave=value)


@pytest.mark.parametrize("value", [0, -64])
def test_block_size(value):
    raises(r"block_size", call, block_size=value)


@pytest.mark.parametrize("interleave,block_size", [(3, 64), (4, 2), (64, 16)])
def test_interleave_not_dividing_block_size(interleave, block_size):
    raises(r"block_size|interleave", call, world_size=2, interleave=interleave,
           block_size=block_size)


@pytest.mark.parametrize("field,value", [("mode", "prefill"), ("kv_dtype", "fp16"),
                                         ("kv_dtype", "fp8"), ("route", "three_stage"),
                                         ("merge", "gather"), ("device", "tpu"),
                                         ("mode", "")])
def test_unknown_strings(field, value):
    msg = raises(field, call, **{field: value})
    assert value in msg


@pytest.mark.parametrize("field,value", [("mode", None), ("route", 3), ("kv_dtype", b"bf16")])
def test_non_string_options(field, value):
    raises(field, call, **{field: value})


@pytest.mark.parametrize("mode", ["decode", "draft"])
def test_two_stage_outside_verify(mode):
    q, kv, s = inputs(qlen=1 if mode == "decode" else 2)
    raises(rf"'route' = two_stage: expected a route that serves mode {mode}", dcpmla.mla_attention, q, kv, s,
           mode=mode, route="two_stage")


@pytest.mark.parametrize("value", [576, 600, 0, -1])
def test_kv_lora_rank_out_of_range(value):
    raises(r"kv_lora_rank", call, kv_lora_rank=value)


@pytest.mark.parametrize("dtype", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("scale", [0.0, -1.0, math.nan, math.inf])
def test_fp8_scale(dtype, scale):
    raises(r"kv_scale", call, kv_dtype=dtype, kv_scale=scale)


@pytest.mark.parametrize("value", [math.nan, math.inf, 0.0, -0.1])
def test_softmax_scale(value):
    raises(r"softmax_scale", call, softmax_scale=value)


# Probe finding 1: a scale that is not a positive normal float32 was narrowed silently (1e-46
# became 0.0, which the library reads as "use D ** -0.5"); the messages showed the narrowed
# value. Each is refused, and the message shows the value as the caller gave it.
BAD_SCALES = [(1e-46, "1e-46"), (1e-50, "1e-50"), (1e-40, "1e-40"), (1e39, "1e+39"), (-0.0, "-0.0"),
              (10**400, "1" + "0" * 400), (np.float64(1e-45), "1e-45")]


@pytest.mark.parametrize("value,shown", BAD_SCALES)
def test_softmax_scale_outside_float32_normals(value, shown):
    msg = raises(r"field 'softmax_scale'", call, softmax_scale=value)
    assert f"= {shown}: expected a positive normal float32" in msg


@pytest.mark.parametrize("dtype", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("value,shown", BAD_SCALES)
def test_kv_scale_outside_float32_normals(dtype, value, shown):
    msg = raises(r"field 'kv_scale'", call, kv_dtype=dtype, kv_scale=value)
    assert f"= {shown}: expected a positive normal float32" in msg


def test_smallest_and_largest_normal_scales_run():
    tiny, big = float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max)
    _, lse_tiny = call(softmax_scale=tiny)
    _, lse_default = call()
    assert not np.array_equal(lse_tiny, lse_default), "a tiny scale is not the default scale"
    call(kv_dtype="fp8_e4m3", kv_scale=tiny)
    # The largest kv_scale keeps the largest stored value, and the largest softmax_scale times
    # it (the CUDA kernels fold the two), finite: FLT_MAX / (65536 log2 e).
    most = float(np.nextafter(np.float32(big / (65536 * np.log2(np.e))), np.float32(0)))
    for dtype in ("fp8_e4m3", "fp8_e5m2"):
        out, lse = call(kv_dtype=dtype, kv_scale=most)
        assert np.all(np.isfinite(out)) and np.all(np.isfinite(lse))
        raises(r"field 'kv_scale' = .*: expected <= 3.59", call, kv_dtype=dtype, kv_scale=big)


def test_kv_scale_as_a_one_element_array():
    """As the engine API's run() and write_kv() take it: a 0-d or one-element float array is its
    value; more elements, or an integer array, are refused by name."""
    want = call(kv_dtype="fp8_e4m3", kv_scale=0.37)
    for scale in (np.array(0.37), np.array([0.37], np.float32), np.array([[0.37]])):
        got = call(kv_dtype="fp8_e4m3", kv_scale=scale)
        np.testing.assert_array_equal(got[0], want[0])
    for scale in (np.array([0.37, 0.37]), np.array([1])):
        raises(r"field 'kv_scale' = array", call, kv_dtype="fp8_e4m3", kv_scale=scale)
    raises(r"field 'kv_scale' = 1e-46", call, kv_dtype="fp8_e4m3", kv_scale=np.array([1e-46]))


def test_scatter_heads_needs_divisible_heads():
    # H = 2 heads over 3 ranks cannot be reduce-scattered.
    raises(r"'heads' = 2: expected a multiple of world_size \(3\) for merge = scatter_heads", call, world_size=3,
           merge="scatter_heads")


def test_cuda_device_refused_when_not_built():
    if dcpmla.cuda_available:
        pytest.skip("the CUDA backend is built into this module")
    msg = raises(r"device", call, device="cuda")
    assert "CUDA" in msg


def test_cuda_without_a_gpu_is_refused_plainly(monkeypatch):
    # Probe finding 4: the CUDA runtime's own error (cudaErrorInsufficientDriver) came back
    # although cuda_device_available() was already False. The Python layer refuses first, and
    # never calls into the library. Simulated here so that the check runs on every machine.
    # Where the check reads them (dcpmla._checks._require_usable_cuda), for both entry points.
    monkeypatch.setattr(dcpmla._dcpmla, "cuda_available", True)
    monkeypatch.setattr(dcpmla._dcpmla, "cuda_device_available", lambda: False)

    def must_not_run(*args, **kwargs):
        raise AssertionError("called into the library")

    monkeypatch.setattr(dcpmla._dcpmla, "_mla_attention", must_not_run)
    msg = raises(r"field 'device' = 'cuda'", call, device="cuda")
    assert "no usable CUDA device" in msg
    monkeypatch.setattr(dcpmla._dcpmla, "_Engine", must_not_run)
    with pytest.raises(ValueError, match=r"field 'device' = 'cuda:0': expected 'cpu': no usable CUDA device"):
        dcpmla.Attention(heads=16, device="cuda:0")

    # The free functions take CUDA tensors, not a device string: named by the tensor.
    class OnCuda:
        def __dlpack__(self, **kwargs):
            raise AssertionError("exported")

        def __dlpack_device__(self):
            return (2, 0)

    for native in ("_write_kv", "_merge_states"):
        monkeypatch.setattr(dcpmla._dcpmla, native, must_not_run)
    with pytest.raises(ValueError, match=r"field 'kv_cache.device' = cuda:0: expected host memory: no usable CUDA"):
        dcpmla.write_kv(OnCuda(), np.zeros((1, 576), np.float32), [0])
    with pytest.raises(ValueError, match=r"field 'out_parts.device' = cuda:0: expected host memory: no usable CUDA"):
        dcpmla.merge_states(OnCuda(), np.zeros((2, 3), np.float32))


def test_cuda_on_this_machine_without_a_gpu():
    if not dcpmla.cuda_available or dcpmla.cuda_device_available():
        pytest.skip("needs the CUDA backend built in and no usable GPU")
    raises(r"no usable CUDA device", call, device="cuda")


def test_too_many_heads_names_heads():
    # Probe finding 7: 4097 heads was reported as "field 'route' = auto".
    q, kv, s = inputs(H=4097)
    raises(r"field 'heads' = 4097: expected in \[1, 4096\] on the cpu backend", dcpmla.mla_attention, q, kv, s)


def test_seed_out_of_range():
    raises(r"seed", call, seed=-1)


@pytest.mark.parametrize("field,value", [("world_size", 2.0), ("block_size", "64"),
                                         ("interleave", True), ("world_size", 2**40)])
def test_non_integer_or_huge_ints(field, value):
    raises(field, call, **{field: value})


# --- attention: arrays (the Python layer checks) --------------------------------------------

def test_float64_q():
    q, kv, s = inputs()
    msg = raises(r"'q\.dtype'", dcpmla.mla_attention, q.astype(np.float64), kv, s)
    assert "float64" in msg and "float32" in msg


def test_float64_kv():
    q, kv, s = inputs()
    raises(r"'kv\.dtype'", dcpmla.mla_attention, q, kv.astype(np.float64), s)


def test_float16_q():
    q, kv, s = inputs()
    raises(r"'q\.dtype'", dcpmla.mla_attention, q.astype(np.float16), kv, s)


def test_seq_lens_as_engines_hold_them():
    """int64 arrays and lists are converted losslessly (the same answer as int32); a value that
    does not fit int32, or a non-integer dtype, is refused naming it."""
    q, kv, s = inputs()
    out, lse = dcpmla.mla_attention(q, kv, s)
    for other in (s.astype(np.int64), [int(x) for x in s]):
        o2, l2 = dcpmla.mla_attention(q, kv, other)
        assert np.array_equal(out, o2) and np.array_equal(lse, l2)
    raises(r"'seq_lens\[1\]' = 3000000000", dcpmla.mla_attention, q, kv, np.array([5, 3_000_000_000]))
    raises(r"'seq_lens\.dtype' = float64", dcpmla.mla_attention, q, kv, s.astype(np.float64))


@pytest.mark.parametrize("which,shape", [("q", (2, 2, 1152)), ("q", (2, 2, 2, 1, 576)),
                                         ("kv", (2, 3456)), ("seq_lens", (2, 1))])
def test_wrong_ndim(which, shape):
    q, kv, s = inputs()
    arrays = {"q": q, "kv": kv, "seq_lens": s}
    arrays[which] = arrays[which].reshape(shape)
    raises(rf"'{which}\.ndim'", dcpmla.mla_attention, arrays["q"], arrays["kv"], arrays["seq_lens"])


def test_kv_batch_mismatch():
    q, kv, s = inputs()
    raises(r"kv\.shape\[0\]", dcpmla.mla_attention, q, kv[:1], s)


def test_seq_lens_length_mismatch():
    q, kv, _ = inputs()
    raises(r"seq_lens\.shape\[0\]", dcpmla.mla_attention, q, kv, np.array([5, 3, 4], np.int32))


def test_kv_dim_mismatch():
    q, kv, s = inputs()
    raises(r"kv\.shape\[2\]", dcpmla.mla_attention, q, kv[..., :575], s)


def test_seq_len_beyond_lmax():
    msg = raises(r"seq_lens\[1\]", call, seq_lens=np.array([5, 7], np.int32))
    assert "7" in msg


# --- layout helpers ------------------------------------------------------------------------

@pytest.mark.parametrize("rank,world", [(2, 2), (8, 8), (-1, 4)])
def test_rank_out_of_range(rank, world):
    raises(r"rank", dcpmla.local_length, 10, world, rank, 1)
    raises(r"rank", dcpmla.row_local_lengths, "verify", 10, 3, world, rank, 1)
    raises(r"rank", dcpmla.slot_mapping, [0, 1], [0], 4, 1, world, rank, 1)


def test_layout_world_and_interleave():
    raises(r"world_size", dcpmla.local_length, 10, 0, 0, 1)
    raises(r"interleave", dcpmla.local_length, 10, 2, 0, 0)
    raises(r"world_size", dcpmla.row_local_lengths, "verify", 10, 3, 0, 0, 1)
    raises(r"interleave", dcpmla.row_local_lengths, "verify", 10, 3, 2, 0, 0)
    raises(r"local_length|w", dcpmla.local_length, -1, 2, 0, 1)


def test_row_local_lengths_bad_values():
    raises(r"seq_len", dcpmla.row_local_lengths, "verify", -1, 1, 2, 0, 1)
    raises(r"seq_len", dcpmla.row_local_lengths, "verify", 2, 3, 2, 0, 1)
    raises(r"qlen", dcpmla.row_local_lengths, "verify", 5, 0, 2, 0, 1)
    raises(r"qlen|mode", dcpmla.row_local_lengths, "decode", 5, 2, 2, 0, 1)
    raises(r"mode", dcpmla.row_local_lengths, "sideways", 5, 1, 2, 0, 1)


def test_slot_mapping_block_id_out_of_range():
    # 8 positions, N=1, bs=4: local 0..7 -> table[0], table[1]; num_blocks = 4.
    pos = np.arange(8)
    raises(r"block|table", dcpmla.slot_mapping, pos, [1, 4], 4, 4, 1, 0, 1)
    raises(r"block|table", dcpmla.slot_mapping, pos, [-1, 2], 4, 4, 1, 0, 1)


def test_slot_mapping_table_too_short():
    pos = np.arange(9)  # local 8 needs table[2]
    raises(r"block|table", dcpmla.slot_mapping, pos, [0, 1], 4, 4, 1, 0, 1)
    raises(r"block|table", dcpmla.slot_mapping, [0], np.zeros(0, np.int32), 4, 4, 1, 0, 1)


def test_slot_mapping_bad_layout_and_positions():
    raises(r"block_size|interleave", dcpmla.slot_mapping, [0, 1], [0], 6, 1, 2, 0, 4)
    raises(r"block_size", dcpmla.slot_mapping, [0, 1], [0], 0, 1, 2, 0, 1)
    raises(r"positions\[1\]", dcpmla.slot_mapping, [0, -3], [0], 4, 1, 1, 0, 1)
    raises(r"positions", dcpmla.slot_mapping, [0.5, 1.0], [0], 4, 1, 1, 0, 1)
    raises(r"block_table", dcpmla.slot_mapping, [0], [2**40], 4, 1, 1, 0, 1)

