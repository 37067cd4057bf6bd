"""Hostile input to the Python API (SPEC §5, §6): threads sharing one Attention, broadcast views
that describe terabytes in a few bytes, outputs aliasing inputs, arrays nanobind cannot import,
empty steps. Each is refused with a ValueError naming the argument and value (or runs correctly),
never a crash, a MemoryError, a hang, a TypeError without a field or a silent wrong answer."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import dcpmla

D, R = 576, 512


def error(match):
    return pytest.raises(ValueError, match=match)


def bf16_bits(x):
    """float32 -> bf16 bits as uint16 (truncation: any bf16 values will do)."""
    return (np.ascontiguousarray(x, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)


def planned(heads=2, qlen=2, kv_dtype="bf16", **kw):
    """A CPU Attention planned for 2 requests of 40 tokens over blocks 0..7 of a 16-block cache."""
    att = dcpmla.Attention(heads=heads, block_size=16, device="cpu", kv_dtype=kv_dtype, max_batch=8, max_qlen=8,
                           max_local_len=4096, **kw)
    att.plan(np.full(2, 40, np.int32), np.arange(8, dtype=np.int32).reshape(2, 4), qlen)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, qlen, heads, D)).astype(np.float32)
    if kv_dtype == "bf16":
        cache = bf16_bits(rng.standard_normal((16, 16, D)))
    else:
        cache = rng.integers(0, 120, (16, 16, D), dtype=np.uint8)
    return att, q, cache


def run_script(code, timeout=180):
    """Runs `code` in a fresh interpreter importing this dcpmla (a crash there fails the test
    instead of killing pytest); returns (returncode, output)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(dcpmla.__file__).resolve().parent.parent),
                                         env.get("PYTHONPATH", "")])
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                       timeout=timeout, env=env)
    return p.returncode, p.stdout + p.stderr


# ---- 1. one Attention from several threads ------------------------------------------------------

RACE = """
    import sys, threading, time
    import numpy as np
    import dcpmla

    D, H, BS, NB = 576, 16, 64, 1100
    rng = np.random.default_rng(0)
    cache = (rng.standard_normal((NB, BS, D)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    att = dcpmla.Attention(heads=H, block_size=BS, device="cpu", max_batch=16, max_qlen=4, max_local_len=4096)
    # Two plans told apart by their shapes: a run that succeeds had one of them throughout.
    small = (np.array([300], np.int32), rng.permutation(NB)[:5].astype(np.int32)[None], 1)
    big = (rng.integers(2000, 4096, 16).astype(np.int32),
           rng.permutation(NB)[:16 * 64].astype(np.int32).reshape(16, 64), 4)
    qs = {1: rng.standard_normal((1, 1, H, D)).astype(np.float32),
          16: rng.standard_normal((16, 4, H, D)).astype(np.float32)}
    refs = {}
    for p in (small, big):
        att.plan(*p)
        refs[len(p[0])] = att.run(qs[len(p[0])], cache)
    stop = time.time() + 3.0
    failures = []

    def guarded(f):
        def loop():
            try:
                while time.time() < stop:
                    f()
            except BaseException as e:
                failures.append(repr(e))
        return loop

    def replan():
        att.plan(*big)
        att.plan(*small)

    def read():
        assert att.batch in (1, 16) and att.qlen in (1, 4) and att.route != "none"

    threads = [threading.Thread(target=guarded(replan)), threading.Thread(target=guarded(read))]
    for t in threads:
        t.start()
    runs = wrong = 0
    while time.time() < stop:
        for b in (16, 1):
            out = np.empty(qs[b].shape[:3] + (512,), np.float32)
            lse = np.empty(qs[b].shape[:3], np.float32)
            try:
                att.run(qs[b], cache, out=out, lse=lse)
            except ValueError as e:  # the plan of the other shape is current: refused, named
                assert "'q.shape'" in str(e), e
                continue
            runs += 1
            wrong += not (np.array_equal(out, refs[b][0]) and np.array_equal(lse, refs[b][1]))
    for t in threads:
        t.join()
    print(f"runs {runs} wrong {wrong} failures {failures}")
    sys.exit(0 if runs and not wrong and not failures else 1)
"""


def test_plan_and_run_from_two_threads():
    """run() computes without the GIL; a plan() (or a property read) of another thread waits for
    it instead of replacing the plan under the kernels: no crash, and every run that succeeds gives
    exactly the single-threaded answer of its plan."""
    rc, output = run_script(RACE)
    assert rc == 0, output[-2000:]


def test_two_attentions_run_from_two_threads():
    """Two Attentions run from two threads at once (a smoke test: each gives its own answer; it
    does not measure that their runs overlap)."""
    import threading

    pairs = [planned(heads=4) for _ in range(2)]
    want = [att.run(q, cache) for att, q, cache in pairs]
    got = [None, None]

    def work(i):
        att, q, cache = pairs[i]
        for _ in range(20):
            got[i] = att.run(q, cache)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for (o, l), (wo, wl) in zip(got, want):
        assert np.array_equal(o, wo) and np.array_equal(l, wl)


# ---- 2. integer arrays: the extents are checked from the shapes first ---------------------------

BROADCASTS = """
    import numpy as np
    import dcpmla

    def refused(match, f, *args, **kw):
        try:
            f(*args, **kw)
        except ValueError as e:
            assert match in str(e), e
            return
        raise AssertionError(f"accepted: {match}")

    att = dcpmla.Attention(heads=2, block_size=16, device="cpu", max_batch=8)
    for dtype in (np.int32, np.int64, np.uint8):
        huge = np.broadcast_to(dtype(5), (2**40,))
        refused("field 'batch' = 1099511627776: expected 1..limits.max_batch (8)", att.plan, huge,
                np.zeros((2, 1), np.int32), 1)
        refused("field 'block_tables.shape[1]' = 1099511627776: expected a table width that fits int32", att.plan,
                np.full(2, 5, np.int32), np.broadcast_to(dtype(0), (2, 2**40)), 1)
        # Cut to the columns a request can use (max_local_len / block_size) before the copy: plans.
        att.plan(np.full(2, 5, np.int32), np.broadcast_to(dtype(0), (2, 2**31 - 1)), 1)
        refused("field 'block_tables.shape[0]' = 1099511627776: expected 2 (B, the length of seq_lens)",
                att.plan, np.full(2, 5, np.int32), np.broadcast_to(dtype(0), (2**40, 1)), 1)
        refused("field 'qlens.shape[0]' = 1099511627776: expected 2", att.plan, np.full(2, 5, np.int32),
                np.zeros((2, 1), np.int32), 1, qlens=huge)
        refused("field 'positions' = a non-contiguous view of shape (1099511627776,)", dcpmla.slot_mapping, huge,
                np.arange(4, dtype=np.int32), 16, 4, 1, 0)
        refused("field 'seq_lens.shape[0]' = 1099511627776: expected 2", dcpmla.mla_attention,
                np.zeros((2, 1, 1, 576), np.float32), np.zeros((2, 4, 576), np.float32), huge)
        refused("field 'kv.shape[0]' = 2: expected 1099511627776", dcpmla.mla_attention,
                np.zeros((0, 1, 576), np.float32), np.zeros((2, 4, 576), np.float32), huge, qlens=[0, 0])
    print("ok")
"""


def test_broadcast_integer_views_are_refused_from_their_shapes():
    """A broadcast view of 2**40 entries (4 bytes of memory) is refused before anything copies it
    (it was a MemoryError asking for terabytes) or scans it for min / max (it hung for minutes)."""
    rc, output = run_script(BROADCASTS, timeout=120)
    assert rc == 0 and "ok" in output, output[-2000:]


def test_small_views_and_other_integer_dtypes_still_convert():
    att, q, cache = planned()
    want = att.run(q, cache)
    seq = np.broadcast_to(np.int64(40), (2,))  # a broadcast int64 view of 2 entries
    wide = np.zeros((2, 8), np.int64)
    wide[:, :4] = np.arange(8).reshape(2, 4)
    tables = wide[:, :4]  # a strided int64 view of the same tables
    att.plan(seq, tables, 2)
    got = att.run(q, cache)
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
    att.plan(np.array([40, 40], dtype=">i4"), np.arange(8, dtype=">i8").reshape(2, 4), 2)  # big-endian: converted
    got = att.run(q, cache)
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])


# ---- 3. outputs that share memory with the inputs or each other ---------------------------------

def test_outputs_aliasing_the_inputs_are_refused():
    att, q, cache = planned()
    q16 = bf16_bits(q)
    want_out, want_lse = att.run(q16, cache, out=np.zeros((2, 2, 2, R), np.uint16))
    before = cache.copy()
    with error(r"field 'out' = 8192 bytes at 0x[0-9a-f]+, overlapping kv_cache .*: expected memory that shares "
               r"no byte with the call's other tensors"):
        att.run(q16, cache, out=cache[4].reshape(-1)[:4096].reshape(2, 2, 2, R))  # block 4 is read by request 1
    assert np.array_equal(cache, before)  # refused before anything ran
    with error(r"field 'out' = .* overlapping q"):
        att.run(q16, cache, out=q16.reshape(-1)[:2 * 2 * 2 * R].reshape(2, 2, 2, R))
    with error(r"field 'lse' = .* overlapping q"):
        att.run(q, cache, lse=q.reshape(-1)[8:16].reshape(2, 2, 2))
    with error(r"field 'lse' = .* overlapping kv_cache"):
        att.run(q16, cache, lse=cache.reshape(-1).view(np.float32)[100:108].reshape(2, 2, 2))
    buffer = np.zeros(2 * 2 * 2 * R + 8, np.float32)
    with error(r"field 'out' = .* overlapping lse"):
        att.run(q, cache, out=buffer[:4096].reshape(2, 2, 2, R), lse=buffer[4088:4096].reshape(2, 2, 2))
    # Disjoint views of one buffer are fine (the check compares byte ranges, exactly).
    out, lse = att.run(q16, cache, out=np.zeros((2, 2, 2, R), np.uint16), lse=np.zeros((2, 2, 2), np.float32))
    out2, lse2 = att.run(q16, cache, out=buffer[:4096].reshape(2, 2, 2, R), lse=buffer[4096:].reshape(2, 2, 2))
    assert np.array_equal(out, want_out) and np.array_equal(lse, want_lse)
    assert np.array_equal(bf16_bits(out2), want_out) and np.array_equal(lse2, want_lse)


def test_fp8_scale_tensor_aliasing_an_output_is_refused():
    att, q, cache = planned(kv_dtype="fp8_e4m3")
    out = np.full((2, 2, 2, R), 0.5, np.float32)  # a valid scale (the CPU reads it) inside out
    with error(r"field 'out' = .* overlapping kv_scale"):
        att.run(q, cache, kv_scale=out.reshape(-1)[:1], out=out)


def test_write_kv_and_merge_states_refuse_aliasing():
    cache = np.zeros((4, 16, D), np.uint16)
    with error(r"field 'kv_cache' = .* overlapping latent"):
        dcpmla.write_kv(cache, cache[1, :2], np.array([3, 4], np.int64))
    with error(r"field 'kv_cache' = .* overlapping slot_mapping"):
        dcpmla.write_kv(cache, np.zeros((2, D), np.float32), cache.reshape(-1)[:8].view(np.int64))
    parts = np.ones((2, 3, 4, R), np.float32)
    lse_parts = np.zeros((2, 3, 4), np.float32)
    with error(r"field 'out' = .* overlapping out_parts"):
        dcpmla.merge_states(parts, lse_parts, out=parts[1])
    with error(r"field 'lse' = .* overlapping lse_parts"):
        dcpmla.merge_states(parts, lse_parts, lse=lse_parts[1])
    with error(r"field 'out' = .* overlapping lse"):
        both = np.zeros(3 * 4 * R, np.float32)
        dcpmla.merge_states(parts, lse_parts, out=both.reshape(3, 4, R), lse=both[:12].reshape(3, 4))
    # Without aliasing the same call merges (fresh random partials against numpy's LSE merge).
    rng = np.random.default_rng(7)
    parts = rng.standard_normal(parts.shape).astype(np.float32)
    lse_parts = rng.standard_normal(lse_parts.shape).astype(np.float32)
    out, lse = dcpmla.merge_states(parts, lse_parts)
    want_lse = np.logaddexp(lse_parts[0], lse_parts[1])
    weights = np.exp(lse_parts - want_lse)[..., None]
    np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(out, np.float32), (weights * parts).sum(0), rtol=2e-2, atol=2e-2)


# ---- 4. arrays nanobind cannot import: refused naming the argument ------------------------------

def _readonly(a):
    a = a.copy()
    a.flags.writeable = False
    return a


def test_arrays_nanobind_cannot_import_are_named():
    att, q, cache = planned()
    out = np.zeros((2, 2, 2, R), np.float32)
    lse = np.zeros((2, 2, 2), np.float32)
    cases = [
        (r"field 'out' = a read-only float32 array \(flags.writeable is False\): expected a writable array",
         lambda: att.run(q, cache, out=_readonly(out))),
        (r"field 'lse' = a read-only float32 array", lambda: att.run(q, cache, lse=_readonly(lse))),
        (r"field 'q.dtype' = object \(Python objects\): expected float32 or bfloat16",
         lambda: att.run(q.astype(object), cache)),
        (r"field 'q.dtype' = >f4 \(non-native byte order\): expected float32 or bfloat16",
         lambda: att.run(q.astype(">f4"), cache)),
        (r"field 'kv_cache.dtype' = >u2 \(non-native byte order\): expected bfloat16",
         lambda: att.run(q, cache.astype(">u2"))),
        (r"field 'out.dtype' = \[\('a', '<f4'\)\] \(a structured dtype\)",
         lambda: att.run(q, cache, out=np.zeros((2, 2, 2, R), [("a", "<f4")]))),
        (r"field 'lse.dtype' = <U1", lambda: att.run(q, cache, lse=np.zeros((2, 2, 2), "U1"))),
        (r"field 'kv_scale.dtype' = >f4", lambda: att.run(q, cache, kv_scale=np.ones(1, ">f4"))),
        (r"field 'kv_cache' = a read-only uint16 array",
         lambda: dcpmla.write_kv(_readonly(cache), np.zeros((1, D), np.float32), np.zeros(1, np.int64))),
        (r"field 'slot_mapping.dtype' = >i8 \(non-native byte order\): expected int64",
         lambda: dcpmla.write_kv(cache, np.zeros((1, D), np.float32), np.zeros(1, ">i8"))),
        (r"field 'latent.dtype' = object", lambda: dcpmla.write_kv(cache, np.zeros((1, D), object), [0])),
        (r"field 'out_parts.dtype' = >f4", lambda: dcpmla.merge_states(np.zeros((2, 3, R), ">f4"),
                                                                       np.zeros((2, 3), np.float32))),
        (r"field 'lse_parts.dtype' = object", lambda: dcpmla.merge_states(np.zeros((2, 3, R), np.float32),
                                                                          np.zeros((2, 3), object))),
        (r"field 'out' = a read-only float32 array",
         lambda: dcpmla.merge_states(np.zeros((2, 3, R), np.float32), np.zeros((2, 3), np.float32),
                                     out=_readonly(np.zeros((3, R), np.float32)))),
    ]
    for match, call in cases:
        with error(match):
            call()


def test_other_producers_nanobind_cannot_import_are_named():
    """The same refusals for a producer known only through DLPack (a read-only jax array, a torch
    tensor that requires grad): nanobind refused them with a TypeError naming no argument."""
    from engine_case import DLPackOnly

    class Refusing:
        def __dlpack__(self, **kwargs):
            raise RuntimeError("cannot export")

        def __dlpack_device__(self):
            return (1, 0)

    att, q, cache = planned()
    out = np.zeros((2, 2, 2, R), np.float32)
    lse = np.zeros((2, 2, 2), np.float32)
    cases = [
        (r"field 'out' = a DLPackOnly the native call cannot import \(TypeError\): expected a writable array",
         lambda: att.run(q, cache, out=DLPackOnly(_readonly(out)), lse=lse)),
        (r"field 'q' = a DLPackOnly the native call cannot import",
         lambda: att.run(DLPackOnly(q.astype(">f4")), cache, out=out, lse=lse)),
        (r"field 'kv_cache' = a DLPackOnly the native call cannot import",
         lambda: dcpmla.write_kv(DLPackOnly(_readonly(cache)), np.ones((1, D), np.float32), [0])),
        (r"field 'latent' = a Refusing the native call cannot import",
         lambda: dcpmla.write_kv(cache, Refusing(), [0])),
        (r"field 'lse' = a DLPackOnly the native call cannot import",
         lambda: dcpmla.merge_states(np.zeros((2, 3, R), np.float32), np.zeros((2, 3), np.float32),
                                     out=np.zeros((3, R), np.float32),
                                     lse=DLPackOnly(_readonly(np.zeros(3, np.float32))))),
        # Outputs are allocated for numpy and torch partials only; others were an AttributeError.
        (r"field 'out' = None: expected a buffer \(out= and lse=\)",
         lambda: dcpmla.merge_states(DLPackOnly(np.zeros((2, 3, R), np.float32)), np.zeros((2, 3), np.float32))),
    ]
    for match, call in cases:
        with error(match):
            call()
    # numpy partials with a DLPack-only lse_parts: lse's shape comes from out_parts.
    out, lse = dcpmla.merge_states(np.zeros((2, 3, R), np.float32), DLPackOnly(np.zeros((2, 3), np.float32)))
    assert out.shape == (3, R) and lse.shape == (3,)


def test_broadcast_tables_and_positions_are_refused_before_a_copy():
    """An exactly-at-the-limit broadcast view was copied (8 GiB) before its width or the result's
    size was refused."""
    att, _, _ = planned()
    with error(r"field 'block_tables.shape\[1\]' = 2147483648: expected a table width that fits int32"):
        att.plan([40], np.broadcast_to(np.int32(0), (1, 2**31)), 2)
    with error(r"field 'positions' = a non-contiguous view of shape \(1073741824,\)"):
        dcpmla.slot_mapping(np.broadcast_to(np.int64(10**6), (2**30,)), [0], 16, 1, 1, 0)


def test_device_strings_take_ascii_ordinals_only():
    for bad in ["cuda:\u00b2", "cuda:\u0663", "cuda:2147483648", "cuda:", "cuda:-1", "cuda: 1"]:
        with error(r"field 'device' = .*: expected 'cpu', 'cuda' or 'cuda:N'"):
            dcpmla.Attention(heads=2, device=bad)
    with error(r"field 'max_local_len' = -1: expected an integer in \[1, 1073741824\]"):
        dcpmla.Attention(heads=2, device="cpu", max_local_len=-1)


def test_misaligned_views_are_copied_before_the_library_reads_them():
    """mla_attention's q and kv at a byte offset into another buffer: copied (aligned), the same
    answer as the aligned arrays."""
    rng = np.random.default_rng(3)
    q = rng.standard_normal((1, 1, 2, D)).astype(np.float32)
    kv = rng.standard_normal((1, 8, D)).astype(np.float32)

    def at_offset(a):
        raw = np.zeros(a.nbytes + 4, np.uint8)
        view = raw[2:2 + a.nbytes].view(np.float32).reshape(a.shape)
        view[...] = a
        assert not view.flags.aligned
        return view

    want = dcpmla.mla_attention(q, kv, np.array([8], np.int32), mode="decode")
    got = dcpmla.mla_attention(at_offset(q), at_offset(kv), np.array([8], np.int32), mode="decode")
    assert np.array_equal(want[0], got[0]) and np.array_equal(want[1], got[1])


@pytest.mark.parametrize("name", ["float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e4m3b11fnuz", "float8_e4m3",
                                  "float8_e8m0fnu", "float4_e2m1fn", "int4"])
def test_ml_dtypes_formats_the_library_does_not_read(name):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    if not hasattr(ml_dtypes, name):
        pytest.skip(f"ml_dtypes {ml_dtypes.__version__} has no {name}")
    att, q, cache = planned(kv_dtype="fp8_e4m3")
    with error(rf"field 'kv_cache.dtype' = {name}: expected uint8 / int8 or ml_dtypes.float8_e4m3fn"):
        att.run(q, cache.view(getattr(ml_dtypes, name)), kv_scale=0.5)
    with error(rf"field 'latent.dtype' = {name}"):
        dcpmla.write_kv(cache, np.zeros((1, D), getattr(ml_dtypes, name)), [0], kv_dtype="fp8_e4m3",
                        kv_scale=0.5)
    # The format the cache holds is read (as its bytes).
    out, _ = att.run(q, cache.view(ml_dtypes.float8_e4m3fn), kv_scale=0.5)
    assert np.array_equal(out, att.run(q, cache, kv_scale=0.5)[0])


# ---- 5. merge_states checks the partials before it allocates ------------------------------------

def test_merge_states_checks_before_allocating():
    parts = np.broadcast_to(np.float32(0), (2, 2**20, 2**20, R))  # 2 PiB once allocated
    with error(r"field 'out_parts.stride' = \(0, 0, 0, 0\): expected C-contiguous"):
        dcpmla.merge_states(parts, np.broadcast_to(np.float32(0), (2, 2**20, 2**20)))
    with error(r"field 'lse_parts.stride'"):
        dcpmla.merge_states(np.zeros((2, 3, R), np.float32), np.broadcast_to(np.float32(0), (2, 3)))
    with error(r"field 'out_parts.ndim' = 1"):
        dcpmla.merge_states(np.zeros(R, np.float32), np.zeros(1, np.float32))
    with error(r"field 'out_parts' = list"):
        dcpmla.merge_states([[0.0]], np.zeros(1, np.float32))


# ---- 6. messages that name the right argument and value -----------------------------------------

def test_messages_name_the_argument_at_fault():
    att, q, cache = planned()
    with error(r"field 'q' = NoneType: expected an array or tensor"):  # not 'out', allocated for q
        att.run(None, cache)
    with error(r"field 'kv_cache' = NoneType: expected an array or tensor"):
        att.run(q, None)
    with error(r"field 'kv_lora_rank \+ rope_dim' = 2147483647 \+ 64: expected a latent width D that fits int32"):
        dcpmla.Attention(heads=2, device="cpu", kv_lora_rank=2**31 - 1)
    with error(r"field 'kv_lora_rank' = 0: expected >= 1"):
        dcpmla.Attention(heads=2, device="cpu", kv_lora_rank=0)
    q4, kv = np.zeros((2, 1, 1, D), np.float32), np.zeros((2, 4, D), np.float32)
    with error(r"field 'seq_lens\[0\]' = 1180591620717411303424: expected a value that fits int32"):
        dcpmla.mla_attention(q4, kv, [2**70, 3])
    with error(r"field 'seq_lens\[1\]' = -1180591620717411303424: expected a value that fits int32"):
        att.plan([40, -(2**70)], np.zeros((2, 4), np.int32), 2)
    with error(r"field 'seq_lens\[1\]' = None: expected an integer \[B\]"):
        att.plan([40, None], np.zeros((2, 4), np.int32), 2)
    with error(r"field 'block_tables\[1, 0\]' = 1180591620717411303424: expected a value that fits int32"):
        att.plan([40, 40], [[0, 1, 2, 3], [2**70, 5, 6, 7]], 2)
    with error(r"field 'slot_mapping\[2\]' = 1180591620717411303424: expected a value that fits int64"):
        dcpmla.write_kv(cache, np.zeros((3, D), np.float32), [0, 1, 2**70])
    assert att.batch == 2  # the last good plan stands


def test_a_latent_width_past_the_cpu_scratch_is_refused_not_aborted():
    """The CPU kernel's scratch grows with D; a width the host cannot hold was accepted and the
    first run's allocation failed inside an OpenMP loop, which aborted the interpreter (the
    twelfth audit). Refused by name now, by the engine and by the conformance entry point."""
    wide = 2**22
    with error(r"field 'host memory \(plan, split-K workspace and the threads' scratch\)' = "):
        dcpmla.Attention(heads=1, device="cpu", kv_lora_rank=wide, route="one_stage")
    q, kv = np.ones((1, 1, 1, wide + 64), np.float32), np.ones((1, 1, wide + 64), np.float32)
    with error(r"field 'host memory \(input copies; per rank: plans, cache, workspace, merge buffers; "
               r"the CPU kernels' scratch\)' = "):
        dcpmla.mla_attention(q, kv, [1], kv_lora_rank=wide, route="one_stage", block_size=1)


# ---- 7. an empty step ---------------------------------------------------------------------------

def test_empty_step_returns_empty_outputs():
    """qlens all 0 (each >= 0 is allowed): q [0, H, D] has no data pointer; run returns empty
    out [0, H, R] and lse [0, H] without calling the kernels, and still checks the cache."""
    att, q, cache = planned()
    att.plan(np.full(2, 40, np.int32), np.arange(8, dtype=np.int32).reshape(2, 4), 2, qlens=[0, 0])
    assert att.batch == 2 and att.qlen == 2
    for empty_q in (np.zeros((0, 2, D), np.float32), np.zeros((0, 2, D), np.uint16)):
        out, lse = att.run(empty_q, cache)
        assert out.shape == (0, 2, R) and out.dtype == empty_q.dtype and lse.shape == (0, 2) and lse.dtype == np.float32
    out, lse = att.run(np.zeros((0, 2, D), np.float32), cache, out=np.zeros((0, 2, R), np.float32),
                       lse=np.zeros((0, 2), np.float32))
    assert out.shape == (0, 2, R) and lse.shape == (0, 2)
    with error(r"field 'kv_cache num_blocks' = 1"):
        att.run(np.zeros((0, 2, D), np.float32), cache[:1])
    with error(r"field 'q.shape' = \[1, 2, 576\]"):
        att.run(np.zeros((1, 2, D), np.float32), cache)
    # The next plan runs as usual.
    att.plan(np.full(2, 40, np.int32), np.arange(8, dtype=np.int32).reshape(2, 4), 2)
    out, lse = att.run(q, cache)
    assert out.shape == (2, 2, 2, R) and np.isfinite(lse).all()


# ---- 8. strings the native call cannot read whole, None, a 0-d scale, a forced two_stage --------

def test_strings_with_nul_or_lone_surrogates_are_named():
    """A NUL would end the native C string (and cut its error message); a lone surrogate has no
    UTF-8 form (nanobind's TypeError names no field). Both are refused, naming the field."""
    q4, kv = np.zeros((1, 1, 1, D), np.float32), np.zeros((1, 4, D), np.float32)
    with error(r"field 'kv_dtype' = 'fp8_e4m3\\x00': expected a string without NUL characters"):
        dcpmla.Attention(heads=2, device="cpu", kv_dtype="fp8_e4m3\0")
    with error(r"field 'route' = '\\ud800': expected a string with a UTF-8 form"):
        dcpmla.Attention(heads=2, device="cpu", route="\ud800")
    with error(r"field 'mode' = 'verify\\x00'"):
        dcpmla.mla_attention(q4, kv, [2], mode="verify\0")
    with error(r"field 'kv_dtype' = '\\udfff'"):
        dcpmla.mla_attention(q4, kv, [2], kv_dtype="\udfff")
    att, q, cache = planned()
    with error(r"field 'mode' = 'decode\\x00'"):
        att.plan([40, 40], np.arange(8, dtype=np.int32).reshape(2, 4), 1, mode="decode\0")
    with error(r"field 'kv_dtype' = 'bf16\\x00'"):
        dcpmla.write_kv(cache, np.zeros((1, D), np.float32), [0], kv_dtype="bf16\0")


def test_none_arrays_are_named_as_none():
    q4, kv = np.zeros((1, 1, 1, D), np.float32), np.zeros((1, 4, D), np.float32)
    with error(r"field 'q' = None: expected an array"):
        dcpmla.mla_attention(None, kv, [2])
    with error(r"field 'kv' = None: expected an array"):
        dcpmla.mla_attention(q4, None, [2])
    att, _, _ = planned()
    with error(r"field 'seq_lens' = None: expected an array"):
        att.plan(None, np.zeros((2, 4), np.int32), 1)


def test_a_zero_dimensional_scale_tensor_is_one_element():
    """SPEC §6: kv_scale is a float or a one-element tensor; a 0-d array has one element."""
    att, q, cache = planned(kv_dtype="fp8_e4m3")
    out0, lse0 = att.run(q, cache, kv_scale=0.5)
    out1, lse1 = att.run(q, cache, kv_scale=np.array(0.5, np.float32))
    assert np.array_equal(out0, out1) and np.array_equal(lse0, lse1)
    with error(r"field 'kv_scale"):
        att.run(q, cache, kv_scale=np.zeros((2,), np.float32))


def test_two_stage_is_refused_on_the_engine_api():
    """run() returns this rank's partial over its whole window (SPEC §6: equal to mla_attention's
    within bf16 rounding); two_stage's stage B needs the verify block's latents, which run() does
    not take, so a forced two_stage would return stage A alone: refused, not a silent answer."""
    with error(r"field 'route' = 'two_stage': expected 'auto', 'one_stage' or 'split_k'"):
        dcpmla.Attention(heads=2, device="cpu", route="two_stage")


MEMORY = r"field 'host memory \(input copies; per rank: plans, cache, workspace, merge buffers; the CPU kernels' scratch\)' = "


def refused_without_growing(pattern, *args, **kwargs):
    """mla_attention refuses (ValueError matching `pattern`) before it copies anything: the
    process's peak resident memory grows by less than 1 GiB."""
    import resource
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with error(pattern):
        dcpmla.mla_attention(*args, **kwargs)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 2**20, "peak RSS grew by 1 GiB or more (KiB)"


def test_a_broadcast_copy_is_counted_with_the_librarys_memory():
    """A 4.9 GiB float32 broadcast kv: its copy and the library's bf16 copies of q and kv (7.4 GiB)
    fit the limit, but beside the latents and the cache the library then holds (12.4 GiB) they do
    not: one process's memory, refused together before anything is allocated (two separate 8 GiB
    checks let this call reach 12.4 GiB; the seventieth session's audit)."""
    kv = np.broadcast_to(np.ones((1, 1, D), np.float32), (1, 2_300_000, D))
    refused_without_growing(MEMORY + r"12.4 GiB \(\d+ bytes\) for 1 rank\(s\) here, 4.94 GiB \(5299200000 bytes\) of it "
                            r"the caller's copies of strided inputs: expected <= 8 GiB \(8589934592 bytes\)",
                            np.zeros((1, 1, 1, D), np.float32), kv, [2_300_000])


def test_two_views_are_counted_together():
    """q and kv, each a broadcast view whose copy fits the in-process limit alone (4 GiB each and
    the library's bf16 copy: 6 GiB), were each checked alone and copied together (12 GiB; the
    sixtieth session's audit: 32 s). Refused from their shapes, before seq_lens is read."""
    q = np.broadcast_to(np.float32(0), (1, 1, 4096, 2**18))
    kv = np.broadcast_to(np.float32(0), (1, 4096, 2**18))
    refused_without_growing(r"field 'q and kv' = 8 GiB of copies of strided arrays beside the library's bf16 copies "
                            r"of both \(12 GiB, 12884901888 bytes\): expected at most 8 GiB",
                            q, kv, [0], kv_lora_rank=1, block_size=1)


def test_every_check_of_the_shapes_precedes_the_copies():
    """A bad dtype, or a head count past the limit that q's shape alone shows, is refused before a
    strided q or kv is copied (the copy of kv was made first, 4.3 GiB, before q's dtype was read)."""
    kv = np.broadcast_to(np.float32(0), (1, 2_000_000, D))
    refused_without_growing(r"field 'q.dtype' = float64", np.zeros((1, 1, 1, D)), kv, [1])
    q = np.broadcast_to(np.float32(1), (1, 1, 2**21, D))
    refused_without_growing(r"field 'heads' = 2097152: expected in \[1, 4096\]", q, np.ones((1, 1, D), np.float32),
                            [1], mode="decode")


FORK = """
    import multiprocessing as mp
    import numpy as np
    import dcpmla
    att = dcpmla.Attention(heads=2, block_size=16, device="cpu", max_batch=2, max_qlen=1, max_local_len=64)
    att.plan([40], np.arange(4, dtype=np.int32)[None], 1)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 1, 2, 576)).astype(np.float32)
    cache = (rng.standard_normal((4, 16, 576)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    parent = att.run(q, cache)[0]  # the parent's OpenMP pool now exists

    def child(conn):
        conn.send(att.run(q, cache)[0])

    a, b = mp.get_context("fork").Pipe()
    p = mp.get_context("fork").Process(target=child, args=(b,), daemon=True)  # a hung child must not hold the exit
    p.start()
    assert a.poll(60), "the forked child did not answer"
    assert np.array_equal(a.recv(), parent)
    p.join(10)
    print("fork ok")
"""


def test_a_forked_child_runs_the_cpu_engine():
    """libgomp's pool does not survive fork(): the CPU kernels run on the calling thread in a
    forked child (src/cpu/parallel.h) instead of waiting forever for the parent's threads."""
    rc, output = run_script(FORK, timeout=120)
    assert rc == 0 and "fork ok" in output, output


# ---- 9. forged DLPack tensors, bools among integers, values named before their sum ---------------

# A DLPack producer that exports a numpy array's extents with another data pointer (null here):
# the float32 copies read it before the library's own null checks and crashed.
NULL_DATA = """
    import ctypes
    import numpy as np
    import dcpmla

    class Device(ctypes.Structure):
        _fields_ = [("type", ctypes.c_int32), ("id", ctypes.c_int32)]

    class DType(ctypes.Structure):
        _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]

    class Tensor(ctypes.Structure):
        _fields_ = [("data", ctypes.c_void_p), ("device", Device), ("ndim", ctypes.c_int32), ("dtype", DType),
                    ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                    ("byte_offset", ctypes.c_uint64)]

    class Managed(ctypes.Structure):
        _fields_ = [("tensor", Tensor), ("ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]

    new_capsule = ctypes.pythonapi.PyCapsule_New
    new_capsule.restype, new_capsule.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]

    class NullData:
        def __init__(self, a):
            self.shape = (ctypes.c_int64 * a.ndim)(*a.shape)
            code = {"f": 2, "i": 0, "u": 1}[a.dtype.kind]
            self.m = Managed(Tensor(None, Device(1, 0), a.ndim, DType(code, 8 * a.itemsize, 1),
                                    ctypes.cast(self.shape, ctypes.POINTER(ctypes.c_int64)), None, 0))

        def __dlpack__(self, **kwargs):
            return new_capsule(ctypes.addressof(self.m), b"dltensor", None)

        def __dlpack_device__(self):
            return (1, 0)

    att = dcpmla.Attention(heads=2, block_size=16, device="cpu", max_batch=8, max_qlen=8, max_local_len=4096)
    att.plan(np.full(2, 40, np.int32), np.arange(8, dtype=np.int32).reshape(2, 4), 2)
    q = np.ones((2, 2, 2, 576), np.float32)
    cache = np.zeros((16, 16, 576), np.uint16)
    out, lse = np.zeros((2, 2, 2, 512), np.float32), np.zeros((2, 2, 2), np.float32)
    parts = np.zeros((2, 3, 512), np.float32)
    calls = {
        "q": lambda: att.run(NullData(q), cache, out=out, lse=lse),
        "out": lambda: att.run(q, cache, out=NullData(out), lse=lse),
        "latent": lambda: dcpmla.write_kv(cache, NullData(np.ones((1, 576), np.float32)), [0]),
        "kv_scale": lambda: dcpmla.write_kv(np.zeros((16, 16, 576), np.uint8), np.ones((1, 576), np.float32), [0],
                                            "fp8_e4m3", NullData(np.ones(1, np.float32))),
        "out_parts": lambda: dcpmla.merge_states(NullData(parts), np.zeros((2, 3), np.float32),
                                                 out=np.zeros((3, 512), np.float32), lse=np.zeros(3, np.float32)),
    }
    for field, call in calls.items():
        try:
            call()
            print(field, "accepted")
        except ValueError as e:
            print(field, "refused:", e)
"""


def test_dlpack_tensors_with_null_data_are_refused():
    rc, output = run_script(NULL_DATA)
    assert rc == 0, output
    for field in ("q", "out", "latent", "kv_scale", "out_parts"):
        assert f"{field} refused: dcpmla: field '{field}.data_ptr' = null: expected memory holding" in output, output


def test_bools_among_list_integers_are_refused():
    """numpy reads [True, 20] as [1, 20]; a bool alone or a bool array was refused, a bool in a
    list of ints was taken as 1."""
    att, _, cache = planned()
    q4, kv = np.zeros((2, 1, 1, D), np.float32), np.zeros((2, 40, D), np.float32)
    cases = [
        (r"field 'seq_lens\[0\]' = True: expected an integer \[B\]",
         lambda: att.plan([True, 20], [[0, 1], [2, 3]], 1)),
        (r"field 'block_tables\[1, 0\]' = False: expected an integer \[B, table_width\]",
         lambda: att.plan([20, 20], [[0, 1], [False, 3]], 1)),
        (r"field 'block_tables\[1, 0\]' = (np\.)?False", lambda: att.plan([20, 20], [np.array([0, 1]),
                                                                                np.array([False, True])], 1)),
        (r"field 'qlens\[0\]' = True", lambda: att.plan([20, 20], [[0, 1], [2, 3]], 2, qlens=[True, 2])),
        (r"field 'seq_lens\[0\]' = True", lambda: dcpmla.mla_attention(q4, kv, [True, 40])),
        (r"field 'positions\[0\]' = True", lambda: dcpmla.slot_mapping([True, 3], [0, 1], 4, 4, 1, 0)),
        (r"field 'slot_mapping\[0\]' = True", lambda: dcpmla.write_kv(cache, np.ones((2, D), np.float32),
                                                                      [True, -1])),
    ]
    for match, call in cases:
        with error(match):
            call()
    assert att.batch == 2  # the last good plan stands


def test_list_integers_numpy_reads_as_floats_are_named_as_given():
    """numpy 2 reads [3, 2**63] as float64 (an int in [2**63, 2**64) fits no int64, where 2**64
    becomes an object array): the refusal named a float dtype the caller never passed."""
    q, kv = np.zeros((2, 1, 1, D), np.float32), np.zeros((2, 4, D), np.float32)
    with error(r"field 'seq_lens\[1\]' = 9223372036854775808: expected a value that fits int32"):
        dcpmla.mla_attention(q, kv, [3, 2**63])
    with error(r"field 'slot_mapping\[1\]' = 9223372036854775808: expected a value that fits int64"):
        dcpmla.write_kv(np.zeros((1, 4, D), np.uint16), np.zeros((2, D), np.float32), [0, 2**63])
    with error(r"field 'seq_lens\[1\]' = 1.5: expected an integer"):
        dcpmla.mla_attention(q, kv, [3, 1.5])


def test_qlens_values_are_named_before_their_sum():
    """A negative or huge qlens value was reported as q's rows against their sum."""
    q3, kv = np.zeros((3, 1, D), np.float32), np.zeros((3, 40, D), np.float32)
    with error(r"field 'qlens\[0\]' = -5: expected in \[0, 4096\]"):
        dcpmla.mla_attention(q3, kv, [40, 40, 40], qlens=np.array([-5, 1, 1]))
    with error(r"field 'qlens\[1\]' = 5000: expected in \[0, 4096\]"):
        dcpmla.mla_attention(q3, kv, [40, 40, 40], qlens=[1, 5000, 1])
    with error(r"field 'q.shape\[0\]' = 3: expected 4 \(sum\(qlens\)\)"):
        dcpmla.mla_attention(q3, kv, [40, 40, 40], qlens=[2, 1, 1])


def test_other_fields_named_where_they_are_at_fault():
    _, _, cache = planned()
    # write_kv read a bf16 cache's dtype as the unknown format's and blamed the cache.
    with error(r"field 'kv_dtype' = 'bf-16': expected bf16, fp8_e4m3 or fp8_e5m2"):
        dcpmla.write_kv(cache, np.ones((1, D), np.float32), [0], "bf-16")
    # row_local_lengths took the planner's per-request wording.
    with error(r"field 'seq_len' = 1: expected >= qlen \(3\)"):
        dcpmla.row_local_lengths("verify", 1, 3, 1, 0)
    # 65536.003 rounds to the ceiling itself as a float32.
    with error(r"field 'softmax_scale' = 65536.003: expected <= 65536"):
        dcpmla.mla_attention(np.zeros((1, 1, 1, D), np.float32), np.zeros((1, 4, D), np.float32), [4],
                             softmax_scale=65536.003)


def test_producers_that_fail_in_their_own_way_are_named():
    """A producer's __dlpack__ raising anything, or a __dlpack_device__ that is not a (type,
    ordinal) pair, came out as that error, naming no argument."""
    _, _, cache = planned()

    class Raising:
        def __init__(self, e):
            self.e = e

        def __dlpack__(self, **kwargs):
            raise self.e

        def __dlpack_device__(self):
            return (1, 0)

    class BadDevice:
        def __init__(self, a, device):
            self.a, self.device = a, device

        def __dlpack__(self, **kwargs):
            return self.a.__dlpack__(**kwargs)

        def __dlpack_device__(self):
            return self.device

    att, _, _ = planned()
    with error(r"field 'seq_lens' = Raising: expected a host \(CPU\) array readable through DLPack "
               r"\(AttributeError: z\)"):
        att.plan(Raising(AttributeError("z")), [[0, 1, 2, 3], [4, 5, 6, 7]], 2)
    with error(r"field 'seq_lens' = Raising: .*\(KeyError: 'k'\)"):
        dcpmla.mla_attention(np.zeros((1, 1, 1, D), np.float32), np.zeros((1, 4, D), np.float32), Raising(KeyError("k")))
    for device in (None, (None, None), ("x",)):
        with error(r"field 'kv_cache.__dlpack_device__\(\)' = a BadDevice whose __dlpack_device__\(\) failed"):
            dcpmla.write_kv(BadDevice(cache, device), np.ones((1, D), np.float32), [0])
        with error(r"field 'out_parts.__dlpack_device__\(\)' = a BadDevice"):
            dcpmla.merge_states(BadDevice(np.zeros((2, 3, R), np.float32), device), np.zeros((2, 3), np.float32))



# ---- 10. masked arrays, copies of an Attention ------------------------------------------------

def test_masked_arrays_are_refused_not_read_whole():
    """A numpy masked array is an ndarray: its mask was dropped silently (fully masked q and kv gave
    the unmasked answer; a masked length was read). Refused wherever the library reads an array."""
    att, q, cache = planned()
    masked = np.ma.masked_array
    expected = "field '{}' = a numpy masked array: expected a plain array"
    with error(expected.format("seq_lens")):
        att.plan(masked(np.full(2, 40, np.int32), mask=[1, 0]), np.arange(8, dtype=np.int32).reshape(2, 4), 2)
    with error(expected.format("block_tables")):
        att.plan(np.full(2, 40, np.int32), masked(np.arange(8, dtype=np.int32).reshape(2, 4)), 2)
    with error(expected.format("q")):
        att.run(masked(q, mask=np.ones_like(q, bool)), cache)
    with error(expected.format("kv_cache")):
        att.run(q, masked(cache))
    with error(expected.format("q")):
        dcpmla.mla_attention(masked(np.zeros((1, 1, 1, D), np.float32)), np.zeros((1, 4, D), np.float32), [4])
    with error(expected.format("latent")):
        dcpmla.write_kv(cache, masked(np.ones((1, D), np.float32)), [0])
    with error(expected.format("out_parts")):
        dcpmla.merge_states(masked(np.zeros((2, 3, R), np.float32)), np.zeros((2, 3), np.float32))


def test_an_attention_is_neither_copied_nor_pickled():
    """copy.copy shared the native plan and workspace with the original, and its handle named the
    original only (the torch ops refused the live copy once the original was collected); pickle
    failed on the native member with a TypeError that named neither."""
    import copy
    import pickle

    att, _, _ = planned()
    for make in (copy.copy, copy.deepcopy, pickle.dumps):
        with pytest.raises(TypeError, match="dcpmla.Attention cannot be copied or pickled"):
            make(att)
