// Variant dispatch (in one place) and the split-K merge kernel.
#include <cmath>

#include "common/params.h"
#include "common/utils.cuh"
#include "config.h"
#include "dcpmla/cuda.h"
#include "variants.h"

namespace dcpmla::cuda_detail {

// The wgmma kernel serves 64-row CTAs (qlen x heads > 32: verify at 16 heads, 128 heads),
// where the mma.sync kernel is bound by ldmatrix traffic (bench/NOTES.md). Below 64 rows
// it would pad each CTA to 64 rows; the mma.sync kernel keeps those shapes, except fp8 at
// 16 rows, where the fp8 swap kernel reads the cache without dequantising it.
int default_kernel(int rows_per_cta, bool fp8) {
  if (rows_per_cta == 64) return kKernelWgmma;
  if (rows_per_cta == 16 && fp8) return kKernelFp8Swap;
  return kKernelMma;
}

// One warp per (request, row, head): M = max m_s, l = sum l_s 2^(m_s - M),
// o = sum l_s 2^(m_s - M) o_s / l, lse = (M + log2 l) ln 2. Segments with l_s = 0 hold
// no key; none at all (padding, no local key) gives o = 0, lse = -inf; a NaN gives NaN.
// The statistics are reduced across lanes (lane k takes segments k, k + 32, ...), and the
// o loop is unrolled so that several segments' loads are in flight: a ragged batch can
// give one request a hundred segments, and a serial loop would wait on each.
__global__ void __launch_bounds__(256) split_merge_kernel(const __grid_constant__ AttentionParams p) {
  const PlanHeader hdr = *p.plan.header;
  if (hdr.route != int32_t(Route::split_k)) return;  // the route is the device plan's, not the host's
  const float kNegInf = -__int_as_float(0x7f800000);
  constexpr float kLn2 = 0.6931471805599453f;
  const int lane = threadIdx.x & 31;
  const int rows_total = hdr.qlen * p.heads;
  const int64_t rows = int64_t(hdr.batch) * rows_total;
  for (int64_t row = int64_t(blockIdx.x) * 8 + (threadIdx.x >> 5); row < rows; row += int64_t(gridDim.x) * 8) {
    const int b = int(row / rows_total), rr = int(row % rows_total);
    const int first = p.plan.request_work[b], count = p.plan.request_work[b + 1] - first;
    // l_s = 0 marks an empty segment; a NaN l_s (a NaN or inf read) is not empty and
    // poisons the row (the CPU merge's rule).
    float m = kNegInf;
    bool any = false;
    for (int s = lane; s < count; s += 32) {
      const int64_t at = int64_t(first + s) * rows_total + rr;
      if (p.part_l[at] != 0.0f) {
        any = true;
        m = nan_max(m, p.part_m[at]);
      }
    }
#pragma unroll
    for (int d = 16; d; d >>= 1) m = nan_max(m, __shfl_xor_sync(0xffffffffu, m, d));
    any = __any_sync(0xffffffffu, any);
    bf16* out = p.out + row * kRank;
    if (!any) {
      for (int col = lane * 4; col < kRank; col += 128)
        *reinterpret_cast<uint2*>(out + col) = make_uint2(0u, 0u);
      if (lane == 0) p.lse[row] = kNegInf;
      continue;
    }
    float l = 0.0f;
    for (int s = lane; s < count; s += 32) {
      const int64_t at = int64_t(first + s) * rows_total + rr;
      const float ls = p.part_l[at];
      if (ls != 0.0f) l += ls * exp2f(p.part_m[at] - m);
    }
#pragma unroll
    for (int d = 16; d; d >>= 1) l += __shfl_xor_sync(0xffffffffu, l, d);
    const float inv = 1.0f / l;
    float4 acc[kRank / 128];
#pragma unroll
    for (int k = 0; k < kRank / 128; ++k) acc[k] = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 4
    for (int s = 0; s < count; ++s) {
      const int64_t at = int64_t(first + s) * rows_total + rr;
      const float ls = p.part_l[at];
      // Empty segments weigh 0 (their o is 0, never NaN: the kernel writes 0 for them).
      const float w = ls != 0.0f ? ls * exp2f(p.part_m[at] - m) * inv : 0.0f;
      const float* src = p.part_o + at * kRank;
#pragma unroll
      for (int k = 0; k < kRank / 128; ++k) {
        const float4 v = *reinterpret_cast<const float4*>(src + k * 128 + lane * 4);
        acc[k].x += w * v.x;
        acc[k].y += w * v.y;
        acc[k].z += w * v.z;
        acc[k].w += w * v.w;
      }
    }
#pragma unroll
    for (int k = 0; k < kRank / 128; ++k) {
      __nv_bfloat162 lo = __floats2bfloat162_rn(acc[k].x, acc[k].y);
      __nv_bfloat162 hi = __floats2bfloat162_rn(acc[k].z, acc[k].w);
      uint2 v;
      v.x = *reinterpret_cast<uint32_t*>(&lo);
      v.y = *reinterpret_cast<uint32_t*>(&hi);
      *reinterpret_cast<uint2*>(out + k * 128 + lane * 4) = v;
    }
    if (lane == 0) p.lse[row] = (m + log2f(l)) * kLn2;
  }
}

void launch_split_merge(const AttentionParams& p, int grid, cudaStream_t stream) {
  split_merge_kernel<<<grid, 256, 0, stream>>>(p);
  check(cudaGetLastError(), "split_merge_kernel launch");
}

}  // namespace dcpmla::cuda_detail
