// Attention over a plan on sm_90a, 64 query rows per CTA, bf16 caches, with the softmax
// overlapped with the tensor cores: the "seesaw" schedule of FlashMLA's deep dive, on our
// plan and paged layout. Same contract as kernel.cuh (the mma.sync reference variant, which
// the tests run beside it): each CTA of a fixed grid runs its chunk of the schedule for one
// row group; rows with no local key give out = 0, lse = -inf; pieces of cut requests write
// (o / l, m, l) partials.
//
// Two warpgroups, one CTA per SM. Tiles of 64 tokens go in pairs: A (even, stage 0) and B
// (odd, stage 1). WG0 owns O[:, 0:256] and computes S of every A tile, WG1 owns O[:, 256:512]
// and computes S of every B tile; the running max m lives in shared memory and passes from
// A's softmax to B's. Per pair (S_A and S_B are already in registers):
//   WG0: softmax(A) -> O_L += P_A V_A,L (P from registers) | WG1: waits, then softmax(B)
//        against A's max, O_R += P_B V_B,R
//   WG0: P_A rescaled to B's max -> A's rope block (free once S_A is done), for WG1
//   WG1: O_R += P_A V_A,R (P from shared memory); P_B went to B's rope block, for WG0
//   WG0: O_L += P_B V_B,L; then S of the next A; WG1: S of the next B
// so one warpgroup's softmax always has the other's matrix work beside it.
//
// Loads: TMA (cp.async.bulk.tensor, 128-byte swizzle) per (tile, 64-dim column block), one
// mbarrier per column block of each stage, so S starts on a tile's first block while the
// rest still lands. Each block is refilled by the warpgroup that reads it last, right after
// that read completes, and S visits the blocks in the order their refills were issued:
//   A: blocks 0-3 refilled by WG0 after O_L += P_A V_A,L; 4-8 by WG1 after O_R += P_A V_A,R.
//   B: blocks 4-7 refilled by WG1 after O_R += P_B V_B,R; 0-3 and 8 by WG0 after O_L += P_B V_B,L.
// A tile's tokens are runs of whole sub-pages: one box of 64 rows (sub-pages >= 64 tokens) or
// eight of 8 rows (8..32), each box starting on a 1024-byte swizzle atom; smaller sub-pages
// take the wgmma kernel (variants.cpp). Rows of a last, partial tile are zeroed in the value
// blocks after S (they may hold another request's tokens or NaN), so that P = 0 meets V = 0.
//
// Shared memory (SeesawShared, from a 1024-byte aligned base): Q (64, 576) and two KV stages
// (64, 576), each a stack of nine (64, 64) bf16 column blocks of 128-byte rows, 16-byte chunk c
// of row r at chunk c ^ (r & 7); per-row m, the two rescale factors, l per warpgroup and local
// lengths; 18 mbarriers.
#include <cuda.h>
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled

#include <cstdint>

#include "attention/variants.h"
#include "common/params.h"
#include "common/utils.cuh"
#include "config.h"
#include "unit.cuh"
#include "wgmma.cuh"

namespace dcpmla::cuda_detail {

struct SeesawConfig {
  static constexpr int M = 64;                          // query rows per CTA
  static constexpr int NT = 64;                         // KV tokens per tile
  static constexpr int THREADS = 256;                   // two warpgroups
  static constexpr int BLOCKS = kDim / 64;              // 9 column blocks; 0-7 the value, 8 the rope
  static constexpr int BLOCK_BYTES = NT * 128;          // (64 tokens, 64 dims) bf16
  static constexpr int TILE_BYTES = BLOCKS * BLOCK_BYTES;
};

struct SeesawShared {
  alignas(1024) uint8_t q[SeesawConfig::TILE_BYTES];  // (64 rows, 576) bf16, same layout as a tile
  alignas(1024) uint8_t kv[2][SeesawConfig::TILE_BYTES];
  float m[SeesawConfig::M];                           // running max (base 2), shared by both warpgroups
  float scale_a[SeesawConfig::M], scale_b[SeesawConfig::M];  // A's, then B's rescale of the old max
  float l[2][SeesawConfig::M];                        // each warpgroup's row sums, for the epilogue
  int len[SeesawConfig::M];                           // rows' local lengths
  uint64_t bar[2][SeesawConfig::BLOCKS];              // "block b of stage s has landed"
};
inline constexpr int kSeesawSmemBytes = int(sizeof(SeesawShared)) + 1024;  // + slack to align the base
static_assert(kSeesawSmemBytes <= kSmemPerCta, "seesaw tiles do not fit in shared memory");

// Named barriers; each is passed once per pair by one warpgroup (bar.arrive) and the other
// (bar.sync), 256 threads.
enum SeesawBarrier : int {
  kScaleAReady = 1,  // WG0 -> WG1: m and A's rescale factors are written
  kScaleBReady = 2,  // WG1 -> WG0: m and B's rescale factors are written
  kPaReady = 3,      // WG0 -> WG1: P_A is in A's rope block
  kPbReady = 4,      // WG1 -> WG0: P_B is in B's rope block
  kWarpgroup0 = 5,   // 5 + warpgroup, within one warpgroup (128 threads): its zeroed rows are written
};

// The TMA descriptors of the cache (rows of 576 bf16): boxes of 64 and of 8 rows x 64 dims.
struct SeesawMaps {
  CUtensorMap rows64, rows8;
};

namespace {

// Online-softmax step of one tile for this thread's rows r0, r1 (accumulator layout, see
// wgmma.cuh): masks S at each row's limit, m_new = max(m_old, row max * sl2), turns S into P
// in place (base 2) and returns scale = 2^(m_old - m_new) and this thread's part of the row sums.
struct SoftmaxStep {
  float m_new[2], scale[2], sum[2];
};
__device__ __forceinline__ SoftmaxStep softmax_tile(float (&sc)[32], int tok0, const int (&lim)[2], float sl2,
                                                    const float (&m_old)[2], int c) {
  const float kNegInf = neg_inf();
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      if (tok0 + 8 * j + 2 * c + (e & 1) >= lim[e >> 1]) sc[4 * j + e] = kNegInf;
  SoftmaxStep st;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float mx = kNegInf;
#pragma unroll
    for (int j = 0; j < 8; ++j) mx = fmaxf(mx, fmaxf(sc[4 * j + 2 * h], sc[4 * j + 2 * h + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    st.m_new[h] = fmaxf(m_old[h], mx * sl2);  // sl2 > 0
    // A row with no key yet keeps m = -inf; exponents then use 0 so that nothing is NaN.
    const float mu = st.m_new[h] == kNegInf ? 0.0f : st.m_new[h];
    st.scale[h] = fast_exp2(m_old[h] - mu);
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float& x = sc[4 * j + 2 * h + e];
        x = fast_exp2(fmaf(x, sl2, -mu));
        sum += x;
      }
    st.sum[h] = sum;
  }
  return st;
}

// P (f32, accumulator layout) times per-row factors f, as the bf16 A fragments of P V: k16
// step kk = tokens [16 kk, 16 kk + 16).
__device__ __forceinline__ void pack_p(const float (&sc)[32], const float (&f)[2], uint32_t (&pa)[4][4]) {
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    pa[j >> 1][(j & 1) * 2] = pack_bf16x2(sc[4 * j] * f[0], sc[4 * j + 1] * f[0]);
    pa[j >> 1][(j & 1) * 2 + 1] = pack_bf16x2(sc[4 * j + 2] * f[1], sc[4 * j + 3] * f[1]);
  }
}

// The fragments as a K-major swizzled (64, 64) bf16 block at sP (the A operand of an _ss P V).
__device__ __forceinline__ void store_p(uint8_t* sP, const uint32_t (&pa)[4][4], int r0, int g, int c) {
  const int r1 = r0 + 8;
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    *reinterpret_cast<uint32_t*>(sP + r0 * 128 + (((2 * kk) ^ g) << 4) + 4 * c) = pa[kk][0];
    *reinterpret_cast<uint32_t*>(sP + r1 * 128 + (((2 * kk) ^ g) << 4) + 4 * c) = pa[kk][1];
    *reinterpret_cast<uint32_t*>(sP + r0 * 128 + (((2 * kk + 1) ^ g) << 4) + 4 * c) = pa[kk][2];
    *reinterpret_cast<uint32_t*>(sP + r1 * 128 + (((2 * kk + 1) ^ g) << 4) + 4 * c) = pa[kk][3];
  }
}

// O's rows r0, r1 times f; once the running maxima settle f is exactly 1 (skipped).
__device__ __forceinline__ void rescale_o(float (&o)[128], const float (&f)[2]) {
  if (__any_sync(0xffffffffu, f[0] != 1.0f || f[1] != 1.0f)) {
#pragma unroll
    for (int k = 0; k < 128; k += 4) {
      o[k] *= f[0];
      o[k + 1] *= f[0];
      o[k + 2] *= f[1];
      o[k + 3] *= f[1];
    }
  }
}

// S (64, 64) = Q K^T over column blocks FIRST, FIRST + 1, ... (mod 9), COUNT of them, each
// once its mbarrier (bars + 8 b) has completed the phase of `parity`; zero: the first step
// overwrites S. One commit group per block, each opened by its own wgmma.fence after the wait
// (without it ptxas serialises every wgmma of the kernel behind the spin loop).
template <int FIRST, int COUNT>
__device__ __forceinline__ void s_blocks(float (&sc)[32], uint32_t sQ, uint32_t sK, uint32_t bars, uint32_t parity,
                                         bool zero) {
#pragma unroll
  for (int n = 0; n < COUNT; ++n) {
    const int kb = (FIRST + n) % SeesawConfig::BLOCKS;
    mbar_wait(bars + 8 * kb, parity);
    wgmma_fence();
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint32_t off = uint32_t(kb * SeesawConfig::BLOCK_BYTES + j * 32);
      wgmma_m64n64k16_ss<0>(sc, smem_desc_sw128(sQ + off, 16, 1024), smem_desc_sw128(sK + off, 16, 1024),
                            zero && n == 0 && j == 0 ? 0 : 1);
    }
    wgmma_commit();
  }
}

// O (64, 256) += P V over the 256 value dims from `v` (four column blocks of a tile, read
// MN-major: LBO = a block, SBO = 8 tokens, k16 step = 16 tokens), P from registers. One group.
__device__ __forceinline__ void pv_regs(float (&o)[128], const uint32_t (&pa)[4][4], uint32_t v) {
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < 4; ++kk)
    wgmma_m64n256k16_rs<1>(o, pa[kk], smem_desc_sw128(v + kk * 2048, SeesawConfig::BLOCK_BYTES, 1024), 1);
  wgmma_commit();
}
// The same with P from the K-major block at sP.
__device__ __forceinline__ void pv_smem(float (&o)[128], uint32_t sP, uint32_t v) {
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < 4; ++kk)
    wgmma_m64n256k16_ss<1>(o, smem_desc_sw128(sP + kk * 32, 16, 1024),
                           smem_desc_sw128(v + kk * 2048, SeesawConfig::BLOCK_BYTES, 1024), 1);
  wgmma_commit();
}

}  // namespace

__global__ void __launch_bounds__(256, 1)
    attention_seesaw_kernel(const __grid_constant__ AttentionParams p, const __grid_constant__ SeesawMaps maps) {
  using C = SeesawConfig;
  constexpr int M = C::M, NT = C::NT;
  const float kNegInf = neg_inf();

  extern __shared__ __align__(1024) uint8_t smem_raw[];
  SeesawShared& sh =
      *reinterpret_cast<SeesawShared*>(smem_raw + ((1024u - (smem_addr(smem_raw) & 1023u)) & 1023u));
  const uint32_t sQ = smem_addr(sh.q), sKV = smem_addr(sh.kv[0]), bar0 = smem_addr(&sh.bar[0][0]);

  const int tid = threadIdx.x, wg = tid >> 7, t = tid & 127, lane = tid & 31;
  const int g = lane >> 2, c = lane & 3;
  const int r0 = (t >> 5) * 16 + g, r1 = r0 + 8;  // this thread's accumulator rows
  const bool issuer = (t >> 5) == 0;              // warp 0 of each warpgroup issues its loads

  if (tid == 0) {
    for (int i = 0; i < 2 * C::BLOCKS; ++i) mbar_init(bar0 + 8 * i, 1);  // one expect_tx arrival per load
    fence_barrier_init();
  }
  __syncthreads();

  const PlanScalars ps = plan_scalars<M>(p);
  const float sl2 = p.softmax_scale * kLog2e;
  // Boxes: a whole tile of one sub-page, or eight runs of 8 tokens (each inside a sub-page).
  static_assert(kSeesawMinPage == 8, "boxes of 8 rows");
  const int box = ps.page >= NT ? NT : kSeesawMinPage, runs = NT / box;
  const CUtensorMap* map = ps.page >= NT ? &maps.rows64 : &maps.rows8;
  uint32_t loads0 = 0, loads1 = 0;  // tiles loaded into stage 0 / 1 before this unit (mbarrier phases)

  float o[128];  // (64, 256): this warpgroup's half of O
  float sc[32];  // S, then P, of this warpgroup's tile

  for (UnitCursor cur = unit_cursor(); next_unit<M>(p, ps, cur);) {
    const UnitSpan u = unit_span<M, NT>(p, cur, ps);
    const int ntiles = u.ntiles;
    auto stage_of = [&](int i) { return sKV + uint32_t(i & 1) * C::TILE_BYTES; };
    auto bars_of = [&](int i) { return bar0 + uint32_t(i & 1) * (8 * C::BLOCKS); };
    auto parity_of = [&](int i) { return ((i & 1 ? loads1 : loads0) + uint32_t(i >> 1)) & 1u; };

    // Issuer lanes 8 k + r hold run r of tile `first + k` (k = 0, 1): its cache row and
    // whether it holds tokens of the piece. Looked up a pair ahead of its use.
    int run_row = 0;
    bool run_ok = false;
    auto locate = [&](int first) {
      const int ti = first + (lane >> 3), r = lane & 7;
      const int tok = u.tok_lo + ti * NT + r * box;
      run_ok = lane < 16 && r < runs && ti < ntiles && tok < u.tok_hi;
      run_row = run_ok ? u.subpages[tok >> ps.page_shift] * ps.page + (tok & (ps.page - 1)) : 0;
    };
    // Warp-collective (an issuer warp): column blocks [b0, b0 + nb) of the tile lanes 8 k ..
    // 8 k + 7 located, into stage s. Lane 8 k posts the bytes before any box can land.
    auto issue = [&](int k, int s, int b0, int nb) {
      const unsigned mine = (__ballot_sync(0xffffffffu, run_ok) >> (8 * k)) & 0xffu;
      const uint32_t bytes = uint32_t(__popc(mine) * box * 128);
      const uint32_t bars = bar0 + uint32_t(s) * (8 * C::BLOCKS), dst = sKV + uint32_t(s) * C::TILE_BYTES;
      if (lane == 8 * k)
        for (int b = b0; b < b0 + nb; ++b) mbar_arrive_expect_tx(bars + 8 * b, bytes);
      __syncwarp();
      if ((lane >> 3) == k && run_ok)
        for (int b = b0; b < b0 + nb; ++b)
          tma_load_2d(dst + b * C::BLOCK_BYTES + (lane & 7) * box * 128, map, 64 * b, run_row, bars + 8 * b);
    };
    // After S of tile i (by its owner warpgroup): the value rows past the piece are zeroed.
    auto zero_tail = [&](int i) {
      const int valid = u.tok_hi - (u.tok_lo + i * NT);
      if (valid >= NT) return;
      uint8_t* st = sh.kv[i & 1];
      const int rows = NT - valid;
      for (int idx = t; idx < 8 * rows * 8; idx += 128) {
        const int b = idx / (rows * 8), rem = idx % (rows * 8);
        *reinterpret_cast<uint4*>(st + b * C::BLOCK_BYTES + (valid + rem / 8) * 128 + (rem % 8) * 16) =
            make_uint4(0u, 0u, 0u, 0u);
      }
      fence_proxy_async();  // read by wgmma
      named_sync(kWarpgroup0 + wg, 128);
    };

    if (wg == 0 && issuer) {
      locate(0);
      if (ntiles > 0) issue(0, 0, 0, C::BLOCKS);
      if (ntiles > 1) issue(1, 1, 0, C::BLOCKS);
    }
    // Q rows [row0, row0 + nr) of request b; padding rows of the CTA are zero.
    const bf16* qb = p.q + u.q_row * kDim;
    for (int idx = tid; idx < M * (kDim / 8); idx += C::THREADS) {
      const int r = idx / (kDim / 8), ch = idx % (kDim / 8);
      const bool ok = r < u.nr;
      cp_async_16(sQ + uint32_t((ch >> 3) * C::BLOCK_BYTES + r * 128 + (((ch & 7) ^ (r & 7)) << 4)),
                  ok ? static_cast<const void*>(qb + int64_t(r) * kDim + ch * 8) : p.q, ok ? 16 : 0);
    }
    if (tid < M) {
      sh.len[tid] = tid < u.nr ? u.lens[(u.row0 + tid) / p.heads] : 0;
      sh.m[tid] = kNegInf;
    }
    cp_async_wait_all();
    fence_proxy_async();
    __syncthreads();  // Q, lengths and m visible to both warpgroups

#pragma unroll
    for (int k = 0; k < 128; ++k) o[k] = 0.0f;
    float l[2] = {0.0f, 0.0f};
    const int lim[2] = {min(sh.len[r0], u.tok_hi), min(sh.len[r1], u.tok_hi)};

    // Prologue: WG0 S of tile 0, WG1 S of tile 1.
    if (wg < ntiles) {
      s_blocks<0, C::BLOCKS>(sc, sQ, stage_of(wg), bars_of(wg), parity_of(wg), true);
      wgmma_wait<0>();
      fence_regs(sc);
      zero_tail(wg);
    }
    if (issuer) locate(2);

    // One pair: tiles a and b = a + 1 (if has_b), then S of a + 2 and b + 2 (if they exist).
    // Compile-time cases, so that no wgmma is issued or waited for on a data-dependent branch
    // (ptxas would serialise every wgmma of the kernel).
    auto pair = [&]<bool has_b, bool has_a2, bool has_b2>(int a) {
      const int b = a + 1;
      const uint32_t sA = stage_of(a), sB = stage_of(b);
      const uint32_t pA = sA + 8 * C::BLOCK_BYTES, pB = sB + 8 * C::BLOCK_BYTES;  // rope blocks: P
      if (wg == 0) {
        // ---- WG0: softmax(A), O_L += P_A V_A,L, P_A for WG1, O_L += P_B V_B,L, next S_A ----
        const float m_old[2] = {sh.m[r0], sh.m[r1]};
        const SoftmaxStep st = softmax_tile(sc, u.tok_lo + a * NT, lim, sl2, m_old, c);
        __syncwarp();  // the quad has read m
        if (c == 0) {
          sh.m[r0] = st.m_new[0];
          sh.m[r1] = st.m_new[1];
          sh.scale_a[r0] = st.scale[0];
          sh.scale_a[r1] = st.scale[1];
        }
        named_arrive(kScaleAReady, 256);
        rescale_o(o, st.scale);
        l[0] = l[0] * st.scale[0] + st.sum[0];
        l[1] = l[1] * st.scale[1] + st.sum[1];
        uint32_t pa[4][4];
        pack_p(sc, {1.0f, 1.0f}, pa);
        pv_regs(o, pa, sA);

        named_sync(kScaleBReady, 256);
        const float sb[2] = {sh.scale_b[r0], sh.scale_b[r1]};
        wgmma_wait<0>();
        fence_regs(o);
        if (issuer && has_a2) issue(0, 0, 0, 4);
        // P_A at B's max, for WG1's half.
        pack_p(sc, sb, pa);
        store_p(sh.kv[a & 1] + 8 * C::BLOCK_BYTES, pa, r0, g, c);
        fence_proxy_async();
        named_arrive(kPaReady, 256);

        named_sync(kPbReady, 256);
        rescale_o(o, sb);
        l[0] *= sb[0];
        l[1] *= sb[1];
        if constexpr (has_b) {
          for (int kb = 0; kb < 4; ++kb) mbar_wait(bars_of(b) + 8 * kb, parity_of(b));
          pv_smem(o, pB, sB);
        }
        // O_L += P_B V_B,L has finished reading B's blocks 0-3 and P_B (S's four groups may run on).
        if constexpr (has_a2) {
          s_blocks<0, 4>(sc, sQ, sA, bars_of(a), parity_of(a + 2), true);
          wgmma_wait<4>();
        } else {
          wgmma_wait<0>();
        }
        fence_regs(o);
        if (issuer && has_b2) {
          issue(1, 1, 0, 4);
          issue(1, 1, 8, 1);
        }
        if constexpr (has_a2) s_blocks<4, 5>(sc, sQ, sA, bars_of(a), parity_of(a + 2), false);
        wgmma_wait<0>();
        fence_regs(sc);
        fence_regs(o);
        if constexpr (has_a2) zero_tail(a + 2);
      } else {
        // ---- WG1: softmax(B) after A's, O_R += P_B V_B,R, O_R += P_A V_A,R, next S_B ----
        named_sync(kScaleAReady, 256);
        const float m_a[2] = {sh.m[r0], sh.m[r1]};
        const float sa[2] = {sh.scale_a[r0], sh.scale_a[r1]};
        // Without a tile B every score is masked: m stays A's and the factor is 1.
        const int lim_b[2] = {has_b ? lim[0] : 0, has_b ? lim[1] : 0};
        const SoftmaxStep st = softmax_tile(sc, u.tok_lo + b * NT, lim_b, sl2, m_a, c);
        __syncwarp();
        if (c == 0) {
          sh.m[r0] = st.m_new[0];
          sh.m[r1] = st.m_new[1];
          sh.scale_b[r0] = st.scale[0];
          sh.scale_b[r1] = st.scale[1];
        }
        named_arrive(kScaleBReady, 256);
        const float f[2] = {sa[0] * st.scale[0], sa[1] * st.scale[1]};
        rescale_o(o, f);
        l[0] = l[0] * f[0] + st.sum[0];
        l[1] = l[1] * f[1] + st.sum[1];
        uint32_t pb[4][4];
        if constexpr (has_b) {
          pack_p(sc, {1.0f, 1.0f}, pb);
          store_p(sh.kv[b & 1] + 8 * C::BLOCK_BYTES, pb, r0, g, c);
          pv_regs(o, pb, sB + 4 * C::BLOCK_BYTES);
        }
        fence_proxy_async();  // P_B, read by WG0's wgmma
        named_sync(kPaReady, 256);
        for (int kb = 4; kb < 8; ++kb) mbar_wait(bars_of(a) + 8 * kb, parity_of(a));
        pv_smem(o, pA, sA + 4 * C::BLOCK_BYTES);
        named_arrive(kPbReady, 256);
        wgmma_wait<1>();  // O_R += P_B V_B,R has finished reading B's blocks 4-7
        fence_regs(o);
        if (issuer && has_b2) issue(1, 1, 4, 4);
        wgmma_wait<0>();  // O_R += P_A V_A,R has finished reading A's blocks 4-7 and P_A
        fence_regs(o);
        if (issuer && has_a2) issue(0, 0, 4, 5);
        if constexpr (has_b2) {
          s_blocks<4, C::BLOCKS>(sc, sQ, sB, bars_of(b), parity_of(b + 2), true);
          wgmma_wait<0>();
          fence_regs(sc);
          zero_tail(b + 2);
        }
      }
      if (issuer) locate(a + 4);
    };
    for (int a = 0; a < ntiles; a += 2) {
      if (a + 3 < ntiles) pair.template operator()<true, true, true>(a);
      else if (a + 2 < ntiles) pair.template operator()<true, true, false>(a);
      else if (a + 1 < ntiles) pair.template operator()<true, false, false>(a);
      else pair.template operator()<false, false, false>(a);
    }
    loads0 += uint32_t(ntiles + 1) / 2;
    loads1 += uint32_t(ntiles) / 2;

    // ---- epilogue: l over the quad and both warpgroups, normalise, write this half --------
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
      l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
    }
    if (c == 0) {
      sh.l[wg][r0] = l[0];
      sh.l[wg][r1] = l[1];
    }
    __syncthreads();
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = h ? r1 : r0;
      if (r < u.nr)
        store_row_slice<32>(p, u, r, wg * 256 + 2 * c, sh.l[0][r] + sh.l[1][r], 1.0f,
                            [&](int j) { return make_float2(o[4 * j + 2 * h], o[4 * j + 2 * h + 1]); });
    }
    if (tid < u.nr) store_row_stats(p, u, tid, sh.m[tid], sh.l[0][tid] + sh.l[1][tid]);
    __syncthreads();  // shared memory is reused by the next unit
  }
}

int attention_seesaw_smem_bytes() { return kSeesawSmemBytes; }

// The cache's tensor maps: rows of D bf16 (1152 bytes apart) from p.kv. The row count only
// bounds the boxes (each inside a sub-page the plan names), so it is left far above any cache.
// Encoded on the host (no device call); kept per thread for the last cache address.
namespace {
SeesawMaps seesaw_maps(const void* kv) {
  using Encode = PFN_cuTensorMapEncodeTiled_v12000;
  static const Encode encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    check(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found),
          "cudaGetDriverEntryPointByVersion(cuTensorMapEncodeTiled)");
    if (found != cudaDriverEntryPointSuccess || fn == nullptr)
      check(cudaErrorSymbolNotFound, "cuTensorMapEncodeTiled (driver entry point)");
    return reinterpret_cast<Encode>(fn);
  }();
  thread_local const void* last = nullptr;
  thread_local SeesawMaps maps;
  if (kv == last) return maps;
  const cuuint64_t dims[2] = {cuuint64_t(kDim), cuuint64_t(1) << 30};
  const cuuint64_t strides[1] = {cuuint64_t(kDim) * 2};
  const cuuint32_t ones[2] = {1, 1};
  for (const int rows : {SeesawConfig::NT, 8}) {
    const cuuint32_t box[2] = {64, cuuint32_t(rows)};
    const CUresult r = encode(rows == SeesawConfig::NT ? &maps.rows64 : &maps.rows8, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2,
                              const_cast<void*>(kv), dims, strides, box, ones, CU_TENSOR_MAP_INTERLEAVE_NONE,
                              CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                              CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) {
      last = nullptr;
      check(cudaErrorInvalidValue, "cuTensorMapEncodeTiled (kv: a 16-byte aligned device address)");
    }
  }
  last = kv;
  return maps;
}
}  // namespace

void launch_attention_seesaw(const AttentionParams& p, int grid, cudaStream_t stream) {
  const SeesawMaps maps = grid > 0 ? seesaw_maps(p.kv) : SeesawMaps{};
  launch_attention_kernel<attention_seesaw_kernel>(p, grid, SeesawConfig::THREADS, kSeesawSmemBytes, stream,
                                                   "attention_seesaw_kernel", maps);
}

}  // namespace dcpmla::cuda_detail
