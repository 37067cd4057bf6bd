// Attention over a plan on sm_90a: each CTA of a fixed grid runs its chunk of the plan's
// schedule for one row group (unit.cuh), reading the schedule and its scalars from the device
// plan, never from launch arguments, so a captured graph replays after any re-plan.
//
// Per piece (request b, local tokens [tok_begin, tok_end)) and row group (M rows of the
// request's flattened qlen x heads block), with the scalar loop it computes:
//   for j in tokens: for r in rows: if j < len[r]:
//     s = <q_r, k_j> * scale * log2e;  m' = max(m, s);  o = o 2^(m-m') + 2^(s-m') v_j;  l likewise
// The KV of the request is read once for all qlen x heads rows; each row is masked at its
// own rank-local length (plan.row_local_len). A piece of a cut request writes (o / l, m, l)
// partials into its slot; a whole request writes bf16 out and natural-log lse directly.
#pragma once

#include <cstdint>

#include "common/params.h"
#include "common/utils.cuh"
#include "config.h"
#include "softmax.cuh"
#include "swizzle.cuh"
#include "unit.cuh"

namespace dcpmla::cuda_detail {

template <int MT, int NT, int CPS, bool FP8>
__global__ void __launch_bounds__(kThreads, CPS) attention_kernel(const __grid_constant__ AttentionParams p) {
  using C = AttnConfig<MT, NT, CPS, FP8>;
  constexpr int M = C::M, STAGES = C::STAGES;
  static_assert(kThreads % NT == 0);

  extern __shared__ __align__(128) uint8_t smem[];
  uint8_t* sQ = smem;                                   // (M, D) bf16 swizzled
  uint8_t* sStage = sQ + C::Q_BYTES;                    // STAGES x (NT, D) stored dtype
  uint8_t* sConv = sStage + STAGES * C::STAGE_BYTES;    // (NT, D) bf16, fp8 only
  uint8_t* sP = sConv + C::CONV_BYTES;                  // (M, NT) bf16
  float* sRed = reinterpret_cast<float*>(sP + C::P_BYTES);
  int* sLen = reinterpret_cast<int*>(sRed + C::RED_FLOATS);  // (M) rank-local row lengths
  float* sMax = reinterpret_cast<float*>(sLen + M);          // (WN, M) tile max, then l parts
  float* sAlpha = sMax + C::WN * M;                          // (M) rescale of this tile
  float* sM = sAlpha + M;                                    // (M) final running max

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, c = lane & 3;  // mma fragment row / column group
  const int mt = warp % C::WM, wn = (warp / C::WM) % C::WN, wk = warp / (C::WM * C::WN);

  const PlanScalars ps = plan_scalars<M>(p);
  const float kv_scale = FP8 ? kv_scale_of(p) : 1.0f;
  const float sl2 = p.softmax_scale * kv_scale * kLog2e;
  const float out_scale = kv_scale;  // v = stored * kv_scale
  const bool e5m2 = p.kv_dtype == KvDtype::fp8_e5m2;

  const uint32_t sQ_a = smem_addr(sQ), sP_a = smem_addr(sP);

  for (UnitCursor cur = unit_cursor(); next_unit<M>(p, ps, cur);) {
    const UnitSpan u = unit_span<M, NT>(p, cur, ps);
    const int row0 = u.row0, nr = u.nr;
    const int tok_lo = u.tok_lo, tok_hi = u.tok_hi, ntiles = u.ntiles;
    const int32_t* lens = u.lens;
    if (tid < M) sLen[tid] = tid < nr ? lens[(row0 + tid) / p.heads] : 0;

    load_q_async<M, kThreads>(p, u, sQ_a, tid, swz);
    cp_async_commit();

    // Tile i: tokens [tok_lo + i NT, +NT) -> stage s; eight threads per token row, so that a
    // warp's copy reads 4 tokens x 128 contiguous bytes (whole lines), tokens tk + 32 j. The
    // sub-page ids of this thread's tokens are fetched one tile ahead (fetch_subpages), so the
    // table lookups' latency is off the per-tile critical path. Tokens at or past tok_hi are
    // zero-filled (never read from memory).
    constexpr int kPass = kThreads / 8, kTokens = NT / kPass;  // tokens per pass, per thread
    const int tk = tid / 8, sub = tid % 8;
    struct Subpages {
      int v[kTokens];
    };
    auto fetch_subpages = [&](int i) {
      Subpages sp;
#pragma unroll
      for (int j = 0; j < kTokens; ++j) {
        const int jt = tok_lo + i * NT + tk + kPass * j;
        sp.v[j] = token_subpage(u, ps, i, jt);
      }
      return sp;
    };
    auto load_tile = [&](int i, int s, const Subpages& sp) {
      uint8_t* st = sStage + s * C::STAGE_BYTES;
#pragma unroll
      for (int j = 0; j < kTokens; ++j) {
        const int tok = tk + kPass * j, jt = tok_lo + i * NT + tok;
        const bool ok = jt < tok_hi;
        const uint8_t* src = ok ? token_row<C::STORED_ROW_BYTES>(p, ps, sp.v[j], jt) : p.kv;
        if constexpr (!FP8) {
          const uint32_t dst = smem_addr(st);
#pragma unroll
          for (int m = 0; m < kDim / 64; ++m) {
            const int ch = sub + 8 * m;
            cp_async_16(dst + swz(tok, ch), src + ch * 16, ok ? 16 : 0);
          }
        } else {
          const uint32_t dst = smem_addr(st + tok * kDim);
#pragma unroll
          for (int m = 0; m < (kDim / 16 + 7) / 8; ++m) {
            const int ch = sub + 8 * m;
            if (ch < kDim / 16) cp_async_16(dst + ch * 16, src + ch * 16, ok ? 16 : 0);
          }
        }
      }
    };

#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
      if (s < ntiles) load_tile(s, s, fetch_subpages(s));
      cp_async_commit();
    }
    Subpages next_subpages = fetch_subpages(STAGES - 1);

    cp_async_wait<STAGES - 1>();  // Q has landed (the oldest group)
    __syncthreads();

    // This warp's rows of S: mt*16 + g and + 8.
    const int r0 = mt * 16 + g, r1 = r0 + 8;
    const int lim0 = min(sLen[r0], tok_hi), lim1 = min(sLen[r1], tok_hi);

    uint32_t qf[C::Q_IN_REGS ? C::KS : 1][4];
    if constexpr (C::Q_IN_REGS) {
#pragma unroll
      for (int ks = 0; ks < C::KS; ++ks) {
        const int kk = (wk * C::KS + ks) * 16 + (lane >> 4) * 8;
        ldmatrix_x4(sQ_a + swz(mt * 16 + (lane & 15), kk >> 3), qf[ks]);
      }
    }

    float o[MT][8][4];  // (M, 64) slice of O: columns [64 warp, 64 warp + 64)
#pragma unroll
    for (int a = 0; a < MT; ++a)
#pragma unroll
      for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[a][n][e] = 0.0f;
    float m_run[2] = {kNegInf, kNegInf}, l_run[2] = {0.0f, 0.0f};

    for (int i = 0; i < ntiles; ++i) {
      cp_async_wait<STAGES - 2>();
      __syncthreads();  // tile i visible; tile i-1's stage, P and alpha are free
      {
        const int nxt = i + STAGES - 1;
        if (nxt < ntiles) load_tile(nxt, nxt % STAGES, next_subpages);
        cp_async_commit();
        next_subpages = fetch_subpages(nxt + 1);
      }
      const uint8_t* sK = sStage + (i % STAGES) * C::STAGE_BYTES;
      if constexpr (FP8) {
        // Dequantise the stored tile to bf16 once (exact); kv_scale is folded into the
        // softmax scale and the output scale.
#pragma unroll
        for (int idx = tid; idx < NT * (kDim / 16); idx += kThreads) {
          const int tk = idx / (kDim / 16), ch = idx % (kDim / 16);
          uint32_t out[8];
          fp8x16_to_bf16x16(*reinterpret_cast<const uint4*>(sK + tk * kDim + ch * 16), e5m2, out);
          *reinterpret_cast<uint4*>(sConv + swz(tk, 2 * ch)) = make_uint4(out[0], out[1], out[2], out[3]);
          *reinterpret_cast<uint4*>(sConv + swz(tk, 2 * ch + 1)) = make_uint4(out[4], out[5], out[6], out[7]);
        }
        __syncthreads();
        sK = sConv;
      }
      const uint32_t sK_a = smem_addr(sK);

      // ---- S = Q K^T: this warp's (16, NTW*8) block over its k range --------------------
      constexpr int ACC = C::ACC;
      float s[ACC][C::NTW][4];
#pragma unroll
      for (int a = 0; a < ACC; ++a)
#pragma unroll
        for (int n = 0; n < C::NTW; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[a][n][e] = 0.0f;
#pragma unroll
      for (int ks = 0; ks < C::KS; ++ks) {
        const int k0 = (wk * C::KS + ks) * 16;
        uint32_t af[4];
        if constexpr (C::Q_IN_REGS) {
#pragma unroll
          for (int e = 0; e < 4; ++e) af[e] = qf[ks][e];
        } else {
          ldmatrix_x4(sQ_a + swz(mt * 16 + (lane & 15), (k0 >> 3) + (lane >> 4)), af);
        }
        float(&acc)[C::NTW][4] = s[ks % ACC];
        if constexpr (C::NTW == 1) {
          // x4 over (tokens of the n8 tile) x (k lo, k hi) of this and... one k-step only:
          // matrices 2, 3 repeat 0, 1 (cheap; keeps one ldmatrix form).
          uint32_t bf[4];
          const int tok = wn * 8 + (lane & 7);
          ldmatrix_x4(sK_a + swz(tok, (k0 >> 3) + ((lane >> 3) & 1)), bf);
          mma_bf16(acc[0], af, bf[0], bf[1]);
        } else {
#pragma unroll
          for (int np = 0; np < C::NTW / 2; ++np) {
            uint32_t bf[4];
            const int tok = (wn * C::NTW + 2 * np) * 8 + (lane >> 4) * 8 + (lane & 7);
            ldmatrix_x4(sK_a + swz(tok, (k0 >> 3) + ((lane >> 3) & 1)), bf);
            mma_bf16(acc[2 * np], af, bf[0], bf[1]);
            mma_bf16(acc[2 * np + 1], af, bf[2], bf[3]);
          }
        }
      }
#pragma unroll
      for (int a = 1; a < ACC; ++a)
#pragma unroll
        for (int n = 0; n < C::NTW; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[0][n][e] += s[a][n][e];
      float(&sc)[C::NTW][4] = s[0];

      if constexpr (C::WK > 1) {
        // Sum the D-split partials of S into the wk = 0 warps.
        const int slot = mt * C::WN + wn;
        if (wk > 0) {
#pragma unroll
          for (int n = 0; n < C::NTW; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e)
              sRed[((((wk - 1) * C::WM * C::WN + slot) * C::NTW + n) * 4 + e) * 32 + lane] = sc[n][e];
        }
        __syncthreads();
        if (wk == 0) {
#pragma unroll
          for (int q = 1; q < C::WK; ++q)
#pragma unroll
            for (int n = 0; n < C::NTW; ++n)
#pragma unroll
              for (int e = 0; e < 4; ++e)
                sc[n][e] += sRed[((((q - 1) * C::WM * C::WN + slot) * C::NTW + n) * 4 + e) * 32 + lane];
        }
      }

      // ---- online softmax (base 2), rows masked at their own local lengths ---------------
      const int tok0 = tok_lo + i * NT;
      if (wk == 0) {
        float mx0 = kNegInf, mx1 = kNegInf;
#pragma unroll
        for (int n = 0; n < C::NTW; ++n)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int j = tok0 + (wn * C::NTW + n) * 8 + 2 * c + e;
            sc[n][e] = j < lim0 ? sc[n][e] * sl2 : kNegInf;
            sc[n][2 + e] = j < lim1 ? sc[n][2 + e] * sl2 : kNegInf;
            mx0 = fmaxf(mx0, sc[n][e]);
            mx1 = fmaxf(mx1, sc[n][2 + e]);
          }
#pragma unroll
        for (int d = 1; d <= 2; d <<= 1) {
          mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, d));
          mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, d));
        }
        if (c == 0) {
          sMax[wn * M + r0] = mx0;
          sMax[wn * M + r1] = mx1;
        }
      }
      __syncthreads();
      if (wk == 0) {
        float mx0 = kNegInf, mx1 = kNegInf;
#pragma unroll
        for (int q = 0; q < C::WN; ++q) {
          mx0 = fmaxf(mx0, sMax[q * M + r0]);
          mx1 = fmaxf(mx1, sMax[q * M + r1]);
        }
        const SoftmaxStep st0 = softmax_step(m_run[0], mx0), st1 = softmax_step(m_run[1], mx1);
        const float mu0 = st0.mu, mu1 = st1.mu, al0 = st0.alpha, al1 = st1.alpha;
        float sum0 = 0.0f, sum1 = 0.0f;
#pragma unroll
        for (int n = 0; n < C::NTW; ++n) {
          const float p0 = fast_exp2(sc[n][0] - mu0), p1 = fast_exp2(sc[n][1] - mu0);
          const float p2 = fast_exp2(sc[n][2] - mu1), p3 = fast_exp2(sc[n][3] - mu1);
          sum0 += p0 + p1;
          sum1 += p2 + p3;
          const int ch = wn * C::NTW + n;  // 16-byte chunk = n8 tile of tokens
          *reinterpret_cast<uint32_t*>(sP + swz_p<NT>(r0, ch) + 4 * c) = pack_bf16x2(p0, p1);
          *reinterpret_cast<uint32_t*>(sP + swz_p<NT>(r1, ch) + 4 * c) = pack_bf16x2(p2, p3);
        }
        l_run[0] = l_run[0] * al0 + sum0;
        l_run[1] = l_run[1] * al1 + sum1;
        m_run[0] = st0.m;
        m_run[1] = st1.m;
        if (wn == 0 && c == 0) {
          sAlpha[r0] = al0;
          sAlpha[r1] = al1;
        }
      }
      __syncthreads();

      // ---- O = O * alpha + P V: this warp's 64 output columns for all M rows -------------
#pragma unroll
      for (int a = 0; a < MT; ++a) {
        const float a0 = sAlpha[a * 16 + g], a1 = sAlpha[a * 16 + g + 8];
#pragma unroll
        for (int n = 0; n < 8; ++n) {
          o[a][n][0] *= a0;
          o[a][n][1] *= a0;
          o[a][n][2] *= a1;
          o[a][n][3] *= a1;
        }
      }
#pragma unroll
      for (int ks = 0; ks < NT / 16; ++ks) {
        uint32_t pa[MT][4];
#pragma unroll
        for (int a = 0; a < MT; ++a)
          ldmatrix_x4(sP_a + swz_p<NT>(a * 16 + (lane & 15), 2 * ks + (lane >> 4)), pa[a]);
#pragma unroll
        for (int np = 0; np < 4; ++np) {
          uint32_t vb[4];
          const int tok = ks * 16 + ((lane >> 3) & 1) * 8 + (lane & 7);
          const int col = warp * 64 + np * 16 + (lane >> 4) * 8;
          ldmatrix_x4_trans(sK_a + swz(tok, col >> 3), vb);
#pragma unroll
          for (int a = 0; a < MT; ++a) {
            mma_bf16(o[a][2 * np], pa[a], vb[0], vb[1]);
            mma_bf16(o[a][2 * np + 1], pa[a], vb[2], vb[3]);
          }
        }
      }
    }
    cp_async_wait_all();

    // ---- epilogue: l over the WN warps of a row, normalise, write ----------------------
    if (wk == 0) {
      float l0 = l_run[0], l1 = l_run[1];
#pragma unroll
      for (int d = 1; d <= 2; d <<= 1) {
        l0 += __shfl_xor_sync(0xffffffffu, l0, d);
        l1 += __shfl_xor_sync(0xffffffffu, l1, d);
      }
      if (c == 0) {
        sMax[wn * M + r0] = l0;
        sMax[wn * M + r1] = l1;
        if (wn == 0) {
          sM[r0] = m_run[0];
          sM[r1] = m_run[1];
        }
      }
    }
    __syncthreads();
    // l of row r: the sum over the WN token-warps' partial sums.
    auto row_l = [&](int r) {
      float l = 0.0f;
#pragma unroll
      for (int q = 0; q < C::WN; ++q) l += sMax[q * M + r];
      return l;
    };
#pragma unroll
    for (int a = 0; a < MT; ++a)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = a * 16 + g + 8 * h;
        store_row_lanes<1, 2, 8>(p, u, r, r < nr, c, row_l(r), out_scale, [&](int n) { return warp * 64 + 8 * n; },
                                 [&](int n) { return make_float2(o[a][n][2 * h], o[a][n][2 * h + 1]); });
      }
    if (tid < nr) store_row_stats(p, u, tid, sM[tid], row_l(tid));
    __syncthreads();  // shared memory is reused by the next unit
  }
}

template <int MT, int NT, int CPS, bool FP8>
int attention_smem_bytes() {
  return AttnConfig<MT, NT, CPS, FP8>::SMEM_BYTES;
}

template <int MT, int NT, int CPS, bool FP8>
void launch_attention_variant(const AttentionParams& p, int grid, cudaStream_t stream) {
  launch_attention_kernel<attention_kernel<MT, NT, CPS, FP8>>(p, grid, kThreads, AttnConfig<MT, NT, CPS, FP8>::SMEM_BYTES,
                                                              stream, "attention_kernel");
}

}  // namespace dcpmla::cuda_detail

#define DCPMLA_INSTANTIATE_ATTENTION(MT, NT, CPS, FP8)                                             \
  template void dcpmla::cuda_detail::launch_attention_variant<MT, NT, CPS, FP8>(                      \
      const dcpmla::AttentionParams&, int, cudaStream_t);                                             \
  template int dcpmla::cuda_detail::attention_smem_bytes<MT, NT, CPS, FP8>();
