// The combine of the cut requests' partials (the split-K merge kernel).
#include <algorithm>
#include <cmath>

#include "common/params.h"
#include "common/utils.cuh"
#include "config.h"
#include "dcpmla/cuda.h"

namespace dcpmla::cuda_detail {

// The combine of the cut requests' rows (the schedule's partials). An item is a (cut row,
// slice of kSliceCols columns), run by a group of G warps, G a power of two up to
// kCombineWarps chosen per cut request from its piece count: the common two or three pieces
// get a warp per item (eight warps on one such item waited on each other for nothing), a
// request cut into a hundred pieces gets whole CTAs (one CTA per row kept only 64 SMs busy on
// a 64-row request, each with a few loads in flight against DRAM). A task is one CTA's turn
// on kCombineWarps / G items of one request; the CTAs deal every request's tasks round-robin,
// continuing across requests, so the grid stays balanced whatever the mix.
//
// Each warp runs its pieces k, k + G, ... in one pass with an online maximum (m, l and o of
// four pieces in flight), then the group merges its warps: M = max m_w, l = sum l_w 2^(m_w - M),
// o = sum 2^(m_w - M) o_w / l, lse = (M + log2 l) ln 2. Rows of whole requests were written by
// the attention kernel and are not touched. Pieces with l_s = 0 hold no key (their o is 0,
// never NaN: the kernel writes 0 for them); none at all gives o = 0, lse = -inf; a NaN l_s or
// m_s poisons the row (the CPU merge's rule).
constexpr int kCombineWarps = 8;
constexpr int kCombineThreads = 32 * kCombineWarps;
constexpr int kCombineSlices = 4;
constexpr int kSliceCols = kRank / kCombineSlices;
static_assert(kSliceCols == 32 * 4, "a warp covers one slice with one float4 per lane");
constexpr int kPiecesPerWarp = 4;     // a group grows only while each warp keeps this many pieces
constexpr int kCombineCtasPerSm = 4;  // 64 registers a thread: four CTAs fill an SM's register file

__device__ __forceinline__ int combine_group_warps(int pieces) {
  int g = 1;
  while (g < kCombineWarps && 2 * g * kPiecesPerWarp <= pieces) g *= 2;
  return g;
}

// One warp's pieces of (row rr, columns col..col+3 of each lane) in one pass: the running
// maximum m (true -inf while no piece held a key), l and o scaled to it.
struct WarpPartial {
  float m, l;
  float4 o;
};

__device__ __forceinline__ WarpPartial combine_pieces(const AttentionParams& p, int64_t first, int count, int step,
                                                      int64_t slot_rows, int rr, int col) {
  WarpPartial w{neg_inf(), 0.0f, make_float4(0.f, 0.f, 0.f, 0.f)};
#pragma unroll 4
  for (int s = 0; s < count; s += step) {
    const int64_t at = (first + s) * slot_rows + rr;
    const float ls = p.part_l[at], ms = p.part_m[at];
    const float4 v = *reinterpret_cast<const float4*>(p.part_o + at * kRank + col);
    if (ls != 0.0f) {  // a NaN l_s is not empty: it poisons the row
      const float mn = nan_max(w.m, ms);
      const float scale = w.m == mn ? 1.0f : exp2f(w.m - mn), ws = ls * exp2f(ms - mn);
      w.m = mn;
      w.l = w.l * scale + ws;
      w.o.x = w.o.x * scale + ws * v.x;
      w.o.y = w.o.y * scale + ws * v.y;
      w.o.z = w.o.z * scale + ws * v.z;
      w.o.w = w.o.w * scale + ws * v.w;
    }
  }
  return w;
}

__global__ void __launch_bounds__(kCombineThreads, kCombineCtasPerSm)
    split_merge_kernel(const __grid_constant__ AttentionParams p) {
  // Launched early (launch_split_merge): the attention grid's partials are complete and
  // visible only after this.
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  const PlanHeader hdr = *p.plan.header;
  const float kNegInf = neg_inf();
  __shared__ float4 red[kCombineWarps][32];
  __shared__ float red_m[kCombineWarps], red_l[kCombineWarps];
  // The requests in hand: split_slot, and each one's first output row and rows.
  __shared__ int slot_s[kCombineThreads + 1], rows_s[kCombineThreads];
  __shared__ int64_t row0_s[kCombineThreads];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int slot_rows = hdr.qlen * p.heads, row_items = slot_rows * kCombineSlices;
  const int64_t grid = gridDim.x;
  int64_t dealt = 0;  // tasks of the requests before this one (the same in every CTA)
  for (int base = 0; base < hdr.split_requests; base += kCombineThreads) {
    const int in_hand = min(kCombineThreads, hdr.split_requests - base);
    __syncthreads();  // slot_s of the previous requests is read no more
    for (int j = threadIdx.x; j <= in_hand; j += kCombineThreads) {
      slot_s[j] = p.plan.split_slot[base + j];
      if (j < in_hand) {
        const int b = p.plan.split_request[base + j];
        row0_s[j] = int64_t(p.plan.q_start[b]) * p.heads;
        rows_s[j] = (p.plan.q_start[b + 1] - p.plan.q_start[b]) * p.heads;
      }
    }
    __syncthreads();
    for (int i = base; i < base + in_hand; ++i) {
      const int first = slot_s[i - base], count = slot_s[i - base + 1] - first;
      const int group_warps = combine_group_warps(count), per_task = kCombineWarps / group_warps;
      const int64_t tasks = (row_items + per_task - 1) / per_task;
      const int group = warp / group_warps, gw = warp % group_warps, lead = group * group_warps;
      const int rows = rows_s[i - base];
      // Every warp runs every task (the barriers are the CTA's); an item past the request's
      // items or on a padding row of a shorter request is a group with no pieces.
      for (int64_t t = ((blockIdx.x - dealt) % grid + grid) % grid; t < tasks; t += grid) {
        const int item = int(t * per_task) + group;
        const int rr = item / kCombineSlices, col = (item % kCombineSlices) * kSliceCols + lane * 4;
        const bool valid = item < row_items && rr < rows;
        const WarpPartial w =
            combine_pieces(p, first + gw, valid ? max(count - gw, 0) : 0, group_warps, slot_rows, rr, col);
        red[warp][lane] = w.o;
        if (lane == 0) {
          red_m[warp] = w.m;
          red_l[warp] = w.l;
        }
        __syncthreads();
        if (valid && gw == 0) {
          float m = kNegInf;
          for (int v = lead; v < lead + group_warps; ++v) m = nan_max(m, red_m[v]);
          float l = 0.0f;
          float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
          for (int v = lead; v < lead + group_warps; ++v) {
            // A warp with no key (l = 0) adds nothing, also when M is -inf.
            const float f = red_l[v] != 0.0f ? exp2f(red_m[v] - m) : 0.0f;
            const float4 u = red[v][lane];
            l += red_l[v] * f;
            o.x += u.x * f;
            o.y += u.y * f;
            o.z += u.z * f;
            o.w += u.w * f;
          }
          const int64_t row = row0_s[i - base] + rr;
          // No piece held a key: o = 0, lse = -inf (l = 0 then, and every o is 0).
          const float inv = l != 0.0f ? 1.0f / l : 0.0f;
          const __nv_bfloat162 lo = __floats2bfloat162_rn(o.x * inv, o.y * inv);
          const __nv_bfloat162 hi = __floats2bfloat162_rn(o.z * inv, o.w * inv);
          uint2 packed;
          packed.x = *reinterpret_cast<const uint32_t*>(&lo);
          packed.y = *reinterpret_cast<const uint32_t*>(&hi);
          *reinterpret_cast<uint2*>(p.out + row * kRank + col) = packed;
          if (col == 0) p.lse[row] = l != 0.0f ? (m + log2f(l)) * kLn2 : kNegInf;
        }
        __syncthreads();  // red is reused by the next task
      }
      dealt += tasks;
    }
  }
}

// A programmatic dependent launch behind the attention kernel (the stream's previous kernel):
// its launch is processed while the attention kernel runs, and its CTAs start as the
// attention CTAs exit (the implicit trigger) and wait in the kernel for the partials, instead
// of the launch starting after the grid has completed. Also under graph capture (a
// programmatic edge). The attention kernels do not trigger earlier: griddepcontrol in their
// unit loop cost ptxas 25 more registers in the wgmma kernel.
// The grid follows the capacities (graph-safe): a CTA per (row, slice) of the most rows a plan
// can cut, up to a full GPU of them; CTAs with no task exit after the request list.
void launch_split_merge(const AttentionParams& p, int64_t max_cut_rows, int num_sms, cudaStream_t stream) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(unsigned(std::min<int64_t>(max_cut_rows * kCombineSlices, int64_t(num_sms) * kCombineCtasPerSm)));
  cfg.blockDim = dim3(kCombineThreads);
  cfg.stream = stream;
  cudaLaunchAttribute early{};
  early.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  early.val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = &early;
  cfg.numAttrs = 1;
  check(cudaLaunchKernelEx(&cfg, split_merge_kernel, p), "split_merge_kernel launch");
}

}  // namespace dcpmla::cuda_detail
