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
__device__ __forceinline__ SoftmaxStep softmax_step(float m_run, float tile_max) {
  const float m = fmaxf(m_run, tile_max);
  const float mu = m == neg_inf() ? 0.0f : m;
  return {m, mu, fast_exp2(m_run - mu)};
}

}  // namespace dcpmla::cuda_detail
