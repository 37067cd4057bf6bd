// The combine of the cut requests' partials (the split-K merge kernel).
#include <cmath>

#include "common/params.h"
#include "common/utils.cuh"
#include "config.h"
#include "dcpmla/cuda.h"

namespace dcpmla::cuda_detail {

// The combine of the cut requests' rows (the schedule's partials): one CTA of kCombineWarps
// warps per (cut request, row x head), the warps taking pieces k, k + kCombineWarps, ... so
// that a request cut into a hundred pieces has many loads in flight, then one reduction in
// shared memory: M = max m_s, l = sum l_s 2^(m_s - M), o = sum l_s 2^(m_s - M) o_s / l,
// lse = (M + log2 l) ln 2. Rows of whole requests were written by the attention kernel and are
// not touched. Pieces with l_s = 0 hold no key (their o is 0, never NaN: the kernel writes 0
// for them); none at all gives o = 0, lse = -inf; a NaN l_s or m_s poisons the row (the CPU
// merge's rule).
constexpr int kCombineWarps = 4;

__global__ void __launch_bounds__(32 * kCombineWarps) split_merge_kernel(const __grid_constant__ AttentionParams p) {
  // Launched early (launch_split_merge): the attention grid's partials are complete and
  // visible only after this.
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  const PlanHeader hdr = *p.plan.header;
  const float kNegInf = neg_inf();
  constexpr int kCols = kRank / 32;  // columns per lane: 4 float4
  __shared__ float4 red[kCombineWarps][32][kCols / 4];
  __shared__ float red_m[kCombineWarps], red_l[kCombineWarps];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int slot_rows = hdr.qlen * p.heads;
  const int64_t rows = int64_t(hdr.split_requests) * slot_rows;
  for (int64_t x = blockIdx.x; x < rows; x += gridDim.x) {
    const int i = int(x / slot_rows), rr = int(x % slot_rows);
    const int b = p.plan.split_request[i];
    if (rr >= (p.plan.q_start[b + 1] - p.plan.q_start[b]) * p.heads) continue;  // uniform over the CTA
    const int first = p.plan.split_slot[i], count = p.plan.split_slot[i + 1] - first;
    // The row's maximum over every piece holding a key (all lanes of all warps), and whether
    // any does: a NaN l_s (a NaN score; its m_s may be -inf) is not empty and poisons the row.
    float m = kNegInf;
    bool any = false;
    for (int s = threadIdx.x; s < count; s += blockDim.x) {
      const int64_t at = int64_t(first + s) * slot_rows + rr;
      if (p.part_l[at] != 0.0f) {
        any = true;
        m = nan_max(m, p.part_m[at]);
      }
    }
#pragma unroll
    for (int d = 16; d; d >>= 1) m = nan_max(m, __shfl_xor_sync(0xffffffffu, m, d));
    if (lane == 0) red_m[warp] = m;
    any = __syncthreads_or(any);
    m = kNegInf;
#pragma unroll
    for (int w = 0; w < kCombineWarps; ++w) m = nan_max(m, red_m[w]);
    // This warp's pieces, weighted by l_s 2^(m_s - M) (unnormalised), and their l.
    float l = 0.0f;
    float4 acc[kCols / 4];
#pragma unroll
    for (int k = 0; k < kCols / 4; ++k) acc[k] = make_float4(0.f, 0.f, 0.f, 0.f);
    if (any) {
#pragma unroll 4
      for (int s = warp; s < count; s += kCombineWarps) {
        const int64_t at = int64_t(first + s) * slot_rows + rr;
        const float ls = p.part_l[at];
        const float w = ls != 0.0f ? ls * exp2f(p.part_m[at] - m) : 0.0f;
        l += w;
        const float* src = p.part_o + at * kRank;
#pragma unroll
        for (int k = 0; k < kCols / 4; ++k) {
          const float4 v = *reinterpret_cast<const float4*>(src + k * 128 + lane * 4);
          acc[k].x += w * v.x;
          acc[k].y += w * v.y;
          acc[k].z += w * v.z;
          acc[k].w += w * v.w;
        }
      }
    }
#pragma unroll
    for (int k = 0; k < kCols / 4; ++k) red[warp][lane][k] = acc[k];
    if (lane == 0) red_l[warp] = l;
    __syncthreads();
    if (warp == 0) {
      l = 0.0f;
#pragma unroll
      for (int w = 0; w < kCombineWarps; ++w) l += red_l[w];
      const int64_t row = int64_t(p.plan.q_start[b]) * p.heads + rr;
      bf16* out = p.out + row * kRank;
      // No piece held a key: o = 0, lse = -inf (l = 0 then, and every acc is 0).
      const float inv = l != 0.0f ? 1.0f / l : 0.0f;
#pragma unroll
      for (int k = 0; k < kCols / 4; ++k) {
        float4 v = red[0][lane][k];
#pragma unroll
        for (int w = 1; w < kCombineWarps; ++w) {
          const float4 u = red[w][lane][k];
          v.x += u.x;
          v.y += u.y;
          v.z += u.z;
          v.w += u.w;
        }
        __nv_bfloat162 lo = __floats2bfloat162_rn(v.x * inv, v.y * inv);
        __nv_bfloat162 hi = __floats2bfloat162_rn(v.z * inv, v.w * inv);
        uint2 o;
        o.x = *reinterpret_cast<uint32_t*>(&lo);
        o.y = *reinterpret_cast<uint32_t*>(&hi);
        *reinterpret_cast<uint2*>(out + k * 128 + lane * 4) = o;
      }
      if (lane == 0) p.lse[row] = l != 0.0f ? (m + log2f(l)) * kLn2 : kNegInf;
    }
    __syncthreads();  // red is reused by the next row
  }
}

// A programmatic dependent launch behind the attention kernel (the stream's previous kernel):
// its launch is processed while the attention kernel runs, and its CTAs start as the
// attention CTAs exit (the implicit trigger) and wait in the kernel for the partials, instead
// of the launch starting after the grid has completed. Also under graph capture (a
// programmatic edge). The attention kernels do not trigger earlier: griddepcontrol in their
// unit loop cost ptxas 25 more registers in the wgmma kernel.
void launch_split_merge(const AttentionParams& p, int grid, cudaStream_t stream) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(unsigned(grid));
  cfg.blockDim = dim3(32 * kCombineWarps);
  cfg.stream = stream;
  cudaLaunchAttribute early{};
  early.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  early.val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = &early;
  cfg.numAttrs = 1;
  check(cudaLaunchKernelEx(&cfg, split_merge_kernel, p), "split_merge_kernel launch");
}

}  // namespace dcpmla::cuda_detail
