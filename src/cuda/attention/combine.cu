// The combine of the cut requests' partials (the split-K merge kernel).
#include <algorithm>
#include <cmath>

#include <cub/block/block_scan.cuh>

#include "common/params.h"
#include "common/utils.cuh"
#include "config.h"
#include "dcpmla/cuda.h"

namespace dcpmla::cuda_detail {

// The combine of the cut requests' rows (the schedule's partials). An item is one cut row,
// or for a request cut into more than kSlicePieces pieces one 128-column slice of it (lane l
// holds columns 4 l + 128 j of the item: V = 4 float4 a piece for a row, 1 for a slice), run
// by a group of G warps, G a power of two up to kCombineWarps chosen per cut request from its
// own piece count: the common two or three pieces get a warp per row, a request cut into a
// hundred pieces (a long request among short ones) gets whole CTAs per slice, four times the
// warps a row would have. A task is one CTA's turn on kCombineWarps / G items of one request;
// the requests' tasks are dealt to the CTAs round-robin, continuing from one request to the
// next. Each CTA finds its tasks for kCombineThreads requests at a time with one block-wide
// scan (a walk over the request list with a 64-bit modulo per request cost about 1 us per cut
// request); the plan is in memory before the attention kernel runs, so the first scan runs
// before the wait for the partials, beside the attention grid's last CTAs.
// The combine reads each partial once from L2 and a CTA's time is about one round trip of its
// batch of loads, taken while every CTA loads at once (Nsight: the warps wait on the first use
// of a batch; half the bytes, more loads in flight through shared memory and an L2 prefetch
// before the wait did not shorten it: bench/NOTES.md, twenty-third session). So a warp folds
// its pieces k, k + G, ... a batch at a time, all loads of a batch issued before any is used,
// into a running state (online: M = max m_s, l = sum l_s 2^(m_s - M), acc = sum l_s
// 2^(m_s - M) o_s, rescaled when M grows), so no load waits for another row statistic; a
// group's warps then merge their states in shared memory once (one barrier a task,
// double-buffered), o = acc / l, lse = (M + log2 l) ln 2. (The tenth session's form, an item
// per (row, 128-column slice) whatever the piece count, every m_s read before any o and two
// barriers per item, took 6-14 us a combine at 18 % of L2's throughput.)
// Rows of whole requests were written by the attention kernel and are not touched. Pieces
// with l_s = 0 hold no key and are skipped; none at all gives o = 0, lse = -inf; a NaN l_s
// or m_s poisons the row (the CPU merge's rule).
constexpr int kCombineWarps = 8;
constexpr int kCombineThreads = 32 * kCombineWarps;
constexpr int kRowVecs = kRank / 128;  // float4 a lane per piece of a whole row
static_assert(kRowVecs * 128 == kRank, "a warp covers a row with kRowVecs float4 per lane");
// Pieces a warp has in flight per batch: 3 of a row (12 float4 a lane), 4 of a slice (ptxas
// kept no larger pair within 128 registers: 4 and 4 spilled, as did 2 and 8).
template <int V>
inline constexpr int kCombineBatch = V == 1 ? 4 : 3;
constexpr int kPiecesPerWarp = 4;  // a group grows only while each warp keeps this many pieces
// Past this many pieces a request's items are slices: its group is already kCombineWarps warps
// with kPiecesPerWarp pieces each, and only more items add warps.
constexpr int kSlicePieces = kCombineWarps * kPiecesPerWarp;
// Two 256-thread CTAs an SM: __launch_bounds__ holds ptxas to 128 registers a thread, and the
// grid is sized to what is resident.
constexpr int kCombineCtasPerSm = 2;

__device__ __forceinline__ int combine_group_warps(int pieces) {
  int g = 1;
  while (g < kCombineWarps && 2 * g * kPiecesPerWarp <= pieces) g *= 2;
  return g;
}
// Items per cut row: 1 (a whole row) or kRowVecs slices.
__device__ __forceinline__ int combine_slices(int pieces) { return pieces > kSlicePieces ? kRowVecs : 1; }

// The requests in hand: their pieces, rows, first output row and tasks, this CTA's first task
// in each, and the list of those it has a task in.
struct CombineRequests {
  int first[kCombineThreads], count[kCombineThreads], rows[kCombineThreads], tasks[kCombineThreads];
  int start[kCombineThreads], mine[kCombineThreads], n_mine;
  int64_t row0[kCombineThreads];
};

// The group merge's shared memory: each warp's state, double-buffered.
struct CombineReduce {
  float4 acc[2][kCombineWarps][kRowVecs][32];
  float m[2][kCombineWarps], l[2][kCombineWarps];
};

// One warp's running merge of an item: M, l (the same in every lane) and its columns' acc.
template <int V>
struct CombineState {
  float m, l;
  float4 acc[V];
};

__device__ __forceinline__ void scale_add(float4& a, float c, float w, const float4& v) {
  a.x = a.x * c + w * v.x;
  a.y = a.y * c + w * v.y;
  a.z = a.z * c + w * v.z;
  a.w = a.w * c + w * v.w;
}

// Folds (m_s, l_s, o_s) into st. An empty state (l = 0) or piece (l_s = 0) is skipped by its
// factor, never rescaled through -inf - -inf; NaN in l_s or m_s reaches l and acc.
template <int V>
__device__ __forceinline__ void combine_fold(CombineState<V>& st, float ms, float ls, const float4 (&v)[V]) {
  if (ls == 0.0f) return;
  const float m = nan_max(st.m, ms);
  const float c = st.l != 0.0f ? exp2f(st.m - m) : 0.0f;
  const float w = ls * exp2f(ms - m);
  st.m = m;
  st.l = st.l * c + w;
#pragma unroll
  for (int j = 0; j < V; ++j) scale_add(st.acc[j], c, w, v[j]);
}

// One item of a cut request: row rr's columns col0 + 4 lane + 128 j (j < V) over the
// request's pieces (first_slot on), by the group's warp gw of G; the group's first warp
// stores the row's output (and, where col0 = 0, its lse) unless the item is not `valid`. The
// barrier is the CTA's: every warp calls this for every task of a request with G > 1.
template <int V>
__device__ __forceinline__ void combine_item(const AttentionParams& p, CombineReduce& red, int& buf, int64_t first_slot,
                                             int slot_rows, int pieces, int64_t row, int rr, int col0, bool valid,
                                             int warp, int gw, int group_warps, int lane) {
  constexpr int kBatch = kCombineBatch<V>;
  CombineState<V> st{kNegInf, 0.0f, {}};
  const int own = valid ? pieces : 0;
  for (int s0 = gw; s0 < own; s0 += kBatch * group_warps) {
    float ms[kBatch], ls[kBatch];
    float4 v[kBatch][V];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int s = s0 + b * group_warps;
      ms[b] = 0.0f;
      ls[b] = 0.0f;
      if (s < own) {
        const int64_t at = (first_slot + s) * slot_rows + rr;
        ms[b] = __ldcs(p.part_m + at);
        ls[b] = __ldcs(p.part_l + at);
        const float4* o = reinterpret_cast<const float4*>(p.part_o + at * kRank + col0) + lane;
#pragma unroll
        for (int j = 0; j < V; ++j) v[b][j] = __ldcs(o + 32 * j);
      }
    }
#pragma unroll
    for (int b = 0; b < kBatch; ++b) combine_fold(st, ms[b], ls[b], v[b]);
  }
  if (group_warps > 1) {
    // The group's states, merged by its first warp (the l = 0 guard as in combine_fold).
#pragma unroll
    for (int j = 0; j < V; ++j) red.acc[buf][warp][j][lane] = st.acc[j];
    if (lane == 0) {
      red.m[buf][warp] = st.m;
      red.l[buf][warp] = st.l;
    }
    __syncthreads();
    if (gw == 0) {
      const int lead = warp;
      float m = kNegInf;
      for (int w = lead; w < lead + group_warps; ++w)
        if (red.l[buf][w] != 0.0f) m = nan_max(m, red.m[buf][w]);
      st = CombineState<V>{m, 0.0f, {}};
      for (int w = lead; w < lead + group_warps; ++w) {
        const float lw = red.l[buf][w];
        if (lw == 0.0f) continue;
        const float c = exp2f(red.m[buf][w] - m);
        st.l += lw * c;
#pragma unroll
        for (int j = 0; j < V; ++j) scale_add(st.acc[j], 1.0f, c, red.acc[buf][w][j][lane]);
      }
    }
    buf ^= 1;  // the next task writes the other buffer; the one after follows its barrier
  }
  if (valid && gw == 0) {
    // No piece held a key: o = 0, lse = -inf (l = 0 then, and every acc is 0).
    const float inv = st.l != 0.0f ? 1.0f / st.l : 0.0f;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const float4 a = st.acc[j];
      const __nv_bfloat162 lo = __floats2bfloat162_rn(a.x * inv, a.y * inv);
      const __nv_bfloat162 hi = __floats2bfloat162_rn(a.z * inv, a.w * inv);
      uint2 o;
      o.x = *reinterpret_cast<const uint32_t*>(&lo);
      o.y = *reinterpret_cast<const uint32_t*>(&hi);
      *reinterpret_cast<uint2*>(p.out + row * kRank + col0 + 128 * j + 4 * lane) = o;
    }
    if (lane == 0 && col0 == 0) p.lse[row] = st.l != 0.0f ? (st.m + log2f(st.l)) * kLn2 : kNegInf;
  }
}

__global__ void __launch_bounds__(kCombineThreads, kCombineCtasPerSm)
    split_merge_kernel(const __grid_constant__ AttentionParams p) {
  // The plan was copied before the attention kernel ran (stream order), so it may be read
  // before the wait. Every CTA waits for the attention grid before it exits, also with nothing
  // to merge (a plan that cut nothing: a captured graph holds the combine wherever the planner
  // may cut, and replays it for any plan): a kernel an engine launches behind this one as a
  // programmatic dependent launch waits, by PTX's terms, only for this grid, so this grid does
  // not complete before the attention grid has. (Defensive: the early exit was not seen to
  // break such a kernel on the H200; bench/NOTES.md, twenty-sixth session.)
  const PlanHeader hdr = *p.plan.header;
  const bool stamps = threadIdx.x == 0 && blockIdx.x < unsigned(kTraceCtas);
  using Scan = cub::BlockScan<int, kCombineThreads>;
  __shared__ typename Scan::TempStorage scan;
  __shared__ CombineRequests req;
  __shared__ CombineReduce red;
  int buf = 0;
  bool waited = false;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int slot_rows = hdr.qlen * p.heads;
  const int64_t grid = gridDim.x;
  int64_t dealt = 0;  // tasks of the requests before those in hand, mod grid (the same in every CTA)
  for (int base = 0; base < hdr.split_requests; base += kCombineThreads) {
    const int j = threadIdx.x, i = base + j;
    int tasks = 0;
    if (i < hdr.split_requests) {
      const int first = p.plan.split_slot[i], count = p.plan.split_slot[i + 1] - first;
      const int b = p.plan.split_request[i];
      const int per_task = kCombineWarps / combine_group_warps(count);
      tasks = (slot_rows * combine_slices(count) + per_task - 1) / per_task;
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
    if (n_mine > 0 && !waited) {
      // Launched early (launch_split_merge): the attention grid's partials are complete and
      // visible only after this.
      wait_prior_grids();
      waited = true;
      if (stamps) trace_stamp(p.trace, kTraceCombine + 2 * int(blockIdx.x));
    }
    for (int k = 0; k < n_mine; ++k) {
      const int r = req.mine[k];
      const int count = req.count[r], rows = req.rows[r], slices = combine_slices(count);
      const int group_warps = combine_group_warps(count), per_task = kCombineWarps / group_warps;
      const int group = warp / group_warps, gw = warp % group_warps;
      // Every warp runs every task (the barrier is the CTA's); an item past the request's rows
      // (a shorter request's padding, or past the last task's) is a group with no pieces.
      for (int t = req.start[r]; t < req.tasks[r]; t += int(grid)) {
        const int item = t * per_task + group, rr = item / slices;
        const int64_t row = req.row0[r] + rr;
        if (slices == 1)
          combine_item<kRowVecs>(p, red, buf, req.first[r], slot_rows, count, row, rr, 0, rr < rows, warp, gw,
                                 group_warps, lane);
        else
          combine_item<1>(p, red, buf, req.first[r], slot_rows, count, row, rr, 128 * (item % slices), rr < rows,
                          warp, gw, group_warps, lane);
      }
    }
    dealt = (dealt + total) % grid;
    __syncthreads();  // req and scan are rewritten for the next requests
  }
  if (!waited) wait_prior_grids();  // nothing merged here (above)
  else if (stamps) trace_stamp(p.trace, kTraceCombine + 2 * int(blockIdx.x) + 1);
}

// A programmatic dependent launch behind the attention kernel (the stream's previous kernel):
// the wgmma and swap kernels trigger it as their CTAs start (cta_start; the mma.sync kernel
// when its CTAs exit), so its CTAs take the SMs as the attention CTAs leave them and wait in
// the kernel for the partials, instead of the launch starting after the grid has completed.
// Also under graph capture (a programmatic edge). The trigger is in the kernels' prologue:
// griddepcontrol in the unit loop cost ptxas 25 more registers in the wgmma kernel.
// The grid follows the capacities (graph-safe): a CTA per task of the most tasks a plan can
// make, kRowVecs a cut row (the slices of a request cut into more than kSlicePieces pieces,
// one item a task), up to the resident CTAs of the GPU; a CTA runs a request's tasks of
// kCombineWarps / G items, and CTAs with no task exit after the request list.
void launch_split_merge(const AttentionParams& p, int64_t max_cut_rows, int num_sms, cudaStream_t stream) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(unsigned(std::min<int64_t>(max_cut_rows * kRowVecs, int64_t(num_sms) * kCombineCtasPerSm)));
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
