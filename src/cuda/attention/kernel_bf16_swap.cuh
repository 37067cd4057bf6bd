// Attention over a plan on sm_90a for bf16 caches and CTAs of M = 16 or 32 query rows, on
// warpgroup MMA with the operands swapped: S^T = K Q^T and O^T = V^T P^T, so that the 64
// tokens of a tile are the wgmma's M and the query rows its N (wgmma's M is 64: the 64-row
// kernel computes 2-4x the rows these CTAs need; the mma.sync kernel drains its pipeline at
// every unit, and serving batches give a CTA several). The default at 16 rows; at 32 rows it
// ties with the 64-row kernel padded, the default there (bench/NOTES.md, ninth session). Same contract
// as kernel.cuh: each CTA of a fixed grid runs its chunk of the schedule for one row group,
// from the device plan; rows with no local key give out = 0, lse = -inf; pieces of cut
// requests write (o / l, m, l) partials.
//
// Two warpgroups, one CTA per SM. The producer (warpgroup 0) streams the tiles by cp.async
// into two 72 KiB stages, running ahead across the CTA's units (stream_bf16_tiles,
// bf16_tiles.cuh, the 64-row kernel's producer), and each unit's Q rows and row lengths into
// one of two Q buffers before the unit's tiles, so that a unit's start waits for nothing the
// producer could not load during the previous unit (serving batches give a CTA several
// units). The consumer (warpgroup 1), per tile:
//   1. S^T (64 tokens, M rows) = K Q^T: 36 wgmma m64nMk16, A = K (K-major) and B = Q (K-major)
//      from shared memory, one f32 chain;
//   2. masks each row at its own local length (only in a tile that reaches past one of the
//      thread's rows), exchanges the tile maximum across its four warps (a row's 64 scores
//      are spread over the warpgroup: 16 tokens a warp), online softmax in base 2;
//   3. writes P^T as bf16 (K-major, (M, 64): B of the next product) to shared memory and
//      rescales O by alpha (skipped once every row's maximum has settled);
//   4. O^T (512 dims, M rows) += V^T P^T: 32 wgmma m64nMk16, A = V^T read MN-major from the
//      same tile (no transposition: bf16 wgmma takes an MN-major A from shared memory), B = P^T;
//      then it releases the stage.
// At 16 rows a tile's serial chain (S, softmax, P V) is short beside the ~4500 cycles its
// 72 KiB take to arrive at the SM's share of the copy bandwidth: the kernel is bound by its
// loads. At 32 rows the chain (68 wgmma reading ~200 KiB of shared memory, then the softmax)
// takes more than half of that, and one consumer nearly co-limits. Numerics as the other kernels: P
// rounded to bf16 for P V, l summed from the unrounded P, natural-log lse.
//
// Accumulator layout (wgmma.cuh, N = M): thread (warp w, lane 4 g + c) holds, for n8 chunk j
// of the query rows, S^T / O^T rows 16 w + g and 16 w + g + 8 (tokens, or dims 64 b + ..) at
// query rows 8 j + 2 c + u (u < 2): acc[4 j + 2 h + u] is (row 16 w + g + 8 h, query row
// 8 j + 2 c + u).
//
// Shared memory (Bf16SwapShared, from a 1024-byte aligned base; every operand is a stack of
// column blocks of 128-byte rows, chunk c of row r at chunk c ^ (r & 7)):
//   sKV 2 x (64, 576) bf16 in 9 blocks of (64, 128 B): K for S^T (A, K-major), V for O^T (A, MN-major)
//   sQ  2 x (M, 576) bf16 in 9 blocks of (M, 128 B), len 2 x (M) i32: unit k's in buffer k % 2
//   sP  (M, 64) bf16 in rows of 128 B; red, l (4 warps x M) f32
//   mbarriers full[2], empty[2] (the stages), qfull[2], qempty[2] (the Q buffers)
#pragma once

#include <cstdint>

#include "bf16_tiles.cuh"
#include "common/params.h"
#include "common/utils.cuh"
#include "config.h"
#include "softmax.cuh"
#include "swizzle.cuh"
#include "unit.cuh"
#include "wgmma.cuh"

namespace dcpmla::cuda_detail {

template <int M_>
struct Bf16SwapConfig {
  static constexpr int M = M_;  // query rows per CTA: N of every wgmma
  static_assert(M == 16 || M == 32);
  static constexpr int NT = kBf16TileTokens;  // tokens per tile: M of S^T, K of O^T
  static constexpr int THREADS = 256;         // producer + consumer warpgroups
  static constexpr int J = M / 8;             // n8 chunks of the query rows
  static constexpr int Q_BLOCK = M * 128;     // a column block of Q
  static constexpr int Q_BYTES = (kDim / 64) * Q_BLOCK;
  static constexpr int P_BYTES = M * 128;  // (M, 64) bf16
  static_assert(Q_BLOCK % 1024 == 0 && P_BYTES % 1024 == 0);
};

// The kernel's shared memory (from a 1024-byte aligned base; the operands on swizzle atoms).
template <int M>
struct Bf16SwapShared {
  using C = Bf16SwapConfig<M>;
  alignas(1024) uint8_t kv[2][kBf16TileBytes];  // the ring (stream_bf16_tiles)
  alignas(1024) uint8_t q[2][C::Q_BYTES];       // unit k's Q in q[k % 2]
  alignas(1024) uint8_t p[C::P_BYTES];          // P^T: B of O^T
  float red[4][M];                              // [warp][row]: tile maxima
  float l[4][M];                                // [warp][row]: the unit's sums
  int len[2][M];                                // unit k's row lengths in len[k % 2]
  uint64_t full[2], empty[2], qfull[2], qempty[2];
};
template <int M>
inline constexpr int kBf16SwapSmemBytes = int(sizeof(Bf16SwapShared<M>)) + 1024;  // + slack to align the base
static_assert(kBf16SwapSmemBytes<32> <= kSmemPerCta, "bf16 swap tiles do not fit in shared memory");

// The consumer's named barrier (its warpgroup only; the producer never waits on it).
inline constexpr int kBarSwapConsumer = 1;

// D (64 x M) (+)= A B, bf16 from shared memory, for the CTA's M.
template <int M, int TRANS_A>
__device__ __forceinline__ void swap_mma(float (&d)[M / 2], uint64_t desc_a, uint64_t desc_b, int scale_d) {
  if constexpr (M == 16) wgmma_m64n16k16_ss<0, TRANS_A>(d, desc_a, desc_b, scale_d);
  else wgmma_m64n32k16_ss<0, TRANS_A>(d, desc_a, desc_b, scale_d);
}

template <int M>
__global__ void __launch_bounds__(Bf16SwapConfig<M>::THREADS, 1)
    attention_bf16_swap_kernel(const __grid_constant__ AttentionParams p) {
  using C = Bf16SwapConfig<M>;
  constexpr int NT = C::NT, J = C::J;

  extern __shared__ __align__(1024) uint8_t smem_raw[];
  Bf16SwapShared<M>& sh = aligned_shared<Bf16SwapShared<M>>(smem_raw);
  const uint32_t sKV_a = smem_addr(sh.kv[0]), sP_a = smem_addr(sh.p);
  const uint32_t full_a = smem_addr(sh.full), empty_a = smem_addr(sh.empty);  // + 8 s
  const uint32_t qfull_a = smem_addr(sh.qfull), qempty_a = smem_addr(sh.qempty);  // + 8 (k % 2)

  const int tid = threadIdx.x, t = tid & 127;
  const int w = t >> 5, lane = tid & 31, g = lane >> 2, c = lane & 3;
  if (tid == 0) {
    for (int s = 0; s < 2; ++s) {
      mbar_init(full_a + 8 * s, 128);    // one cp.async arrival per producer thread
      mbar_init(empty_a + 8 * s, 128);   // one arrival per consumer thread
      mbar_init(qfull_a + 8 * s, 128);   // as full
      mbar_init(qempty_a + 8 * s, 128);  // as empty
    }
  }
  __syncthreads();

  cta_start(p, tid);
  const PlanScalars ps = plan_scalars<M>(p);
  if (tid < 128) {
    // Unit k's Q rows (zero past the unit's rows) and row lengths into buffer k % 2, once the
    // consumer has released it (unit k - 2's), arriving on qfull as they land.
    auto load_unit = [&](const UnitSpan& u, uint32_t k) {
      produce_unit_q<M, 2>(p, u, k, smem_addr(sh.q[0]), sizeof(sh.q[0]), smem_addr(sh.len[0]), qfull_a, qempty_a, t,
                           [](int r, int ch) { return swz128(r, ch >> 3, ch & 7, C::Q_BLOCK); });
    };
    stream_bf16_tiles<M>(p, ps, sKV_a, full_a, empty_a, t, nullptr, load_unit);
    return;
  }

  auto wg_sync = [] { named_sync(kBarSwapConsumer, 128); };
  const float sl2 = p.softmax_scale * kLog2e;
  // This thread's query rows (accumulator columns): row_of(j, u) = 8 j + 2 c + u.
  auto row_of = [&](int j, int u) { return 8 * j + 2 * c + u; };
  uint8_t* sP = sh.p;

  uint32_t gbase = 0;  // the unit's first tile, numbered across the CTA's units
  uint32_t unit = 0;   // the unit's index among the CTA's units
  for (UnitCursor cur = unit_cursor(); next_unit<M>(p, ps, cur); ++unit) {
    const UnitSpan us = unit_span<M, NT>(p, cur, ps);
    const int nr = us.nr, tok_lo = us.tok_lo, tok_hi = us.tok_hi, ntiles = us.ntiles;
    // The unit's Q and lengths (no proxy fence: cp.async bytes arrived through the mbarrier).
    const uint32_t qb = unit & 1u, sQ_a = smem_addr(sh.q[qb]);
    mbar_wait(qfull_a + 8 * qb, (unit >> 1) & 1u);

    int lim[J][2], lim_min = tok_hi;
#pragma unroll
    for (int j = 0; j < J; ++j)
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        lim[j][u] = min(sh.len[qb][row_of(j, u)], tok_hi);
        if (row_of(j, u) < nr) lim_min = min(lim_min, lim[j][u]);  // padding rows are never stored
      }
    float o[8][M / 2];  // O^T block b (dims 64 b ..): o[b][4 j + 2 h + u], dim 64 b + 16 w + g + 8 h
#pragma unroll
    for (int b = 0; b < 8; ++b)
#pragma unroll
      for (int e = 0; e < M / 2; ++e) o[b][e] = 0.0f;
    float m_run[J][2], l_run[J][2];
#pragma unroll
    for (int j = 0; j < J; ++j)
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        m_run[j][u] = kNegInf;
        l_run[j][u] = 0.0f;
      }

    for (int i = 0; i < ntiles; ++i) {
      const uint32_t gt = gbase + uint32_t(i), s = gt & 1u;
      const uint32_t sK = sKV_a + s * kBf16TileBytes;
      // No proxy fence after the wait: cp.async bytes completed through
      // cp.async.mbarrier.arrive go to wgmma straight after it (as in the 64-row kernel).
      mbar_wait(full_a + 8 * s, (gt >> 1) & 1u);

      // 1. S^T = K Q^T: k16 step ks reads 32 bytes of column block ks / 4 of both.
      float sc[M / 2];  // written by the first step (scale_d = 0)
#pragma unroll
      for (int e = 0; e < M / 2; ++e) sc[e] = 0.0f;
      {
        const SmemDesc dk(sK, 16, 1024), dq(sQ_a, 16, 1024);
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < kDim / 16; ++ks)
          swap_mma<M, 0>(sc, dk.at((ks >> 2) * (NT * 128) + (ks & 3) * 32),
                         dq.at((ks >> 2) * C::Q_BLOCK + (ks & 3) * 32), ks > 0);
        wgmma_commit();
        wgmma_wait<0>();
        fence_regs(sc);
      }

      // 2. Masked where the tile reaches past one of this thread's rows; tokens t0 + 8 h.
      const int t0 = tok_lo + i * NT + 16 * w + g;
      if (tok_lo + (i + 1) * NT > lim_min) {
#pragma unroll
        for (int j = 0; j < J; ++j)
#pragma unroll
          for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int u = 0; u < 2; ++u)
              if (t0 + 8 * h >= lim[j][u]) sc[4 * j + 2 * h + u] = kNegInf;
      }
      float v[2 * J];
#pragma unroll
      for (int j = 0; j < J; ++j)
#pragma unroll
        for (int u = 0; u < 2; ++u) v[2 * j + u] = fmaxf(sc[4 * j + u], sc[4 * j + 2 + u]);
      swap_warp_maxima<J>(v, g, [&](int j, int u, float m) { sh.red[w][row_of(j, u)] = m; });
      wg_sync();
      float tmax[J][2];  // every row's before the first P^T store (swap_tile_maxima)
      swap_tile_maxima<J>(&sh.red[0][0], M, c, tmax);
      float alpha[J][2];
#pragma unroll
      for (int j = 0; j < J; ++j)
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          const int r = row_of(j, u);
          const SoftmaxStep st = softmax_step(m_run[j][u], tmax[j][u] * sl2);  // sl2 > 0
          alpha[j][u] = st.alpha;
          m_run[j][u] = st.m;
          const float p0 = fast_exp2(fmaf(sc[4 * j + u], sl2, -st.mu));
          const float p1 = fast_exp2(fmaf(sc[4 * j + 2 + u], sl2, -st.mu));
          l_run[j][u] = l_run[j][u] * st.alpha + (p0 + p1);
          // 3. P^T[r][token 16 w + g + 8 h]: chunk 2 w + h of row r, element g.
          *reinterpret_cast<__nv_bfloat16*>(sP + swz128(r, 0, 2 * w, C::P_BYTES) + 2 * g) = __float2bfloat16_rn(p0);
          *reinterpret_cast<__nv_bfloat16*>(sP + swz128(r, 0, 2 * w + 1, C::P_BYTES) + 2 * g) =
              __float2bfloat16_rn(p1);
        }
      bool rescale = false;
#pragma unroll
      for (int j = 0; j < J; ++j) rescale = rescale || alpha[j][0] != 1.0f || alpha[j][1] != 1.0f;
      if (__any_sync(0xffffffffu, rescale)) {
#pragma unroll
        for (int b = 0; b < 8; ++b)
#pragma unroll
          for (int j = 0; j < J; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) o[b][4 * j + e] *= alpha[j][e & 1];
      }
      fence_proxy_async();  // P^T is read by wgmma
      wg_sync();            // P^T complete; every warp is past its reads of red

      // 4. O^T += V^T P^T: A = dims [64 b, 64 b + 64) of the tile, MN-major (8-token groups
      //    1 KiB apart; k16 step = 2 KiB), B = P^T (k16 step = 32 bytes of its rows).
      {
        const SmemDesc dv(sK, NT * 128, 1024), dp(sP_a, 16, 1024);
        wgmma_fence();
#pragma unroll
        for (int b = 0; b < 8; ++b)
#pragma unroll
          for (int kk = 0; kk < NT / 16; ++kk)
            swap_mma<M, 1>(o[b], dv.at(b * (NT * 128) + kk * 2048), dp.at(kk * 32), 1);
        wgmma_commit();
        wgmma_wait<0>();
#pragma unroll
        for (int b = 0; b < 8; ++b) fence_regs(o[b]);
      }
      mbar_arrive(empty_a + 8 * s);  // the stage's last reads have completed
      // No barrier here: the next tile rewrites red after every warp has passed the P^T
      // barrier above (its reads of red are before it), and sP after the next S, whose
      // warpgroup-wide wgmma every warp issues only after its wait for this P V.
    }
    gbase += uint32_t(ntiles);
    mbar_arrive(qempty_a + 8 * qb);  // every S of the unit has completed, its lengths are read

    // ---- epilogue: l over the row's lanes and warps, then out (or the partial) and stats ----
#pragma unroll
    for (int j = 0; j < J; ++j)
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        float v = l_run[j][u];
#pragma unroll
        for (int d = 4; d <= 16; d <<= 1) v += __shfl_xor_sync(0xffffffffu, v, d);
        if (g == 0) sh.l[w][row_of(j, u)] = v;
      }
    wg_sync();
    // Lanes g and g ^ 1 (lane ^ 4) trade halves so that each holds two adjacent dims of one
    // row: even g row u = 0, dims (g, g + 1); odd g row u = 1, dims (g - 1, g).
    const int uu = g & 1;
#pragma unroll
    for (int j = 0; j < J; ++j) {
      const int r = row_of(j, uu);
      const float l = sh.l[0][r] + sh.l[1][r] + sh.l[2][r] + sh.l[3][r];
      float2 pair[8][2];
#pragma unroll
      for (int b = 0; b < 8; ++b)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const float v0 = o[b][4 * j + 2 * h], v1 = o[b][4 * j + 2 * h + 1];
          const float got = __shfl_xor_sync(0xffffffffu, uu ? v0 : v1, 4);
          pair[b][h] = uu ? make_float2(got, v1) : make_float2(v0, got);
        }
      // (Row r's four lanes, g = uu, uu + 2, uu + 4, uu + 6, trade on to 16 bytes a lane.)
      store_row_lanes<8, 16, 16>(
          p, us, r, r < nr, g >> 1, l, 1.0f, [&](int i) { return 64 * (i >> 1) + 16 * w + 8 * (i & 1); },
          [&](int i) { return pair[i >> 1][i & 1]; });
      if (r < nr && w == 0 && g < 2) store_row_stats(p, us, r, uu ? m_run[j][1] : m_run[j][0], l);
    }
    wg_sync();  // l is reused by the next unit
  }
  if (tid == 128) trace_cta(p, true);  // the first consumer thread, after its last unit
}

template <int M>
int attention_bf16_swap_smem_bytes() {
  return kBf16SwapSmemBytes<M>;
}

template <int M>
void launch_attention_bf16_swap(const AttentionParams& p, int grid, cudaStream_t stream) {
  launch_attention_kernel<attention_bf16_swap_kernel<M>>(p, grid, Bf16SwapConfig<M>::THREADS, kBf16SwapSmemBytes<M>,
                                                         stream, "attention_bf16_swap_kernel");
}

}  // namespace dcpmla::cuda_detail

#define DCPMLA_INSTANTIATE_ATTENTION_BF16_SWAP(M)                                                          \
  template void dcpmla::cuda_detail::launch_attention_bf16_swap<M>(const dcpmla::AttentionParams&, int, \
                                                                   cudaStream_t);                        \
  template int dcpmla::cuda_detail::attention_bf16_swap_smem_bytes<M>();
