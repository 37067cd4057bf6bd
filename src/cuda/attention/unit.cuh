// A CTA's unit of work, shared by the attention kernels: the plan's scalars (plan_scalars),
// which rows and tokens a unit covers (unit_span), and how it ends: one row's slice of O
// normalised by its l, and the row's statistics, as split-K partials or as the final
// output and lse. Also how each kernel is launched (launch_attention_kernel).
#pragma once

#include <atomic>
#include <cstdint>
#include <string>

#include "common/params.h"
#include "common/utils.cuh"
#include "config.h"

namespace dcpmla::cuda_detail {

// The device plan's scalars for CTAs of M rows, read from plan memory (never from launch
// arguments, so a replayed graph sees the current batch).
struct PlanScalars {
  bool split;  // route split_k: (o / l, m, l) partials instead of out and lse
  int qlen, page, page_shift, rows_total, groups, units;  // page is a power of two
};

// The fp8 cache scale: the device value when the caller passed one (read at run time, so a
// replayed graph sees the current scale), else the launch's.
__device__ __forceinline__ float kv_scale_of(const AttentionParams& p) {
  return p.kv_scale_dev != nullptr ? *p.kv_scale_dev : p.kv_scale;
}

template <int M>
__device__ __forceinline__ PlanScalars plan_scalars(const AttentionParams& p) {
  const PlanHeader hdr = *p.plan.header;
  PlanScalars s;
  s.split = hdr.route == int32_t(Route::split_k);
  s.qlen = hdr.qlen;
  s.page = hdr.page;
  s.page_shift = __ffs(hdr.page) - 1;
  s.rows_total = hdr.qlen * p.heads;
  s.groups = (s.rows_total + M - 1) / M;
  s.units = hdr.work_count * s.groups;
  return s;
}

// Unit `unit` = (work item witem, row group): rows [row0, row0 + nr) of request b over the
// item's tokens [tok_lo, tok_hi) in ntiles tiles of NT. lens: the request's per-row local
// lengths (qlen); subpages: its row of the sub-page table.
struct UnitSpan {
  int witem, b, row0, nr, tok_lo, tok_hi, ntiles;
  const int32_t* lens;
  const int32_t* subpages;
};

template <int M, int NT>
__device__ __forceinline__ UnitSpan unit_span(const AttentionParams& p, int unit, const PlanScalars& ps) {
  UnitSpan u;
  u.witem = unit / ps.groups;
  const WorkItem item = p.plan.work[u.witem];
  u.b = item.request;
  u.row0 = (unit % ps.groups) * M;
  u.nr = min(M, ps.rows_total - u.row0);
  u.lens = p.plan.row_local_len + int64_t(u.b) * ps.qlen;
  u.subpages = p.plan.subpage_table + int64_t(u.b) * p.plan.header->table_stride;
  int longest = 0;
  for (int q = 0; q < ps.qlen; ++q) longest = max(longest, u.lens[q]);
  // Tokens past the longest row are never read: they may be NaN (poisoned) or unmapped.
  u.tok_lo = item.tile_begin * ps.page;
  u.tok_hi = min(item.tile_end * ps.page, longest);
  u.ntiles = u.tok_hi > u.tok_lo ? (u.tok_hi - u.tok_lo + NT - 1) / NT : 0;
  return u;
}

// Columns col + STRIDE n, col + STRIDE n + 1 (n < N) of row `row` from pair(n) = (o, o'),
// scaled by out_scale / l: l = 0 means no key (o = 0); a NaN l propagates.
template <int N, int STRIDE = 8, typename Pair>
__device__ __forceinline__ void store_row_slice(const AttentionParams& p, bool split, int witem, int b, int rows_total,
                                                int64_t row, int col, float l, float out_scale, Pair pair) {
  const float sc = l != 0.0f ? out_scale / l : 0.0f;
  if (split) {
    float* dst = p.part_o + (int64_t(witem) * rows_total + row) * kRank + col;
#pragma unroll
    for (int n = 0; n < N; ++n) {
      const float2 v = pair(n);
      *reinterpret_cast<float2*>(dst + n * STRIDE) = make_float2(v.x * sc, v.y * sc);
    }
  } else {
    bf16* dst = p.out + (int64_t(b) * rows_total + row) * kRank + col;
#pragma unroll
    for (int n = 0; n < N; ++n) {
      const float2 v = pair(n);
      *reinterpret_cast<uint32_t*>(dst + n * STRIDE) = pack_bf16x2(v.x * sc, v.y * sc);
    }
  }
}

// m (base 2) and l of a row: (m, l) partials for split_k (m = -inf where l = 0), else the
// natural-log lse (-inf for a row with no key).
__device__ __forceinline__ void store_row_stats(const AttentionParams& p, bool split, int witem, int b, int rows_total,
                                                int64_t row, float m, float l) {
  const float kNegInf = -__int_as_float(0x7f800000);
  if (split) {
    p.part_m[int64_t(witem) * rows_total + row] = l != 0.0f ? m : kNegInf;
    p.part_l[int64_t(witem) * rows_total + row] = l;
  } else {
    p.lse[int64_t(b) * rows_total + row] = l != 0.0f ? (m + __log2f(l)) * 0.6931471805599453f : kNegInf;
  }
}

// Launches attention kernel K (`name` in errors) on `grid` CTAs of `threads` with `smem`
// bytes of dynamic shared memory; grid = 0 only opts K into its shared memory. The opt-in is
// per function and device, set once per device (a host-side call, also legal while a stream
// is being captured).
template <auto K>
void launch_attention_kernel(const AttentionParams& p, int grid, int threads, int smem, cudaStream_t stream,
                             const char* name) {
  static std::atomic<uint64_t> configured{0};
  int device = 0;
  check(cudaGetDevice(&device), "cudaGetDevice");
  const uint64_t bit = uint64_t(1) << (device & 63);
  if (!(configured.load() & bit)) {
    const cudaError_t e = cudaFuncSetAttribute(K, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (e != cudaSuccess) check(e, (std::string("cudaFuncSetAttribute(") + name + ", max dynamic shared memory)").c_str());
    configured.fetch_or(bit);
  }
  if (grid > 0) {
    K<<<grid, threads, smem, stream>>>(p);
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) check(e, (std::string(name) + " launch").c_str());
  }
}

}  // namespace dcpmla::cuda_detail
