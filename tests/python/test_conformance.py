"""Fresh random inputs through dcpmla.mla_attention against the float64 reference, over a
covering grid of the configuration space (SPEC §5: the same arrays give the same answer
for every world_size, interleave, block_size, route and merge, within bf16 rounding).

The grid is not the full product: for each mode, every value of every axis appears in at
least one case while the other axes take deterministic pseudo-random values, so that each
value meets each mode."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

import dcpmla
from engine_case import DLPackOnly
from reference import assert_close, reference_attention, round_bf16
from split_cut import SPLIT_MIN_SEGMENT, cuttable

D, R = 576, 512

AXES = {
    "world": [1, 2, 3, 4, 5, 6, 7, 8],
    "interleave": [1, 2, 4],
    "block": [1, 16, 64, 256],
    "dtype": ["bf16", "fp8_e4m3", "fp8_e5m2"],
    "route": ["auto", "one_stage", "two_stage", "split_k"],
    "heads": [1, 16, 128],
    "merge": ["all_heads", "scatter_heads"],
    "lengths": ["short", "medium", "long"],
}
QLENS = {"decode": [1], "verify": [2, 3, 4, 1, 5], "draft": [2, 3, 1, 4]}
FP8_SCALES = [1.0, 0.5, 0.37, 2.5]
REPEATS = 2  # passes over the axes, each with its own draws of the other axes


@dataclass(frozen=True)
class Case:
    mode: str
    world: int
    interleave: int
    block: int
    dtype: str
    route: str
    heads: int
    merge: str
    lengths: str
    qlen: int
    kv_scale: float
    padding: bool
    seed: int

    def id(self):
        return (f"{self.mode}-N{self.world}-I{self.interleave}-bs{self.block}-{self.dtype}-"
                f"{self.route}-H{self.heads}-{self.merge}-{self.lengths}-q{self.qlen}"
                f"{'-pad' if self.padding else ''}-s{self.seed}")


def _fix(axis, v):
    """Make a drawn combination legal, keeping the value of the axis under test."""
    if v["block"] % v["interleave"]:
        if axis == "block":
            v["interleave"] = 1
        else:
            v["block"] = 16 if v["interleave"] <= 16 else v["interleave"]
    if v["merge"] == "scatter_heads" and v["heads"] % v["world"]:
        if axis == "heads":
            v["world"] = max(d for d in range(1, v["world"] + 1) if v["heads"] % d == 0)
        else:
            # Keep the world size; a head count of the TP form (a multiple of N).
            v["heads"] = v["world"] * max(1, 16 // v["world"])
    return v


def covering_cases():
    cases = []
    k = 0
    for mode in [m for _ in range(REPEATS) for m in ("decode", "verify", "draft")]:
        axes = dict(AXES)
        if mode != "verify":
            axes["route"] = [r for r in AXES["route"] if r != "two_stage"]
        names = list(axes)
        for axis in names:
            for value in axes[axis]:
                # The other axes: a fixed pseudo-random draw per case (deterministic, and
                # free of the lockstep that plain cycling gives axes of equal length).
                draw = np.random.default_rng([k, 12345])
                v = {other: value if other == axis else axes[other][draw.integers(len(axes[other]))]
                     for other in names}
                if axis != "route":  # routes cycle, so that verify meets two_stage often
                    v["route"] = axes["route"][k % len(axes["route"])]
                v = _fix(axis, v)
                qlens = QLENS[mode]
                cases.append(Case(
                    mode=mode, qlen=qlens[k % len(qlens)],
                    kv_scale=1.0 if v["dtype"] == "bf16" else FP8_SCALES[k % len(FP8_SCALES)],
                    padding=k % 2 == 0, seed=1000 + k, **{a: v[a] for a in names}))
                k += 1
    return cases


CASES = covering_cases()
# The CUDA backend runs the same grid where it is built and a GPU is present.
DEVICES = ["cpu"] + (["cuda"] if dcpmla.cuda_device_available() else [])


def test_grid_split_k_cases_can_cut():
    """Every forced split_k case of the grid holds a request the plan can cut (check() then
    asserts that it did): before, 48 of 52 ran as one piece a request, the one_stage path."""
    for case in CASES:
        if case.route == "split_k":
            lens = draw_lengths(case, np.random.default_rng(case.seed))
            assert cuttable(lens, np.full(len(lens), case.qlen), case.world, case.interleave), case.id()


def test_grid_covers_every_value_with_every_mode():
    for mode in ("decode", "verify", "draft"):
        mine = [c for c in CASES if c.mode == mode]
        for axis, values in AXES.items():
            for value in values:
                if mode != "verify" and axis == "route" and value == "two_stage":
                    continue
                assert any(getattr(c, axis) == value for c in mine), (mode, axis, value)
        for N in AXES["world"]:
            assert any(c.world == N and c.merge == "scatter_heads" for c in CASES), N


def draw_lengths(case, rng):
    """Per request: one exactly qlen, one short (L < N*I: some ranks hold nothing of a row),
    one whose size follows case.lengths, for a forced split_k one that rank 0 holds three
    tiles of (so that the plan cuts it), and possibly a padding request (L = 0)."""
    q, span = case.qlen, case.world * case.interleave
    short = int(rng.integers(q, span)) if span > q else q
    if case.lengths == "short":
        main = int(rng.integers(q, q + 40))
    elif case.lengths == "medium":
        main = int(rng.integers(max(q, 50), 300))
    else:  # long: big enough for split-K segments, bounded by the cost of H heads
        cap = {1: 3000, 16: 1200}.get(case.heads, 300 if case.heads >= 64 else 1200)
        main = int(rng.integers(cap // 2, cap))
    lens = [q, short, main]
    if case.route == "split_k":
        lens.append(next(L for L in range(q, 10**6) if dcpmla.local_length(L, case.world, 0, case.interleave) > 128))
    if case.padding:
        lens.insert(case.seed % 4, 0)
    return np.array(lens, dtype=np.int32)


def make_inputs(rng, lens, qlen, heads, dim=D, tail=3, qlens=None):
    """Normal latents; everything past each length is NaN, so a read past it shows. With qlens,
    q is packed (qo_indptr style): each request's first qlens[b] rows, [sum(qlens), heads, dim]."""
    B = len(lens)
    Lmax = int(lens.max()) + tail
    q = rng.standard_normal((B, qlen, heads, dim), dtype=np.float32)
    kv = rng.standard_normal((B, Lmax, dim), dtype=np.float32)
    for b, L in enumerate(lens):
        kv[b, L:] = np.nan
    if qlens is not None:
        q = np.concatenate([q[b, :n] for b, n in enumerate(qlens)])
    return q, kv


def packed_reference(q, kv, lens, rows, **opts):
    """The float64 reference of packed rows (qlens, qo_indptr style): request by request, each
    with its own row count as its qlen, concatenated as q is."""
    H = q.shape[1]
    ref_out, ref_lse, row = [np.zeros((0, H, R))], [np.zeros((0, H))], 0
    for b, (L, n) in enumerate(zip(lens, rows)):
        if n == 0:
            continue
        o, l = reference_attention(q[row:row + n][None], kv[b:b + 1], [L], **opts)
        ref_out.append(o[0])
        ref_lse.append(l[0])
        row += n
    return np.concatenate(ref_out), np.concatenate(ref_lse)


def check(q, kv, lens, what, **opts):
    """mla_attention against the float64 reference, with the contract's bound, bf16 outputs,
    padding requests' zeros and -inf, finite lse elsewhere, and the route a forced route asks
    for. With opts["qlens"], q and the results are packed ([sum(qlens), H, ...]). A forced
    split_k (pieces of SPLIT_MIN_SEGMENT tokens unless opts say otherwise) must cut a request
    wherever the lengths allow one, and cannot cut elsewhere."""
    route, qlens = opts.get("route", "auto"), opts.get("qlens")
    if route == "split_k":
        opts = {"min_segment_tokens": SPLIT_MIN_SEGMENT, **opts}
    out, lse, routes, pieces = dcpmla._mla_attention_with_plans(q, kv, lens, **opts)
    ref_opts = {k: opts[k] for k in ("mode", "kv_dtype", "kv_scale", "softmax_scale",
                                     "kv_lora_rank") if k in opts}
    assert out.dtype == np.float32 and lse.dtype == np.float32
    if qlens is None:
        ref_out, ref_lse = reference_attention(q, kv, lens, **ref_opts)
        pad = lens == 0
    else:
        ref_out, ref_lse = packed_reference(q, kv, lens, qlens, **ref_opts)
        # Each packed row compared as a request of one row.
        out, lse, ref_out, ref_lse = out[:, None], lse[:, None], ref_out[:, None], ref_lse[:, None]
        pad = np.repeat(lens == 0, qlens)
    # two_stage rounds stage B to bf16 before the local merge: up to about 1.5 bf16 ulps
    # (docs/reliability.md, second audit), against one rounding per partial elsewhere.
    bound = 2e-2 if route == "two_stage" else 1e-2
    assert out.shape == ref_out.shape, f"{what}: out shape {out.shape} != {ref_out.shape}"
    if out.size:  # (packed rows: every request may hold none)
        assert_close(out, lse, ref_out, ref_lse, bound=bound, what=what)
    # The output holds bf16 values.
    assert np.array_equal(round_bf16(out), out), f"{what}: out is not bf16-representable"
    assert np.all(out[pad] == 0) and np.all(np.isneginf(lse[pad])), f"{what}: padding rows"
    assert np.all(np.isfinite(lse[~pad])), f"{what}: non-padding rows must have finite lse"
    if route != "auto":
        assert set(routes) == {route}, f"{what}: forced {route}, planners took {routes}"
    else:
        assert set(routes) <= {"one_stage", "two_stage", "split_k"}, routes
    if route == "split_k":
        rows = qlens if qlens is not None else np.full(len(lens), q.shape[1])
        can_cut = cuttable(lens, rows, opts.get("world_size", 1), opts.get("interleave", 1),
                           opts["min_segment_tokens"])
        assert (max(pieces) > 1) == can_cut, f"{what}: pieces per rank {pieces}, expected a cut: {can_cut}"
    return out, lse, routes


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=Case.id)
def test_conformance(case, device):
    rng = np.random.default_rng(case.seed)
    lens = draw_lengths(case, rng)
    q, kv = make_inputs(rng, lens, case.qlen, case.heads)
    check(q, kv, lens, f"{case.id()}-{device}", mode=case.mode, world_size=case.world,
          interleave=case.interleave, block_size=case.block, kv_dtype=case.dtype,
          kv_scale=case.kv_scale, route=case.route, merge=case.merge, seed=case.seed,
          device=device)


# --- targeted cases -------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("world,route", [(1, "split_k"), (2, "split_k"), (1, "auto"),
                                         (3, "two_stage"), (8, "split_k")])
def test_long_windows(world, route, device):
    """Local lengths of several split-K segments at the library's default min_segment_tokens
    (256): rank 0 holds 576 tokens of the longest request at N = 8, two pieces' worth."""
    rng = np.random.default_rng(world * 7)
    lens = np.array([4600, 1100, 0, 4], dtype=np.int32)
    q, kv = make_inputs(rng, lens, 4, 8)
    check(q, kv, lens, f"long N={world} {route} {device}", mode="verify", world_size=world,
          interleave=2, block_size=64, route=route, seed=world, device=device, min_segment_tokens=256)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("heads,mode,qlen,dtype,route,merge", [
    (256, "verify", 2, "bf16", "split_k", "all_heads"), (520, "decode", 1, "fp8_e4m3", "auto", "scatter_heads"),
    (200, "draft", 3, "fp8_e5m2", "one_stage", "all_heads"), (4096, "decode", 1, "bf16", "auto", "all_heads")])
def test_many_heads(heads, mode, qlen, dtype, route, merge, device):
    """Past 128 heads (SPEC section 1: "1..128 and beyond"), up to max_heads, on every device:
    row counts that are and are not multiples of the kernels' 64-row groups."""
    rng = np.random.default_rng(heads + qlen)
    lens = np.array([0, qlen, 300 if heads < 4096 else 40, 1500 if heads < 1000 else 90], dtype=np.int32)
    q, kv = make_inputs(rng, lens, qlen, heads)
    check(q, kv, lens, f"H={heads} {mode} {dtype} {route} {device}", mode=mode, world_size=4, interleave=2,
          block_size=16, kv_dtype=dtype, kv_scale=1.0 if dtype == "bf16" else 0.37, route=route, merge=merge,
          seed=heads, device=device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode,world,interleave,block,dtype,route", [
    ("verify", 1, 1, 64, "bf16", "auto"), ("verify", 3, 2, 16, "fp8_e4m3", "split_k"),
    ("draft", 8, 1, 1, "fp8_e5m2", "one_stage"), ("decode", 2, 1, 256, "bf16", "split_k"),
    ("verify", 4, 4, 64, "bf16", "one_stage"), ("draft", 2, 2, 16, "bf16", "auto")])
def test_per_request_query_lengths(mode, world, interleave, block, dtype, route, device):
    """qlens (qo_indptr style): packed rows, each request's windows those of its own qlen;
    requests without rows, a padding request, and rows whose rank-local window is empty."""
    rng = np.random.default_rng(world * 13 + block)
    lens = np.array([2600, 3, 0, 700, 1, 1800], dtype=np.int32)
    top = 1 if mode == "decode" else 4
    qlens = np.array([top, min(top, 3), top, 0, 1, max(top - 1, 0)], dtype=np.int32)
    if mode == "draft":
        qlens[4] = top
    q, kv = make_inputs(rng, lens, top, 8, qlens=qlens)
    check(q, kv, lens, f"qlens {qlens.tolist()} {mode} N={world} I={interleave} bs={block} {dtype} {route} {device}",
          mode=mode, world_size=world, interleave=interleave, block_size=block, kv_dtype=dtype,
          kv_scale=1.0 if dtype == "bf16" else 0.37, route=route, device=device, seed=5, qlens=qlens)


def test_per_request_query_lengths_refused_plainly():
    q = np.zeros((3, 2, D), dtype=np.float32)
    kv = np.zeros((2, 8, D), dtype=np.float32)
    with pytest.raises(ValueError, match=r"'q.shape\[0\]' = 3: expected 4 \(sum\(qlens\)\)"):
        dcpmla.mla_attention(q, kv, [8, 8], qlens=[2, 2])
    with pytest.raises(ValueError, match=r"'qlens.shape\[0\]' = 1"):
        dcpmla.mla_attention(q, kv, [8, 8], qlens=[3])
    with pytest.raises(ValueError, match=r"'qlens\[1\]' = -1"):
        dcpmla.mla_attention(np.zeros((4, 2, D), np.float32), kv, [8, 8], qlens=[5, -1])
    with pytest.raises(ValueError, match=r"qlens\[1\]"):
        dcpmla.mla_attention(q, kv, [8, 8], qlens=[3, 0], route="two_stage")


@pytest.mark.parametrize("world,interleave,block", [(2, 1, 1), (4, 2, 2), (8, 4, 4), (3, 1, 1)])
def test_every_rank_short(world, interleave, block):
    """Lengths 1..N*I: most ranks hold nothing of the early rows."""
    rng = np.random.default_rng(world)
    qlen = 2
    lens = np.arange(qlen, world * interleave + 2, dtype=np.int32)
    q, kv = make_inputs(rng, lens, qlen, 4)
    for route in ("one_stage", "two_stage", "split_k"):
        check(q, kv, lens, f"short N={world} I={interleave} {route}", mode="verify",
              world_size=world, interleave=interleave, block_size=block, route=route)


@pytest.mark.parametrize("mode", ["decode", "verify", "draft"])
def test_all_padding_batch(mode):
    """A batch of padding requests only (CUDA-graph padding): zeros and -inf, no NaN."""
    qlen = 1 if mode == "decode" else 3
    q = np.random.default_rng(1).standard_normal((3, qlen, 16, D), dtype=np.float32)
    kv = np.zeros((3, 0, D), dtype=np.float32)
    out, lse = dcpmla.mla_attention(q, kv, np.zeros(3, np.int32), mode=mode, world_size=4)
    assert out.shape == (3, qlen, 16, R) and np.all(out == 0) and np.all(np.isneginf(lse))


@pytest.mark.parametrize("dtype,scale,peak", [("fp8_e4m3", 1.0, 1000.0), ("fp8_e4m3", 0.25, 300.0),
                                              ("fp8_e5m2", 0.5, 1e5), ("fp8_e5m2", 1.0, 3e4)])
def test_fp8_saturation(dtype, scale, peak):
    """Latents beyond the format's range saturate to its largest value, never inf or NaN."""
    rng = np.random.default_rng(5)
    lens = np.array([40, 9], dtype=np.int32)
    q, kv = make_inputs(rng, lens, 2, 4)
    q *= np.float32(0.01)  # keep the softmax from collapsing onto one saturated key
    kv[0, 3, :10] = peak
    kv[1, 5, 100:120] = -peak
    check(q, kv, lens, f"saturation {dtype} {scale}", mode="verify", world_size=3,
          kv_dtype=dtype, kv_scale=scale, block_size=16)


def test_custom_softmax_scale_and_rank():
    rng = np.random.default_rng(11)
    lens = np.array([30, 3], dtype=np.int32)
    q, kv = make_inputs(rng, lens, 3, 8, dim=320)
    check(q, kv, lens, "R=256 D=320", mode="verify", world_size=2, kv_lora_rank=256,
          softmax_scale=0.03, block_size=16)
    q, kv = make_inputs(rng, lens, 3, 4)
    check(q, kv, lens, "softmax_scale=0.2", mode="draft", world_size=3, softmax_scale=0.2)


def test_answer_independent_of_layout():
    """The same arrays under different shardings, pagings, routes, merges and block tables
    agree with each other within bf16 rounding."""
    rng = np.random.default_rng(3)
    lens = np.array([77, 5, 0, 260], dtype=np.int32)
    q, kv = make_inputs(rng, lens, 5, 16)
    base_out, base_lse = dcpmla.mla_attention(q, kv, lens)
    for world, inter, bs, route, merge, seed in [(8, 1, 1, "split_k", "scatter_heads", 1),
                                                  (3, 4, 256, "two_stage", "all_heads", 2),
                                                  (1, 1, 64, "auto", "all_heads", 99)]:
        out, lse = dcpmla.mla_attention(q, kv, lens, world_size=world, interleave=inter,
                                        block_size=bs, route=route, merge=merge, seed=seed)
        assert_close(out, lse, base_out.astype(np.float64), base_lse.astype(np.float64),
                     what=f"N={world} I={inter} bs={bs} {route} {merge}")


def test_deterministic():
    rng = np.random.default_rng(4)
    lens = np.array([50, 7], dtype=np.int32)
    q, kv = make_inputs(rng, lens, 3, 16)
    a = dcpmla.mla_attention(q, kv, lens, world_size=4, seed=5)
    b = dcpmla.mla_attention(q, kv, lens, world_size=4, seed=5)
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])


# --- array interchange ----------------------------------------------------------------------

def test_dlpack_and_non_contiguous_inputs():
    rng = np.random.default_rng(9)
    lens = np.array([20, 6], dtype=np.int32)
    q, kv = make_inputs(rng, lens, 2, 4)
    want = dcpmla.mla_attention(q, kv, lens, world_size=2)
    got = dcpmla.mla_attention(DLPackOnly(q), DLPackOnly(kv), DLPackOnly(lens), world_size=2)
    assert np.array_equal(want[0], got[0]) and np.array_equal(want[1], got[1])
    # Non-contiguous views: heads swapped in memory, kv and seq_lens strided.
    q_t = np.ascontiguousarray(q.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    kv_big = np.zeros((2, kv.shape[1], 2 * D), dtype=np.float32)
    kv_big[:, :, ::2] = kv
    lens_big = np.zeros(4, np.int32)
    lens_big[::2] = lens
    assert not q_t.flags.c_contiguous and not kv_big[:, :, ::2].flags.c_contiguous
    got = dcpmla.mla_attention(q_t, kv_big[:, :, ::2], lens_big[::2], world_size=2)
    assert np.array_equal(want[0], got[0]) and np.array_equal(want[1], got[1])


def test_result_is_a_fresh_writable_numpy_array():
    rng = np.random.default_rng(10)
    lens = np.array([8], dtype=np.int32)
    q, kv = make_inputs(rng, lens, 2, 2)
    out, lse = dcpmla.mla_attention(q, kv, lens)
    assert isinstance(out, np.ndarray) and out.flags.c_contiguous and out.flags.writeable
    want_out, want_lse = out.copy(), lse.copy()
    assert np.any(want_out != 0)
    out[:] = 0  # the caller's to keep and write, not a view into library memory reused later
    lse[:] = 0
    out2, lse2 = dcpmla.mla_attention(q, kv, lens)
    assert not np.shares_memory(out, out2) and not np.shares_memory(lse, lse2)
    assert np.all(out == 0) and np.all(lse == 0), "a later call wrote into an earlier result"
    assert np.array_equal(out2, want_out) and np.array_equal(lse2, want_lse), "the earlier result's writes reached the library"


# --- random configurations ------------------------------------------------------------------

RANDOM_CASES = 100  # per device; each bounded to a few million score entries
# Head counts the kernels' row groups (16, 32, 64 rows) meet at and off their edges.
HEAD_CHOICES = [1, 2, 3, 8, 16, 20, 24, 32, 40, 48, 64, 96, 100, 128, 132, 160, 192]
BLOCK_CHOICES = [1, 2, 3, 8, 12, 16, 32, 48, 64, 96, 128, 256, 512, 1024]


def random_configuration(index):
    """One configuration drawn from every axis at once (the grid above varies one axis a case):
    the head count, qlen and per-request qlens, lengths around N * I and past split-K's
    segments, block sizes that are not powers of two, every dtype, route and merge."""
    rng = np.random.default_rng([index, 2026_12_06])
    pick = lambda xs: xs[int(rng.integers(len(xs)))]  # noqa: E731
    mode = pick(["decode", "verify", "verify", "draft"])
    qlen = 1 if mode == "decode" else int(rng.integers(1, 7))
    heads = pick(HEAD_CHOICES)
    world = int(rng.integers(1, 9))
    block = pick(BLOCK_CHOICES)
    interleave = pick([i for i in (1, 2, 3, 4, 8, 16) if block % i == 0])
    dtype = pick(["bf16", "fp8_e4m3", "fp8_e5m2"])
    use_qlens = mode != "decode" and rng.random() < 0.35
    two_stage = ["two_stage"] if mode == "verify" and not use_qlens else []  # uniform query blocks only
    route = pick(["auto", "auto", "one_stage", "split_k"] + two_stage)
    merge = "scatter_heads" if heads % world == 0 and rng.random() < 0.4 else "all_heads"
    batch = int(rng.integers(1, 7))
    qlens = rng.integers(0, qlen + 1, size=batch).astype(np.int32) if use_qlens else np.full(batch, qlen, np.int32)
    # Score entries (rows x heads x keys) and tokens stay under budgets, so a case takes about
    # a second.
    budget = min(3_000_000 // (heads * qlen), 24_000)
    lens = []
    for b in range(batch):
        need = int(qlens[b]) if mode == "verify" else 1
        kind = rng.random()
        if kind < 0.15:
            lens.append(0)  # a padding request
        elif kind < 0.4:
            lens.append(int(rng.integers(max(need, 1), max(need, world * interleave) + 2)))  # around N * I
        else:
            lens.append(int(rng.integers(max(need, 1), max(need + 1, budget // batch))))
    lens = np.array(lens, dtype=np.int32)  # a padding request may still hold rows (qlens): 0 and -inf
    kv_scale = 1.0 if dtype == "bf16" else float(np.float32(rng.uniform(0.2, 3.0)))
    return dict(mode=mode, qlen=qlen, heads=heads, world=world, block=block, interleave=interleave, dtype=dtype,
                route=route, merge=merge, lens=lens, qlens=qlens if use_qlens else None, kv_scale=kv_scale,
                seed=index)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("index", range(RANDOM_CASES))
def test_random_configuration(index, device):
    c = random_configuration(index)
    rng = np.random.default_rng(c["seed"] + 77)
    lens, qlens, mode, H = c["lens"], c["qlens"], c["mode"], c["heads"]
    q, kv = make_inputs(rng, lens, c["qlen"], H, qlens=qlens)
    what = (f"#{index} {mode} q{c['qlen']} H{H} N{c['world']} I{c['interleave']} bs{c['block']} {c['dtype']} "
            f"{c['route']} {c['merge']} lens {lens.tolist()} "
            f"qlens {None if qlens is None else qlens.tolist()} {device}")
    check(q, kv, lens, what, mode=mode, world_size=c["world"], interleave=c["interleave"], block_size=c["block"],
          kv_dtype=c["dtype"], kv_scale=c["kv_scale"], route=c["route"], merge=c["merge"], seed=c["seed"],
          device=device, qlens=qlens)
