// Thin wrappers over the sm_90a instructions of the wgmma attention kernels: warpgroup MMA
// (wgmma.mma_async with its fence / commit / wait), shared-memory matrix descriptors,
// mbarriers, named barriers, register reallocation and the generic -> async proxy fence; and
// the TMA unit's bulk copies with their byte-counting mbarrier arrivals, multicast and the
// cluster barrier (the wgmma probe's tile streams, bench/wgmma_probe.cu). No CUTLASS/CuTe.
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
// Registers per thread at launch for a CTA of `threads` (one CTA an SM: the file's 65536, in
// steps of 8).
constexpr int launch_registers(int threads) { return 65536 / threads / 8 * 8; }
// A warpgroup's share set to N from the launch's count: increased above it, decreased at or
// below it (a decrease to the launch count itself makes ptxas fit the code after it in N,
// where that code would otherwise take the launch region's allocation).
template <int THREADS, int N>
__device__ __forceinline__ void setmaxnreg_to() {
  if constexpr (N > launch_registers(THREADS)) setmaxnreg_inc<N>();
  else setmaxnreg_dec<N>();
}
// setmaxnreg only moves registers within the CTA's launch allocation: a producer warpgroup and
// consumer warpgroups whose shares sum to more make the consumers' increase wait forever.
// `warpgroup_regs`: the shares summed over the CTA's warpgroups.
constexpr bool fits_launch_registers(int threads, int warpgroup_regs) {
  return warpgroup_regs <= threads / 128 * launch_registers(threads);
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
// One arrival on `bar` that also expects `bytes` more of asynchronous copies (complete_tx) in
// this phase.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.expect_tx.shared::cta.b64 state, [%0], %1;\n}\n" ::"r"(bar),
               "r"(bytes)
               : "memory");
}
// Bulk copy (the TMA unit, no tensor map) of `bytes` contiguous bytes (a multiple of 16, both
// ends 16-byte aligned) from global to shared memory; completes `bytes` on `bar`.
__device__ __forceinline__ void bulk_copy_g2s(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}
// The same into the same shared-memory offset of every CTA of the cluster in cta_mask (bit r:
// cluster rank r), completing on the mbarrier at the same offset in each.
__device__ __forceinline__ void bulk_copy_g2s_multicast(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar,
                                                        uint16_t cta_mask) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1], %2, [%3], %4;\n" ::
          "r"(dst),
      "l"(src), "r"(bytes), "r"(bar), "h"(cta_mask)
      : "memory");
}
// A 2D box of a tensor map (the TMA unit) into shared memory at dst, in the map's swizzle, box
// coordinates (x: innermost, in elements; y: rows); completes the box's bytes on `bar`. map: the
// generic address of a CUtensorMap in parameter, constant or global memory.
__device__ __forceinline__ void tensor_box_g2s(uint32_t dst, const void* map, int x, int y, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::
          "r"(dst),
      "l"(map), "r"(x), "r"(y), "r"(bar)
      : "memory");
}
// The same box into the same shared-memory offset of every CTA of the cluster in cta_mask,
// completing on the mbarrier at the same offset in each.
__device__ __forceinline__ void tensor_box_g2s_multicast(uint32_t dst, const void* map, int x, int y, uint32_t bar,
                                                         uint16_t cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1, {%2, "
      "%3}], [%4], %5;\n" ::"r"(dst),
      "l"(map), "r"(x), "r"(y), "r"(bar), "h"(cta_mask)
      : "memory");
}
// All threads of every CTA of the cluster (release / acquire).
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
__device__ __forceinline__ uint32_t cluster_ctarank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
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

// ---- wgmma.mma_async, bf16 or f16 operands, f32 accumulators --------------------------------
// _ss: A and B from shared memory (descriptors); _rs: A from registers (see the layout above).
// TRANS_B = 1: B is MN-major (N contiguous in shared memory); TRANS_A = 1 (_ss only): A is
// MN-major (M contiguous). scale_d = 0: D = A B (the accumulators' old values are ignored).

// The accumulator operands of m64n16 / n32 / n64 / n128 / n256 wgmma (8, 16, 32, 64, 128 per
// thread): %0..%N-1 in the instruction text, and the register operands with constraint C
// ("+f" to accumulate, "=f" where D = A B only writes them), each list the previous one
// extended.
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
#define DCPMLA_WGMMA_D8(C, d) \
  C(d[0]), C(d[1]), C(d[2]), C(d[3]), C(d[4]), C(d[5]), C(d[6]), C(d[7])
#define DCPMLA_WGMMA_D16(C, d) DCPMLA_WGMMA_D8(C, d), \
  C(d[8]), C(d[9]), C(d[10]), C(d[11]), C(d[12]), C(d[13]), C(d[14]), C(d[15])
#define DCPMLA_WGMMA_D32(C, d) DCPMLA_WGMMA_D16(C, d), \
  C(d[16]), C(d[17]), C(d[18]), C(d[19]), C(d[20]), C(d[21]), C(d[22]), C(d[23]), \
  C(d[24]), C(d[25]), C(d[26]), C(d[27]), C(d[28]), C(d[29]), C(d[30]), C(d[31])
#define DCPMLA_WGMMA_D64(C, d) DCPMLA_WGMMA_D32(C, d), \
  C(d[32]), C(d[33]), C(d[34]), C(d[35]), C(d[36]), C(d[37]), C(d[38]), C(d[39]), \
  C(d[40]), C(d[41]), C(d[42]), C(d[43]), C(d[44]), C(d[45]), C(d[46]), C(d[47]), \
  C(d[48]), C(d[49]), C(d[50]), C(d[51]), C(d[52]), C(d[53]), C(d[54]), C(d[55]), \
  C(d[56]), C(d[57]), C(d[58]), C(d[59]), C(d[60]), C(d[61]), C(d[62]), C(d[63])
#define DCPMLA_WGMMA_D128(C, d) DCPMLA_WGMMA_D64(C, d), \
  C(d[64]), C(d[65]), C(d[66]), C(d[67]), C(d[68]), C(d[69]), C(d[70]), C(d[71]), \
  C(d[72]), C(d[73]), C(d[74]), C(d[75]), C(d[76]), C(d[77]), C(d[78]), C(d[79]), \
  C(d[80]), C(d[81]), C(d[82]), C(d[83]), C(d[84]), C(d[85]), C(d[86]), C(d[87]), \
  C(d[88]), C(d[89]), C(d[90]), C(d[91]), C(d[92]), C(d[93]), C(d[94]), C(d[95]), \
  C(d[96]), C(d[97]), C(d[98]), C(d[99]), C(d[100]), C(d[101]), C(d[102]), C(d[103]), \
  C(d[104]), C(d[105]), C(d[106]), C(d[107]), C(d[108]), C(d[109]), C(d[110]), C(d[111]), \
  C(d[112]), C(d[113]), C(d[114]), C(d[115]), C(d[116]), C(d[117]), C(d[118]), C(d[119]), \
  C(d[120]), C(d[121]), C(d[122]), C(d[123]), C(d[124]), C(d[125]), C(d[126]), C(d[127])

// The _ss (A and B from shared memory) and _rs (A from registers) forms of m64nNk16 with
// NACC = N / 2 accumulators per thread, for bf16 operands or (F16) f16 ones; the operand
// numbers after the accumulators are spelled out, since the instruction text must be a literal.
#define DCPMLA_WGMMA_16BIT_ASM(N, NACC, TYPE, OPS, SCALE, ...)                                                    \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " SCALE ", 0;\n"                                                \
               "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TYPE "." TYPE " {" DCPMLA_WGMMA_D##NACC##_TEXT  \
               "}, " OPS ";\n}\n"                                                                               \
               : DCPMLA_WGMMA_D##NACC("+f", d)                                                                \
               : __VA_ARGS__)
#define DCPMLA_WGMMA_16BIT_FORMS(N, NACC, SS_OPS, SS_SCALE, RS_OPS, RS_SCALE)                                       \
  template <int TRANS_B, int TRANS_A = 0, bool F16 = false>                                                        \
  __device__ __forceinline__ void wgmma_m64n##N##k16_ss(float(&d)[NACC], uint64_t desc_a, uint64_t desc_b,         \
                                                        int scale_d) {                                             \
    if constexpr (F16)                                                                                             \
      DCPMLA_WGMMA_16BIT_ASM(N, NACC, "f16", SS_OPS, SS_SCALE, "l"(desc_a), "l"(desc_b), "r"(scale_d),            \
                             "n"(TRANS_B), "n"(TRANS_A));                                                          \
    else                                                                                                           \
      DCPMLA_WGMMA_16BIT_ASM(N, NACC, "bf16", SS_OPS, SS_SCALE, "l"(desc_a), "l"(desc_b), "r"(scale_d),           \
                             "n"(TRANS_B), "n"(TRANS_A));                                                          \
  }                                                                                                                \
  template <int TRANS_B, bool F16 = false>                                                                         \
  __device__ __forceinline__ void wgmma_m64n##N##k16_rs(float(&d)[NACC], const uint32_t(&a)[4], uint64_t desc_b,   \
                                                        int scale_d) {                                             \
    if constexpr (F16)                                                                                             \
      DCPMLA_WGMMA_16BIT_ASM(N, NACC, "f16", RS_OPS, RS_SCALE, "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]),        \
                             "l"(desc_b), "r"(scale_d), "n"(TRANS_B));                                             \
    else                                                                                                           \
      DCPMLA_WGMMA_16BIT_ASM(N, NACC, "bf16", RS_OPS, RS_SCALE, "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]),       \
                             "l"(desc_b), "r"(scale_d), "n"(TRANS_B));                                             \
  }

DCPMLA_WGMMA_16BIT_FORMS(16, 8, "%8, %9, p, 1, 1, %12, %11", "%10", "{%8, %9, %10, %11}, %12, p, 1, 1, %14", "%13")
DCPMLA_WGMMA_16BIT_FORMS(32, 16, "%16, %17, p, 1, 1, %20, %19", "%18", "{%16, %17, %18, %19}, %20, p, 1, 1, %22", "%21")
DCPMLA_WGMMA_16BIT_FORMS(64, 32, "%32, %33, p, 1, 1, %36, %35", "%34", "{%32, %33, %34, %35}, %36, p, 1, 1, %38", "%37")
DCPMLA_WGMMA_16BIT_FORMS(128, 64, "%64, %65, p, 1, 1, %68, %67", "%66", "{%64, %65, %66, %67}, %68, p, 1, 1, %70", "%69")
DCPMLA_WGMMA_16BIT_FORMS(256, 128, "%128, %129, p, 1, 1, %132, %131", "%130",
                        "{%128, %129, %130, %131}, %132, p, 1, 1, %134", "%133")

// ---- wgmma.mma_async m64n{16,32,64}k32, fp8 operands, f32 accumulators ---------------------------
// fp8 operands are K-major only. A is the cache's format (e4m3 or e5m2), B is e4m3. A from
// registers holds four elements per register, lowest k in the lowest byte:
//   a0 = A[16 w + g][4 c .. 4 c + 3], a1 = A[16 w + g + 8][4 c ..], a2 = A[16 w + g][16 + 4 c ..],
//   a3 = A[16 w + g + 8][16 + 4 c ..]
// D as above: d[4 j + 0, 1] = D[16 w + g][8 j + 2 c + 0, 1], d[4 j + 2, 3] = D[16 w + g + 8][same].
// ACC = false: D = A B, the accumulators written only (no zeroing before a chain's first
// step); ACC = true: D += A B. IN_PLACE (default ACC) makes D an in-out operand even when
// written only: the compiler then keeps a chain in the registers d already names, so the
// reads of d's last chain must come before this issue. Without it, ptxas may give every
// chain fresh registers and defer the reads of the last past the issue (the fp8 swap
// kernel's scores warpgroup: five chains' accumulators live at once).
// One fp8 form in its four instantiations (A e4m3 or e5m2, D in-out or written only): N,
// NACC = N / 2 accumulators, OPS the operand numbers after them, SCALE the scale-d flag's,
// then the input operands.
#define DCPMLA_WGMMA_FP8_ASM(N, NACC, OPS, SCALE, ATYPE, C, ...)                                                   \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " SCALE ", 0;\n"                                                 \
               "wgmma.mma_async.sync.aligned.m64n" #N "k32.f32." ATYPE ".e4m3 {" DCPMLA_WGMMA_D##NACC##_TEXT "}, " OPS \
               ", p, 1, 1;\n}\n"                                                                                   \
               : DCPMLA_WGMMA_D##NACC(C, d)                                                                       \
               : __VA_ARGS__)
#define DCPMLA_WGMMA_FP8_FORM(N, NACC, OPS, SCALE, IN_PLACE, ...)                                 \
  if constexpr (A_E5M2 && IN_PLACE) DCPMLA_WGMMA_FP8_ASM(N, NACC, OPS, SCALE, "e5m2", "+f", __VA_ARGS__); \
  else if constexpr (A_E5M2) DCPMLA_WGMMA_FP8_ASM(N, NACC, OPS, SCALE, "e5m2", "=f", __VA_ARGS__);        \
  else if constexpr (IN_PLACE) DCPMLA_WGMMA_FP8_ASM(N, NACC, OPS, SCALE, "e4m3", "+f", __VA_ARGS__);      \
  else DCPMLA_WGMMA_FP8_ASM(N, NACC, OPS, SCALE, "e4m3", "=f", __VA_ARGS__)

template <bool A_E5M2, bool ACC>
__device__ __forceinline__ void wgmma_m64n32k32_fp8_ss(float (&d)[16], uint64_t desc_a, uint64_t desc_b) {
  DCPMLA_WGMMA_FP8_FORM(32, 16, "%16, %17", "%18", ACC, "l"(desc_a), "l"(desc_b), "r"(int(ACC)));
}

template <bool A_E5M2, bool ACC, bool IN_PLACE = ACC>
__device__ __forceinline__ void wgmma_m64n64k32_fp8_ss(float (&d)[32], uint64_t desc_a, uint64_t desc_b) {
  DCPMLA_WGMMA_FP8_FORM(64, 32, "%32, %33", "%34", IN_PLACE, "l"(desc_a), "l"(desc_b), "r"(int(ACC)));
}

template <bool A_E5M2, bool ACC>
__device__ __forceinline__ void wgmma_m64n16k32_fp8_rs(float (&d)[8], const uint32_t (&a)[4], uint64_t desc_b) {
  DCPMLA_WGMMA_FP8_FORM(16, 8, "{%8, %9, %10, %11}, %12", "%13", ACC, "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]),
                        "l"(desc_b), "r"(int(ACC)));
}

template <bool A_E5M2, bool ACC>
__device__ __forceinline__ void wgmma_m64n32k32_fp8_rs(float (&d)[16], const uint32_t (&a)[4], uint64_t desc_b) {
  DCPMLA_WGMMA_FP8_FORM(32, 16, "{%16, %17, %18, %19}, %20", "%21", ACC, "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]),
                        "l"(desc_b), "r"(int(ACC)));
}

// m64nNk32 with A from registers, N = 16 or 32 (the fp8 swap kernel's O^T at its rows per CTA).
template <int N, bool A_E5M2, bool ACC>
__device__ __forceinline__ void wgmma_m64k32_fp8_rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc_b) {
  static_assert(N == 16 || N == 32);
  if constexpr (N == 16) wgmma_m64n16k32_fp8_rs<A_E5M2, ACC>(d, a, desc_b);
  else wgmma_m64n32k32_fp8_rs<A_E5M2, ACC>(d, a, desc_b);
}

#undef DCPMLA_WGMMA_FP8_FORM
#undef DCPMLA_WGMMA_FP8_ASM
#undef DCPMLA_WGMMA_16BIT_FORMS
#undef DCPMLA_WGMMA_D8_TEXT
#undef DCPMLA_WGMMA_D8
#undef DCPMLA_WGMMA_D16_TEXT
#undef DCPMLA_WGMMA_D16
#undef DCPMLA_WGMMA_D32_TEXT
#undef DCPMLA_WGMMA_D32
#undef DCPMLA_WGMMA_D64_TEXT
#undef DCPMLA_WGMMA_D64
#undef DCPMLA_WGMMA_D128_TEXT
#undef DCPMLA_WGMMA_D128

}  // namespace dcpmla::cuda_detail
