// The producers' tile maps (src/cuda/attention/tile_maps.h), checked on the host: which thread
// moves which 16-byte chunk of a 64-token tile. The GPU scenarios find a map that loses or
// misplaces bytes (wrong rows); what they cannot see is a map that is right but slow, so the
// properties the kernels' speed rests on are checked here, where CI runs them without a GPU:
// every chunk moved exactly once, a warp's load instruction reading whole 32-byte sectors
// (fp8: a second read of a sector costs an L1 pass, or without L1 allocation a second trip to
// L2: 23-41 %), and a quarter warp's eight 16-byte stores falling on eight distinct bank
// groups (two-way conflicts cost the fp8 rows 3-5.5 %; bench/NOTES.md, fourteenth and fifteenth
// sessions). Two negative controls, the fourteenth session's two maps, show the sector and
// the bank checks failing.
#include <set>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "attention/swizzle.cuh"
#include "attention/tile_maps.h"

namespace {

using dcpmla::cuda_detail::Bf16TileMap;
using dcpmla::cuda_detail::Fp8TileMap;
using dcpmla::cuda_detail::swz128;

constexpr int kThreads = 128;          // a producer warpgroup
constexpr int kTokens = 64;            // a tile
constexpr int kBlocks = 9;             // 64-value column blocks of a 576-value row
constexpr int kBlockBytes = kTokens * 128;
constexpr int kFp8Chunks = 576 / 16;   // 16-byte chunks of a stored fp8 row
constexpr int kBf16Chunks = 576 / 8;   // of a bf16 row

// The bank group (16 bytes of the 128 banks' bytes) of a stage address.
int bank_group(uint32_t addr) { return int(addr / 16 % 8); }

// An fp8 map: thread t's token h, the fp8 chunk (of the row's 36) its load k reads, and the
// bf16 chunk (of the row's 72) its e-th half of that load is stored to.
struct Fp8Map {
  int tokens_per_thread, loads;  // per thread and token
  int (*token)(int t, int h);
  int (*fp8_chunk)(int t, int k);
  int (*store_chunk)(int t, int k, int e);
};

// The kernel's map: load k is piece k, stored into column block k.
Fp8Map current() {
  return {Fp8TileMap::kTokens, kBlocks, Fp8TileMap::token, Fp8TileMap::fp8_chunk,
          [](int t, int k, int e) { return 8 * k + Fp8TileMap::bf16_chunk(t, e); }};
}

// The fourteenth session's first map (two threads a token, alternating 16-byte chunks
// 2 k + half): right and sector-whole, but both threads of a token wrote the same half of
// each 128-byte row.
Fp8Map alternating() {
  return {1, kFp8Chunks / 2, [](int t, int) { return t >> 1; }, [](int t, int k) { return 2 * k + (t & 1); },
          [](int t, int k, int e) { return 2 * (2 * k + (t & 1)) + e; }};
}

// The fourteenth session's landed map (two threads a token, each one 32-byte half of every
// 64-byte piece: fp8 chunk 4 (k / 2) + 2 half + k % 2): conflict-free, but each sector read by
// two load instructions.
Fp8Map halves() {
  return {1, kFp8Chunks / 2, [](int t, int) { return t >> 1; },
          [](int t, int k) { return 4 * (k >> 1) + 2 * (t & 1) + (k & 1); },
          [](int t, int k, int e) { return 2 * (4 * (k >> 1) + 2 * (t & 1) + (k & 1)) + e; }};
}

// Every (token, fp8 chunk) of the tile is loaded by exactly one thread's load, and its two
// bf16 chunks land where its values belong (bf16 chunks 2 f, 2 f + 1 of the row).
::testing::AssertionResult covers_once(const Fp8Map& m) {
  std::vector<int> seen(kTokens * kFp8Chunks, 0);
  for (int t = 0; t < kThreads; ++t)
    for (int h = 0; h < m.tokens_per_thread; ++h)
      for (int k = 0; k < m.loads; ++k) {
        const int tok = m.token(t, h), f = m.fp8_chunk(t, k);
        if (tok < 0 || tok >= kTokens || f < 0 || f >= kFp8Chunks)
          return ::testing::AssertionFailure() << "thread " << t << " loads token " << tok << " chunk " << f;
        ++seen[tok * kFp8Chunks + f];
        for (int e = 0; e < 2; ++e)
          if (m.store_chunk(t, k, e) != 2 * f + e)
            return ::testing::AssertionFailure() << "fp8 chunk " << f << " half " << e << " lands in bf16 chunk "
                                                 << m.store_chunk(t, k, e);
      }
  for (int i = 0; i < kTokens * kFp8Chunks; ++i)
    if (seen[i] != 1)
      return ::testing::AssertionFailure() << "token " << i / kFp8Chunks << " chunk " << i % kFp8Chunks << " loaded "
                                           << seen[i] << " times";
  return ::testing::AssertionSuccess();
}

// Each load instruction (one h, one k, a warp's 32 threads) reads only whole 32-byte sectors
// of its tokens' rows: no sector is split between two instructions.
::testing::AssertionResult whole_sectors(const Fp8Map& m) {
  for (int w = 0; w < kThreads / 32; ++w)
    for (int h = 0; h < m.tokens_per_thread; ++h)
      for (int k = 0; k < m.loads; ++k) {
        std::set<std::pair<int, int>> chunks;  // (token, fp8 chunk)
        for (int t = 32 * w; t < 32 * w + 32; ++t) chunks.insert({m.token(t, h), m.fp8_chunk(t, k)});
        for (const auto& [tok, f] : chunks)
          if (!chunks.count({tok, f ^ 1}))
            return ::testing::AssertionFailure() << "warp " << w << " load (" << h << ", " << k << ") reads half of "
                                                 << "the sector of token " << tok << " chunk " << f;
      }
  return ::testing::AssertionSuccess();
}

// Each store instruction (h, k, e) of a quarter warp (8 threads, one shared-memory wavefront)
// falls on 8 distinct bank groups.
::testing::AssertionResult conflict_free_stores(const Fp8Map& m) {
  for (int q = 0; q < kThreads / 8; ++q)
    for (int h = 0; h < m.tokens_per_thread; ++h)
      for (int k = 0; k < m.loads; ++k)
        for (int e = 0; e < 2; ++e) {
          std::set<int> groups;
          for (int t = 8 * q; t < 8 * q + 8; ++t) {
            const int c = m.store_chunk(t, k, e);
            groups.insert(bank_group(swz128(m.token(t, h), c / 8, c % 8, kBlockBytes)));
          }
          if (groups.size() != 8)
            return ::testing::AssertionFailure() << "quarter warp " << q << " store (" << h << ", " << k << ", " << e
                                                 << ") on " << groups.size() << " bank groups";
        }
  return ::testing::AssertionSuccess();
}

TEST(Fp8TileMap, LoadsEveryChunkOnceAndStoresItsValuesInPlace) { EXPECT_TRUE(covers_once(current())); }

TEST(Fp8TileMap, EachLoadReadsWholeSectors) { EXPECT_TRUE(whole_sectors(current())); }

TEST(Fp8TileMap, StoresAvoidBankConflicts) { EXPECT_TRUE(conflict_free_stores(current())); }

TEST(Fp8TileMap, NegativeControlTheHalvesMapSplitsSectors) {
  const Fp8Map old = halves();
  EXPECT_TRUE(covers_once(old));
  EXPECT_FALSE(whole_sectors(old));
  EXPECT_TRUE(conflict_free_stores(old));
}

TEST(Fp8TileMap, NegativeControlTheAlternatingMapConflicts) {
  // Correct and sector-whole, so the first two checks pass it; its stores conflict.
  const Fp8Map old = alternating();
  EXPECT_TRUE(covers_once(old));
  EXPECT_TRUE(whole_sectors(old));
  EXPECT_FALSE(conflict_free_stores(old));
}

TEST(Bf16TileMap, CopiesEveryChunkOnceWholeLinesWithoutConflicts) {
  std::vector<int> seen(kTokens * kBf16Chunks, 0);
  for (int t = 0; t < kThreads; ++t)
    for (int j = 0; j < Bf16TileMap::kTokens; ++j)
      for (int b = 0; b < kBlocks; ++b) ++seen[Bf16TileMap::token(t, j) * kBf16Chunks + 8 * b + Bf16TileMap::chunk(t)];
  for (int i = 0; i < kTokens * kBf16Chunks; ++i) ASSERT_EQ(seen[i], 1) << "token " << i / kBf16Chunks;
  for (int w = 0; w < kThreads / 32; ++w)
    for (int j = 0; j < Bf16TileMap::kTokens; ++j)
      for (int b = 0; b < kBlocks; ++b) {
        // A copy instruction: every token it touches gets all 8 chunks of block b (128 bytes).
        std::set<std::pair<int, int>> chunks;
        for (int t = 32 * w; t < 32 * w + 32; ++t) chunks.insert({Bf16TileMap::token(t, j), Bf16TileMap::chunk(t)});
        for (const auto& [tok, c] : chunks)
          for (int other = 0; other < 8; ++other) ASSERT_TRUE(chunks.count({tok, other})) << "token " << tok;
        for (int q = 4 * w; q < 4 * w + 4; ++q) {
          std::set<int> groups;
          for (int t = 8 * q; t < 8 * q + 8; ++t)
            groups.insert(bank_group(swz128(Bf16TileMap::token(t, j), b, Bf16TileMap::chunk(t), kBlockBytes)));
          EXPECT_EQ(groups.size(), 8u) << "quarter warp " << q;
        }
      }
}

}  // namespace
