#include "dcpmla/cache.h"

#include <gtest/gtest.h>

#include <cmath>

#include "dcpmla/error.h"
#include "dcpmla/layout.h"
#include "test_helpers.h"

namespace dcpmla {

TEST(Cache, SubpageIsLargestPowerOfTwoUpTo128) {
  EXPECT_EQ(subpage_size(1), 1);
  EXPECT_EQ(subpage_size(16), 16);
  EXPECT_EQ(subpage_size(48), 16);
  EXPECT_EQ(subpage_size(64), 64);
  EXPECT_EQ(subpage_size(256), 128);
  EXPECT_EQ(subpage_size(1024), 128);
  EXPECT_EQ(subpage_size(24), 8);
}

TEST(Cache, SubpageRefusesBlockSizesNoCacheAccepts) {
  using testing::expect_error;
  expect_error([] { subpage_size(0); }, "'block_size' = 0");  // was 0, silently
  expect_error([] { subpage_size(-16); }, "'block_size' = -16");
  expect_error([] { subpage_size(INT32_MIN); }, "'block_size' = -2147483648");  // was UB (-INT_MIN)
  expect_error([] { subpage_size(kMaxBlockSize + 1); }, "'block_size'");
  EXPECT_EQ(subpage_size(kMaxBlockSize), 128);
}

class CacheWrite : public ::testing::TestWithParam<KvDtype> {};

TEST_P(CacheWrite, WritesOwnedSlotsAndSkipsPad) {
  const KvDtype d = GetParam();
  const float scale = d == KvDtype::bf16 ? 1.0f : 0.03f;
  PagedCache cache(CacheConfig{4, 16, 8, d, scale});
  cache.poison();
  EXPECT_TRUE(std::isnan(cache.read(0, 0)));
  const auto x = testing::random_normal(3 * 8, 7);
  std::vector<bf16> latents;
  for (float v : x) latents.push_back(float_to_bf16(v));
  const std::vector<int64_t> slots{5, kPadSlot, 63};
  cache.write(latents, slots);
  for (int j = 0; j < 8; ++j) {
    EXPECT_EQ(cache.read(5, j), quantize_roundtrip(x[size_t(j)], d, scale));
    EXPECT_EQ(cache.read(63, j), quantize_roundtrip(x[size_t(16 + j)], d, scale));
  }
  for (int64_t s = 0; s < 64; ++s)
    if (s != 5 && s != 63) EXPECT_TRUE(std::isnan(cache.read(s, 0))) << "slot " << s << " was written";
}

INSTANTIATE_TEST_SUITE_P(Dtypes, CacheWrite,
                         ::testing::Values(KvDtype::bf16, KvDtype::fp8_e4m3, KvDtype::fp8_e5m2));

TEST(Cache, RefusesBadInputBeforeWriting) {
  PagedCache cache(CacheConfig{2, 4, 2, KvDtype::bf16, 1.0f});
  cache.poison();
  const std::vector<bf16> two(4, float_to_bf16(1.0f));
  const std::vector<int64_t> slots{0, 8};  // 8 is past the last slot
  EXPECT_THROW(cache.write(two, slots), Error);
  EXPECT_TRUE(std::isnan(cache.read(0, 0))) << "a bad batch wrote its good rows";
  const std::vector<int64_t> one{0};
  EXPECT_THROW(cache.write(two, one), Error);
  EXPECT_THROW(PagedCache(CacheConfig{0, 4, 2, KvDtype::bf16, 1.0f}), Error);
  EXPECT_THROW(PagedCache(CacheConfig{1, 4, 2, KvDtype::bf16, 2.0f}), Error);
  EXPECT_THROW(PagedCache(CacheConfig{1, 4, 2, KvDtype::fp8_e4m3, 0.0f}), Error);
  EXPECT_THROW(PagedCache(CacheConfig{1, 4, 2, KvDtype::fp8_e4m3, NAN}), Error);
}

// A moved-from cache keeps its config but no memory: read() is refused (it read through null
// or past an empty vector); a latent split across its alignment is refused by encode_latent.
TEST(Cache, MovedFromReadsAndMisalignedLatentsAreRefused) {
  for (const KvDtype dtype : {KvDtype::bf16, KvDtype::fp8_e4m3}) {
    PagedCache a(CacheConfig{2, 4, 8, dtype, 1.0f});
    a.poison();
    const PagedCache b(std::move(a));
    EXPECT_TRUE(std::isnan(b.read(7, 7)));
    testing::expect_error([&] { (void)a.read(0, 0); }, "'kv_cache' = null");
  }
  std::vector<bf16> src(17, float_to_bf16(1.0f));
  std::vector<uint8_t> dst(16);
  const auto* odd = reinterpret_cast<const bf16*>(reinterpret_cast<uintptr_t>(src.data()) + 1);
  testing::expect_error([&] { encode_latent(odd, 8, KvDtype::fp8_e4m3, 1.0f, dst.data()); }, "'src' = address");
  encode_latent(src.data() + 1, 8, KvDtype::fp8_e4m3, 1.0f, dst.data());  // a whole value past: fine
  EXPECT_EQ(fp8_to_float(dst[7], KvDtype::fp8_e4m3), 1.0f);
}

// Refused before any allocation: a byte count that overflows int64, a block beyond the limit.
TEST(Cache, RefusesAbsurdSizes) {
  try {
    PagedCache(CacheConfig{int64_t(1) << 50, 64, 576, KvDtype::bf16, 1.0f});
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'num_blocks' = 1125899906842624"), std::string::npos) << e.what();
  }
  EXPECT_THROW(PagedCache(CacheConfig{1, kMaxBlockSize + 1, 2, KvDtype::bf16, 1.0f}), Error);
  EXPECT_THROW(PagedCache(CacheConfig{1, INT32_MAX, 576, KvDtype::bf16, 1.0f}), Error);
  EXPECT_EQ(PagedCache(CacheConfig{1, kMaxBlockSize, 1, KvDtype::fp8_e4m3, 1.0f}).config().num_slots(), kMaxBlockSize);
  // Valid-looking sizes beyond the host cap (1.2 TB) are refused before the allocation is
  // attempted (they were a std::bad_alloc, or an OOM kill).
  testing::expect_error([] { PagedCache(CacheConfig{int64_t(1) << 24, 64, 576, KvDtype::bf16, 1.0f}); },
                        "'num_blocks' = 16777216: expected a host cache of at most 8 GiB (8589934592 bytes)");
  // Just past the cap, the message gives the bytes: "at most 8 GiB (... is 8 GiB)" read as a
  // contradiction (the seventieth session's audit).
  testing::expect_error([] { PagedCache(CacheConfig{116509, 64, 576, KvDtype::bf16, 1.0f}); },
                        "116509 blocks of 64 tokens x 1152 bytes is 8 GiB (8589975552 bytes))");
}

}  // namespace dcpmla
