// The combine of the cut requests' partials (the split-K merge kernel).
#include <algorithm>
#include <cmath>

#include <cub/block/block_scan.cuh>

#include "common/params.h"
#include "common/utils.cuh"
#include "config.h"
#include "dcpmla/cuda.h"

namespace dcpmla::cuda_detail {

// The combine of the cut requests' rows (the schedule's partials). An item is a (cut row,
// slice of kSliceCols columns), run by a group of G warps, G a power of two up to
// kCombineWarps chosen per cut request from its own piece count: the common two or three
// pieces get a warp per item (eight warps on one such item waited on each other for nothing:
// decode128 lost 45 us to that), a request cut into a hundred pieces gets whole CTAs (one CTA
// per row kept only 64 SMs busy on a 64-row request, each with a few loads in flight against
// DRAM). A task is one CTA's turn on kCombineWarps / G items of one request; the requests'
// tasks are dealt to the CTAs round-robin, continuing from one request to the next. Each CTA
// finds its tasks for kCombineThreads requests at a time with one block-wide scan (a walk over
// the request list with a 64-bit modulo per request cost about 1 us per cut request).
// Per item the group's warps take pieces k, k + G, ..., then one reduction in shared memory:
// M = max m_s, l = sum l_s 2^(m_s - M), o = sum l_s 2^(m_s - M) o_s / l, lse = (M + log2 l) ln 2.
// Rows of whole requests were written by the attention kernel and are not touched. Pieces
// with l_s = 0 hold no key (their o is 0, never NaN: the kernel writes 0 for them); none at
// all gives o = 0, lse = -inf; a NaN l_s or m_s poisons the row (the CPU merge's rule).
constexpr int kCombineWarps = 8;
constexpr int kCombineThreads = 32 * kCombineWarps;
constexpr int kCombineSlices = 4;
constexpr int kSliceCols = kRank / kCombineSlices;
static_assert(kSliceCols == 32 * 4, "a warp covers one slice with one float4 per lane");
constexpr int kPiecesPerWarp = 4;     // a group grows only while each warp keeps this many pieces
// Four 256-thread CTAs an SM: __launch_bounds__ holds ptxas to 64 registers a thread (no
// spills at four loads in flight a warp), and the grid is sized to what is resident.
constexpr int kCombineCtasPerSm = 4;

__device__ __forceinline__ int combine_group_warps(int pieces) {
  int g = 1;
  while (g < kCombineWarps && 2 * g * kPiecesPerWarp <= pieces) g *= 2;
  return g;
}

// The requests in hand: their pieces, rows, first output row and tasks, this CTA's first task
// in each, and the list of those it has a task in.
struct CombineRequests {
  int first[kCombineThreads], count[kCombineThreads], rows[kCombineThreads], tasks[kCombineThreads];
  int start[kCombineThreads], mine[kCombineThreads], n_mine;
  int64_t row0[kCombineThreads];
};

__global__ void __launch_bounds__(kCombineThreads, kCombineCtasPerSm)
    split_merge_kernel(const __grid_constant__ AttentionParams p) {
  // The plan was copied before the attention kernel ran (stream order), so its header may be
  // read before the wait: a plan that cut no request exits here, beside the attention grid's
  // last CTAs, instead of waiting for that grid to complete (a captured graph holds the
  // combine wherever the planner may cut, and replays it for plans that cut nothing).
  const PlanHeader hdr = *p.plan.header;
  if (hdr.split_requests == 0) return;
  // Launched early (launch_split_merge): the attention grid's partials are complete and
  // visible only after this.
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  const bool stamps = threadIdx.x == 0 && blockIdx.x < unsigned(kTraceCtas);
  if (stamps) trace_stamp(p.trace, kTraceCombine + 2 * int(blockIdx.x));
  const float kNegInf = neg_inf();
  using Scan = cub::BlockScan<int, kCombineThreads>;
  __shared__ typename Scan::TempStorage scan;
  __shared__ CombineRequests req;
  __shared__ float4 red[kCombineWarps][32];
  __shared__ float red_m[kCombineWarps], red_l[kCombineWarps];
  __shared__ int red_any[kCombineWarps];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int slot_rows = hdr.qlen * p.heads, row_items = slot_rows * kCombineSlices;
  const int64_t grid = gridDim.x;
  int64_t dealt = 0;  // tasks of the requests before those in hand, mod grid (the same in every CTA)
  for (int base = 0; base < hdr.split_requests; base += kCombineThreads) {
    const int j = threadIdx.x, i = base + j;
    int tasks = 0;
    if (i < hdr.split_requests) {
      const int first = p.plan.split_slot[i], count = p.plan.split_slot[i + 1] - first;
      const int b = p.plan.split_request[i];
      const int per_task = kCombineWarps / combine_group_warps(count);
      tasks = (row_items + per_task - 1) / per_task;
      req.first[j] = first;
      req.count[j] = count;
      req.rows[j] = (p.plan.q_start[b + 1] - p.plan.q_start[b]) * p.heads;
      req.row0[j] = int64_t(p.plan.q_start[b]) * p.heads;
    }
    int offset, total;
    Scan(scan).ExclusiveSum(tasks, offset, total);
    if (j == 0) req.n_mine = 0;
    __syncthreads();
    if (tasks > 0) {
      // This CTA runs the request's tasks t with (dealt + offset + t) % grid == blockIdx.x.
      const int start = int(((int64_t(blockIdx.x) - dealt - offset) % grid + grid) % grid);
      if (start < tasks) {
        req.tasks[j] = tasks;
        req.start[j] = start;
        req.mine[atomicAdd(&req.n_mine, 1)] = j;
      }
    }
    __syncthreads();
    const int n_mine = req.n_mine;
    for (int k = 0; k < n_mine; ++k) {
      const int r = req.mine[k];
      const int count = req.count[r], rows = req.rows[r];
      const int group_warps = combine_group_warps(count), per_task = kCombineWarps / group_warps;
      const int group = warp / group_warps, gw = warp % group_warps, lead = group * group_warps;
      // Every warp runs every task (the barriers are the CTA's); an item past the request's
      // items or on a padding row of a shorter request is a group with no pieces.
      for (int t = req.start[r]; t < req.tasks[r]; t += int(grid)) {
        const int item = t * per_task + group;
        const int rr = item / kCombineSlices, col = (item % kCombineSlices) * kSliceCols + lane * 4;
        const bool valid = item < row_items && rr < rows;
        const int first = req.first[r], pieces = valid ? count : 0;
        // The row's maximum over every piece holding a key (all lanes of the group), and
        // whether any does: a NaN l_s (a NaN score; its m_s may be -inf) is not empty and
        // poisons the row.
        float m = kNegInf;
        bool any = false;
        for (int s = gw * 32 + lane; s < pieces; s += group_warps * 32) {
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
          for (int s = gw; s < pieces; s += group_warps) {
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
          const int64_t row = req.row0[r] + rr;
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
        __syncthreads();  // red is reused by the next task
      }
    }
    dealt = (dealt + total) % grid;
    __syncthreads();  // req and scan are rewritten for the next requests
  }
  if (stamps) trace_stamp(p.trace, kTraceCombine + 2 * int(blockIdx.x) + 1);
}

// A programmatic dependent launch behind the attention kernel (the stream's previous kernel):
// its launch is processed while the attention kernel runs, and its CTAs start as the
// attention CTAs exit (the implicit trigger) and wait in the kernel for the partials, instead
// of the launch starting after the grid has completed. Also under graph capture (a
// programmatic edge). The attention kernels do not trigger earlier: griddepcontrol in their
// unit loop cost ptxas 25 more registers in the wgmma kernel.
// The grid follows the capacities (graph-safe): as many CTAs as (row, slice) items of the most
// rows a plan can cut, up to the resident CTAs of the GPU; a CTA runs a request's tasks of
// kCombineWarps / G items, and CTAs with no task exit after the request list.
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
