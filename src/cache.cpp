#include "dcpmla/cache.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "dcpmla/error.h"
#include "dcpmla/layout.h"

namespace dcpmla {

int subpage_size(int block_size) {
  // block_size & -block_size negates INT_MIN (UB) and gives 0 for 0: refuse what no cache accepts.
  require_block_size(block_size);
  const int pow2 = block_size & -block_size;  // largest power of two dividing block_size
  return pow2 < 128 ? pow2 : 128;
}

namespace {

// Checked by every run and write_kv (KvCache::validate): messages are formatted only on failure.
void validate_shape(int64_t num_blocks, int block_size, int dim, KvDtype dtype) {
  require(num_blocks >= 1, "num_blocks", num_blocks, ">= 1");
  require_block_size(block_size);
  require(dim >= 1, "dim", dim, ">= 1");
  require_known("kv_dtype", dtype);
  if (!checked_product({num_blocks, block_size, dim, bytes_per_value(dtype)}))
    fail("num_blocks", num_blocks,
         fmt::format("num_blocks x block_size {} x dim {} x {} bytes that fit int64", block_size, dim,
                     bytes_per_value(dtype)));
}

}  // namespace

void CacheConfig::validate() const {
  validate_shape(num_blocks, block_size, dim, dtype);
  KvScale{scale}.validate(dtype);
}

void KvCache::validate() const {
  validate_shape(num_blocks, block_size, dim, dtype);
  if (data == nullptr) fail("kv_cache", "null", "a pointer to the cache's memory");
  // Whole values here (the CPU backend reads no wider); the CUDA entries ask 16 bytes of their own.
  if (reinterpret_cast<uintptr_t>(data) % bytes_per_value(dtype) != 0)
    fail("kv_cache", fmt::format("address {}", data),
         fmt::format("{}-byte aligned memory (whole {} values)", bytes_per_value(dtype), to_string(dtype)));
}

void KvScale::validate(KvDtype dtype) const {
  require_kv_scale(value, dtype);
  if (device != nullptr && dtype == KvDtype::bf16)
    fail("kv_scale", "a device tensor", "a plain 1.0 for a bf16 cache (the scale is for fp8)");
}

void require_write_disjoint(const KvCache& cache, const bf16* latents, const int64_t* slots, int64_t n,
                            const float* device_scale, const int* errors) {
  const std::optional<int64_t> latent_bytes = checked_product({n, cache.dim, 2});
  if (!latent_bytes || !checked_product({n, int64_t(sizeof(int64_t))}))
    fail("n", n, fmt::format("a count of latents and slots whose bytes fit int64 (D = {})", cache.dim));
  require_disjoint({{"kv_cache", cache.data, cache.num_slots() * cache.row_bytes()},
                    {"errors", errors, errors != nullptr ? int64_t(sizeof(int)) : 0}},
                   {{"latents", latents, *latent_bytes},
                    {"slot_mapping", slots, n * int64_t(sizeof(int64_t))},
                    {"kv_scale", device_scale, device_scale != nullptr ? int64_t(sizeof(float)) : 0}});
}

void write_kv(const KvCache& cache, const bf16* latents, const int64_t* slots, int64_t n, float scale) {
  cache.validate();
  KvScale{scale}.validate(cache.dtype);
  if (n < 0) fail("n", n, ">= 0");
  if (n == 0) return;
  if (latents == nullptr || slots == nullptr) fail("latents/slot_mapping", "null", "host pointers");
  require_value_aligned(latents, "latents");
  require_value_aligned(slots, "slot_mapping");
  require_write_disjoint(cache, latents, slots, n);
  const int64_t num_slots = cache.num_slots();
  for (int64_t k = 0; k < n; ++k)
    if (slots[k] != kPadSlot && (slots[k] < 0 || slots[k] >= num_slots))
      fail(fmt::format("slot_mapping[{}]", k), slots[k], fmt::format("-1 (PAD) or a slot in [0, {})", num_slots));
  // Each slot is read once more and bounded again: the caller's array may change under a call
  // made without the GIL (a Python thread writing it), and a changed slot must not reach past
  // the cache. Such a slot is skipped, as the device path skips one.
  auto* base = static_cast<uint8_t*>(cache.data);
  for (int64_t k = 0; k < n; ++k) {
    const int64_t slot = slots[k];
    if (slot >= 0 && slot < num_slots)
      encode_latent(latents + k * cache.dim, cache.dim, cache.dtype, scale, base + slot * cache.row_bytes());
  }
}

PagedCache::PagedCache(const CacheConfig& config) : config_(config) {
  config_.validate();
  require(config_.bytes() <= kMaxHostBytes, "num_blocks", config_.num_blocks,
          fmt::format("a host cache of at most {} ({} blocks of {} tokens x {} bytes is {})",
                      bytes_text(double(kMaxHostBytes)), config_.num_blocks, config_.block_size,
                      int64_t(config_.dim) * bytes_per_value(config_.dtype), bytes_text(double(config_.bytes()))));
  bytes_.resize(size_t(config_.bytes()));
}

void encode_latent(const bf16* src, int dim, KvDtype dtype, float scale, uint8_t* dst) {
  // Per token of a write: messages formatted only on failure.
  if (dim < 1) fail("dim", dim, ">= 1");
  require_kv_scale(scale, dtype);
  if (src == nullptr || dst == nullptr) fail(src == nullptr ? "src" : "dst", "null", "a host pointer");
  require_value_aligned(src, "src");
  if (dtype == KvDtype::bf16) {
    std::memcpy(dst, src, size_t(dim) * 2);
    return;
  }
  for (int j = 0; j < dim; ++j) dst[j] = float_to_fp8(bf16_to_float(src[j]) / scale, dtype);
}

void PagedCache::write(std::span<const bf16> latents, std::span<const int64_t> slots) {
  if (latents.size() != slots.size() * size_t(config_.dim))
    fail("latents", latents.size(), fmt::format("slots ({}) x dim ({}) values", slots.size(), config_.dim));
  write_kv(view(), latents.data(), slots.data(), int64_t(slots.size()), config_.scale);
}

// 0xff bytes are NaN in bf16, e4m3 and e5m2 alike: the pattern the CUDA caches use too, so a
// host and a device cache poisoned and written alike are equal byte for byte.
void PagedCache::poison() { std::fill(bytes_.begin(), bytes_.end(), uint8_t(0xff)); }

float PagedCache::read(int64_t slot, int j) const {
  // Per value read (the tests read whole caches): messages formatted only on failure. A
  // moved-from cache keeps its config but no bytes (write and view see a null kv_cache).
  if (bytes_.empty()) fail("kv_cache", "null", "a cache's memory (a moved-from PagedCache holds none)");
  if (slot < 0 || slot >= config_.num_slots()) fail("slot", slot, fmt::format("a slot in [0, {})", config_.num_slots()));
  if (j < 0 || j >= config_.dim) fail("j", j, fmt::format("in [0, {})", config_.dim));
  const int64_t idx = slot * config_.dim + j;
  if (config_.dtype == KvDtype::bf16) {
    bf16 h;
    std::memcpy(&h, bytes_.data() + idx * 2, 2);
    return bf16_to_float(h);
  }
  return fp8_to_float(bytes_[size_t(idx)], config_.dtype) * config_.scale;
}

}  // namespace dcpmla
