// A CTA's unit of work, shared by the attention kernels: which rows and tokens it covers
// (unit_span), and how it ends: one row's slice of O normalised by its l, and the row's
// statistics, as split-K partials or as the final output and lse.
#pragma once

#include <cstdint>

#include "../params.h"
#include "../utils.cuh"
#include "config.h"

namespace dcpmla::cuda_detail {

// Unit `unit` = (work item witem, row group): rows [row0, row0 + nr) of request b over the
// item's tokens [tok_lo, tok_hi) in ntiles tiles of NT. lens: the request's per-row local
// lengths (qlen); subpages: its row of the sub-page table.
struct UnitSpan {
  int witem, b, row0, nr, tok_lo, tok_hi, ntiles;
  const int32_t* lens;
  const int32_t* subpages;
};

template <int M, int NT>
__device__ __forceinline__ UnitSpan unit_span(const AttentionParams& p, int unit, int groups, int qlen, int page,
                                              int rows_total) {
  UnitSpan u;
  u.witem = unit / groups;
  const WorkItem item = p.plan.work[u.witem];
  u.b = item.request;
  u.row0 = (unit % groups) * M;
  u.nr = min(M, rows_total - u.row0);
  u.lens = p.plan.row_local_len + int64_t(u.b) * qlen;
  u.subpages = p.plan.subpage_table + int64_t(u.b) * p.plan.table_stride;
  int longest = 0;
  for (int q = 0; q < qlen; ++q) longest = max(longest, u.lens[q]);
  // Tokens past the longest row are never read: they may be NaN (poisoned) or unmapped.
  u.tok_lo = item.tile_begin * page;
  u.tok_hi = min(item.tile_end * page, longest);
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

}  // namespace dcpmla::cuda_detail
