// Thin wrappers over the sm_80+ instructions the kernels use: cp.async, ldmatrix,
// mma.sync m16n8k16 (bf16 in, f32 accumulate), ex2. Fragment layouts follow the PTX ISA:
// lane = 4 g + c; A (16x16 row): a0 = A[g][2c..], a1 = A[g+8][2c..], a2 = A[g][2c+8..],
// a3 = A[g+8][2c+8..]; B (16x8 col): b0 = B[2c..][g], b1 = B[2c+8..][g];
// C (16x8): c0,c1 = C[g][2c..], c2,c3 = C[g+8][2c..].
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "dcpmla/numeric.h"  // kLog2e, kLn2, kNegInf

namespace dcpmla::cuda_detail {

// The GPU's global timer (ns), the same on every SM.
__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// The SM this thread runs on.
__device__ __forceinline__ uint32_t sm_id() {
  uint32_t v;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(v));
  return v;
}

// Diagnostics (AttentionParams::trace): the global timer into trace[slot], where the caller
// asked for it (trace not null).
__device__ __forceinline__ void trace_stamp(uint64_t* trace, int slot) {
  if (trace != nullptr) trace[slot] = global_ns();
}

// Programmatic dependent launch (sm_90): a kernel launched with the programmatic stream
// serialization attribute may start while the stream's previous kernel still runs. This
// returns once that kernel has completed and its writes are visible.
__device__ __forceinline__ void wait_prior_grids() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return uint32_t(__cvta_generic_to_shared(p));
}

// 16-byte global -> shared copy; src_bytes = 0 fills the destination with zeros (and
// reads nothing: the address only has to be a valid pointer).
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
// Starts bringing `bytes` (a multiple of 16, from a 16-byte aligned src) into L2, without
// waiting or writing anything (one instruction for a contiguous run).
__device__ __forceinline__ void prefetch_l2(const void* src, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(src), "r"(bytes) : "memory");
}
// 4-byte form (cp.async.ca: 16 is the only size of .cg); src_bytes 0 fills zeros.
__device__ __forceinline__ void cp_async_4(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
// The split-K partials stay in L2 from the attention kernel that writes them to the combine
// that reads them once (evict_last: the KV streamed in between would otherwise evict the
// early pieces' partials to DRAM before the combine reads them). The combine reads them with
// evict-first streaming loads (ld.global.cs); whether that demotes the lines for the kernels
// after it has not been measured (bench/NOTES.md).
__device__ __forceinline__ uint64_t l2_keep_policy() {
  uint64_t policy;
  asm("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}
__device__ __forceinline__ void st_global_kept(float* dst, float2 v, uint64_t policy) {
  asm volatile("st.global.L2::cache_hint.v2.f32 [%0], {%1, %2}, %3;\n" ::"l"(dst), "f"(v.x), "f"(v.y), "l"(policy)
               : "memory");
}
__device__ __forceinline__ void st_global_kept(float* dst, float4 v, uint64_t policy) {
  asm volatile("st.global.L2::cache_hint.v4.f32 [%0], {%1, %2, %3, %4}, %5;\n" ::"l"(dst), "f"(v.x), "f"(v.y), "f"(v.z),
               "f"(v.w), "l"(policy)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::); }

__device__ __forceinline__ void ldmatrix_x4(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// Four 8x8 b16 matrices from registers (fragment i of matrix i: row lane / 4, columns
// 2 (lane % 4) and + 1) to shared memory; lane l gives the address of row l % 8 of matrix l / 8.
__device__ __forceinline__ void stmatrix_x4(uint32_t addr, const uint32_t (&r)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1,%2,%3,%4};\n" ::"r"(addr), "r"(r[0]), "r"(r[1]),
               "r"(r[2]), "r"(r[3])
               : "memory");
}

// D = A B + D, m16n8k16, bf16 operands, f32 accumulators.
__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// max that keeps a NaN (fmaxf drops one): the merges take their reference maximum with it,
// so a NaN partial poisons its row instead of being skipped as empty (merge.h's nan_max).
__device__ __forceinline__ float nan_max(float a, float b) { return (isnan(a) || isnan(b)) ? a + b : fmaxf(a, b); }

// 2^x; ex2.approx(-inf) = +0, which the masked softmax relies on.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

__device__ __forceinline__ uint32_t pack_f16x2(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// A bf16 pair (the low half first) as two floats, exactly.
__device__ __forceinline__ float2 bf16x2_to_float2(uint32_t w) {
  return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
}

// The per-row scale of the kernels that feed Q to narrower tensor-core types (the fp8 swap
// kernel's e4m3 pairs, the wgmma kernel's f16): up = 2^a puts the row's largest magnitude amax
// in [2^(top - 1), 2^top) (exact on every element: a power of two), down = 2^-a undoes it in
// the row's score scale. A row with an infinite element has no such scale and is to be
// poisoned with NaN (its products would be inf or NaN); an all-zero row keeps a = 0.
struct RowScale {
  float up, down;
  bool poison;
};
__device__ __forceinline__ RowScale pow2_row_scale(float amax, int top) {
  int ex = 0;
  frexpf(amax, &ex);  // amax in [2^(ex - 1), 2^ex)
  const int a = amax > 0.0f ? min(top - ex, 126) : 0;
  return {__int_as_float((127 + a) << 23), __int_as_float((127 - a) << 23), isinf(amax)};
}

// Two stored fp8 values (low byte first) -> two bf16 of the same value (exact: every e4m3
// and e5m2 value is a bf16 value). The cache scale is applied outside.
template <bool E5M2>
__device__ __forceinline__ uint32_t fp8x2_to_bf16x2(uint16_t v) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(v), E5M2 ? __NV_E5M2 : __NV_E4M3);
  const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h));
  return pack_bf16x2(f.x, f.y);
}

// A read-only 16-byte load that does not allocate in L1 (its bytes are used once).
__device__ __forceinline__ uint4 ldg_no_l1(const void* src) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(src));
  return v;
}

// One stored 16-byte chunk (16 fp8 values, lowest first) -> 8 bf16 pairs, exactly.
__device__ __forceinline__ void fp8x16_to_bf16x16(uint4 v, bool e5m2, uint32_t (&out)[8]) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    if (e5m2) {
      out[2 * q] = fp8x2_to_bf16x2<true>(uint16_t(w[q] & 0xffffu));
      out[2 * q + 1] = fp8x2_to_bf16x2<true>(uint16_t(w[q] >> 16));
    } else {
      out[2 * q] = fp8x2_to_bf16x2<false>(uint16_t(w[q] & 0xffffu));
      out[2 * q + 1] = fp8x2_to_bf16x2<false>(uint16_t(w[q] >> 16));
    }
  }
}

// Both e4m3 pairs of a 32-bit word -> two f16 pairs. The halves are split inside the PTX so
// that the hardware unpack reads the upper one in place (an .H1 operand); the intrinsic takes
// a 16-bit value, which costs a shift a word (bench/NOTES.md, thirty-third session).
__device__ __forceinline__ void e4m3x4_to_f16x4(uint32_t w, uint32_t& lo, uint32_t& hi) {
  asm("{\n.reg .b16 l, h;\nmov.b32 {l, h}, %2;\ncvt.rn.f16x2.e4m3x2 %0, l;\ncvt.rn.f16x2.e4m3x2 %1, h;\n}\n"
      : "=r"(lo), "=r"(hi)
      : "r"(w));
}

// One stored 16-byte chunk (16 fp8 values, lowest first) -> 8 f16 pairs, exactly (every e4m3
// and e5m2 value is an f16 value): e4m3 by the hardware unpack, one instruction a pair; e5m2
// is an f16's upper byte, a byte permute a pair.
__device__ __forceinline__ void fp8x16_to_f16x16(uint4 v, bool e5m2, uint32_t (&out)[8]) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    if (e5m2) {
      out[2 * q] = __byte_perm(w[q], 0u, 0x1404u);
      out[2 * q + 1] = __byte_perm(w[q], 0u, 0x3424u);
    } else {
      e4m3x4_to_f16x4(w[q], out[2 * q], out[2 * q + 1]);
    }
  }
}

}  // namespace dcpmla::cuda_detail
