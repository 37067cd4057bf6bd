// Attention over a plan on sm_90a for fp8 caches and CTAs of M = 16 or 32 rows, on native
// fp8 wgmma with the operands swapped: S^T = K Q^T and O^T = V^T P^T, so that the 64 tokens
// of a tile are the wgmma's M and the query rows its N (a 16-row CTA on the 64-row kernels
// computes four times the rows it needs). The cache is never dequantised: K and V enter the
// tensor cores as stored, kv_scale is folded into the softmax and output scales. Same
// contract as kernel.cuh: each CTA of a fixed grid runs its chunk of the schedule for one
// row group, from the device plan; rows with no local key give out = 0, lse = -inf; pieces
// of cut requests write (o / l, m, l) partials.
//
// The bf16 side as fp8, exactly: wgmma takes fp8 for both operands, so Q and P are each
// split into two e4m3 terms, x = hi + lo with hi = rn(x), lo = rn(x - hi). A bf16 value has
// 8 significant bits and hi keeps 4, so lo is exact whenever it is not subnormal: Q (scaled
// per row by a power of two so that its largest element lies in [128, 256)) is exact down
// to 2^-10 of the row maximum, below that off by at most 2^-18 of it; P (scaled by 256) is
// kept to 8 significant bits, as the bf16 kernels round it, down to P = 2^-10. The tensor
// cores add fp8 products at reduced precision (about 14 bits), so every accumulator chain
// is short and summed in f32: S over one 128-byte column block (4 k-steps), O over one tile.
//
// Three warpgroups (384 threads), one CTA per SM. The producer (warpgroup 0) streams the
// tiles by cp.async through a ring of four stages (full / empty mbarriers), running ahead
// across units; it is the only role with loads in flight, so the consumers' proxy fences (a
// MEMBAR, which waits for the issuing thread's loads) cost nothing. The two consumers share
// the work in one of two ways:
//   M = 16 (232 registers each): they take alternate tiles of a unit, each with its own
//     running max, sum and O (all rows, all 512 dims), merged at the end of the unit;
//   M = 32 (ROLES): the consumers split the steps below, a tile apart. The scores warpgroup
//     (216 registers) runs steps 1-3 for all 32 rows (S^T at N = 64: Q_hi and Q_lo of 32
//     rows stacked; its five chains two in flight, each summed in f32 as it completes) and
//     hands P^T and each row's rescale factor to the values warpgroup through buffers by
//     tile parity (pfull / pfree mbarriers), so that it computes tile i + 1 while the values
//     warpgroup (256 registers: O^T of all 512 dims, 128 f32 a thread) runs step 4 of tile
//     i, in two halves of 64 dims a warp. The scores warpgroup runs steps 2-3 of tile i
//     under tile i + 1's first two chains (its tile bound the kernel: bench/NOTES.md,
//     forty-ninth and fiftieth sessions). At a unit's
//     end it leaves each row's sum and maximum in shared memory (sfull / sfree) and goes on
//     to the next unit; the values warpgroup normalises and writes every row. A tile is
//     read, transposed and multiplied once for all 32 rows. (The lock-step form before it,
//     each consumer S and softmax of 16 rows and P V of 256 dims behind one barrier of both
//     a tile, left the tensor cores idle through both softmaxes: 6 % slower on the H100,
//     bench/NOTES.md, forty-fourth session.)
// Per tile (M = 16: each consumer on its own tiles; M = 32: steps 1-3 the scores warpgroup,
// step 4 the values warpgroup):
//   1. S^T (64 tokens, M rows) = K Q_hi^T + K Q_lo^T: 18 wgmma m64n(2M)k32 (B = Q_hi and
//      Q_lo stacked as 2 M rows, so K is read from shared memory once), A = K and B = Q from
//      shared memory, one accumulator per column block;
//   2. masks each row at its own local length, exchanges the tile maximum across its four
//      warps (a row's 64 scores are spread over the warpgroup), online softmax in base 2;
//   3. writes P^T as hi and lo e4m3 (K-major, B of the next product) to shared memory;
//   4. O^T (512 dims, M rows) += V^T P^T: V^T is the A operand from registers (fp8 wgmma
//      has no MN-major operand), transposed from the tile by ldmatrix.trans on byte pairs
//      and one byte permute per register, 32 wgmma m64nMk32 into a fresh accumulator, then
//      O = O alpha + O_tile in f32.
// Operand orders are chosen so that no data moves more than once:
//   - M row (block b, warp w, lane row g, half h) of O^T is dim 128 w + 16 b + 2 g + h: one
//     ldmatrix.x4.trans of block b's 16-byte chunk gives a thread dims 2 g, 2 g + 1 of the
//     tokens 2 c, 2 c + 1 of four 8-token groups, and two permutes per pair of groups give
//     its fragment registers;
//   - k index 4 c + j of each 16-token half of a k32 step is token 2 c + 8 (j & 1) + (j >> 1)
//     of that half: ldmatrix.trans delivers tokens 2 c, 2 c + 1 of each 8-token group, and
//     the permutes interleave the two groups, so that the tokens g and g + 8 that a thread
//     of S^T holds are adjacent in k (one 16-bit store of P^T a term).
//
// Shared memory (Fp8SwapShared, from a 1024-byte aligned base; every operand is a stack of
// column blocks of 128-byte rows, chunk c of row r stored at chunk c ^ (r & 7), the 128-byte swizzle):
//   sKV  4 x (64, 576) e4m3/e5m2 in 5 blocks of (64, 128 B) (the last half used): the ring
//   sQ   (2 M, 576) e4m3 in 5 blocks: rows 0 .. M - 1 Q_hi, M .. 2 M - 1 Q_lo; sP 2 x {hi, lo}
//        (M, 64) e4m3 in rows of 128 B (per consumer at M = 16, per tile parity at 32)
//   sO1 (64 x 128) f32 (M = 16): the second consumer's O for the merge; sQscale (M) f32,
//   sLen (M) i32, sRed 2 x (4 warps, M) f32 (tile maxima), sL 2 x (4, M) f32, sM1 (M) f32,
//   sAlpha 2 x (M) f32 (M = 32), mbarriers full[4], empty[4], pfull[2], pfree[2], sfull, sfree
#pragma once

#include <cstdint>

#include "common/params.h"
#include "common/utils.cuh"
#include "config.h"
#include "softmax.cuh"
#include "swizzle.cuh"
#include "unit.cuh"
#include "wgmma.cuh"

namespace dcpmla::cuda_detail {

template <int M_>
struct Fp8SwapConfig {
  static constexpr int M = M_;          // query rows per CTA
  static_assert(M == 16 || M == 32);
  // M = 32: the consumers split the roles (ROLES): the scores warpgroup computes S and the
  // softmax of all 32 rows, the values warpgroup O^T for all 512 dims, a tile behind;
  // M = 16: the consumers take alternate tiles, all rows and dims.
  static constexpr bool ROLES = M == 32;
  static constexpr int QB = M;          // rows of S^T (Q_hi and Q_lo stacked: N = 2 QB)
  static constexpr int NT = 64;         // tokens per tile: M of S^T, K of O^T
  static constexpr int THREADS = 384;   // producer + two consumer warpgroups
  // Registers a thread: M 16 gives both consumers the same; M 32 gives the values warpgroup
  // (O^T of 512 dims, 128 f32 a thread, beside a fresh half) the most.
  static constexpr int PRODUCER_REGS = ROLES ? 32 : 40;
  static constexpr int SCORES_REGS = ROLES ? 216 : 232, VALUES_REGS = ROLES ? 256 : 232;
  static_assert(fits_launch_registers(THREADS, PRODUCER_REGS + SCORES_REGS + VALUES_REGS));
  static constexpr int STAGES = 4;
  static constexpr int BLOCKS = 5;      // 128-byte column blocks of a 576-byte row
  static constexpr int TILE_BYTES = BLOCKS * NT * 128;   // 40 KiB
  static constexpr int Q_BYTES = BLOCKS * 2 * QB * 128;  // 20 or 40 KiB: the stacked Q block
  static constexpr int P_BYTES = M * 128;                // P^T, all M rows (N of O^T)
  static constexpr int NBB = 8;                          // 16-dim chunks of O^T per warp (128 dims)
  // Q loaders: both consumers (M 16) or the scores warpgroup (M 32).
  static constexpr int Q_THREADS_PER_ROW = (ROLES ? 128 : 256) / M;
  static_assert(TILE_BYTES % 1024 == 0 && Q_BYTES % 1024 == 0 && P_BYTES % 1024 == 0);
};

// The kernel's shared memory (from a 1024-byte aligned base; the operands on swizzle atoms).
template <int M>
struct Fp8SwapShared {
  using C = Fp8SwapConfig<M>;
  alignas(1024) uint8_t kv[C::STAGES][C::TILE_BYTES];  // the ring
  alignas(1024) uint8_t q[C::Q_BYTES];                 // rows 0 .. QB - 1 Q_hi, QB .. 2 QB - 1 Q_lo
  alignas(1024) uint8_t p[2][2][C::P_BYTES];           // [consumer (M 16) or tile parity (M 32)][hi, lo]
  float o1[C::ROLES ? 1 : 64 * 128];                   // M 16: the second consumer's O, for the merge
  float qscale[M];
  int len[M];
  float red[2][4 * C::QB];  // [consumer (M 16) or tile parity (M 32)][warp x row]: tile maxima
  float l[2][4 * C::QB];    // [consumer][warp x row] (M 32: consumer 0 only)
  float m1[C::QB];          // M 16: the second consumer's running max; M 32: the rows' maxima
  float alpha[2][M];        // M 32: [tile parity][row]: the rescale of O's rows
  // full, empty: the ring; M 32: pfull, pfree: P^T and alpha of a tile parity; sfull,
  // sfree: the unit's row sums and maxima (sL, m1).
  uint64_t full[C::STAGES], empty[C::STAGES], pfull[2], pfree[2], sfull, sfree;
};
template <int M>
inline constexpr int kFp8SwapSmemBytes = int(sizeof(Fp8SwapShared<M>)) + 1024;  // + slack to align the base
static_assert(kFp8SwapSmemBytes<16> <= kSmemPerCta && kFp8SwapSmemBytes<32> <= kSmemPerCta,
              "fp8 swap tiles do not fit in shared memory");

// Named barriers: each consumer warpgroup's own, and both consumers' (M 16: Q and the merge).
enum Fp8SwapBarrier : int {
  kBarFirstConsumer = 1,   // warpgroup 1 alone (M 32: the scores warpgroup)
  kBarSecondConsumer = 2,  // warpgroup 2 alone (M 16 only: the values warpgroup has no barrier)
  kBarBothConsumers = 3,   // both consumer warpgroups (M 16 only)
};

// x = hi + lo in e4m3 for two values (low byte first), as above.
__device__ __forceinline__ void split_e4m3x2(float a, float b, uint16_t& hi, uint16_t& lo) {
  hi = __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(hi, __NV_E4M3);
  const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h));
  lo = __nv_cvt_float2_to_fp8x2(make_float2(a - f.x, b - f.y), __NV_SATFINITE, __NV_E4M3);
}

// A consumer's rows of S^T are J pairs a thread: rows 8 j + 2 c + u (u < 2), each at the
// tokens 16 w + g and 16 w + g + 8 of the tile (h = 0, 1). Their base-2 scores x[j][h][u]
// from s[4 j + 2 h + u] (Q_hi's and Q_lo's columns summed), masked at each row's own limit;
// each row's maximum over warp w's 16 tokens (the lanes of one c) goes to red[w QB + row],
// for softmax_rows after a barrier of the warpgroup (swap_warp_maxima).
template <int J, int QB>
__device__ __forceinline__ void masked_scores(const float (&s)[4 * J], int tok0, const int (&lim)[J][2],
                                              const float (&sl2r)[J][2], float (&x)[J][2][2], float* red, int w,
                                              int g, int c) {
  float v[2 * J];
#pragma unroll
  for (int j = 0; j < J; ++j)
#pragma unroll
    for (int u = 0; u < 2; ++u) {
#pragma unroll
      for (int h = 0; h < 2; ++h) x[j][h][u] = tok0 + 8 * h < lim[j][u] ? s[4 * j + 2 * h + u] * sl2r[j][u] : kNegInf;
      v[2 * j + u] = fmaxf(x[j][0][u], x[j][1][u]);
    }
  swap_warp_maxima<J>(v, g, [&](int j, int u, float m) { red[w * QB + 8 * j + 2 * c + u] = m; });
}

// The online softmax's step for those rows at the tile maxima of the four warps (warp q's
// maximum of row r at red[q QB + r]): the running maximum and sum move on, and each row's
// exponentials go to store_p(r, p0, p1) and its rescale factor to on_alpha(j, u, alpha);
// every row's maxima are read before the first store (swap_tile_maxima).
template <int J, int QB, typename StoreP, typename OnAlpha>
__device__ __forceinline__ void softmax_rows(const float (&x)[J][2][2], const float* red, int c, float (&m_run)[J][2],
                                             float (&l_run)[J][2], StoreP store_p, OnAlpha on_alpha) {
  float tmax[J][2];
  swap_tile_maxima<J>(red, QB, c, tmax);
#pragma unroll
  for (int j = 0; j < J; ++j)
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int r = 8 * j + 2 * c + u;
      const SoftmaxStep sst = softmax_step(m_run[j][u], tmax[j][u]);
      const float p0 = fast_exp2(x[j][0][u] - sst.mu), p1 = fast_exp2(x[j][1][u] - sst.mu);
      l_run[j][u] = l_run[j][u] * sst.alpha + (p0 + p1);
      m_run[j][u] = sst.m;
      store_p(r, p0, p1);
      on_alpha(j, u, sst.alpha);
    }
}

// Each of those rows' sums over its warp's tokens (the lanes of one c), in place.
template <int J>
__device__ __forceinline__ void warp_row_sums(float (&l)[J][2]) {
#pragma unroll
  for (int j = 0; j < J; ++j)
#pragma unroll
    for (int u = 0; u < 2; ++u)
#pragma unroll
      for (int d = 4; d <= 16; d <<= 1) l[j][u] += __shfl_xor_sync(0xffffffffu, l[j][u], d);
}

// O = O alpha + O_tile for NB 16-dim chunks of O^T (o: the first of them), each column (a query
// row 8 j + 2 c + u) by its row's factor.
template <int J, int NB>
__device__ __forceinline__ void rescale_add(float (*o)[4 * J], const float (&alpha)[J][2], const float (&ot)[NB][4 * J]) {
#pragma unroll
  for (int bb = 0; bb < NB; ++bb)
#pragma unroll
    for (int j = 0; j < J; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          float& v = o[bb][4 * j + 2 * h + u];
          v = fmaf(v, alpha[j][u], ot[bb][4 * j + 2 * h + u]);
        }
}

// O_tile^T = V^T P^T for NB 16-dim chunks of a warp's O^T (chunks vch0 + bb of 128-dim column
// block vcb) of the tile at sK, one k32 step at a time (the second step's fragments reuse the
// first's registers), P^T's hi and lo terms at sPh_a, sPl_a. Lane l addresses row l & 7 of
// matrix l >> 3 = (half, 8-token group) of the step; block b's chunk of those tokens sits at
// chunk b ^ (token & 7). `last` runs after the stage's last reads (the second step's fragments).
template <bool E5M2, int M, int NB, typename Last>
__device__ __forceinline__ void fp8_pv_tile(float (&ot)[NB][M / 2], uint32_t sK, int vcb, int vch0, uint32_t sPh_a,
                                            uint32_t sPl_a, int lane, Last last) {
  constexpr int NT = Fp8SwapConfig<M>::NT;
  const int mi = lane >> 3, mr = lane & 7;
  const uint32_t vrow = sK + vcb * (NT * 128) + (16 * (mi >> 1) + 8 * (mi & 1) + mr) * 128;
#pragma unroll
  for (int s = 0; s < 2; ++s) {
    uint32_t va[NB][4];
#pragma unroll
    for (int bb = 0; bb < NB; ++bb) {
      // t[2 hf + t8]: tokens 32 s + 16 hf + 8 t8 + 2 c, + 1, dims 2 g, 2 g + 1 of chunk vch0 + bb;
      // the permutes take k = 4 c + j from token 2 c + 8 (j & 1) + (j >> 1) of the half.
      uint32_t tt[4];
      ldmatrix_x4_trans(vrow + s * (32 * 128) + (((vch0 + bb) ^ mr) << 4), tt);
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        va[bb][2 * hf] = __byte_perm(tt[2 * hf], tt[2 * hf + 1], 0x6240);      // dim 2 g
        va[bb][2 * hf + 1] = __byte_perm(tt[2 * hf], tt[2 * hf + 1], 0x7351);  // dim 2 g + 1
      }
    }
    if (s == 1) last();
    const SmemDesc dph(sPh_a, 16, 1024), dpl(sPl_a, 16, 1024);
    wgmma_fence();
#pragma unroll
    for (int bb = 0; bb < NB; ++bb) {
      if (s == 0) wgmma_m64k32_fp8_rs<M, E5M2, false>(ot[bb], va[bb], dph.at());
      else wgmma_m64k32_fp8_rs<M, E5M2, true>(ot[bb], va[bb], dph.at(32));
      wgmma_m64k32_fp8_rs<M, E5M2, true>(ot[bb], va[bb], dpl.at(32 * s));
    }
    wgmma_commit();
    wgmma_wait<0>();
  }
#pragma unroll
  for (int bb = 0; bb < NB; ++bb) fence_regs(ot[bb]);
}

template <bool E5M2, int M>
__global__ void __launch_bounds__(384, 1) attention_fp8_swap_kernel(const __grid_constant__ AttentionParams p) {
  using C = Fp8SwapConfig<M>;
  constexpr int NT = C::NT, STAGES = C::STAGES, QB = C::QB, NBB = C::NBB;

  extern __shared__ __align__(1024) uint8_t smem_raw[];
  Fp8SwapShared<M>& sh = aligned_shared<Fp8SwapShared<M>>(smem_raw);
  const uint32_t sKV_a = smem_addr(sh.kv[0]);
  const uint32_t full_a = smem_addr(sh.full), empty_a = smem_addr(sh.empty);  // + 8 s
  const uint32_t pfull_a = smem_addr(sh.pfull), pfree_a = smem_addr(sh.pfree);  // + 8 parity
  const uint32_t sfull_a = smem_addr(&sh.sfull), sfree_a = smem_addr(&sh.sfree);

  const int tid = threadIdx.x, role = tid >> 7, t = tid & 127;
  const int w = t >> 5, lane = tid & 31, g = lane >> 2, c = lane & 3;
  if (tid == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full_a + 8 * s, 128);   // one cp.async arrival per producer thread
      mbar_init(empty_a + 8 * s, C::ROLES ? 256 : 128);  // one arrival per consumer thread of the tile
    }
    for (int b = 0; b < 2; ++b) {
      mbar_init(pfull_a + 8 * b, 128);  // the scores warpgroup's threads
      mbar_init(pfree_a + 8 * b, 128);  // the values warpgroup's threads
    }
    mbar_init(sfull_a, 128);
    mbar_init(sfree_a, 128);
  }
  __syncthreads();

  cta_start(p, tid);
  // The plan's scalars (ps), like kv_scale's scales, are read by each role after setmaxnreg:
  // a value live across it may be spilled.

  // Tiles are numbered across the CTA's units (gt): tile gt sits in stage gt % STAGES, its
  // n-th use (n = gt / STAGES) completes phase n of full[stage] and of empty[stage].
  uint32_t gbase = 0;

  // ================= producer role ==============================================================
  // Eight threads per token row (chunks lc + 8 m: one 128-byte row of each column block),
  // tokens lt + 16 j; a warp's copy reads 4 tokens x 128 contiguous bytes.
  auto producer_role = [&] {
    const PlanScalars ps = plan_scalars<M>(p);
    const int lt = t >> 3, lc = t & 7;
    for (UnitCursor cur = unit_cursor(); next_unit<M>(p, ps, cur);) {
      const UnitSpan us = unit_span<M, NT>(p, cur, ps);
      if (t == 0) prefetch_unit_q(p, us);  // the consumers load it STAGES tiles from now at most
      // Sub-page ids of this thread's four tokens of tile i (0 past the end: never used).
      auto fetch_subpages = [&](int i, int (&sp)[4]) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int jt = us.tok_lo + i * NT + lt + 16 * j;
          sp[j] = token_subpage(us, ps, i, jt);
        }
      };
      // Two tiles ahead: a lookup's latency is longer than a tile's issue.
      int sp[4], sp_next[4];
      fetch_subpages(0, sp);
      fetch_subpages(1, sp_next);
      for (int i = 0; i < us.ntiles; ++i) {
        const uint32_t gt = gbase + uint32_t(i), s = gt % STAGES, n = gt / STAGES;
        if (n > 0) mbar_wait(empty_a + 8 * s, (n - 1) & 1u);
        const uint32_t dst = sKV_a + s * C::TILE_BYTES;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int tok = lt + 16 * j, jt = us.tok_lo + i * NT + tok;
          const bool ok = jt < us.tok_hi;  // past it: zero-filled, never read
          const uint8_t* src = ok ? token_row<kDim>(p, ps, sp[j], jt) : p.kv;
#pragma unroll
          for (int m = 0; m < C::BLOCKS; ++m)
            if (m < C::BLOCKS - 1 || lc < 4)
              cp_async_16(dst + swz128(tok, m, lc, NT * 128), src + (lc + 8 * m) * 16,
                          ok ? 16 : 0);
        }
        cp_async_mbar_arrive(full_a + 8 * s);
#pragma unroll
        for (int j = 0; j < 4; ++j) sp[j] = sp_next[j];
        fetch_subpages(i + 2, sp_next);
      }
      gbase += uint32_t(us.ntiles);
    }
    cp_async_wait_all();  // the CTA does not exit with copies in flight
  };
  if (role == 0) {
    setmaxnreg_dec<C::PRODUCER_REGS>();
    producer_role();
    return;
  }

  // =================== consumers ==================================================================
  auto scores_scale = [&] { return p.softmax_scale * kv_scale_of(p) * kLog2e; };
  auto out_scale_of = [&] { return kv_scale_of(p) * (1.0f / 256.0f); };  // v = stored * kv_scale; P entered as 256 P
  float* sQscale = sh.qscale;
  int* sLen = sh.len;
  const uint32_t sQ_a = smem_addr(sh.q);
  auto wg_sync = [&] {  // each id a constant: ptxas keeps both barriers immediate
    if (role == 1) named_sync(kBarFirstConsumer, 128);
    else named_sync(kBarSecondConsumer, 128);
  };
  auto consumers_sync = [] { named_sync(kBarBothConsumers, 256); };

  // Q rows [row0, row0 + nr) of unit us as hi + lo e4m3, scaled per row, by the loaders (ct
  // < 128 or 256): T threads per row, chunk (8 values) q + T m; hi at row r of the stacked
  // block, lo QB rows further. Padding rows of the CTA are zero.
  auto load_q = [&](const UnitSpan& us, int ct) {
    constexpr int T = C::Q_THREADS_PER_ROW, CH = (kDim / 8 + T - 1) / T;
    const int r = ct / T, q = ct % T, nr = us.nr;
    const bf16* qrow = p.q + (us.q_row + r) * kDim;
    uint4 raw[CH];
    float amax = 0.0f;
#pragma unroll
    for (int m = 0; m < CH; ++m) {
      const int ch = q + T * m;
      raw[m] = (r < nr && ch < kDim / 8) ? __ldg(reinterpret_cast<const uint4*>(qrow + ch * 8)) : make_uint4(0, 0, 0, 0);
      const uint32_t v[4] = {raw[m].x, raw[m].y, raw[m].z, raw[m].w};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float2 x = bf16x2_to_float2(v[e]);
        amax = fmaxf(amax, fabsf(x.x));
        amax = fmaxf(amax, fabsf(x.y));
      }
    }
#pragma unroll
    for (int d = 1; d < T; d <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, d));
    // Largest element to [128, 256); an infinite element poisons its row with NaN.
    const RowScale sc = pow2_row_scale(amax, 8);
    if (q == 0) {
      sQscale[r] = sc.down;
      sLen[r] = r < nr ? us.lens[(us.row0 + r) / p.heads] : 0;
    }
#pragma unroll
    for (int m = 0; m < CH; ++m) {
      const int ch = q + T * m;
      if (ch >= kDim / 8) continue;
      const uint32_t v[4] = {raw[m].x, raw[m].y, raw[m].z, raw[m].w};
      uint32_t hi[2], lo[2];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        uint16_t h, l;
        const float2 x = bf16x2_to_float2(v[e]);
        split_e4m3x2(x.x * sc.up, x.y * sc.up, h, l);
        if (sc.poison) h = 0x7f7fu;
        if (e & 1) {
          hi[e >> 1] |= uint32_t(h) << 16;
          lo[e >> 1] |= uint32_t(l) << 16;
        } else {
          hi[e >> 1] = h;
          lo[e >> 1] = l;
        }
      }
      const int byte = ch * 8;  // hi and lo blocks alternate: a block of each per 128 bytes of Q
      const int off = swz128(r, byte >> 7, (byte >> 4) & 7, 2 * QB * 128) + (byte & 15);
      *reinterpret_cast<uint2*>(sh.q + off) = make_uint2(hi[0], hi[1]);
      *reinterpret_cast<uint2*>(sh.q + QB * 128 + off) = make_uint2(lo[0], lo[1]);
    }
  };

  // P^T of row r: token g + 8 h of warp w's 16 is k 16 w + 4 (g >> 1) + 2 (g & 1) + h (V^T's
  // k order, fp8_pv_tile), so each term's two bytes (h = 0, 1) are one 16-bit store.
  auto store_p = [&](uint8_t* sPh, uint8_t* sPl, int r, float p0, float p1) {
    uint16_t ph, pl;
    split_e4m3x2(p0 * 256.0f, p1 * 256.0f, ph, pl);
    const int kk = 16 * w + 4 * (g >> 1) + 2 * (g & 1);
    const int off = swz128(r, 0, kk >> 4, C::P_BYTES) + (kk & 15);
    *reinterpret_cast<uint16_t*>(sPh + off) = ph;
    *reinterpret_cast<uint16_t*>(sPl + off) = pl;
  };

  if constexpr (C::ROLES) {
    // ================= M 32: the scores warpgroup ==============================================
    // S^T of all 32 rows (N = 64: Q_hi and Q_lo stacked), the softmax, P^T and each row's
    // rescale factor into the tile parity's buffers (pfull), the unit's row sums and maxima
    // into sL / m1 at its end (sfull). This thread's rows: 8 j + 2 c + u (j < 4, u < 2).
    if (role == 1) {
      setmaxnreg_inc<C::SCORES_REGS>();
      const float sl2 = scores_scale();
      const PlanScalars ps = plan_scalars<M>(p);
      uint32_t unit = 0;
      for (UnitCursor cur = unit_cursor(); next_unit<M>(p, ps, cur); ++unit) {
        const UnitSpan us = unit_span<M, NT>(p, cur, ps);
        wg_sync();  // every warp is past the last unit's reads of sQscale, sLen and its S
        load_q(us, t);
        fence_proxy_async();  // Q is read by wgmma (async proxy)
        wg_sync();
        float sl2r[4][2], m_run[4][2], l_run[4][2];
        int lim[4][2];
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
          for (int u = 0; u < 2; ++u) {
            const int r = 8 * j + 2 * c + u;
            sl2r[j][u] = sl2 * sQscale[r];
            lim[j][u] = min(sLen[r], us.tok_hi);
            m_run[j][u] = kNegInf;
            l_run[j][u] = 0.0f;
          }
        // 1. S^T = K Q^T: one chain per column block (4 k32 steps), two in flight, each
        //    summed (hi + lo) into sn as it completes (s at the tile's end). `between` runs
        //    after the first two chains' issue: the last tile's steps 2-3, under them. No
        //    mbarrier spin lies between a chain's issue and its wait (ptxas would serialise
        //    every wgmma of the kernel); a named barrier may.
        const SmemDesc dq(sQ_a, 16, 1024);
        float s[16];  // the last tile's S, read by its softmax under the next tile's chains
        auto scores = [&](int i, auto between) {
          const uint32_t gt = gbase + uint32_t(i), st = gt % STAGES;
          const uint32_t sK = sKV_a + st * C::TILE_BYTES;
          const SmemDesc dk(sK, 16, 1024);
          float a[2][32], sn[16];
          auto chain = [&](int cb, float (&acc)[32]) {
            wgmma_fence();
#pragma unroll
            for (int ks = 0; ks < (cb < C::BLOCKS - 1 ? 4 : 2); ++ks) {
              const uint64_t da = dk.at(cb * (NT * 128) + ks * 32);
              const uint64_t db = dq.at(cb * (2 * QB * 128) + ks * 32);
              // In place: the fold of acc's last chain comes before this issue, so the five
              // chains take two accumulators' registers, not five (the softmax runs beside them).
              if (ks == 0) wgmma_m64n64k32_fp8_ss<E5M2, false, true>(acc, da, db);
              else wgmma_m64n64k32_fp8_ss<E5M2, true>(acc, da, db);
            }
            wgmma_commit();
          };
          auto fold = [&](float (&acc)[32], bool first) {
            fence_regs(acc);
#pragma unroll
            for (int e = 0; e < 16; ++e) {
              const float v = acc[e] + acc[16 + e];
              sn[e] = first ? v : sn[e] + v;
            }
          };
          // Written out: the same sequence as a loop over cb gave ptxas other descriptor
          // arithmetic (a few integer instructions), and this is the form measured.
          chain(0, a[0]);
          chain(1, a[1]);
          between();
          wgmma_wait<1>();
          fold(a[0], true);
          chain(2, a[0]);
          wgmma_wait<1>();
          fold(a[1], false);
          chain(3, a[1]);
          wgmma_wait<1>();
          fold(a[0], false);
          chain(4, a[0]);
          wgmma_wait<1>();
          fold(a[1], false);
          wgmma_wait<0>();
          fold(a[0], false);
          mbar_arrive(empty_a + 8 * st);  // this warpgroup's reads of the stage are done
#pragma unroll
          for (int e = 0; e < 16; ++e) s[e] = sn[e];
        };
        // 2. Tile i's scores in base 2 (x), masked, and their maxima (red, by parity) across
        //    the four warps; 3. the softmax, P^T and alpha into the parity's buffers.
        auto softmax = [&](int i) {
          const uint32_t b = (gbase + uint32_t(i)) & 1u;
          float x[4][2][2];
          masked_scores<4, QB>(s, us.tok_lo + i * NT + 16 * w + g, lim, sl2r, x, sh.red[b], w, g, c);
          wg_sync();  // red complete
          uint8_t* sPh = sh.p[b][0];
          uint8_t* sPl = sh.p[b][1];
          softmax_rows<4, QB>(
              x, sh.red[b], c, m_run, l_run, [&](int r, float p0, float p1) { store_p(sPh, sPl, r, p0, p1); },
              [&](int j, int u, float alpha) {
                if (w == 0 && g == 0) sh.alpha[b][8 * j + 2 * c + u] = alpha;
              });
          fence_proxy_async();  // P^T is read by wgmma
          mbar_arrive(pfull_a + 8 * b);
        };
        // The spins before a tile's scores: its stage full (wait_full), and before the
        // softmax of tile i that runs under them its parity's P^T and alpha free (wait_free),
        // once the values warpgroup's P V of tile i - 2 is done. (red of a parity is
        // rewritten by tile gt + 2's softmax only after the barrier in tile gt + 1's, past
        // every warp's reads of it in tile gt's.)
        auto wait_free = [&](int i) {
          const uint32_t gt = gbase + uint32_t(i);
          if (gt >= 2) mbar_wait(pfree_a + 8 * (gt & 1u), ((gt >> 1) - 1) & 1u);
        };
        auto wait_full = [&](int i) {
          const uint32_t gt = gbase + uint32_t(i);
          mbar_wait(full_a + 8 * (gt % STAGES), (gt / STAGES) & 1u);
        };
        if (us.ntiles > 0) {
          wait_full(0);
          scores(0, [] {});
          for (int i = 1; i < us.ntiles; ++i) {
            wait_free(i - 1);
            wait_full(i);
            scores(i, [&] { softmax(i - 1); });
          }
          wait_free(us.ntiles - 1);
          softmax(us.ntiles - 1);
        }
        gbase += uint32_t(us.ntiles);
        // The unit's row sums (per warp: lanes of one c share the rows) and maxima, once the
        // values warpgroup has read the last unit's.
        warp_row_sums<4>(l_run);
        if (unit > 0) mbar_wait(sfree_a, (unit - 1) & 1u);
        if (g == 0) {
#pragma unroll
          for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int u = 0; u < 2; ++u) {
              const int r = 8 * j + 2 * c + u;
              sh.l[0][w * QB + r] = l_run[j][u];
              if (w == 0) sh.m1[r] = m_run[j][u];
            }
        }
        mbar_arrive(sfull_a);
      }
      return;
    }
    // ================= M 32: the values warpgroup ==============================================
    // O^T of all 32 rows for this warp's 128 dims (column block w), in two halves of 64 dims
    // a tile (a fresh accumulator each, summed in f32), a tile behind the scores warpgroup;
    // normalised and written at the unit's end.
    setmaxnreg_inc<C::VALUES_REGS>();
    const float out_scale = out_scale_of();
    const PlanScalars ps = plan_scalars<M>(p);
    const int dim0 = 128 * w + 2 * g;  // dims dim0 + 16 bb + h
    uint32_t unit = 0;
    for (UnitCursor cur = unit_cursor(); next_unit<M>(p, ps, cur); ++unit) {
      const UnitSpan us = unit_span<M, NT>(p, cur, ps);
      // o[bb][4 j + 2 h + u] = O[8 j + 2 c + u][dim0 + 16 bb + h]
      float o[NBB][M / 2];
#pragma unroll
      for (int bb = 0; bb < NBB; ++bb)
#pragma unroll
        for (int e = 0; e < M / 2; ++e) o[bb][e] = 0.0f;
      for (int i = 0; i < us.ntiles; ++i) {
        const uint32_t gt = gbase + uint32_t(i), st = gt % STAGES, b = gt & 1u;
        const uint32_t sK = sKV_a + st * C::TILE_BYTES;
        mbar_wait(full_a + 8 * st, (gt / STAGES) & 1u);
        mbar_wait(pfull_a + 8 * b, (gt >> 1) & 1u);
        float al[M / 8][2];
#pragma unroll
        for (int j = 0; j < M / 8; ++j)
#pragma unroll
          for (int u = 0; u < 2; ++u) al[j][u] = sh.alpha[b][8 * j + 2 * c + u];
        const uint32_t sPh_a = smem_addr(sh.p[b][0]), sPl_a = smem_addr(sh.p[b][1]);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          float ot[NBB / 2][M / 2];  // written by the first step
          fp8_pv_tile<E5M2, M>(ot, sK, w, 4 * half, sPh_a, sPl_a, lane, [&] {
            if (half == 1) mbar_arrive(empty_a + 8 * st);  // the stage's last reads
          });
          rescale_add(&o[4 * half], al, ot);
        }
        mbar_arrive(pfree_a + 8 * b);  // this tile's P V has completed: P^T and alpha free
      }
      gbase += uint32_t(us.ntiles);
      mbar_wait(sfull_a, unit & 1u);
#pragma unroll
      for (int j = 0; j < M / 8; ++j)
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          const int r = 8 * j + 2 * c + u;
          const float l = sh.l[0][r] + sh.l[0][QB + r] + sh.l[0][2 * QB + r] + sh.l[0][3 * QB + r];
          const float m = sh.m1[r];
          if (r < us.nr) {
            store_row_slice<NBB, 16>(p, us, r, dim0, l, out_scale,
                                     [&](int bb) { return make_float2(o[bb][4 * j + u], o[bb][4 * j + 2 + u]); });
            if (w == 0 && g == 0) store_row_stats(p, us, r, m, l);
          }
        }
      mbar_arrive(sfree_a);
    }
    if (t == 0) trace_cta(p, true);  // the values warpgroup's first thread, after its last unit
    return;
  } else {
    // ================= M 16: alternate tiles ===================================================
    static_assert(C::SCORES_REGS == C::VALUES_REGS);
    setmaxnreg_inc<C::SCORES_REGS>();
    const float sl2 = scores_scale(), out_scale = out_scale_of();
    const PlanScalars ps = plan_scalars<M>(p);
    // Consumer cw takes tiles cw, cw + 2, ... of each unit, all rows and dims.
    const int cw = role - 1;
    float* sRed = sh.red[cw];
    float* sL = &sh.l[0][0];  // consumer k's warp w, row r at (4 k + w) QB + r
    float* sM1 = sh.m1;
    float* sO1 = sh.o1;
    // This thread's rows of S^T (the accumulator columns) and O^T: 8 j + 2 c + u (j < 2).
    auto lrow = [&](int j, int u) { return 8 * j + 2 * c + u; };
    const int dim0 = 128 * w + 2 * g;  // dims dim0 + 16 bb + h

    for (UnitCursor cur = unit_cursor(); next_unit<M>(p, ps, cur);) {
      const UnitSpan us = unit_span<M, NT>(p, cur, ps);
      const int nr = us.nr, ntiles = us.ntiles;
      load_q(us, tid - 128);
      fence_proxy_async();  // Q is read by wgmma (async proxy)
      consumers_sync();

      float sl2r[2][2];
      int lim[2][2];
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          sl2r[j][u] = sl2 * sQscale[lrow(j, u)];
          lim[j][u] = min(sLen[lrow(j, u)], us.tok_hi);
        }
      // O^T chunk bb: o[bb][4 j + 2 h + u] = O[8 j + 2 c + u][dim0 + 16 bb + h].
      float o[NBB][M / 2];
#pragma unroll
      for (int bb = 0; bb < NBB; ++bb)
#pragma unroll
        for (int e = 0; e < M / 2; ++e) o[bb][e] = 0.0f;
      float m_run[2][2], l_run[2][2];
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          m_run[j][u] = kNegInf;
          l_run[j][u] = 0.0f;
        }

      for (int i = cw; i < ntiles; i += 2) {
        const uint32_t gt = gbase + uint32_t(i), st = gt % STAGES;
        const uint32_t sK = sKV_a + st * C::TILE_BYTES;
        // No proxy fence after the wait: cp.async bytes completed through
        // cp.async.mbarrier.arrive go to wgmma straight after it (FlashAttention-3's paged path).
        mbar_wait(full_a + 8 * st, (gt / STAGES) & 1u);

        // 1. S^T = K Q^T, one accumulator chain per column block (4 k32 steps); columns
        //    8 j + .. of acc are Q_hi's rows for j < 2, Q_lo's for j >= 2.
        float acc[C::BLOCKS][16];  // written by each chain's first step (ACC = false)
        const SmemDesc dk(sK, 16, 1024), dq(sQ_a, 16, 1024);
        wgmma_fence();
#pragma unroll
        for (int cb = 0; cb < C::BLOCKS; ++cb)
#pragma unroll
          for (int ks = 0; ks < (cb < C::BLOCKS - 1 ? 4 : 2); ++ks) {
            const uint64_t da = dk.at(cb * (NT * 128) + ks * 32);
            const uint64_t db = dq.at(cb * (2 * QB * 128) + ks * 32);
            if (ks == 0) wgmma_m64n32k32_fp8_ss<E5M2, false>(acc[cb], da, db);
            else wgmma_m64n32k32_fp8_ss<E5M2, true>(acc[cb], da, db);
          }
        wgmma_commit();
        wgmma_wait<0>();
#pragma unroll
        for (int cb = 0; cb < C::BLOCKS; ++cb) fence_regs(acc[cb]);

        // 2. Scores in base 2, masked, and the softmax; 3. P^T.
        float sc[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          float sum = 0.0f;
#pragma unroll
          for (int cb = 0; cb < C::BLOCKS; ++cb) sum += acc[cb][e] + acc[cb][8 + e];
          sc[e] = sum;
        }
        float x[2][2][2];
        masked_scores<2, QB>(sc, us.tok_lo + i * NT + 16 * w + g, lim, sl2r, x, sRed, w, g, c);
        wg_sync();
        uint8_t* sPh = sh.p[cw][0];
        uint8_t* sPl = sh.p[cw][1];
        float alpha[2][2];
        softmax_rows<2, QB>(
            x, sRed, c, m_run, l_run, [&](int r, float p0, float p1) { store_p(sPh, sPl, r, p0, p1); },
            [&](int j, int u, float a) { alpha[j][u] = a; });
        fence_proxy_async();
        wg_sync();  // P^T complete; every warp is past its reads of sRed

        // 4. O_tile = V^T P^T, then O = O alpha + O_tile.
        float ot[NBB][M / 2];
        fp8_pv_tile<E5M2, M>(ot, sK, w, 0, smem_addr(sPh), smem_addr(sPl), lane, [&] { mbar_arrive(empty_a + 8 * st); });
        rescale_add(&o[0], alpha, ot);
        // No barrier here: the next tile rewrites sRed after every warp has passed the P^T
        // barrier above (its reads of sRed are before it), and sP after its S, whose
        // warpgroup-wide wgmma every warp issues only after its wait for this P V.
      }
      gbase += uint32_t(ntiles);
      // Both consumers pass the same number of barriers per unit (two per tile): with an odd
      // tile count the second one passes its pair here. Nothing needs it for ordering (the
      // consumer barriers below order the units), but compute-sanitizer's racecheck otherwise
      // reports the next unit's sQscale and sLen as racing (bench/NOTES.md).
      if (cw == 1 && (ntiles & 1)) {
        wg_sync();
        wg_sync();
      }

      // ---- merge the two consumers' states, normalise and write ---------------------------
      // l of this consumer's rows over its warpgroup: lanes of one c share the rows; then the
      // four warps, read back from sL.
      warp_row_sums<2>(l_run);
      if (g == 0) {
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
          for (int u = 0; u < 2; ++u) sL[(cw * 4 + w) * QB + lrow(j, u)] = l_run[j][u];
      }
      if (cw == 1) {
#pragma unroll
        for (int bb = 0; bb < NBB; ++bb)
#pragma unroll
          for (int e = 0; e < M / 2; ++e) sO1[(bb * 8 + e) * 128 + t] = o[bb][e];
        if (w == 0 && g == 0)
#pragma unroll
          for (int j = 0; j < 2; ++j)
#pragma unroll
            for (int u = 0; u < 2; ++u) sM1[lrow(j, u)] = m_run[j][u];
      }
      consumers_sync();
      if (cw == 0) {
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
          for (int u = 0; u < 2; ++u) {
            const int r = lrow(j, u);
            const float m0 = m_run[j][u], m1 = sM1[r];
            const SoftmaxStep sst = softmax_step(m0, m1);  // the merged state's maximum and both factors
            const float mn = sst.m, f0 = sst.alpha, f1 = fast_exp2(m1 - sst.mu);
            float l0 = 0.0f, l1 = 0.0f;
#pragma unroll
            for (int q = 0; q < 4; ++q) {
              l0 += sL[q * QB + r];
              l1 += sL[(4 + q) * QB + r];
            }
            const float l = l0 * f0 + l1 * f1;
#pragma unroll
            for (int bb = 0; bb < NBB; ++bb)
#pragma unroll
              for (int h = 0; h < 2; ++h) {
                const int e = 4 * j + 2 * h + u;
                o[bb][e] = o[bb][e] * f0 + sO1[(bb * 8 + e) * 128 + t] * f1;
              }
            if (r < nr) {
              store_row_slice<NBB, 16>(p, us, r, dim0, l, out_scale,
                                       [&](int bb) { return make_float2(o[bb][4 * j + u], o[bb][4 * j + 2 + u]); });
              if (w == 0 && g == 0) store_row_stats(p, us, r, mn, l);
            }
          }
      }
      consumers_sync();  // sQ, sO1, sL, sM1 are reused by the next unit
    }
    if (tid == 128) trace_cta(p, true);  // the first consumer thread, after its last unit
  }
}

template <bool E5M2, int M>
int attention_fp8_swap_smem_bytes() {
  return kFp8SwapSmemBytes<M>;
}

template <bool E5M2, int M>
void launch_attention_fp8_swap(const AttentionParams& p, int grid, cudaStream_t stream) {
  launch_attention_kernel<attention_fp8_swap_kernel<E5M2, M>>(p, grid, Fp8SwapConfig<M>::THREADS,
                                                              kFp8SwapSmemBytes<M>, stream, "attention_fp8_swap_kernel");
}

}  // namespace dcpmla::cuda_detail

#define DCPMLA_INSTANTIATE_ATTENTION_FP8_SWAP(E5M2, M)                                                       \
  template void dcpmla::cuda_detail::launch_attention_fp8_swap<E5M2, M>(const dcpmla::AttentionParams&, int, \
                                                                        cudaStream_t);                        \
  template int dcpmla::cuda_detail::attention_fp8_swap_smem_bytes<E5M2, M>();
