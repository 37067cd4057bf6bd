// merge_state / combine_partials (merge.h) on the device: one warp per row, natural-log lse.
// lse = m + ln sum_k e^(lse_k - m); o = sum_k e^(lse_k - lse) o_k; -inf partials carry no
// weight; all -inf gives o = 0, lse = -inf. Each warp reads its row before writing it, so
// the output may alias a partial.
#include <algorithm>

#include "common/params.h"
#include "common/utils.cuh"

namespace dcpmla::cuda_detail {

__global__ void __launch_bounds__(256) merge_kernel(const MergeParams p) {
  const int lane = threadIdx.x & 31;
  for (int64_t row = int64_t(blockIdx.x) * 8 + (threadIdx.x >> 5); row < p.rows;
       row += int64_t(gridDim.x) * 8) {
    float m = kNegInf;
    // nan_max: a NaN partial poisons the row instead of passing for an empty one.
    for (int k = 0; k < p.n; ++k) m = nan_max(m, p.lse_parts[k * p.part_stride_lse + row]);
    float sum = 0.0f;
    if (m != kNegInf)
      for (int k = 0; k < p.n; ++k) {
        const float l = p.lse_parts[k * p.part_stride_lse + row];
        if (l != kNegInf) sum += expf(l - m);
      }
    // Every lane has read every lse before any lane writes (the output may alias).
    __syncwarp();
    bf16* out = p.o + row * p.width;
    for (int col = lane; col < p.width; col += 32) {
      float acc = 0.0f;
      if (m != kNegInf)
        for (int k = 0; k < p.n; ++k) {
          const float l = p.lse_parts[k * p.part_stride_lse + row];
          if (l == kNegInf) continue;
          const bf16 v = p.o_parts[k * p.part_stride_o + row * p.width + col];
          // Normalised before it scales the partial (two partials near FLT_MAX overflowed).
          acc += (expf(l - m) / sum) * __uint_as_float(uint32_t(v.bits) << 16);
        }
      const float r = m == kNegInf ? 0.0f : acc;
      const __nv_bfloat16 h = __float2bfloat16_rn(r);
      out[col] = *reinterpret_cast<const bf16*>(&h);
    }
    __syncwarp();
    if (lane == 0) p.lse[row] = m == kNegInf ? kNegInf : m + logf(sum);
  }
}

void launch_merge(const MergeParams& p, cudaStream_t stream) {
  if (p.rows == 0) return;
  const int grid = int(std::min<int64_t>((p.rows + 7) / 8, 8192));
  merge_kernel<<<grid, 256, 0, stream>>>(p);
  check(cudaGetLastError(), "merge_kernel launch");
}

}  // namespace dcpmla::cuda_detail
