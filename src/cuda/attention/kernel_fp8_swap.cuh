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
// Three warpgroups (384 threads), one CTA per SM. The producer (warpgroup 0, 40 registers)
// streams the tiles by cp.async through a ring of four stages (full / empty mbarriers),
// running ahead across units; it is the only role with loads in flight, so the consumers'
// proxy fences (a MEMBAR, which waits for the issuing thread's loads) cost nothing. The two
// consumers (232 registers each) share the work in one of two ways:
//   M = 16: they take alternate tiles of a unit, each with its own running max, sum and O
//     (all rows, all 512 dims), merged at the end of the unit;
//   M = 32 (the split schedule): both take every tile; consumer k computes S^T and the softmax
//     of rows 16 k .. 16 k + 15 (steps 1-3 below, as a 16-row consumer) and O^T for dims
//     256 k .. 256 k + 255 of all 32 rows (step 4 with 4 chunks a warp, N = 32). P^T (all
//     32 rows) and each row's rescale factor go through shared memory, alternating by tile
//     parity, behind one barrier of both consumers a tile; each consumer writes its dims of
//     every row at the end, the row's owner its statistics. A tile is read, transposed and
//     multiplied once for all 32 rows, instead of once per 16-row CTA.
// Per tile a consumer (M = 16):
//   1. S^T (64 tokens, 16 rows) = K Q_hi^T + K Q_lo^T: 18 wgmma m64n32k32 (B = Q_hi and
//      Q_lo stacked as 32 rows, so K is read from shared memory once), A = K and B = Q from
//      shared memory, one accumulator per column block;
//   2. masks each row at its own local length, exchanges the tile maximum across its four
//      warps (a row's 64 scores are spread over the warpgroup), online softmax in base 2;
//   3. writes P^T as hi and lo e4m3 (K-major, B of the next product) to shared memory;
//   4. O^T (512 dims, 16 rows) += V^T P^T: V^T is the A operand from registers (fp8 wgmma
//      has no MN-major operand), transposed from the tile by ldmatrix.trans on byte pairs
//      and one byte permute per register, 32 wgmma m64n16k32 into a fresh accumulator,
//      then O = O alpha + O_tile in f32.
// Operand orders are chosen so that no data moves more than once:
//   - M row (block b, warp w, lane row g, half h) of O^T is dim 128 w + 16 b + 2 g + h: one
//     ldmatrix.x4.trans of block b's 16-byte chunk gives a thread dims 2 g, 2 g + 1 of the
//     tokens 2 c, 2 c + 1 of four 8-token groups, and two permutes per pair of groups give
//     its fragment registers;
//   - k index 4 c + j of each 16-token half of a k32 step is token 2 c + (j & 1) + 8 (j >> 1)
//     of that half (the order ldmatrix.trans delivers).
//
// Shared memory (Fp8SwapShared, from a 1024-byte aligned base; every operand is a stack of
// column blocks of 128-byte rows, chunk c of row r stored at chunk c ^ (r & 7), the 128-byte swizzle):
//   sKV  4 x (64, 576) e4m3/e5m2 in 5 blocks of (64, 128 B) (the last half used): the ring
//   sQ   M / 16 stacked blocks, each (32, 576) e4m3 in 5 blocks: rows 0-15 Q_hi, 16-31 Q_lo of
//        16 query rows; sP 2 x {hi, lo} (M, 64) e4m3 in rows of 128 B (per consumer at M = 16,
//        per tile parity at 32)
//   sO1 (64 x 128) f32 (M = 16): the second consumer's O for the merge; sQscale (M) f32,
//   sLen (M) i32, sRed 2 x (4 warps, 16) f32 (tile maxima), sL 2 x (4, 16) f32, sM1 (16)
//   f32, sAlpha 2 x (M) f32 (M = 32), mbarriers full[4], empty[4]
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
  // M = 32: each consumer computes S for its 16 rows and O^T for its 256 dims of all rows
  // (the split schedule); M = 16: the consumers take alternate tiles, all rows and dims.
  static constexpr bool SPLIT = M == 32;
  static constexpr int QB = 16;         // rows of one consumer's S^T (Q_hi and Q_lo stacked: N = 32)
  static constexpr int NT = 64;         // tokens per tile: M of S^T, K of O^T
  static constexpr int THREADS = 384;   // producer + two consumer warpgroups
  static constexpr int PRODUCER_REGS = 40, CONSUMER_REGS = 232;
  static_assert(fits_launch_registers(THREADS, PRODUCER_REGS, CONSUMER_REGS));
  static constexpr int STAGES = 4;
  static constexpr int BLOCKS = 5;      // 128-byte column blocks of a 576-byte row
  static constexpr int TILE_BYTES = BLOCKS * NT * 128;   // 40 KiB
  static constexpr int Q_BYTES = BLOCKS * 2 * QB * 128;  // 20 KiB: one stacked Q block
  static constexpr int Q_BLOCKS = M / QB;                // one per consumer when split
  static constexpr int P_BYTES = M * 128;                // P^T, all M rows (N of O^T)
  static constexpr int NBB = SPLIT ? 4 : 8;              // 16-dim chunks of O^T per warp
  static constexpr int Q_THREADS_PER_ROW = 256 / M;      // Q loaders: both consumers
  static_assert(TILE_BYTES % 1024 == 0 && Q_BYTES % 1024 == 0 && P_BYTES % 1024 == 0);
};

// The kernel's shared memory (from a 1024-byte aligned base; the operands on swizzle atoms).
template <int M>
struct Fp8SwapShared {
  using C = Fp8SwapConfig<M>;
  alignas(1024) uint8_t kv[C::STAGES][C::TILE_BYTES];  // the ring
  alignas(1024) uint8_t q[C::Q_BLOCKS][C::Q_BYTES];    // block k: rows 16 k .. as Q_hi (0-15), Q_lo (16-31)
  alignas(1024) uint8_t p[2][2][C::P_BYTES];           // [consumer (M 16) or tile parity (M 32)][hi, lo]
  float o1[C::SPLIT ? 1 : 64 * 128];                   // M 16: the second consumer's O, for the merge
  float qscale[M];
  int len[M];
  float red[2][4 * C::QB];  // [consumer][warp x row of its S]: tile maxima
  float l[2][4 * C::QB];    // [consumer][warp x row of its S]
  float m1[C::QB];          // M 16: the second consumer's running max
  float alpha[2][M];        // M 32: [tile parity][row]: the rescale of O's rows
  uint64_t full[C::STAGES], empty[C::STAGES];
};
template <int M>
inline constexpr int kFp8SwapSmemBytes = int(sizeof(Fp8SwapShared<M>)) + 1024;  // + slack to align the base
static_assert(kFp8SwapSmemBytes<16> <= kSmemPerCta && kFp8SwapSmemBytes<32> <= kSmemPerCta,
              "fp8 swap tiles do not fit in shared memory");

// x = hi + lo in e4m3 for two values (low byte first), as above.
__device__ __forceinline__ void split_e4m3x2(float a, float b, uint16_t& hi, uint16_t& lo) {
  hi = __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(hi, __NV_E4M3);
  const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h));
  lo = __nv_cvt_float2_to_fp8x2(make_float2(a - f.x, b - f.y), __NV_SATFINITE, __NV_E4M3);
}

template <bool E5M2, int M>
__global__ void __launch_bounds__(384, 1) attention_fp8_swap_kernel(const __grid_constant__ AttentionParams p) {
  using C = Fp8SwapConfig<M>;
  constexpr int NT = C::NT, STAGES = C::STAGES, QB = C::QB, NBB = C::NBB;
  const float kNegInf = neg_inf();

  extern __shared__ __align__(1024) uint8_t smem_raw[];
  Fp8SwapShared<M>& sh = aligned_shared<Fp8SwapShared<M>>(smem_raw);
  const uint32_t sKV_a = smem_addr(sh.kv[0]);
  const uint32_t full_a = smem_addr(sh.full), empty_a = smem_addr(sh.empty);  // + 8 s

  const int tid = threadIdx.x, role = tid >> 7, t = tid & 127;
  const int w = t >> 5, lane = tid & 31, g = lane >> 2, c = lane & 3;
  if (tid == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full_a + 8 * s, 128);   // one cp.async arrival per producer thread
      mbar_init(empty_a + 8 * s, C::SPLIT ? 256 : 128);  // one arrival per consumer thread of the tile
    }
  }
  __syncthreads();

  cta_start(p, tid);
  const PlanScalars ps = plan_scalars<M>(p);

  // Tiles are numbered across the CTA's units (gt): tile gt sits in stage gt % STAGES, its
  // n-th use (n = gt / STAGES) completes phase n of full[stage] and of empty[stage].
  uint32_t gbase = 0;

  // ================= producer role ==============================================================
  // Eight threads per token row (chunks lc + 8 m: one 128-byte row of each column block),
  // tokens lt + 16 j; a warp's copy reads 4 tokens x 128 contiguous bytes.
  auto producer_role = [&] {
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
  setmaxnreg_inc<C::CONSUMER_REGS>();
  // Consumer index. M 16: tiles cw, cw + 2, ... of each unit, all rows and dims; M 32: every
  // tile, S for rows 16 cw .. 16 cw + 15, O^T for dims 256 cw .. 256 cw + 255.
  const int cw = role - 1;
  float* sQscale = sh.qscale;
  int* sLen = sh.len;
  float* sRed = sh.red[cw];
  float* sL = &sh.l[0][0];  // consumer k's warp w, row r of its S at (4 k + w) QB + r
  float* sM1 = sh.m1;
  float* sO1 = sh.o1;
  // Named barriers (immediate ids): 1, 2 this consumer's warpgroup; 3 both consumers.
  auto wg_sync = [&] {
    if (cw == 0) asm volatile("bar.sync 1, 128;\n" ::: "memory");
    else asm volatile("bar.sync 2, 128;\n" ::: "memory");
  };
  auto consumers_sync = [] { asm volatile("bar.sync 3, 256;\n" ::: "memory"); };

  const float kv_scale = kv_scale_of(p);
  const float sl2 = p.softmax_scale * kv_scale * kLog2e;
  const float out_scale = kv_scale * (1.0f / 256.0f);  // v = stored * kv_scale; P entered as 256 P
  // This thread's rows of S^T (the accumulator columns), among the CTA's: row(j, u) = r0 + 8 j +
  // 2 c + u (j < 2), r0 = 16 cw when split; O^T's columns are rows 8 j + 2 c + u (j < M / 8).
  const int r0 = C::SPLIT ? QB * cw : 0;
  auto lrow = [&](int j, int u) { return 8 * j + 2 * c + u; };  // among the consumer's 16
  auto row_of = [&](int j, int u) { return r0 + lrow(j, u); };
  const uint32_t sQc_a = smem_addr(sh.q[C::SPLIT ? cw : 0]);  // this consumer's stacked Q block
  // O^T's dims of this warp: chunk bb (16 dims) of 128-dim column block vcb, chunk vch0 + bb.
  const int vcb = C::SPLIT ? 2 * cw + (w >> 1) : w, vch0 = C::SPLIT ? 4 * (w & 1) : 0;
  const int dim0 = 128 * vcb + 16 * vch0 + 2 * g;  // dims dim0 + 16 bb + h

  for (UnitCursor cur = unit_cursor(); next_unit<M>(p, ps, cur);) {
    const UnitSpan us = unit_span<M, NT>(p, cur, ps);
    const int row0 = us.row0, nr = us.nr;
    const int tok_lo = us.tok_lo, tok_hi = us.tok_hi, ntiles = us.ntiles;

    // Q rows [row0, row0 + nr) as hi + lo e4m3, scaled per row: T = 256 / M consumer threads
    // per row (both consumers), chunk (8 values) q + T m. Row r goes to stacked block r / 16
    // (hi at its row r % 16, lo 16 rows further). Padding rows of the CTA are zero.
    auto load_q = [&] {
      constexpr int T = C::Q_THREADS_PER_ROW, CH = (kDim / 8 + T - 1) / T;
      const int ct = tid - 128, r = ct / T, q = ct % T;
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
        sLen[r] = r < nr ? us.lens[(row0 + r) / p.heads] : 0;
      }
      uint8_t* qblk = sh.q[r / QB];
      const int rr = r % QB;
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
        const int off = swz128(rr, byte >> 7, (byte >> 4) & 7, 2 * QB * 128) + (byte & 15);
        *reinterpret_cast<uint2*>(qblk + off) = make_uint2(hi[0], hi[1]);
        *reinterpret_cast<uint2*>(qblk + QB * 128 + off) = make_uint2(lo[0], lo[1]);
      }
    };
    load_q();
    fence_proxy_async();  // Q is read by wgmma (async proxy)
    consumers_sync();

    float sl2r[2][2];
    int lim[2][2];
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        sl2r[j][u] = sl2 * sQscale[row_of(j, u)];
        lim[j][u] = min(sLen[row_of(j, u)], tok_hi);
      }
    // O^T chunk bb: o[bb][4 j + 2 h + u] = O[8 j + 2 c + u][dim0 + 16 bb + h] (M 16: rows
    // row_of(j, u), j < 2; M 32: every row, j < 4).
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

    for (int i = C::SPLIT ? 0 : cw; i < ntiles; i += C::SPLIT ? 1 : 2) {
      const uint32_t gt = gbase + uint32_t(i), st = gt % STAGES;
      const uint32_t sK = sKV_a + st * C::TILE_BYTES;
      // No proxy fence after the wait: cp.async bytes completed through
      // cp.async.mbarrier.arrive go to wgmma straight after it (FlashAttention-3's paged path).
      mbar_wait(full_a + 8 * st, (gt / STAGES) & 1u);

      // 1. S^T = K Q^T, one accumulator chain per column block (4 k32 steps); columns
      //    8 j + .. of acc are Q_hi's rows for j < 2, Q_lo's for j >= 2.
      float acc[C::BLOCKS][16];  // written by each chain's first step (ACC = false)
      const SmemDesc dk(sK, 16, 1024), dq(sQc_a, 16, 1024);
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

      // 2. Scores in base 2, masked: x[j][h][u] for token 16 w + g + 8 h of the tile, row_of(j, u).
      const int tok0 = tok_lo + i * NT + 16 * w + g;
      float x[2][2][2], mx[2][2];
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int u = 0; u < 2; ++u) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            float sum = 0.0f;
#pragma unroll
            for (int cb = 0; cb < C::BLOCKS; ++cb) sum += acc[cb][4 * j + 2 * h + u] + acc[cb][8 + 4 * j + 2 * h + u];
            x[j][h][u] = tok0 + 8 * h < lim[j][u] ? sum * sl2r[j][u] : kNegInf;
          }
          float v = fmaxf(x[j][0][u], x[j][1][u]);
#pragma unroll
          for (int d = 4; d <= 16; d <<= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, d));
          mx[j][u] = v;
        }
      if (g == 0) {
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
          for (int u = 0; u < 2; ++u) sRed[w * QB + lrow(j, u)] = mx[j][u];
      }
      wg_sync();
      // P^T of this tile: the consumer's own (M 16), or the CTA's by tile parity (M 32).
      const int pb = C::SPLIT ? (i & 1) : cw;
      uint8_t* sPh = sh.p[pb][0];
      uint8_t* sPl = sh.p[pb][1];
      float alpha[2][2];
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          const int lr = lrow(j, u), r = row_of(j, u);
          const float tmax = fmaxf(fmaxf(sRed[lr], sRed[QB + lr]), fmaxf(sRed[2 * QB + lr], sRed[3 * QB + lr]));
          const SoftmaxStep st = softmax_step(m_run[j][u], tmax);
          const float mu = st.mu;
          alpha[j][u] = st.alpha;
          const float p0 = fast_exp2(x[j][0][u] - mu), p1 = fast_exp2(x[j][1][u] - mu);
          l_run[j][u] = l_run[j][u] * alpha[j][u] + (p0 + p1);
          m_run[j][u] = st.m;
          // 3. P^T[r][k]: token g + 8 h of this warp's 16 is k 16 w + 4 (g >> 1) + (g & 1) + 2 h.
          uint16_t ph, pl;
          split_e4m3x2(p0 * 256.0f, p1 * 256.0f, ph, pl);
          const int kk = 16 * w + 4 * (g >> 1) + (g & 1);
          const int off = swz128(r, 0, kk >> 4, C::P_BYTES) + (kk & 15);
          sPh[off] = uint8_t(ph);
          sPh[off + 2] = uint8_t(ph >> 8);
          sPl[off] = uint8_t(pl);
          sPl[off + 2] = uint8_t(pl >> 8);
        }
      if constexpr (C::SPLIT) {
        // O's rows of both consumers are rescaled by both: alpha through shared memory.
        if (w == 0 && g == 0)
#pragma unroll
          for (int j = 0; j < 2; ++j)
#pragma unroll
            for (int u = 0; u < 2; ++u) sh.alpha[i & 1][row_of(j, u)] = alpha[j][u];
        fence_proxy_async();
        consumers_sync();  // P^T and alpha of all rows complete; every warp is past its reads of sRed
      } else {
        fence_proxy_async();
        wg_sync();  // P^T complete; every warp is past its reads of sRed
      }

      // 4. O_tile = V^T P^T, one k32 step at a time (the second step's fragments reuse the
      //    first's registers). Lane l addresses row l & 7 of matrix l >> 3 = (half, 8-token
      //    group) of the step; block b's chunk of those tokens sits at chunk b ^ (token & 7).
      float ot[NBB][M / 2];  // written by the first step (ACC = false)
      const int mi = lane >> 3, mr = lane & 7;
      const uint32_t vrow = sK + vcb * (NT * 128) + (16 * (mi >> 1) + 8 * (mi & 1) + mr) * 128;
      const uint32_t sPh_a = smem_addr(sPh), sPl_a = smem_addr(sPl);
#pragma unroll
      for (int s = 0; s < 2; ++s) {
        uint32_t va[NBB][4];
#pragma unroll
        for (int bb = 0; bb < NBB; ++bb) {
          // t[2 hf + t8]: tokens 32 s + 16 hf + 8 t8 + 2 c, + 1, dims 2 g, 2 g + 1 of chunk vch0 + bb.
          uint32_t t[4];
          ldmatrix_x4_trans(vrow + s * (32 * 128) + (((vch0 + bb) ^ mr) << 4), t);
#pragma unroll
          for (int hf = 0; hf < 2; ++hf) {
            va[bb][2 * hf] = __byte_perm(t[2 * hf], t[2 * hf + 1], 0x6420);      // dim 2 g
            va[bb][2 * hf + 1] = __byte_perm(t[2 * hf], t[2 * hf + 1], 0x7531);  // dim 2 g + 1
          }
        }
        // The stage's last reads (S's wgmma has completed): hand it back to the producer.
        if (s == 1) mbar_arrive(empty_a + 8 * st);
        const SmemDesc dph(sPh_a, 16, 1024), dpl(sPl_a, 16, 1024);
        wgmma_fence();
#pragma unroll
        for (int bb = 0; bb < NBB; ++bb) {
          if (s == 0) wgmma_m64k32_fp8_rs<M, E5M2, false>(ot[bb], va[bb], dph.at());
          else wgmma_m64k32_fp8_rs<M, E5M2, true>(ot[bb], va[bb], dph.at(32));
          wgmma_m64k32_fp8_rs<M, E5M2, true>(ot[bb], va[bb], dpl.at(32 * s));
        }
        wgmma_commit();
        wgmma_wait<0>();
      }
      // O = O alpha + O_tile; alpha of O's rows: this consumer's (M 16) or both's (M 32).
      float al[M / 8][2];
#pragma unroll
      for (int j = 0; j < M / 8; ++j)
#pragma unroll
        for (int u = 0; u < 2; ++u) al[j][u] = C::SPLIT ? sh.alpha[i & 1][8 * j + 2 * c + u] : alpha[j & 1][u];
#pragma unroll
      for (int bb = 0; bb < NBB; ++bb) {
        fence_regs(ot[bb]);
#pragma unroll
        for (int j = 0; j < M / 8; ++j)
#pragma unroll
          for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int u = 0; u < 2; ++u) {
              float& v = o[bb][4 * j + 2 * h + u];
              v = fmaf(v, al[j][u], ot[bb][4 * j + 2 * h + u]);
            }
      }
      // No barrier here: the next tile rewrites sRed after every warp has passed the P^T
      // barrier above (its reads of sRed are before it). M 16: the next tile rewrites sP after
      // its S, whose warpgroup-wide wgmma every warp issues only after its wait for this P V.
      // M 32: sP and alpha alternate by tile parity; tile i + 2's are written after tile i + 1's
      // barrier, which each consumer reaches only after this P V and these reads of alpha.
    }
    gbase += uint32_t(ntiles);
    // Both consumers pass the same number of barriers per unit (two per tile): with an odd
    // tile count the second one passes its pair here. Nothing needs it for ordering (the
    // consumer barriers below order the units), but compute-sanitizer's racecheck otherwise
    // reports the next unit's sQscale and sLen as racing (bench/NOTES.md).
    if (!C::SPLIT && cw == 1 && (ntiles & 1)) {
      wg_sync();
      wg_sync();
    }

    // ---- normalise and write: M 16 merges the two consumers' states first -------------------
    // l of this consumer's rows over its warpgroup: lanes of one c share the rows; then the
    // four warps, read back from sL.
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        float v = l_run[j][u];
#pragma unroll
        for (int d = 4; d <= 16; d <<= 1) v += __shfl_xor_sync(0xffffffffu, v, d);
        if (g == 0) sL[(cw * 4 + w) * QB + lrow(j, u)] = v;
      }
    auto merge_and_store = [&] {
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
            const int r = row_of(j, u);
            const float m0 = m_run[j][u], m1 = sM1[r];
            const SoftmaxStep st = softmax_step(m0, m1);  // the merged state's maximum and both factors
            const float mn = st.m, f0 = st.alpha, f1 = fast_exp2(m1 - st.mu);
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
    };
    // M 32: each consumer writes its dims of every row; a row's l is its owner's (the consumer
    // whose S covered it: 8 j + 2 c + u with j >> 1 = owner), as are its statistics.
    auto store_split = [&] {
      consumers_sync();
#pragma unroll
      for (int j = 0; j < M / 8; ++j)
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          const int r = 8 * j + 2 * c + u, own = j >> 1, lr = r % QB;
          float l = 0.0f;
#pragma unroll
          for (int q = 0; q < 4; ++q) l += sL[(own * 4 + q) * QB + lr];
          if (r < nr) {
            store_row_slice<NBB, 16>(p, us, r, dim0, l, out_scale,
                                     [&](int bb) { return make_float2(o[bb][4 * j + u], o[bb][4 * j + 2 + u]); });
            if (own == cw && w == 0 && g == 0) store_row_stats(p, us, r, m_run[j & 1][u], l);
          }
        }
    };
    if constexpr (C::SPLIT) store_split();
    else merge_and_store();
    consumers_sync();  // sQ, sO1, sL, sM1 are reused by the next unit
  }
  if (tid == 128) trace_cta(p, true);  // the first consumer thread, after its last unit
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
