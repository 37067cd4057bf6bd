// The combine of the cut requests' partials (the split-K merge kernel).
#include <algorithm>
#include <cmath>

#include "common/params.h"
#include "common/utils.cuh"
#include "config.h"
#include "dcpmla/cuda.h"

namespace dcpmla::cuda_detail {

// The combine of the cut requests' rows (the schedule's partials). An item is a (cut row,
// slice of kSliceCols columns), run by a group of G warps (G a power of two up to
// kCombineWarps, the same for the whole launch, from the plan's max_pieces): each warp takes
// pieces k, k + G, ... with four loads in flight, then the group reduces in shared memory:
// M = max m_s, l = sum l_s 2^(m_s - M), o = sum l_s 2^(m_s - M) o_s / l, lse = (M + log2 l) ln 2.
// A CTA of kCombineWarps warps runs kCombineWarps / G items at a time. So a request cut into a
// hundred pieces gets whole CTAs per item (one CTA per row kept only 64 SMs busy on a 64-row
// request, each with a few loads in flight against DRAM), and the common two or three pieces
// get a warp per item (eight warps sharing one item waited on each other for nothing: decode128
// lost 45 us to that). Rows of whole requests were written by the attention kernel and are not
// touched. Pieces with l_s = 0 hold no key (their o is 0, never NaN: the kernel writes 0 for
// them); none at all gives o = 0, lse = -inf; a NaN l_s or m_s poisons the row (the CPU merge's
// rule).
constexpr int kCombineWarps = 8;
constexpr int kCombineSlices = 4;
constexpr int kSliceCols = kRank / kCombineSlices;
static_assert(kSliceCols == 32 * 4, "a warp covers one slice with one float4 per lane");
constexpr int kPiecesPerWarp = 4;  // a group grows only while each warp keeps this many pieces
// Four 256-thread CTAs an SM: __launch_bounds__ holds ptxas to 64 registers a thread (no
// spills at four loads in flight a warp), and the grid is sized to what is resident.
constexpr int kCombineCtasPerSm = 4;

__device__ __forceinline__ int combine_group_warps(int max_pieces) {
  int g = 1;
  while (g < kCombineWarps && 2 * g * kPiecesPerWarp <= max_pieces) g *= 2;
  return g;
}

__global__ void __launch_bounds__(32 * kCombineWarps, kCombineCtasPerSm) split_merge_kernel(const __grid_constant__ AttentionParams p) {
  // Launched early (launch_split_merge): the attention grid's partials are complete and
  // visible only after this.
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  const PlanHeader hdr = *p.plan.header;
  const float kNegInf = neg_inf();
  __shared__ float4 red[kCombineWarps][32];
  __shared__ float red_m[kCombineWarps], red_l[kCombineWarps];
  __shared__ int red_any[kCombineWarps];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int group_warps = combine_group_warps(hdr.max_pieces), per_cta = kCombineWarps / group_warps;
  const int group = warp / group_warps, gw = warp % group_warps, lead = group * group_warps;
  const int slot_rows = hdr.qlen * p.heads;
  const int64_t items = int64_t(hdr.split_requests) * slot_rows * kCombineSlices;
  // Every warp runs every iteration (the barriers are the CTA's); an item past the end or a
  // padding row of a shorter request is a group with no pieces that writes nothing.
  for (int64_t base = int64_t(blockIdx.x) * per_cta; base < items; base += int64_t(gridDim.x) * per_cta) {
    const int64_t x = base + group;
    const int64_t cut_row = x / kCombineSlices;
    const int col = int(x % kCombineSlices) * kSliceCols + lane * 4;
    const int i = int(cut_row / slot_rows), rr = int(cut_row % slot_rows);
    const int b = x < items ? p.plan.split_request[i] : 0;
    const bool valid = x < items && rr < (p.plan.q_start[b + 1] - p.plan.q_start[b]) * p.heads;
    const int first = valid ? p.plan.split_slot[i] : 0, count = valid ? p.plan.split_slot[i + 1] - first : 0;
    // The row's maximum over every piece holding a key (all lanes of the group), and whether
    // any does: a NaN l_s (a NaN score; its m_s may be -inf) is not empty and poisons the row.
    float m = kNegInf;
    bool any = false;
    for (int s = gw * 32 + lane; s < count; s += group_warps * 32) {
      const int64_t at = int64_t(first + s) * slot_rows + rr;
      if (p.part_l[at] != 0.0f) {
        any = true;
        m = nan_max(m, p.part_m[at]);
      }
    }
#pragma unroll
    for (int d = 16; d; d >>= 1) m = nan_max(m, __shfl_xor_sync(0xffffffffu, m, d));
    any = __any_sync(0xffffffffu, any);
    if (lane == 0) {
      red_m[warp] = m;
      red_any[warp] = any;
    }
    __syncthreads();
    m = kNegInf;
    any = false;
    for (int w = lead; w < lead + group_warps; ++w) {
      m = nan_max(m, red_m[w]);
      any = any || red_any[w] != 0;
    }
    // This warp's pieces, weighted by l_s 2^(m_s - M) (unnormalised), and their l.
    float l = 0.0f;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    if (any) {
#pragma unroll 4
      for (int s = gw; s < count; s += group_warps) {
        const int64_t at = int64_t(first + s) * slot_rows + rr;
        const float ls = p.part_l[at];
        const float w = ls != 0.0f ? ls * exp2f(p.part_m[at] - m) : 0.0f;
        l += w;
        const float4 v = *reinterpret_cast<const float4*>(p.part_o + at * kRank + col);
        acc.x += w * v.x;
        acc.y += w * v.y;
        acc.z += w * v.z;
        acc.w += w * v.w;
      }
    }
    red[warp][lane] = acc;
    if (lane == 0) red_l[warp] = l;
    __syncthreads();
    if (valid && gw == 0) {
      l = 0.0f;
      float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
      for (int w = lead; w < lead + group_warps; ++w) {
        l += red_l[w];
        const float4 u = red[w][lane];
        v.x += u.x;
        v.y += u.y;
        v.z += u.z;
        v.w += u.w;
      }
      const int64_t row = int64_t(p.plan.q_start[b]) * p.heads + rr;
      // No piece held a key: o = 0, lse = -inf (l = 0 then, and every acc is 0).
      const float inv = l != 0.0f ? 1.0f / l : 0.0f;
      const __nv_bfloat162 lo = __floats2bfloat162_rn(v.x * inv, v.y * inv);
      const __nv_bfloat162 hi = __floats2bfloat162_rn(v.z * inv, v.w * inv);
      uint2 o;
      o.x = *reinterpret_cast<const uint32_t*>(&lo);
      o.y = *reinterpret_cast<const uint32_t*>(&hi);
      *reinterpret_cast<uint2*>(p.out + row * kRank + col) = o;
      if (col == 0) p.lse[row] = l != 0.0f ? (m + log2f(l)) * kLn2 : kNegInf;
    }
    __syncthreads();  // red is reused by the next items
  }
}

// A programmatic dependent launch behind the attention kernel (the stream's previous kernel):
// its launch is processed while the attention kernel runs, and its CTAs start as the
// attention CTAs exit (the implicit trigger) and wait in the kernel for the partials, instead
// of the launch starting after the grid has completed. Also under graph capture (a
// programmatic edge). The attention kernels do not trigger earlier: griddepcontrol in their
// unit loop cost ptxas 25 more registers in the wgmma kernel.
// The grid follows the capacities (graph-safe): as many CTAs as (row, slice) items of the most
// rows a plan can cut, up to the resident CTAs of the GPU; a CTA takes kCombineWarps / G items
// a pass, and CTAs past a plan's items exit at once.
void launch_split_merge(const AttentionParams& p, int64_t max_cut_rows, int num_sms, cudaStream_t stream) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(unsigned(std::min<int64_t>(max_cut_rows * kCombineSlices, int64_t(num_sms) * kCombineCtasPerSm)));
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
