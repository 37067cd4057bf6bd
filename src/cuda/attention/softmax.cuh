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
inline constexpr float kLazyMaxSlack = 8.0f;
template <bool LAZY = false>
__device__ __forceinline__ SoftmaxStep softmax_step(float m_run, float tile_max) {
  const float m = LAZY ? (tile_max > m_run + kLazyMaxSlack ? tile_max : m_run) : fmaxf(m_run, tile_max);
  const float mu = m == neg_inf() ? 0.0f : m;
  return {m, mu, fast_exp2(m_run - mu)};
}

}  // namespace dcpmla::cuda_detail
