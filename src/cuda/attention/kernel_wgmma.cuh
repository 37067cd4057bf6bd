// Attention over a plan on sm_90a with warpgroup MMA: 64 query rows per CTA, KV tiles of 64
// tokens in 128B-swizzled shared memory, S = Q K^T and O += P V on wgmma with the
// accumulators in registers. Same contract as kernel.cuh (the mma.sync reference variant,
// which the tests run beside this one): each CTA of a fixed grid runs its chunk of the
// schedule for one row group, from the device plan; rows with no local key give out = 0,
// lse = -inf; pieces of cut requests write (o / l, m, l) partials.
//
// Two consumer warpgroups, one CTA per SM (smem: Q 72 KiB + 2 KV stages of 72 KiB):
//   WG0 ("softmax"): waits for tile i, S = Q K_i^T (36 wgmma m64n64k16, A and B from shared
//       memory), masks each row at its own local length, online softmax (base 2, the
//       running maximum lazy: softmax.cuh; the exponentials issued under the rows' offsets
//       before the tile's maximum is known, and recomputed by a warp where one moved) in
//       registers (a row's 64 scores live in one quad of lanes), hands P (bf16; fp8: f16)
//       and the rescale factors to WG1 through shared memory, then O[:, 0:256] += P V_i
//       with P from registers (4 wgmma m64n256k16, V read MN-major from the same tile).
//   WG1: O[:, 256:512] += P V_i with P from shared memory.
//   Per tile the tensor cores run S, then (after softmax) both halves of P V together; WG1's
//   half may still run while WG0 starts the next S. (Overlapping softmax with the tensor
//   cores needs another schedule: bench/NOTES.md, next steps.)
// A third warpgroup, the producer, fills the stages: it waits until both consumers have
// released a stage ("empty" mbarriers), fills it and arrives on its "full" mbarrier, running
// ahead across the CTA's units (tiles are numbered across them: tile gt sits in stage gt % 2),
// so the next unit's first tiles load during this unit's last tiles and epilogue. It also
// loads each unit's Q and row lengths, as soon as WG0 has run the previous unit's last S
// (the Q buffer is single: two would not fit), so that the load overlaps that unit's last
// softmax, P V and epilogue instead of following them (bench/NOTES.md, eleventh session: a
// piece cost 8-10 us with the consumers loading Q after the epilogue, about 6.5 so).
//   bf16: straight into the swizzled stage (stream_bf16_tiles, bf16_tiles.cuh, shared with the
//     bf16 swap kernel): where several row groups read each tile, whole tiles on sub-pages of
//     32+ tokens by the TMA unit (one thread's boxes, kv_box_maps: the kernel's second
//     parameter), elsewhere by cp.async, each producer thread's copies arriving on the stage's
//     full barrier when they land. 40 registers; the consumers take 232.
//   fp8: the raw bytes of the next tile wait in registers (four threads a token, whole
//     sectors a load, not kept in L1; each half of the pieces loads the tile after behind the
//     wait for the other half), are unpacked to f16 (exact: every e4m3 and e5m2 value
//     is an f16 value; one instruction a pair, where bf16 took four; kv_scale folded into the
//     softmax and output scales) into the stage, fenced for the async proxy, then arrived, a
//     third of the columns at a time (S starts on the first third); at one row group a request
//     it also prefetches the next tile into L2. 120 registers; WG0 takes 216 and WG1 168.
//     The tensor cores then run f16: WG0 turns each unit's Q into f16 in place, each row
//     scaled by a power of two (its score scale undoes it), and P enters P V as f16 (11
//     significant bits, where the bf16 kernel rounds it to 8).
//
// Shared memory (WgShared, from a 1024-byte aligned base; every buffer is a stack of (rows, 64)
// column blocks of 128-byte rows, the 16-byte chunk c of row r at chunk c ^ (r & 7)):
//   sQ   (64, 576) bf16      9 blocks of (64, 64) (fp8: f16 once converted)
//   sKV  2 x (64, 576) bf16  K for S (K-major B) and V for P V (MN-major B) alike (fp8: f16)
//   sP   (64, 64) bf16       A of WG1's P V (fp8: f16)
//   sAlpha, sL, sM, sQscale (64) f32, sLen (64) i32, mbarriers (WgMbarrier)
#pragma once

#include <cstdint>
#include <type_traits>

#include "common/params.h"
#include "common/utils.cuh"
#include "bf16_tiles.cuh"
#include "config.h"
#include "softmax.cuh"
#include "swizzle.cuh"
#include "tile_maps.h"
#include "unit.cuh"
#include "wgmma.cuh"

namespace dcpmla::cuda_detail {

template <bool FP8>
struct WgConfig {
  static constexpr int M = 64;         // query rows per CTA: one wgmma M
  static constexpr int NT = 64;        // KV tokens per tile: N of S, K of P V
  // Two consumer warpgroups and the producer.
  static constexpr int THREADS = 384;
  static constexpr int CONSUMERS = 256;
  // The register split (168 per thread at launch, 3 x 168 in all): fp8's producer holds a tile
  // of raw bytes, bf16's only issues copies. fp8's WG1 (O and its P V) stays at the launch's
  // 168, so that WG0 has the 216 it needs for the exponentials ahead of the tile's maximum.
  static constexpr int PRODUCER_REGS = FP8 ? 120 : 40, SOFTMAX_REGS = FP8 ? 216 : 232, PV_REGS = FP8 ? 168 : 232;
  static_assert(fits_launch_registers(THREADS, PRODUCER_REGS + SOFTMAX_REGS + PV_REGS));
  static constexpr int STAGES = 2;
  // fp8: a stage arrives in PARTS parts of BLOCKS_PER_PART 64-column blocks, each with its own
  // full barrier, and S starts on the first part while the producer dequantises the rest (4-7 %
  // at 128 heads; whole stages were 8 % slower again in the fifty-third session, although a
  // per-tile timeline found the parts mostly early). bf16's cp.async tiles arrive whole: per-part waits only lengthened its S
  // chain (5-8 % slower; bench/NOTES.md, seventh session).
  static constexpr int PARTS = FP8 ? 3 : 1;
  static constexpr int BLOCKS_PER_PART = kDim / 64 / PARTS;
  static_assert(BLOCKS_PER_PART * PARTS * 64 == kDim);
  static constexpr int KSTEPS = kDim / 16;                  // 36 k16 steps of S
  static constexpr int Q_BYTES = M * kDim * 2;              // (64, 576) bf16
  static constexpr int TILE_BYTES = kBf16TileBytes;         // (64, 576) bf16
  static constexpr int P_BYTES = M * NT * 2;                // (64, 64) bf16
  static_assert(M == NT, "Q and KV column blocks share the k-step offsets of S");
  static_assert(Q_BYTES % 1024 == 0 && TILE_BYTES % 1024 == 0 && P_BYTES % 1024 == 0);
};

// Named barriers: 256 threads, one warpgroup arriving (bar.arrive) and the other waiting
// (bar.sync); 128 for one warpgroup alone. Each consumer warpgroup runs its own copy of the
// unit loop, and bar.sync is the aligned form (every thread that blocks in one generation
// blocks at the same instruction), so only one warpgroup blocks on each barrier. They carry
// WG0's writes to WG1; the unit's end, which orders reads before the next unit's writes, is
// an mbarrier (kMbarUnitEnd, below).
enum WgBarrier : int {
  kBarPReady = 1,   // WG0 -> WG1: P(i) and alpha(i) are in shared memory
  kBarStats = 4,    // WG0 -> WG1: the unit's row sums and maxima are in shared memory
  kBarSoftmax = 5,  // WG0 alone (128 threads; fp8: its f16 Q is in place; the row statistics)
  kBarPv = 6,       // WG1 alone: passed as often as WG0 passes kBarSoftmax (racecheck's bookkeeping)
};
// The mbarriers (WgShared::bar): full[s][q] at full_bar(s, q) ("part q of stage s holds its
// columns of the tile"; one arrival per producer thread, after its copies or stores of parts
// 0..q, so a part's completion implies the earlier parts'), then "P free": WG1 has consumed
// P(i) and alpha(i), sP may be rewritten (one arrival per WG1 thread; WG0 waits on it from its
// own branch, where a named barrier would have to be the slower unaligned barrier.sync), then
// empty[0], empty[1] ("both consumers are done with stage s"; one arrival per consumer thread),
// then "Q full" (the unit's Q and row lengths have landed: one cp.async arrival per producer
// thread, produce_unit_q) and "Q empty" (WG0 has read the lengths and run the unit's last S:
// one arrival per WG0 thread; the producer then loads the next unit's Q while WG0 finishes
// the unit), then "unit end" (both consumers are past their reads of the unit's shared
// memory: sP, sAlpha, sL and sM; one arrival per consumer thread, waited for by WG0 before
// the next unit rewrites them). The unit end is an mbarrier, not a named barrier that WG1
// arrives at and WG0 waits on: compute-sanitizer's racecheck does not take a bar.arrive as
// ordering the arriving thread's earlier reads before the waiting threads' later writes (it
// reported WG1's reads of sL against WG0's next writes), while it follows an mbarrier's
// arrivals (release) and wait (acquire). The full barriers take room for the most parts
// (fp8's).
enum WgMbarrier : int {
  kMbarFull = 0,
  kMbarPFree = 6,
  kMbarEmpty0 = 7,
  kMbarEmpty1 = 8,
  kMbarQFull = 9,
  kMbarQEmpty = 10,
  kMbarUnitEnd = 11,
  kMbarCount = 12
};
static_assert(kMbarPFree - kMbarFull == WgConfig<true>::STAGES * WgConfig<true>::PARTS &&
              WgConfig<true>::PARTS >= WgConfig<false>::PARTS);
template <bool FP8>
__device__ __forceinline__ constexpr int full_bar(uint32_t stage, int part) {
  return kMbarFull + WgConfig<FP8>::PARTS * int(stage) + part;
}
// bf16's stages have one part: its full barriers, like its empty ones, are consecutive (the
// producer, stream_bf16_tiles, takes stage 0's and steps 8 bytes).
static_assert(full_bar<false>(1, 0) == full_bar<false>(0, 0) + 1 && kMbarEmpty1 == kMbarEmpty0 + 1);

// The kernel's shared memory (from a 1024-byte aligned base; the operands on swizzle atoms).
struct WgShared {
  using C = WgConfig<false>;  // the layout is the same for both caches (fp8's stages hold f16)
  alignas(1024) uint8_t q[C::Q_BYTES];
  alignas(1024) uint8_t kv[C::STAGES][C::TILE_BYTES];  // K for S (K-major B) and V for P V (MN-major B)
  alignas(1024) uint8_t p[C::P_BYTES];                 // A of WG1's P V
  float alpha[C::M], l[C::M], m[C::M];
  float qscale[C::M];  // fp8: 2^-a of each row, whose Q entered as f16 times 2^a
  int len[C::M];
  uint64_t bar[kMbarCount];
};
inline constexpr int kWgSmemBytes = int(sizeof(WgShared)) + 1024;  // + slack to align the base
static_assert(kWgSmemBytes <= kSmemPerCta, "wgmma tiles do not fit in shared memory");


// The producer's load of unit k's Q and row lengths (produce_unit_q into the one Q buffer).
__device__ __forceinline__ void wgmma_load_unit_q(const AttentionParams& p, const UnitSpan& u, uint32_t k,
                                                  WgShared& sh, int t) {
  constexpr int M = WgShared::C::M;
  const uint32_t bar_a = smem_addr(sh.bar);
  produce_unit_q<M, 1>(p, u, k, smem_addr(sh.q), WgShared::C::Q_BYTES, smem_addr(sh.len), bar_a + 8 * kMbarQFull,
                       bar_a + 8 * kMbarQEmpty, t, [](int r, int ch) { return swz128(r, ch >> 3, ch & 7, M * 128); });
}

// fp8 producer warpgroup (thread t of 128): streams the raw bytes of each tile into
// registers one tile ahead (Fp8TileMap: four threads per token, two tokens a thread; the
// registers of each half of the pieces reload with the next tile's once that half is
// unpacked and the other half has landed), waits
// until both consumers have released the tile's stage, unpacks it there as f16 (exact: every
// e4m3 / e5m2 value is an f16 value; kv_scale is applied outside), fences the stores for the
// async proxy and arrives on the stage's full barrier.
// The bytes in registers are the stream's only lead, and its loads' latency still costs 12-24 %
// of the fp8 64-row rows (bench/NOTES.md, fifty-first session). Each part's proxy fence is a
// MEMBAR, which waits for every load this thread has in flight, so no load outlives a part's
// unpacking whatever order they are issued in. Tried and slower (fifty-first and fifty-second
// sessions): copying each tile into its released stage and unpacking it there (18 %); the
// fences in the consumers after their waits (their own MEMBARs cost more), also with a tile
// and a half of registers here; one part a tile with the next tile's loads after its fence;
// (fifty-third) the fences in WG1, idle while WG0 runs S and the softmax, on a second barrier
// WG0 waits for (6-16 %); the loads pinned in program order, five orders (even to 7 %). A
// second producer warpgroup does not fit beside the consumers' registers.
// One body per format: a run-time choice per chunk keeps both conversions' registers live.
template <bool E5M2>
__device__ __forceinline__ void wgmma_fp8_producer(const AttentionParams& p, const PlanScalars& ps, WgShared& sh,
                                                   int t) {
  using C = WgConfig<true>;
  constexpr int M = C::M, NT = C::NT;
  constexpr int PIECES = kDim / 64;  // 64-byte pieces of a stored row: one bf16 column block each
  const uint32_t bar_a = smem_addr(sh.bar);
  // Each 32-byte sector is read by one load instruction only (Fp8TileMap), so the loads skip
  // L1 allocation (3 % on the 128-head rows; with the old map, which read every sector twice,
  // skipping L1 cost a second trip to L2: 23-41 %).
  using Map = Fp8TileMap;
  uint4 raw[Map::kTokens][PIECES];
  uint32_t gbase = 0, unit = 0;
  for (UnitCursor cur = unit_cursor(); next_unit<M>(p, ps, cur);) {
    const UnitSpan u = unit_span<M, NT>(p, cur, ps);
    if (t == 0) prefetch_unit_q(p, u);  // its load waits for the previous unit's last S
    // Sub-pages of this thread's two tokens of tile i.
    auto subpages = [&](int i, int (&sp)[Map::kTokens]) {
#pragma unroll
      for (int h = 0; h < Map::kTokens; ++h) sp[h] = token_subpage(u, ps, i, u.tok_lo + i * NT + Map::token(t, h));
    };
    // Tile i's rows for this thread's tokens (null past tok_hi: that token's bytes read as zeros).
    auto rows = [&](int i, const int (&sp)[Map::kTokens], const uint8_t* (&src)[Map::kTokens]) {
#pragma unroll
      for (int h = 0; h < Map::kTokens; ++h) {
        const int j = u.tok_lo + i * NT + Map::token(t, h);
        src[h] = j < u.tok_hi ? token_row<kDim>(p, ps, sp[h], j) : nullptr;
      }
    };
    // Raw bytes of piece k of the tokens at src.
    auto read_piece = [&](int k, const uint8_t* const (&src)[Map::kTokens]) {
#pragma unroll
      for (int h = 0; h < Map::kTokens; ++h)
        raw[h][k] = src[h] ? ldg_no_l1(src[h] + Map::fp8_chunk(t, k) * 16) : make_uint4(0u, 0u, 0u, 0u);
    };
    // Piece k into its f16 chunks of column block k of stage s; a part's last piece fences the
    // part for the async proxy (wgmma reads it) and arrives.
    auto unpack_piece = [&](int k, uint32_t s) {
#pragma unroll
      for (int h = 0; h < Map::kTokens; ++h) {
        uint32_t v[8];
        fp8x16_to_f16x16(raw[h][k], E5M2, v);
#pragma unroll
        for (int e = 0; e < 2; ++e)
          *reinterpret_cast<uint4*>(sh.kv[s] + swz128(Map::token(t, h), k, Map::bf16_chunk(t, e), NT * 128)) =
              make_uint4(v[4 * e], v[4 * e + 1], v[4 * e + 2], v[4 * e + 3]);
      }
      if ((k + 1) % C::BLOCKS_PER_PART == 0) {
        fence_proxy_async();
        mbar_arrive(bar_a + 8 * full_bar<true>(s, k / C::BLOCKS_PER_PART));
      }
    };
    // A tile's pieces in two halves, X = [0, KX) and Y = [KX, PIECES), each loaded right after
    // the wait for the other. ptxas counts every load of the producer on one scoreboard, so
    // the first use of a loaded register waits for every load in flight: with each piece
    // reloaded as soon as it was unpacked, a tile's first unpack waited for its last pieces,
    // issued just before. Now a wait covers one half, issued about half a tile of unpacking
    // earlier (2-3.5 % on every fp8 row of this kernel, bench/NOTES.md, thirty-fourth session);
    // each part's fence drains what is in flight as well. This is the source order; ptxas
    // issues the Y half above the wait for the stage's release, which beat every order pinned
    // with volatile loads (fifty-third session): read the SASS before reordering.
    // The next half's loads sit in `if (more)`: without the branch ptxas sank branch-free
    // non-coherent loads behind the tile's last arrival (16 % slower, thirty-third session).
    constexpr int KX = 4;
    int sp[Map::kTokens];
    const uint8_t* src[Map::kTokens];
    if (u.ntiles > 0) {
      subpages(0, sp);
      rows(0, sp, src);
#pragma unroll
      for (int k = 0; k < KX; ++k) read_piece(k, src);
    } else {
      wgmma_load_unit_q(p, u, unit, sh, t);
    }
    subpages(1, sp);
    for (int i = 0; i < u.ntiles; ++i) {
      const uint32_t gt = gbase + uint32_t(i), s = gt & 1u, n = gt >> 1;
      const bool more = i + 1 < u.ntiles;
      if (n > 0) mbar_wait(bar_a + 8 * (kMbarEmpty0 + s), (n - 1) & 1u);
      unpack_piece(0, s);  // waits for X (and the sub-pages of tile i + 1)
#pragma unroll
      for (int k = KX; k < PIECES; ++k) read_piece(k, src);
      // Tile i + 1 into L2 now, so that its X loads (after the Y wait) and Y loads (a tile on)
      // find their lines on the way. Only where one row group reads each tile (at most 64 rows
      // a request: the stream waits on load latency); where several do, the tile is in L2 for
      // all but the first anyway and the tensor cores set the pace (there, 4 % slower).
      const bool prefetch = more && ps.groups == 1;
      if (prefetch) {
        rows(i + 1, sp, src);
        const int j0 = u.tok_lo + (i + 1) * NT, j1 = min(j0 + NT, u.tok_hi);
#pragma unroll
        for (int h = 0; h < Map::kTokens; ++h)
          if ((t & 3) == 0) prefetch_tile_run_l2<kDim>(ps, j0 + Map::token(t, h), j0, j1, src[h]);
      }
#pragma unroll
      for (int k = 1; k < KX; ++k) unpack_piece(k, s);
      if (more && !prefetch) rows(i + 1, sp, src);
      unpack_piece(KX, s);  // waits for Y
      if (more) {
#pragma unroll
        for (int k = 0; k < KX; ++k) read_piece(k, src);
        subpages(i + 2, sp);
      }
#pragma unroll
      for (int k = KX + 1; k < PIECES; ++k) unpack_piece(k, s);
      // The unit's Q behind its first tile (as stream_bf16_tiles' on_unit), the next tile's
      // bytes in flight meanwhile.
      if (i == 0) wgmma_load_unit_q(p, u, unit, sh, t);
    }
    gbase += uint32_t(u.ntiles);
    ++unit;
  }
}

// fp8: row r of the unit's Q (bf16, in sQ's swizzled blocks) to f16 in place, times the
// power of two that puts its largest magnitude in [2^14, 2^15) (pow2_row_scale): exact for
// every element down to 2^-28 of the row's largest, below it within 2^-40 of it. Returns the
// 2^-a that the row's score scale takes. A row with an infinite element is poisoned with NaN.
// Two adjacent lanes share the row, lane l (0, 1) taking its chunks l, l + 2, ..
__device__ __forceinline__ float q_row_to_f16(uint8_t* q, int r, int l) {
  constexpr int M = WgShared::C::M, CHUNKS = kDim / 8 / 2;  // of the row's 72 chunks, this lane's
  auto chunk = [&](int m) {
    const int ch = l + 2 * m;
    return reinterpret_cast<uint4*>(q + swz128(r, ch >> 3, ch & 7, M * 128));
  };
  float amax = 0.0f;
#pragma unroll
  for (int m = 0; m < CHUNKS; ++m) {
    const uint4 v = *chunk(m);
    for (const uint32_t w : {v.x, v.y, v.z, v.w}) {
      const float2 x = bf16x2_to_float2(w);
      amax = fmaxf(amax, fmaxf(fabsf(x.x), fabsf(x.y)));
    }
  }
  amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
  const RowScale sc = pow2_row_scale(amax, 15);
#pragma unroll
  for (int m = 0; m < CHUNKS; ++m) {
    uint4 v = *chunk(m);
    for (uint32_t* w : {&v.x, &v.y, &v.z, &v.w}) {
      const float2 x = bf16x2_to_float2(*w);
      *w = sc.poison ? 0x7e007e00u : pack_f16x2(x.x * sc.up, x.y * sc.up);
    }
    *chunk(m) = v;
  }
  return sc.down;
}

template <bool FP8>
__global__ void __launch_bounds__(WgConfig<FP8>::THREADS, 1)
    attention_wgmma_kernel(const __grid_constant__ AttentionParams p, const __grid_constant__ KvBoxMaps maps) {
  using C = WgConfig<FP8>;
  constexpr int M = C::M, NT = C::NT;

  extern __shared__ __align__(1024) uint8_t smem_raw[];
  WgShared& sh = aligned_shared<WgShared>(smem_raw);
  const uint32_t sQ_a = smem_addr(sh.q), sKV_a = smem_addr(sh.kv[0]), sP_a = smem_addr(sh.p);
  const uint32_t bar_a = smem_addr(sh.bar);  // mbarrier k (WgMbarrier) at bar_a + 8 k
  float* sAlpha = sh.alpha;
  float* sL = sh.l;
  float* sM = sh.m;
  int* sLen = sh.len;

  const int tid = threadIdx.x, wg = tid >> 7, t = tid & 127;
  const int lane = tid & 31, g = lane >> 2, c = lane & 3;
  const int r0 = (t >> 5) * 16 + g, r1 = r0 + 8;  // the two accumulator rows of this thread

  if (tid == 0) {
    // One arrival per producer thread (bf16: when its copies land).
    for (int b = kMbarFull; b < kMbarFull + C::STAGES * C::PARTS; ++b) mbar_init(bar_a + 8 * b, 128);
    mbar_init(bar_a + 8 * kMbarPFree, 128);
    mbar_init(bar_a + 8 * kMbarEmpty0, C::CONSUMERS);
    mbar_init(bar_a + 8 * kMbarEmpty1, C::CONSUMERS);
    mbar_init(bar_a + 8 * kMbarQFull, 128);
    mbar_init(bar_a + 8 * kMbarQEmpty, 128);
    mbar_init(bar_a + 8 * kMbarUnitEnd, C::CONSUMERS);
    // The full barriers are completed by the TMA unit (bf16 boxes, stream_bf16_tiles): their
    // initialisation made visible to the async proxy (as the CUDA guide's TMA example does).
    fence_proxy_async();
  }
  __syncthreads();

  cta_start(p, tid);
  // The plan's scalars are read by each role after its setmaxnreg: a value live across it
  // may be spilled.
  if (wg == 2) {
    setmaxnreg_to<C::THREADS, C::PRODUCER_REGS>();
    const PlanScalars ps = plan_scalars<M>(p);
    if constexpr (!FP8)
      stream_bf16_tiles<M>(p, ps, sKV_a, bar_a + 8 * full_bar<false>(0, 0), bar_a + 8 * kMbarEmpty0, t, &maps,
                           [&](const UnitSpan& u, uint32_t k) { wgmma_load_unit_q(p, u, k, sh, t); });
    else if (p.kv_dtype == KvDtype::fp8_e5m2) wgmma_fp8_producer<true>(p, ps, sh, t);
    else wgmma_fp8_producer<false>(p, ps, sh, t);
    return;
  }
  // Each consumer warpgroup runs its own copy of the unit loop, with only its role's code in
  // it, so that ptxas allocates each copy's registers for that role alone (the 128-head rows
  // 1-2 % faster than one loop with both roles in it on the H100: bench/NOTES.md,
  // fifty-second session). The barriers between them pair an arrive with a sync (WgBarrier),
  // and the unit ends on an mbarrier both arrive at (kMbarUnitEnd).
  auto consumer = [&](auto softmax_wg) {
    constexpr bool kSoftmaxWg = decltype(softmax_wg)::value;
    setmaxnreg_to<C::THREADS, kSoftmaxWg ? C::SOFTMAX_REGS : C::PV_REGS>();
    const PlanScalars ps = plan_scalars<M>(p);

    const float kv_scale = FP8 ? kv_scale_of(p) : 1.0f;
    const float sl2 = p.softmax_scale * kv_scale * kLog2e;
    const float out_scale = kv_scale;  // v = stored * kv_scale

    uint32_t phase = 0;  // bit k: parity of the next completion of mbarrier k this thread waits for
    uint32_t gbase = 0;  // the unit's first tile, numbered across the CTA's units

    float o[128];  // (64, 256) slice of O: this warpgroup's columns [256 wg, 256 wg + 256)
    // O's rows r0, r1 times alpha; once the running maxima settle alpha is exactly 1 (skipped).
    auto rescale_o = [&](float al0, float al1) {
      if (__any_sync(0xffffffffu, al0 != 1.0f || al1 != 1.0f)) {
#pragma unroll
        for (int k = 0; k < 128; k += 4) {
          o[k] *= al0;
          o[k + 1] *= al0;
          o[k + 2] *= al1;
          o[k + 3] *= al1;
        }
      }
    };

    for (UnitCursor cur = unit_cursor(); next_unit<M>(p, ps, cur);) {
      const UnitSpan u = unit_span<M, NT>(p, cur, ps);
      const int nr = u.nr;
      const int tok_lo = u.tok_lo, tok_hi = u.tok_hi, ntiles = u.ntiles;

#pragma unroll
      for (int k = 0; k < 128; ++k) o[k] = 0.0f;
      float m_run[2] = {kNegInf, kNegInf}, l_run[2] = {0.0f, 0.0f};

      // The softmax role (WG0): S, the online softmax, P and alpha to WG1, O[:, 0:256] += P V;
      // then the row statistics for the epilogue.
      auto softmax_role = [&] {
        // The unit's Q and lengths, loaded by the producer (no proxy fence: cp.async bytes
        // arrived through the mbarrier). Q is released after the unit's last S.
        mbar_wait(bar_a + 8 * kMbarQFull, (phase >> kMbarQFull) & 1u);
        phase ^= 1u << kMbarQFull;
        // fp8: WG0 turns the unit's Q into f16 in place (two threads a row) and puts each
        // row's scale beside it. Only WG0 touches Q, so the producer's next load of it waits
        // for WG0 alone, and WG1 never sees Q or the scales.
        if constexpr (FP8) {
          const float qs = q_row_to_f16(sh.q, t >> 1, t & 1);
          if ((t & 1) == 0) sh.qscale[t >> 1] = qs;
          fence_proxy_async();  // the f16 Q is read by wgmma (async proxy)
          named_sync(kBarSoftmax, 128);
        }
        // Rows past the unit's (padding to 64) have a zero Q and are never stored, so they go
        // unmasked: their scores are 0, their maxima settle on the first tile and their warps
        // take the fast path. Masked, they had no key, so every tile of theirs paid the mask, the
        // maximum's step and a rescale of O (alpha = 2^-inf): 17-23 % at every row count above
        // 64 that is not a multiple of it (bench/NOTES.md, twenty-ninth session).
        const int lim0 = r0 >= nr ? tok_hi : min(sLen[r0], tok_hi), lim1 = r1 >= nr ? tok_hi : min(sLen[r1], tok_hi);
        // This thread's four stmatrix addresses of P (one per k16 step; lane l addresses row
        // l % 8 of matrix l / 8), made opaque so that ptxas keeps them rather than rebuilding them
        // (a chain of about 20 instructions) between the P-free wait and the stores on every tile.
        uint32_t p_st[4];
        {
          const int mi = lane >> 3, rr = lane & 7, row = (t >> 5) * 16 + (mi & 1) * 8 + rr;
#pragma unroll
          for (int kk = 0; kk < 4; ++kk) {
            p_st[kk] = sP_a + row * 128 + (((2 * kk + (mi >> 1)) ^ rr) << 4);
            asm volatile("" : "+r"(p_st[kk]));
          }
        }
        // Each row's score scale (fp8: times the 2^-a its Q was scaled by).
        const float sl2r0 = FP8 ? sl2 * sh.qscale[r0] : sl2, sl2r1 = FP8 ? sl2 * sh.qscale[r1] : sl2;
        if (ntiles == 0) mbar_arrive(bar_a + 8 * kMbarQEmpty);
        for (int i = 0; i < ntiles; ++i) {
          const int s = (gbase + i) & 1;
          // No proxy fence after the wait: cp.async bytes, completed through
          // cp.async.mbarrier.arrive, go to wgmma straight after the barrier (as in
          // FlashAttention-3's paged-KV path); the fp8 producer fences its own stores before
          // arriving. Here fence.proxy.async is a MEMBAR that also waits for this thread's loads
          // in flight: dropping it took verify16_q4 from 225 to 204 us (bench/NOTES.md).
          const uint32_t sK = sKV_a + s * C::TILE_BYTES;
          // S (64, 64) = Q (64, 576) K^T: k16 step ks reads 32 bytes of column block ks / 4; each
          // part's steps start when the part has landed, one commit group per part (a spin on
          // an mbarrier inside one group makes ptxas serialise every wgmma of the kernel).
          // sc[4 j + e]: row r0, token 8 j + 2 c + e; sc[4 j + 2 + e]: row r1.
          float sc[32];
#pragma unroll
          for (int k = 0; k < 32; ++k) sc[k] = 0.0f;  // (overwritten: the first step has scale_d = 0)
#pragma unroll
          for (int q = 0; q < C::PARTS; ++q) {
            const int fb = full_bar<FP8>(s, q);
            mbar_wait(bar_a + 8 * fb, (phase >> fb) & 1u);
            phase ^= 1u << fb;
            const SmemDesc dq(sQ_a, 16, 1024), dk(sK, 16, 1024);  // (per part: not held across the waits)
            wgmma_fence();
#pragma unroll
            for (int kq = 0; kq < 4 * C::BLOCKS_PER_PART; ++kq) {
              const int ks = q * 4 * C::BLOCKS_PER_PART + kq;
              const uint32_t off = uint32_t((ks >> 2) * (M * 128) + (ks & 3) * 32);
              wgmma_m64n64k16_ss<0, 0, FP8>(sc, dq.at(off), dk.at(off), ks > 0);
            }
            wgmma_commit();
          }
          wgmma_wait<0>();
          fence_regs(sc);
          if (i + 1 == ntiles) mbar_arrive(bar_a + 8 * kMbarQEmpty);

          // Online softmax, base 2; each row masked at its own local length, in place and only
          // in a tile that reaches past one of this thread's two rows (a unit's last tile, or a
          // verify row's shorter window): full tiles skip the 64 compares.
          const int tok0 = tok_lo + i * NT;
          if (tok0 + NT > min(lim0, lim1)) {
#pragma unroll
            for (int j = 0; j < 8; ++j)
#pragma unroll
              for (int e = 0; e < 4; ++e)
                if (tok0 + 8 * j + 2 * c + (e & 1) >= (e < 2 ? lim0 : lim1)) sc[4 * j + e] = kNegInf;
          }
          auto x = [&](int j, int e) { return sc[4 * j + e]; };  // e 0, 1: row r0; 2, 3: row r1
          // P (packed for P V) and its row sums under the exponent offsets mu0, mu1.
          float sum0, sum1;
          uint32_t pa[4][4];  // A fragments of P V, k16 step kk = tokens [16 kk, 16 kk + 16)
          auto exponentials = [&](float mu0, float mu1) {
            sum0 = 0.0f;
            sum1 = 0.0f;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
              const float p0 = fast_exp2(fmaf(x(j, 0), sl2r0, -mu0)), p1 = fast_exp2(fmaf(x(j, 1), sl2r0, -mu0));
              const float p2 = fast_exp2(fmaf(x(j, 2), sl2r1, -mu1)), p3 = fast_exp2(fmaf(x(j, 3), sl2r1, -mu1));
              sum0 += p0 + p1;
              sum1 += p2 + p3;
              pa[j >> 1][(j & 1) * 2] = FP8 ? pack_f16x2(p0, p1) : pack_bf16x2(p0, p1);
              pa[j >> 1][(j & 1) * 2 + 1] = FP8 ? pack_f16x2(p2, p3) : pack_bf16x2(p2, p3);
            }
          };
          // The exponentials first, under the offsets the rows had. With the lazy maximum these
          // stay on almost every tile, so the values are the step's own, and the exponentials no
          // longer wait for the tile's maximum (a tree of compares and two shuffles); a warp where
          // a row's offset moved computes them again (on a unit's first tile every warp does: a
          // run-time gate for that tile cost 4 %, bench/NOTES.md). fp8's WG0 holds P beside the
          // scores in its 216 registers (at 192 it could not, and fp8 took the maximum first:
          // even to 3 % slower on the H100, bench/NOTES.md, fifty-third session).
          const float keep0 = softmax_offset(m_run[0]), keep1 = softmax_offset(m_run[1]);
          exponentials(keep0, keep1);
          // A lazy maximum moves only for a score over 2^kLazyMaxSlack under the row's offset, so a
          // warp where no row can move (and every row has a maximum already) keeps every offset:
          // it skips the shuffles and the step, and alpha is 1 (on almost every tile). The sums
          // say so (the exponentials are not negative; a NaN sum fails the test), and the
          // maximum's tree is skipped as well.
          constexpr float kLazyMaxExp = float(1u << unsigned(kLazyMaxSlack));
          float al0 = 1.0f, al1 = 1.0f;
          const bool keeps = sum0 <= kLazyMaxExp && sum1 <= kLazyMaxExp;
          if (__any_sync(0xffffffffu, !keeps || m_run[0] == kNegInf || m_run[1] == kNegInf)) {
            float mx0 = max16(sc, 0), mx1 = max16(sc, 2);
#pragma unroll
            for (int d = 1; d <= 2; d <<= 1) {
              mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, d));
              mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, d));
            }
            // (sl2r > 0: the scaled maximum is the maximum of the scaled scores.)
            const SoftmaxStep st0 = softmax_step<true, !FP8>(m_run[0], mx0 * sl2r0),
                              st1 = softmax_step<true, !FP8>(m_run[1], mx1 * sl2r1);
            if (__any_sync(0xffffffffu, st0.mu != keep0 || st1.mu != keep1)) exponentials(st0.mu, st1.mu);
            al0 = st0.alpha;
            al1 = st1.alpha;
            m_run[0] = st0.m;
            m_run[1] = st1.m;
            rescale_o(al0, al1);
          }
          l_run[0] = l_run[0] * al0 + sum0;
          l_run[1] = l_run[1] * al1 + sum1;

          // Hand P (bf16, fp8: f16; K-major swizzled (64, 64)) and alpha to WG1.
          if (i > 0) {
            mbar_wait(bar_a + 8 * kMbarPFree, (phase >> kMbarPFree) & 1u);
            phase ^= 1u << kMbarPFree;
          }
          // One stmatrix per k16 step: pa[kk][i] is matrix i's fragment (rows r0 / r1 = the
          // warp's rows 0-7 / 8-15, columns 16 kk + 8 (i >> 1) ..).
#pragma unroll
          for (int kk = 0; kk < 4; ++kk) stmatrix_x4(p_st[kk], pa[kk]);
          if (c == 0) {
            sAlpha[r0] = al0;
            sAlpha[r1] = al1;
          }

          // O[:, 0:256] += P V: V = dims [0, 256) of the tile, MN-major (4 blocks of 64 dims,
          // LBO 8 KiB apart; 8-token groups SBO 1 KiB apart; k16 step = 2 KiB). Issued before
          // the handoff's fence and arrival (as FlashMLA orders its P store, P V and fence): the
          // tensor cores start on this half while the fence (a MEMBAR) drains the stores; P's
          // registers were read by the stores above, before the wgmma takes them.
          const SmemDesc dv(sK, NT * 128, 1024);
          wgmma_fence();
#pragma unroll
          for (int kk = 0; kk < 4; ++kk) wgmma_m64n256k16_rs<1, FP8>(o, pa[kk], dv.at(kk * 2048), 1);
          wgmma_commit();
          fence_proxy_async();
          named_arrive(kBarPReady, 256);
          wgmma_wait<0>();
          fence_regs(o);
          mbar_arrive(bar_a + 8 * (kMbarEmpty0 + s));
        }
        // l over the quad of lanes that share a row (each summed its own tokens).
#pragma unroll
        for (int d = 1; d <= 2; d <<= 1) {
          l_run[0] += __shfl_xor_sync(0xffffffffu, l_run[0], d);
          l_run[1] += __shfl_xor_sync(0xffffffffu, l_run[1], d);
        }
        if (c == 0) {
          sL[r0] = l_run[0];
          sL[r1] = l_run[1];
          sM[r0] = m_run[0];
          sM[r1] = m_run[1];
        }
      };
      // The P V role (WG1): O[:, 256:512] += P V with P from shared memory.
      auto pv_role = [&] {
        // Nothing waits for this barrier: it keeps both consumers' barrier counts equal, which
        // racecheck's bookkeeping needs (as in the fp8 swap kernel).
        if constexpr (FP8) named_sync(kBarPv, 128);
        for (int i = 0; i < ntiles; ++i) {
          const int s = (gbase + i) & 1;
          named_sync(kBarPReady, 256);
          // The last part: every part has landed (no proxy fence: see WG0).
          const int fb = full_bar<FP8>(s, C::PARTS - 1);
          mbar_wait(bar_a + 8 * fb, (phase >> fb) & 1u);
          phase ^= 1u << fb;
          rescale_o(sAlpha[r0], sAlpha[r1]);
          const uint32_t sK = sKV_a + s * C::TILE_BYTES;
          const SmemDesc dp(sP_a, 16, 1024), dv(sK + 4 * (NT * 128), NT * 128, 1024);
          wgmma_fence();
#pragma unroll
          for (int kk = 0; kk < 4; ++kk) wgmma_m64n256k16_ss<1, 0, FP8>(o, dp.at(kk * 32), dv.at(kk * 2048), 1);
          wgmma_commit();
          wgmma_wait<0>();
          fence_regs(o);
          mbar_arrive(bar_a + 8 * (kMbarEmpty0 + s));
          // sP and sAlpha may be rewritten once every WG1 thread has arrived (its reads above
          // are released to WG0's writes of the next tile).
          if (i + 1 < ntiles) mbar_arrive(bar_a + 8 * kMbarPFree);
        }
      };
      // sL, sM: WG0's threads store rows that other warps of WG0 wrote.
      if constexpr (kSoftmaxWg) {
        softmax_role();
        named_arrive(kBarStats, C::CONSUMERS);
        named_sync(kBarSoftmax, 128);
      } else {
        pv_role();
        named_sync(kBarStats, C::CONSUMERS);
        named_sync(kBarPv, 128);
      }

      // ---- epilogue: normalise, write this warpgroup's 256 columns ----------------------------
      // The first column opaque, so that ptxas computes the stores' addresses here rather than
      // holding them in registers across the unit loop.
      int col0 = wg * 256;
      asm volatile("" : "+r"(col0));
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = h ? r1 : r0;
        store_row_lanes<1, 2, 32>(p, u, r, r < nr, c, sL[r], out_scale, [&](int j) { return col0 + 8 * j; },
                                  [&](int j) { return make_float2(o[4 * j + 2 * h], o[4 * j + 2 * h + 1]); });
      }
      if (kSoftmaxWg && tid < nr) store_row_stats(p, u, tid, sM[tid], sL[tid]);
      gbase += uint32_t(ntiles);
      // WG0 rewrites sAlpha and sP at the next unit's first tile and sL, sM at its end, after
      // both consumers' reads of this unit's.
      mbar_arrive(bar_a + 8 * kMbarUnitEnd);
      if constexpr (kSoftmaxWg) {
        mbar_wait(bar_a + 8 * kMbarUnitEnd, (phase >> kMbarUnitEnd) & 1u);
        phase ^= 1u << kMbarUnitEnd;
      }
    }
    if (tid == 128) trace_cta(p, true);  // the first consumer thread, after its last unit
  };
  if (wg == 0) consumer(std::true_type{});
  else consumer(std::false_type{});
}

template <bool FP8>
int attention_wgmma_smem_bytes() {
  return kWgSmemBytes;
}

template <bool FP8>
void launch_attention_wgmma(const AttentionParams& p, int grid, cudaStream_t stream) {
  // bf16 tiles come by the TMA unit (kv_box_maps); fp8's producer loads its bytes itself.
  static const KvBoxMaps kNoMaps{};
  launch_attention_kernel<attention_wgmma_kernel<FP8>>(p, grid, WgConfig<FP8>::THREADS, kWgSmemBytes, stream,
                                                       "attention_wgmma_kernel",
                                                       FP8 || grid == 0 ? kNoMaps : kv_box_maps(p.kv));
}

}  // namespace dcpmla::cuda_detail

#define DCPMLA_INSTANTIATE_ATTENTION_WGMMA(FP8)                                                          \
  template void dcpmla::cuda_detail::launch_attention_wgmma<FP8>(const dcpmla::AttentionParams&, int,  \
                                                                 cudaStream_t);                         \
  template int dcpmla::cuda_detail::attention_wgmma_smem_bytes<FP8>();
