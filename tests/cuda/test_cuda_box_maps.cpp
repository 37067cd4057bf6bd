// The TMA tensor maps of bf16 caches (src/cuda/attention/kv_box_maps.h): one address gives the
// same maps on every launch, and past the table's kMapCaches addresses (it is cleared) an
// address that comes back gets maps equal to a fresh encoding, not another cache's. The encoder only packs the
// address into the maps (it reads no memory), so the addresses need not be allocations; it
// lives in the driver, hence the GPU label.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>

#include "attention/kv_box_maps.h"
#include "cuda_helpers.h"

namespace dcpmla {
namespace {

using cuda_detail::kBoxHeights;
using cuda_detail::kMapCaches;
using cuda_detail::kMinBoxRows;
using cuda_detail::KvBoxMaps;

const void* address(int i) { return reinterpret_cast<const void*>(uintptr_t(0x7f0000000000ull) + uintptr_t(i) * 4096); }

bool same(const KvBoxMaps& a, const KvBoxMaps& b) { return std::memcmp(&a, &b, sizeof(KvBoxMaps)) == 0; }

KvBoxMaps fresh(const void* kv) {
  KvBoxMaps m;
  for (int k = 0; k < kBoxHeights; ++k) m.box[k] = cuda_detail::bf16_rows_map(kv, 1ull << 31, kMinBoxRows << k);
  return m;
}

TEST(KvBoxMaps, OneAddressOneEncodingAcrossTheTable) {
  DCPMLA_REQUIRE_GPU();
  const KvBoxMaps first = cuda_detail::kv_box_maps(address(0));
  EXPECT_TRUE(same(first, fresh(address(0))));
  EXPECT_TRUE(same(first, cuda_detail::kv_box_maps(address(0))));
  EXPECT_FALSE(same(first, cuda_detail::kv_box_maps(address(1))));
  // More addresses than the table holds: it starts again; the first ones are encoded again.
  for (int i = 2; i < kMapCaches + 40; ++i) ASSERT_TRUE(same(cuda_detail::kv_box_maps(address(i)), fresh(address(i))));
  for (int i : {0, 1, kMapCaches + 39})
    EXPECT_TRUE(same(cuda_detail::kv_box_maps(address(i)), fresh(address(i)))) << "address " << i;
}

}  // namespace
}  // namespace dcpmla
