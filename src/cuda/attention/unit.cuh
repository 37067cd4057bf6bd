// A CTA's units of work, shared by the attention kernels: the plan's scalars (plan_scalars),
// which units a CTA runs (next_unit: its chunk of the balanced schedule, for its row group),
// which rows and tokens a unit covers (unit_span), and how it ends: one row's slice of O
// normalised by its l, and the row's statistics, as split-K partials of a cut request or as
// the final output and lse. Also how each kernel is launched (launch_attention_kernel).
#pragma once

#include <atomic>
#include <cstdint>
#include <string>

#include "common/params.h"
#include "common/utils.cuh"
#include "config.h"

namespace dcpmla::cuda_detail {

// The fp8 cache scale: the device value when the caller passed one (read at run time, so a
// replayed graph sees the current scale), else the launch's.
__device__ __forceinline__ float kv_scale_of(const AttentionParams& p) {
  return p.kv_scale_dev != nullptr ? *p.kv_scale_dev : p.kv_scale;
}

// The device plan's scalars for CTAs of M rows, read from plan memory (never from launch
// arguments, so a replayed graph sees the current batch).
struct PlanScalars {
  int page, page_shift;  // page is a power of two
  int slot_rows;         // rows of a partial slot: the step's qlen x heads
  // CTA slot c runs chunk c / groups for row group c % groups: the CTAs that read the same
  // tokens for different row groups are neighbours (launched together, on one GPC: they
  // share their L2 partition instead of crossing the L2 fabric).
  int groups, chunks;
};

// Diagnostics (AttentionParams::trace): attention CTA b's start (end = false, with its SM) or
// end, each on the global timer and the SM's cycle counter; one thread of the CTA stamps.
__device__ __forceinline__ void trace_cta(const AttentionParams& p, bool end) {
  if (blockIdx.x < unsigned(kTraceCtas) && p.trace != nullptr) {
    trace_stamp(p.trace, 2 * int(blockIdx.x) + int(end));
    p.trace[kTraceCycles + 2 * blockIdx.x + int(end)] = uint64_t(clock64());
    if (!end) p.trace[kTraceSm + blockIdx.x] = sm_id();
  }
}

// Every attention kernel's first step once its barriers are set up: lets the combine's CTAs
// launch now (a programmatic dependent launch, launch_split_merge: they take the SMs the
// attention CTAs leave, read the plan and wait in-kernel for the partials, instead of
// launching after the last attention CTA has exited), and stamps the CTA's start.
__device__ __forceinline__ void cta_start(const AttentionParams& p, int tid) {
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
  if (tid == 0) trace_cta(p, false);
}

template <int M>
__device__ __forceinline__ PlanScalars plan_scalars(const AttentionParams& p) {
  const PlanHeader hdr = *p.plan.header;
  PlanScalars s;
  s.page = hdr.page;
  s.page_shift = __ffs(hdr.page) - 1;
  s.slot_rows = hdr.qlen * p.heads;
  s.groups = (hdr.widest_qlen * p.heads + M - 1) / M;
  s.chunks = hdr.chunks;
  return s;
}

// Where a CTA is in its units: CTA slots blockIdx.x, + gridDim.x, ... (one, when the grid
// covers groups x chunks), and in each, its chunk's pieces with rows in its row group.
struct UnitCursor {
  int slot, group, w, w_end;
};

__device__ __forceinline__ UnitCursor unit_cursor() { return UnitCursor{int(blockIdx.x) - int(gridDim.x), 0, 0, 0}; }

// Advances to the CTA's next unit; false when it has none left. Every role of a CTA walks
// the same units in the same order.
template <int M>
__device__ __forceinline__ bool next_unit(const AttentionParams& p, const PlanScalars& ps, UnitCursor& cur) {
  for (;;) {
    if (++cur.w < cur.w_end) {
      const int b = p.plan.work[cur.w].request;
      if ((p.plan.q_start[b + 1] - p.plan.q_start[b]) * p.heads > cur.group * M) return true;
      continue;  // this request has no row in the group
    }
    cur.slot += gridDim.x;
    if (cur.slot >= ps.groups * ps.chunks) return false;
    cur.group = cur.slot % ps.groups;
    const int k = cur.slot / ps.groups;
    cur.w = p.plan.chunk_work[k] - 1;
    cur.w_end = p.plan.chunk_work[k + 1];
  }
}

// A unit: rows [row0, row0 + nr) (query row x head, flattened) of request b over the piece's
// tokens [tok_lo, tok_hi) in ntiles tiles of NT. q_row: the unit's first row in q (packed
// rows); dst_row: the first row it writes, in out and lse, or in its partial slot (split).
// lens: the request's per-query-row local lengths; subpages: its row of the sub-page table.
struct UnitSpan {
  int b, row0, nr, tok_lo, tok_hi, ntiles;
  bool split;
  int64_t q_row, dst_row;
  const int32_t* lens;
  const int32_t* subpages;
};

template <int M, int NT>
__device__ __forceinline__ UnitSpan unit_span(const AttentionParams& p, const UnitCursor& cur, const PlanScalars& ps) {
  UnitSpan u;
  const WorkItem item = p.plan.work[cur.w];
  u.b = item.request;
  const int q0 = p.plan.q_start[u.b], qlen = p.plan.q_start[u.b + 1] - q0;
  u.row0 = cur.group * M;
  u.nr = min(M, qlen * p.heads - u.row0);
  u.lens = p.plan.row_local_len + q0;
  u.subpages = p.plan.subpage_table + int64_t(u.b) * p.plan.header->table_stride;
  // The piece ends at or before the request's longest row (WorkItem), so no token past it is
  // read; not reloading the row lengths here spares a CTA's start a dependent load.
  u.tok_lo = item.tok_begin;
  u.tok_hi = item.tok_end;
  u.ntiles = u.tok_hi > u.tok_lo ? (u.tok_hi - u.tok_lo + NT - 1) / NT : 0;
  u.split = item.slot >= 0;
  u.q_row = int64_t(q0) * p.heads + u.row0;
  u.dst_row = u.split ? int64_t(item.slot) * ps.slot_rows + u.row0 : u.q_row;
  return u;
}

// The sub-page holding token jt of the unit's tile i, from its row of the sub-page table; 0
// past the last tile or at or past tok_hi, where the loaders read nothing (zero-fill) and
// the table may end.
__device__ __forceinline__ int token_subpage(const UnitSpan& u, const PlanScalars& ps, int i, int jt) {
  return (i < u.ntiles && jt < u.tok_hi) ? u.subpages[jt >> ps.page_shift] : 0;
}

// Token jt's stored row (ROW_BYTES) in the paged cache, on its sub-page.
template <int ROW_BYTES>
__device__ __forceinline__ const uint8_t* token_row(const AttentionParams& p, const PlanScalars& ps, int subpage,
                                                    int jt) {
  return p.kv + (int64_t(subpage) * ps.page + (jt & (ps.page - 1))) * ROW_BYTES;
}

// A producer's prefetch into L2 of token jt's run in the tile [j0, j1): one bulk prefetch
// from its row, by one thread per token, where jt starts a run (the tile's first token or a
// page's), so that each page's part of the tile is asked for once and a warp's prefetches
// stay few (the bulk prefetch loops over a warp's distinct addresses).
template <int ROW_BYTES>
__device__ __forceinline__ void prefetch_tile_run_l2(const PlanScalars& ps, int jt, int j0, int j1, const uint8_t* row) {
  if (jt < j1 && (jt == j0 || (jt & (ps.page - 1)) == 0))
    prefetch_l2(row, uint32_t(min(j1, (jt | (ps.page - 1)) + 1) - jt) * ROW_BYTES);
}

// A producer's prefetch (one thread) of unit u's Q rows into L2 as it reaches the unit, a few
// tiles before the unit's Q is loaded (the rows of a unit are contiguous in q), so that load
// finds them in L2 instead of DRAM.
__device__ __forceinline__ void prefetch_unit_q(const AttentionParams& p, const UnitSpan& u) {
  if (u.nr > 0) prefetch_l2(p.q + u.q_row * kDim, uint32_t(u.nr) * kDim * 2);
}

// The factor a row's O is stored with, out_scale / l: l = 0 means no key (o = 0, stored as 0);
// a NaN l propagates.
__device__ __forceinline__ float row_out_factor(float l, float out_scale) { return l != 0.0f ? out_scale / l : 0.0f; }

// Columns col + STRIDE n, col + STRIDE n + 1 (n < N) of row dst_row + r of unit u, from
// pair(n) = (o, o'), scaled by row_out_factor. A partial is kept in L2 for the combine
// (l2_keep_policy). Each lane stores its own pairs, 4 or 8 bytes at a time: the fp8 swap
// kernel's form (its epilogue runs in one consumer warpgroup at the register limit;
// store_row_lanes' trade made it 2-4 % slower: bench/NOTES.md, thirtieth session). The other
// kernels trade first (store_row_lanes).
template <int N, int STRIDE = 8, typename Pair>
__device__ __forceinline__ void store_row_slice(const AttentionParams& p, const UnitSpan& u, int r, int col, float l,
                                                float out_scale, Pair pair) {
  const float sc = row_out_factor(l, out_scale);
  const int64_t row = u.dst_row + r;
  if (u.split) {
    float* dst = p.part_o + row * kRank + col;
    const uint64_t keep = l2_keep_policy();
#pragma unroll
    for (int n = 0; n < N; ++n) {
      const float2 v = pair(n);
      st_global_kept(dst + n * STRIDE, make_float2(v.x * sc, v.y * sc), keep);
    }
  } else {
    bf16* dst = p.out + row * kRank + col;
#pragma unroll
    for (int n = 0; n < N; ++n) {
      const float2 v = pair(n);
      *reinterpret_cast<uint32_t*>(dst + n * STRIDE) = pack_bf16x2(v.x * sc, v.y * sc);
    }
  }
}

// Trades between the lanes that share an output row, so that each lane stores 16 contiguous
// bytes and a warp's store writes whole 32-byte sectors: the kernels' accumulator layouts give
// a lane 2 adjacent columns of a row, and their 4- and 8-byte stores took 4x (bf16) or 2x
// (fp32) the store instructions on half sectors; at a unit's end these held up the next unit
// by several microseconds (bench/NOTES.md, thirtieth session). Every lane of the warp calls
// them (shuffles).
// Four lanes k = 0..3 (bit 0 of k: lane ^ X1; bit 1: lane ^ X2) hold a 4 x 4 matrix of words,
// w[i] = M[k][i]; lane k gets column k, M[0..3][k], in two rounds of swaps.
template <int X1, int X2>
__device__ __forceinline__ uint4 transpose4(const uint32_t (&w)[4], int k) {
  constexpr uint32_t kAll = 0xffffffffu;
  const bool hi = k & 2, odd = k & 1;
  // Round 1: keep columns kb, kb + 1 (kb = k & 2); get them from lane k ^ 2.
  const uint32_t k0 = hi ? w[2] : w[0], k1 = hi ? w[3] : w[1];
  const uint32_t r0 = __shfl_xor_sync(kAll, hi ? w[0] : w[2], X2), r1 = __shfl_xor_sync(kAll, hi ? w[1] : w[3], X2);
  // Round 2: keep column k of rows k, k ^ 2; get it from lane k ^ 1 (its rows k ^ 1, k ^ 3).
  const uint32_t a = odd ? k1 : k0, b = odd ? r1 : r0;
  const uint32_t a1 = __shfl_xor_sync(kAll, odd ? k0 : k1, X1), b1 = __shfl_xor_sync(kAll, odd ? r0 : r1, X1);
  // Row s goes to position s: a is row k, a1 row k ^ 1, b row k ^ 2, b1 row k ^ 3.
  const uint32_t e0 = odd ? a1 : a, e1 = odd ? a : a1, f0 = odd ? b1 : b, f1 = odd ? b : b1;
  return hi ? make_uint4(f0, f1, e0, e1) : make_uint4(e0, e1, f0, f1);
}
// Two lanes k = 0, 1 (lane ^ X) hold pairs f0 = M[k][0], f1 = M[k][1]; lane k gets column k,
// (M[0][k], M[1][k]), as 4 floats. (Both pairs cross: a select of what to send made ptxas swap
// every pair of the 64-row kernel up front and spill.)
template <int X>
__device__ __forceinline__ float4 transpose2(float2 f0, float2 f1, bool odd) {
  constexpr uint32_t kAll = 0xffffffffu;
  const float2 g0 = {__shfl_xor_sync(kAll, f0.x, X), __shfl_xor_sync(kAll, f0.y, X)};
  const float2 g1 = {__shfl_xor_sync(kAll, f1.x, X), __shfl_xor_sync(kAll, f1.y, X)};
  return odd ? make_float4(g1.x, g1.y, f1.x, f1.y) : make_float4(f0.x, f0.y, g0.x, g0.y);
}
// 16 bytes of row dst_row + r of unit u at column col: 8 bf16 of the output (w) or 4 fp32 of
// its partial (f; kept in L2 for the combine, l2_keep_policy).
__device__ __forceinline__ void store_out16(const AttentionParams& p, const UnitSpan& u, int r, int col, uint4 w) {
  *reinterpret_cast<uint4*>(p.out + (u.dst_row + r) * kRank + col) = w;
}
__device__ __forceinline__ void store_part16(const AttentionParams& p, const UnitSpan& u, int r, int col, float4 f,
                                             uint64_t keep) {
  st_global_kept(p.part_o + (u.dst_row + r) * kRank + col, f, keep);
}
__device__ __forceinline__ float4 scaled(float4 v, float s) { return make_float4(v.x * s, v.y * s, v.z * s, v.w * s); }

// Row dst_row + r of unit u from the four lanes k = 0..3 that hold it (bit 0 of k: lane ^ X1;
// bit 1: lane ^ X2): lane k's pair(i) = (o, o') (i < N) are columns col(i) + 2k, + 1, and col(i)
// .. col(i) + 7 are contiguous. Scaled by row_out_factor into the bf16 output, or the fp32
// partial of a cut request (kept in L2 for the combine, l2_keep_policy). `store`: whether the
// row is one to write (the lanes trade either way).
template <int X1, int X2, int N, typename Col, typename Pair>
__device__ __forceinline__ void store_row_lanes(const AttentionParams& p, const UnitSpan& u, int r, bool store, int k,
                                                float l, float out_scale, Col col, Pair pair) {
  static_assert(N % 4 == 0);
  const float sc = row_out_factor(l, out_scale);
  if (u.split) {
    // Pairs i, i + 1: the even lane takes i's columns 2k..2k+3, the odd one i + 1's 2(k-1)..2k+1.
    const uint64_t keep = l2_keep_policy();
#pragma unroll
    for (int i = 0; i < N; i += 2) {
      const float4 v = transpose2<X1>(pair(i), pair(i + 1), k & 1);
      if (store) store_part16(p, u, r, col(i + (k & 1)) + 2 * (k & ~1), scaled(v, sc), keep);
    }
  } else {
    // Pairs i..i+3 as a 4 x 4 matrix of words: lane k takes pair i + k's 8 columns.
#pragma unroll
    for (int i = 0; i < N; i += 4) {
      uint32_t w[4];
#pragma unroll
      for (int m = 0; m < 4; ++m) {
        const float2 v = pair(i + m);
        w[m] = pack_bf16x2(v.x * sc, v.y * sc);
      }
      const uint4 t = transpose4<X1, X2>(w, k);
      if (store) store_out16(p, u, r, col(i + k), t);
    }
  }
}

// m (base 2) and l of row dst_row + r of unit u: (m, l) partials for a cut request (m = -inf
// where l = 0), else the natural-log lse (-inf for a row with no key).
__device__ __forceinline__ void store_row_stats(const AttentionParams& p, const UnitSpan& u, int r, float m, float l) {
  const int64_t row = u.dst_row + r;
  if (u.split) {
    p.part_m[row] = l != 0.0f ? m : kNegInf;
    p.part_l[row] = l;
  } else {
    p.lse[row] = l != 0.0f ? (m + __log2f(l)) * kLn2 : kNegInf;
  }
}

// Launches attention kernel K (`name` in errors) on `grid` CTAs of `threads` with `smem`
// bytes of dynamic shared memory, with p and any further arguments; grid = 0 only opts K into
// its shared memory. The opt-in is per function and device, set once per device (a host-side
// call, also legal while a stream is being captured).
template <auto K, typename... More>
void launch_attention_kernel(const AttentionParams& p, int grid, int threads, int smem, cudaStream_t stream,
                             const char* name, const More&... more) {
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
    K<<<grid, threads, smem, stream>>>(p, more...);
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) check(e, (std::string(name) + " launch").c_str());
  }
}

// The unit's Q rows [row0, row0 + nr) into shared memory by cp.async (THREADS threads from
// `tid`, not committed): 16-byte chunk ch of row r at sQ + at(r, ch), the kernel's layout.
// Padding rows of the CTA are zero-filled.
template <int M, int THREADS, typename At>
__device__ __forceinline__ void load_q_async(const AttentionParams& p, const UnitSpan& u, uint32_t sQ, int tid,
                                             At at) {
  const bf16* qb = p.q + u.q_row * kDim;
  for (int idx = tid; idx < M * (kDim / 8); idx += THREADS) {
    const int r = idx / (kDim / 8), ch = idx % (kDim / 8);
    const bool ok = r < u.nr;
    cp_async_16(sQ + at(r, ch), ok ? static_cast<const void*>(qb + int64_t(r) * kDim + ch * 8) : p.q, ok ? 16 : 0);
  }
}

}  // namespace dcpmla::cuda_detail
