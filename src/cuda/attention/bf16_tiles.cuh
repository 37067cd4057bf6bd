// The bf16 producer warpgroup of the warp-specialised kernels (kernel_wgmma.cuh's 64-row
// kernel and kernel_bf16_swap.cuh's 16- and 32-row one): it streams the KV tiles of the
// CTA's units, 64 tokens of 576 bf16 each, by cp.async or the TMA unit straight into a ring of
// two stages in the wgmma layout (9 column blocks of (64, 128 B), 128-byte swizzle: K-major for
// S, MN-major for P V), running ahead across units: the CTA's tiles are numbered across its
// units and tile gt sits in stage gt % 2. A stage is refilled once its consumers have released
// it (empty[s]: phase n - 1 for its n-th fill); full[s] expects 128 arrivals, one a producer
// thread (cp.async.mbarrier.arrive.noinc as its copies land, or, for a tile of TMA boxes,
// thread 0's expect_tx of the tile's bytes and the others' plain arrivals).
// on_unit(u, k) runs once the CTA's k-th unit u has its first tile issued (at once when it has
// none): the kernels load the unit's Q there (produce_unit_q), one unit ahead of their
// consumers, behind the tile, which the 64-row kernel's single Q buffer would otherwise hold
// back until the previous unit's last S.
#pragma once

#include <cstdint>

#include "common/params.h"
#include "common/utils.cuh"
#include "config.h"
#include "kv_box_maps.h"
#include "swizzle.cuh"
#include "tile_maps.h"
#include "unit.cuh"
#include "wgmma.cuh"

namespace dcpmla::cuda_detail {

// DCPMLA_PROBE_NO_FILL (the CMake option of a measuring build): no copy is issued, each stage
// is released to the consumers at once (wrong results: their pace alone).
#ifdef DCPMLA_PROBE_NO_FILL
inline constexpr bool kProbeNoFill = true;
#else
inline constexpr bool kProbeNoFill = false;
#endif

inline constexpr int kBf16TileTokens = 64;
inline constexpr int kBf16TileBytes = kBf16TileTokens * kDim * 2;  // (64, 576) bf16: 72 KiB

// A producer thread's part (t < 128) of unit k's Q rows (zero past the unit's rows; 16-byte
// chunk ch of row r at q + at(r, ch)) and row lengths (M int32 at len) into buffer k % BUFS
// (the next buffer q_bytes and 4 M bytes on), once the consumers have released it (unit
// k - BUFS's: qempty + 8 b), arriving on qfull + 8 b as they land (cp.async.mbarrier.arrive.noinc:
// qfull expects 128 arrivals). The producers load Q one unit ahead, so that a unit's start
// waits for no load of the consumers' own.
template <int M, int BUFS, typename At>
__device__ __forceinline__ void produce_unit_q(const AttentionParams& p, const UnitSpan& u, uint32_t k, uint32_t q,
                                               uint32_t q_bytes, uint32_t len, uint32_t qfull, uint32_t qempty, int t,
                                               At at) {
  const uint32_t b = k % BUFS, n = k / BUFS;
  if (n > 0) mbar_wait(qempty + 8 * b, (n - 1) & 1u);
  load_q_async<M, 128>(p, u, q + b * q_bytes, t, at);
  if (t < M) {
    const bool ok = t < u.nr;
    cp_async_4(len + b * (4 * M) + 4 * t, ok ? u.lens + (u.row0 + t) / p.heads : u.lens, ok ? 4 : 0);
  }
  cp_async_mbar_arrive(qfull + 8 * b);
}

// Thread t (< 128) of the producer warpgroup of CTAs of M rows; ring: stage 0's shared
// address (stage 1 follows kBf16TileBytes later); full, empty: the mbarriers of stage 0 (stage
// 1's 8 bytes later). With maps (the cache's, kv_box_maps), a whole tile on sub-pages of
// kMinBoxPage tokens or more, where several row groups read each tile, is one thread's boxes,
// 9 per sub-page run (9 a tile on pages of 64+ tokens), its full barrier expecting the tile's
// bytes: 3-3.6 % faster than cp.async on every 128-head row, whose second row group's tile
// comes from L2 (bench/NOTES.md, thirty-eighth session). Otherwise (no maps; one row group,
// where each tile comes from DRAM once and boxes were 4-6 % slower; smaller sub-pages; a
// unit's last tile when it is partial, whose rows past the end must read as zeros) each thread
// copies by cp.async, eight threads per token (Bf16TileMap: chunk lc of every column block m,
// one 128-byte row of it), four tokens a thread: a warp's copy reads 4 tokens x 128 contiguous
// bytes. The next tile's sub-pages are looked up while this tile's copies are in flight.
template <int M, typename OnUnit>
__device__ __forceinline__ void stream_bf16_tiles(const AttentionParams& p, const PlanScalars& ps, uint32_t ring,
                                                  uint32_t full, uint32_t empty, int t, const KvBoxMaps* maps,
                                                  OnUnit on_unit) {
  constexpr int NT = kBf16TileTokens;
  using Map = Bf16TileMap;
  const int lc = Map::chunk(t);
  uint32_t gbase = 0, unit = 0;
  for (UnitCursor cur = unit_cursor(); next_unit<M>(p, ps, cur);) {
    const UnitSpan u = unit_span<M, NT>(p, cur, ps);
    if (t == 0) prefetch_unit_q(p, u);  // on_unit's Q load may wait for the consumers
    if (u.ntiles == 0) on_unit(u, unit);
    // The sub-pages of this thread's four tokens of tile i (0 past the end: never dereferenced).
    auto subpages = [&](int i, int (&sp)[Map::kTokens]) {
#pragma unroll
      for (int j = 0; j < Map::kTokens; ++j) sp[j] = token_subpage(u, ps, i, u.tok_lo + i * NT + Map::token(t, j));
    };
    int sp[Map::kTokens];
    if (u.ntiles > 0) subpages(0, sp);
    for (int i = 0; i < u.ntiles; ++i) {
      const uint32_t gt = gbase + uint32_t(i), s = gt & 1u, n = gt >> 1;
      if (n > 0) mbar_wait(empty + 8 * s, (n - 1) & 1u);
      const uint32_t dst = ring + s * kBf16TileBytes;
      const int tok0 = u.tok_lo + i * NT;
      if (!kProbeNoFill && maps != nullptr && ps.groups > 1 && ps.page >= kMinBoxPage && tok0 + NT <= u.tok_hi) {
        if (t == 0) {
          mbar_arrive_expect_tx(full + 8 * s, kBf16TileBytes);
          const int h = min(ps.page, NT);  // a run: one sub-page's tokens, or the whole tile
          const void* map = &maps->box[__ffs(h) - __ffs(kMinBoxRows)];
          // Run r0 from sub-page sub: thread 0's tokens 16 j are looked up with its cp.async
          // tokens, a tile ahead (sp), and the runs start at tokens 0 and (pages of 32) 32.
          auto run = [&](int r0, int sub) {
            const int row = sub * ps.page + ((tok0 + r0) & (ps.page - 1));
#pragma unroll
            for (int m = 0; m < kDim / 64; ++m)
              tensor_box_g2s(dst + m * (NT * 128) + r0 * 128, map, 64 * m, row, full + 8 * s);
          };
          static_assert(NT / kMinBoxPage == 2 && Map::token(0, 2) == 32);
          run(0, sp[0]);
          if (h < NT) run(32, sp[2]);
        } else {
          mbar_arrive(full + 8 * s);
        }
        // (The loop's tail here rather than an else around the cp.async form: the kernel was
        // measured in this form, and the else moved ptxas's register allocation.)
        if (i == 0) on_unit(u, unit);
        if (i + 1 < u.ntiles) subpages(i + 1, sp);
        continue;
      }
#pragma unroll
      for (int j = 0; j < Map::kTokens; ++j) {
        const int tok = Map::token(t, j), jt = u.tok_lo + i * NT + tok;
        const bool ok = jt < u.tok_hi;  // past it: zero-filled, never read
        const uint8_t* src = ok ? token_row<kDim * 2>(p, ps, sp[j], jt) : p.kv;
        if constexpr (!kProbeNoFill)
#pragma unroll
          for (int m = 0; m < kDim / 64; ++m)
            cp_async_16(dst + swz128(tok, m, lc, NT * 128), src + (lc + 8 * m) * 16, ok ? 16 : 0);
      }
      cp_async_mbar_arrive(full + 8 * s);
      if (i == 0) on_unit(u, unit);
      if (i + 1 < u.ntiles) subpages(i + 1, sp);
    }
    gbase += uint32_t(u.ntiles);
    ++unit;
  }
}

}  // namespace dcpmla::cuda_detail
