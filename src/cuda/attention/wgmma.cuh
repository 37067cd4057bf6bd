// Thin wrappers over the sm_90a instructions of the wgmma attention kernels: warpgroup MMA
// (wgmma.mma_async with its fence / commit / wait), shared-memory matrix descriptors,
// mbarriers, named barriers, register reallocation and the generic -> async proxy fence.
// No CUTLASS/CuTe.
//
// wgmma m64nNk16 (PTX ISA 9.7.15): a warpgroup (4 consecutive warps, the first warp index
// a multiple of 4) computes D (64 x N) += A (64 x 16) B (16 x N). Warp w of the group owns
// rows 16 w .. 16 w + 15, with the m16n8 fragment layout of mma.sync per n8 chunk j:
//   D: d[4 j + 0, 1] = D[16 w + g][8 j + 2 c + 0, 1], d[4 j + 2, 3] = D[16 w + g + 8][same]
//   A (registers): a0 = A[16 w + g][2 c..], a1 = A[16 w + g + 8][2 c..], a2 = A[16 w + g][2 c + 8..],
//                  a3 = A[16 w + g + 8][2 c + 8..]          (lane = 4 g + c)
// so the S accumulators of one wgmma are, packed to bf16 pairs, the A operand of the next.
#pragma once

#include <cstdint>

namespace dcpmla::cuda_detail {

// Shared-memory matrix descriptor with 128-byte swizzle: start address >> 4 (bits 0-13),
// leading byte offset >> 4 (16-29), stride byte offset >> 4 (32-45), base offset 0 (every
// swizzle atom of 8 rows x 128 B starts on a 1024-byte boundary), mode 1 (62-63).
//   K-major (rows of 128 B along K): SBO = bytes between 8-row groups; LBO unused (1).
//   MN-major: LBO = bytes between 64-element groups along MN; SBO = bytes between 8-row
//   groups along K. The start address may point inside an atom (k steps of 32 B).
// Held as its two words because a wgmma chain walks one operand at constant byte offsets:
// at(offset) adds offset >> 4 to the low word (the start field cannot carry: shared::cta
// addresses are below 2^18) and keeps the constant high word, one add per operand instead of
// building each descriptor afresh (7.5 SASS instructions per S wgmma instead of 13.4; the fp8
// swap kernel, bound by its instruction stream, gained 1-3 %).
struct SmemDesc {
  uint32_t lo, hi;
  __device__ __forceinline__ SmemDesc(uint32_t addr, uint32_t lbo, uint32_t sbo)
      : lo(((addr & 0x3FFFFu) >> 4) | ((lbo >> 4) << 16)), hi((sbo >> 4) | (1u << 30)) {}
  __device__ __forceinline__ uint64_t at(uint32_t byte_offset = 0) const {
    return (uint64_t(hi) << 32) | (lo + (byte_offset >> 4));
  }
};

// A kernel's shared-memory struct on the first 1024-byte boundary of its dynamic shared
// memory (launched with 1024 bytes of slack): the descriptors' base offset is 0, so every
// swizzle atom must start on such a boundary.
template <typename Shared>
__device__ __forceinline__ Shared& aligned_shared(uint8_t* raw) {
  return *reinterpret_cast<Shared*>(raw + ((1024u - (uint32_t(__cvta_generic_to_shared(raw)) & 1023u)) & 1023u));
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// Register fence: the compiler sees wgmma as writing its accumulators at issue; this keeps
// reads and writes of them on the right side of the wait.
template <int N>
__device__ __forceinline__ void fence_regs(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

// Orders this thread's generic-proxy shared-memory accesses (st.shared, cp.async) with
// later async-proxy ones (wgmma operand reads).
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Named barriers 1..15 (0 is __syncthreads). arrive does not wait; sync waits until
// `threads` threads (a multiple of 32) have arrived or synced. bar.sync is the aligned form:
// every thread that blocks in one generation must block at the same instruction.
__device__ __forceinline__ void named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// Warpgroup register reallocation (every thread of the warpgroup executes it): a producer
// gives registers back, consumers take them.
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}
// setmaxnreg only moves registers within the CTA's launch allocation (65536 / threads per
// thread, in steps of 8): a producer warpgroup and consumer warpgroups whose shares sum to
// more make the consumers' increase wait forever.
constexpr bool fits_launch_registers(int threads, int producer_regs, int consumer_regs) {
  const int warpgroups = threads / 128;
  return producer_regs + (warpgroups - 1) * consumer_regs <= warpgroups * (65536 / threads / 8 * 8);
}

// mbarrier in shared memory (8 bytes, 8-byte aligned).
__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.shared::cta.b64 state, [%0];\n}\n" ::"r"(bar) : "memory");
}
// One arrival on `bar` once every cp.async this thread issued so far has landed (.noinc:
// the barrier's expected count includes these arrivals).
__device__ __forceinline__ void cp_async_mbar_arrive(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
// Waits until the phase of parity `parity` has completed.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}

// ---- wgmma.mma_async, bf16 operands, f32 accumulators ---------------------------------------
// _ss: A and B from shared memory (descriptors); _rs: A from registers (see the layout above).
// TRANS_B = 1: B is MN-major (N contiguous in shared memory); TRANS_A = 1 (_ss only): A is
// MN-major (M contiguous). scale_d = 0: D = A B (the accumulators' old values are ignored).

// The accumulator operands of m64n16 / n32 / n64 / n128 / n256 wgmma (8, 16, 32, 64, 128 per
// thread): %0..%N-1
// in the instruction text and the matching read-write register constraints, each list the
// previous one extended.
#define DCPMLA_WGMMA_D8_TEXT "%0, %1, %2, %3, %4, %5, %6, %7"
#define DCPMLA_WGMMA_D16_TEXT DCPMLA_WGMMA_D8_TEXT ", %8, %9, %10, %11, %12, %13, %14, %15"
#define DCPMLA_WGMMA_D32_TEXT DCPMLA_WGMMA_D16_TEXT "," \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define DCPMLA_WGMMA_D64_TEXT DCPMLA_WGMMA_D32_TEXT "," \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47," \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define DCPMLA_WGMMA_D128_TEXT DCPMLA_WGMMA_D64_TEXT "," \
  "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79," \
  "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95," \
  "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111," \
  "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
#define DCPMLA_WGMMA_D8_OPERANDS(d) \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
#define DCPMLA_WGMMA_D16_OPERANDS(d) DCPMLA_WGMMA_D8_OPERANDS(d), \
  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
#define DCPMLA_WGMMA_D32_OPERANDS(d) DCPMLA_WGMMA_D16_OPERANDS(d), \
  "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
  "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define DCPMLA_WGMMA_D64_OPERANDS(d) DCPMLA_WGMMA_D32_OPERANDS(d), \
  "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
  "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
  "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
  "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
#define DCPMLA_WGMMA_D128_OPERANDS(d) DCPMLA_WGMMA_D64_OPERANDS(d), \
  "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
  "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), \
  "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), \
  "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), \
  "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), \
  "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), \
  "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), \
  "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])

// The _ss (A and B from shared memory) and _rs (A from registers) forms of m64nNk16 with
// NACC = N / 2 accumulators per thread; the operand numbers after the accumulators are
// spelled out, since the instruction text must be a literal.
#define DCPMLA_WGMMA_BF16_FORMS(N, NACC, SS_OPS, SS_SCALE, RS_OPS, RS_SCALE)                                       \
  template <int TRANS_B, int TRANS_A = 0>                                                                          \
  __device__ __forceinline__ void wgmma_m64n##N##k16_ss(float(&d)[NACC], uint64_t desc_a, uint64_t desc_b,         \
                                                        int scale_d) {                                             \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " SS_SCALE ", 0;\n"                                              \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32.bf16.bf16 {" DCPMLA_WGMMA_D##NACC##_TEXT "}, " SS_OPS \
                 ";\n}\n"                                                                                          \
                 : DCPMLA_WGMMA_D##NACC##_OPERANDS(d)                                                              \
                 : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(TRANS_B), "n"(TRANS_A));                            \
  }                                                                                                                \
  template <int TRANS_B>                                                                                           \
  __device__ __forceinline__ void wgmma_m64n##N##k16_rs(float(&d)[NACC], const uint32_t(&a)[4], uint64_t desc_b,   \
                                                        int scale_d) {                                             \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " RS_SCALE ", 0;\n"                                              \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32.bf16.bf16 {" DCPMLA_WGMMA_D##NACC##_TEXT "}, " RS_OPS \
                 ";\n}\n"                                                                                          \
                 : DCPMLA_WGMMA_D##NACC##_OPERANDS(d)                                                              \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d), "n"(TRANS_B));           \
  }

DCPMLA_WGMMA_BF16_FORMS(16, 8, "%8, %9, p, 1, 1, %12, %11", "%10", "{%8, %9, %10, %11}, %12, p, 1, 1, %14", "%13")
DCPMLA_WGMMA_BF16_FORMS(32, 16, "%16, %17, p, 1, 1, %20, %19", "%18", "{%16, %17, %18, %19}, %20, p, 1, 1, %22", "%21")
DCPMLA_WGMMA_BF16_FORMS(64, 32, "%32, %33, p, 1, 1, %36, %35", "%34", "{%32, %33, %34, %35}, %36, p, 1, 1, %38", "%37")
DCPMLA_WGMMA_BF16_FORMS(128, 64, "%64, %65, p, 1, 1, %68, %67", "%66", "{%64, %65, %66, %67}, %68, p, 1, 1, %70", "%69")
DCPMLA_WGMMA_BF16_FORMS(256, 128, "%128, %129, p, 1, 1, %132, %131", "%130",
                        "{%128, %129, %130, %131}, %132, p, 1, 1, %134", "%133")

// ---- wgmma.mma_async m64n{16,32}k32, fp8 operands, f32 accumulators ---------------------------
// fp8 operands are K-major only. A is the cache's format (e4m3 or e5m2), B is e4m3. A from
// registers holds four elements per register, lowest k in the lowest byte:
//   a0 = A[16 w + g][4 c .. 4 c + 3], a1 = A[16 w + g + 8][4 c ..], a2 = A[16 w + g][16 + 4 c ..],
//   a3 = A[16 w + g + 8][16 + 4 c ..]
// D as above: d[4 j + 0, 1] = D[16 w + g][8 j + 2 c + 0, 1], d[4 j + 2, 3] = D[16 w + g + 8][same].
// ACC = false: D = A B, the accumulators written only (no zeroing before a chain's first
// step); ACC = true: D += A B.
#define DCPMLA_WGMMA_D8(C, d) C(d[0]), C(d[1]), C(d[2]), C(d[3]), C(d[4]), C(d[5]), C(d[6]), C(d[7])
#define DCPMLA_WGMMA_D16(C, d) \
  DCPMLA_WGMMA_D8(C, d), C(d[8]), C(d[9]), C(d[10]), C(d[11]), C(d[12]), C(d[13]), C(d[14]), C(d[15])
#define DCPMLA_WGMMA_FP8_SS_N32(ATYPE, C)                                                                 \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"                                                \
               "wgmma.mma_async.sync.aligned.m64n32k32.f32." ATYPE ".e4m3 "                                 \
               "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1;\n}\n" \
               : DCPMLA_WGMMA_D16(C, d)                                                                    \
               : "l"(desc_a), "l"(desc_b), "r"(int(ACC)))
#define DCPMLA_WGMMA_FP8_RS_N16(ATYPE, C)                                                                 \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"                                                \
               "wgmma.mma_async.sync.aligned.m64n16k32.f32." ATYPE ".e4m3 "                                 \
               "{%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, p, 1, 1;\n}\n"                   \
               : DCPMLA_WGMMA_D8(C, d)                                                                     \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(int(ACC)))

#define DCPMLA_WGMMA_FP8_RS_N32(ATYPE, C)                                                                 \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"                                                \
               "wgmma.mma_async.sync.aligned.m64n32k32.f32." ATYPE ".e4m3 "                                 \
               "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "                   \
               "{%16, %17, %18, %19}, %20, p, 1, 1;\n}\n"                                                    \
               : DCPMLA_WGMMA_D16(C, d)                                                                    \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(int(ACC)))

template <bool A_E5M2, bool ACC>
__device__ __forceinline__ void wgmma_m64n32k32_fp8_ss(float (&d)[16], uint64_t desc_a, uint64_t desc_b) {
  if constexpr (A_E5M2 && ACC) DCPMLA_WGMMA_FP8_SS_N32("e5m2", "+f");
  else if constexpr (A_E5M2) DCPMLA_WGMMA_FP8_SS_N32("e5m2", "=f");
  else if constexpr (ACC) DCPMLA_WGMMA_FP8_SS_N32("e4m3", "+f");
  else DCPMLA_WGMMA_FP8_SS_N32("e4m3", "=f");
}

template <bool A_E5M2, bool ACC>
__device__ __forceinline__ void wgmma_m64n16k32_fp8_rs(float (&d)[8], const uint32_t (&a)[4], uint64_t desc_b) {
  if constexpr (A_E5M2 && ACC) DCPMLA_WGMMA_FP8_RS_N16("e5m2", "+f");
  else if constexpr (A_E5M2) DCPMLA_WGMMA_FP8_RS_N16("e5m2", "=f");
  else if constexpr (ACC) DCPMLA_WGMMA_FP8_RS_N16("e4m3", "+f");
  else DCPMLA_WGMMA_FP8_RS_N16("e4m3", "=f");
}

template <bool A_E5M2, bool ACC>
__device__ __forceinline__ void wgmma_m64n32k32_fp8_rs(float (&d)[16], const uint32_t (&a)[4], uint64_t desc_b) {
  if constexpr (A_E5M2 && ACC) DCPMLA_WGMMA_FP8_RS_N32("e5m2", "+f");
  else if constexpr (A_E5M2) DCPMLA_WGMMA_FP8_RS_N32("e5m2", "=f");
  else if constexpr (ACC) DCPMLA_WGMMA_FP8_RS_N32("e4m3", "+f");
  else DCPMLA_WGMMA_FP8_RS_N32("e4m3", "=f");
}

#undef DCPMLA_WGMMA_D8
#undef DCPMLA_WGMMA_D16
#undef DCPMLA_WGMMA_FP8_SS_N32
#undef DCPMLA_WGMMA_FP8_RS_N16
#undef DCPMLA_WGMMA_FP8_RS_N32

#undef DCPMLA_WGMMA_BF16_FORMS
#undef DCPMLA_WGMMA_D8_TEXT
#undef DCPMLA_WGMMA_D8_OPERANDS
#undef DCPMLA_WGMMA_D16_TEXT
#undef DCPMLA_WGMMA_D16_OPERANDS
#undef DCPMLA_WGMMA_D32_TEXT
#undef DCPMLA_WGMMA_D32_OPERANDS
#undef DCPMLA_WGMMA_D64_TEXT
#undef DCPMLA_WGMMA_D64_OPERANDS
#undef DCPMLA_WGMMA_D128_TEXT
#undef DCPMLA_WGMMA_D128_OPERANDS

}  // namespace dcpmla::cuda_detail
