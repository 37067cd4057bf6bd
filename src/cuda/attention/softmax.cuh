// The online softmax's step, shared by the attention kernels (base 2: scores already carry
// log2 e) and the fp8 swap kernel's merge of two running states.
#pragma once

#include "common/utils.cuh"

namespace dcpmla::cuda_detail {

// A row with running maximum m_run sees tile_max. m: the new running maximum; mu: the offset
// its exponents use (0 while the row has no key, so that -inf - -inf never makes a NaN);
// alpha = 2^(m_run - mu), the factor for what was summed under m_run (exactly 1 once the
// maximum settles, which lets the kernels skip the rescale).
struct SoftmaxStep {
  float m, mu, alpha;
};
// LAZY (the 64-row kernel): the running maximum moves only when a tile's exceeds it by more
// than kLazyMaxSlack (base 2), so that O is rescaled a few times a unit instead of on about
// half the tiles of a 64-tile one (a new maximum in any of a warp's 16 rows rescales the
// warp's O); the exponentials are then up to 2^kLazyMaxSlack, which P as bf16 or f16 and
// float32 l and O hold as exactly as values up to 1. The fp8 swap kernel cannot (its P x 256
// must fit e4m3), and the bf16 swap kernel, bound by its loads, keeps the exact maximum.
// KEYLESS_ONE (the 64-row kernel's bf16 form): alpha is 1 while m_run is still -inf: nothing
// was summed then (every exponential was 0, or NaN, which no factor clears), so no rescale
// runs at a row's first key or on the tiles of a row that has none (a rank's empty window).
// The other kernels keep 2^-inf = 0: the select made two mma.sync variants spill, and the fp8
// 64-row kernel was 1.3 % slower at 128 heads with it and the padded rows' unmasking together
// (bench/NOTES.md, twenty-ninth session).
inline constexpr float kLazyMaxSlack = 8.0f;
// The exponent offset of a row whose running maximum is m.
__device__ __forceinline__ float softmax_offset(float m) { return m == kNegInf ? 0.0f : m; }
template <bool LAZY = false, bool KEYLESS_ONE = false>
__device__ __forceinline__ SoftmaxStep softmax_step(float m_run, float tile_max) {
  const float m = LAZY ? (tile_max > m_run + kLazyMaxSlack ? tile_max : m_run) : fmaxf(m_run, tile_max);
  const float mu = softmax_offset(m);
  return {m, mu, KEYLESS_ONE && m_run == kNegInf ? 1.0f : fast_exp2(m_run - mu)};
}

// The maximum of the 16 scores of one accumulator row in a thread's S fragment (sc[4 j + e0],
// sc[4 j + e0 + 1], j < 8; e0 = 0: row r0, 2: row r1), as a tree: four compares deep, where
// a running maximum over the pairs is nine.
__device__ __forceinline__ float max16(const float (&sc)[32], int e0) {
  float v[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) v[j] = fmaxf(sc[4 * j + e0], sc[4 * j + e0 + 1]);
#pragma unroll
  for (int w = 4; w >= 1; w >>= 1)
#pragma unroll
    for (int j = 0; j < w; ++j) v[j] = fmaxf(v[j], v[j + w]);
  return v[0];
}

// The swap kernels' maxima over a warp's 16 tokens of a thread's rows 8 j + 2 c + u (j < J,
// u < 2; v[2 j + u] the thread's two tokens' maximum), which the eight lanes of one c
// (g = lane / 4) share: reduced by halves, each exchange sending the half of the values left
// that the lane gives up and keeping the other, so that lane g ends with value g (J 4) or
// g / 2 (J 2): 2 J - 1 shuffles (+ 1 at J 2) instead of 6 J for an all-reduce of every row.
// store(j, u, max) runs once per row in the warp, in the lane that holds it.
template <int J, typename Store>
__device__ __forceinline__ void swap_warp_maxima(float (&v)[2 * J], int g, Store store) {
  static_assert(J == 2 || J == 4, "2 J rows over the 8 lanes of one c");
  int n = 2 * J;
#pragma unroll
  for (int d = 16; d >= 4; d >>= 1) {
    if (n == 1) {
      v[0] = fmaxf(v[0], __shfl_xor_sync(0xffffffffu, v[0], d));
      continue;
    }
    n >>= 1;
    const bool upper = (g & (d >> 2)) != 0;  // lane bit d is bit d / 4 of g
#pragma unroll
    for (int k = 0; k < n; ++k) {
      const float send = upper ? v[k] : v[k + n], keep = upper ? v[k + n] : v[k];
      v[k] = fmaxf(keep, __shfl_xor_sync(0xffffffffu, send, d));
    }
  }
  const int k = J == 4 ? g : g >> 1;
  if (J == 4 || (g & 1) == 0) store(k >> 1, k & 1, v[0]);
}

// The swap kernels' tile maxima (S^T: a row's 64 scores lie over the four warps, each warp's
// maximum of row r at red[q stride + r]) of a thread's rows 8 j + 2 c + u (j < J, u < 2).
// Read for every row before the first P^T store: the compiler must assume those stores may
// alias red, so a row read after one waits for it and the rows' softmax steps run one after
// another (1 340 of a 32-row fp8 tile's 3 140 cycles on the H100, bench/NOTES.md, forty-ninth
// session; scripts/check_register_split.py fails a swap kernel whose SASS does so).
template <int J>
__device__ __forceinline__ void swap_tile_maxima(const float* red, int stride, int c, float (&tmax)[J][2]) {
#pragma unroll
  for (int j = 0; j < J; ++j)
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int r = 8 * j + 2 * c + u;
      tmax[j][u] = fmaxf(fmaxf(red[r], red[stride + r]), fmaxf(red[2 * stride + r], red[3 * stride + r]));
    }
}

}  // namespace dcpmla::cuda_detail
