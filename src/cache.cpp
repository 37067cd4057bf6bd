#include "dcpmla/cache.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "dcpmla/error.h"
#include "dcpmla/layout.h"

namespace dcpmla {

int subpage_size(int block_size) {
  const int pow2 = block_size & -block_size;  // largest power of two dividing block_size
  return pow2 < 128 ? pow2 : 128;
}

void CacheConfig::validate() const {
  require(num_blocks >= 1, "num_blocks", num_blocks, ">= 1");
  require(block_size >= 1 && block_size <= kMaxBlockSize, "block_size", block_size,
          fmt::format("in [1, {}]", kMaxBlockSize));
  require(dim >= 1, "dim", dim, ">= 1");
  // bytes() = num_blocks x block_size x dim x bytes per value must not overflow int64.
  const int64_t row_bytes = int64_t(block_size) * dim * bytes_per_value(dtype);
  require(num_blocks <= std::numeric_limits<int64_t>::max() / row_bytes, "num_blocks", num_blocks,
          fmt::format("<= {} (the cache's byte count must fit int64)", std::numeric_limits<int64_t>::max() / row_bytes));
  if (dtype == KvDtype::bf16)
    require(scale == 1.0f, "kv_scale", scale, "1.0 for a bf16 cache (the scale is for fp8)");
  else
    require_scale("kv_scale", scale);
}

PagedCache::PagedCache(const CacheConfig& config) : config_(config) {
  config_.validate();
  bytes_.resize(size_t(config_.bytes()));
}

void encode_latent(const bf16* src, int dim, KvDtype dtype, float scale, uint8_t* dst) {
  if (dtype == KvDtype::bf16) {
    std::memcpy(dst, src, size_t(dim) * 2);
    return;
  }
  for (int j = 0; j < dim; ++j) dst[j] = float_to_fp8(bf16_to_float(src[j]) / scale, dtype);
}

void PagedCache::write(std::span<const bf16> latents, std::span<const int64_t> slots) {
  const int dim = config_.dim;
  require(latents.size() == slots.size() * size_t(dim), "latents", latents.size(),
          fmt::format("slots ({}) x dim ({}) values", slots.size(), dim));
  for (size_t n = 0; n < slots.size(); ++n)
    require(slots[n] == kPadSlot || (slots[n] >= 0 && slots[n] < config_.num_slots()),
            fmt::format("slot_mapping[{}]", n), slots[n],
            fmt::format("-1 (PAD) or a slot in [0, {})", config_.num_slots()));
  const int64_t row_bytes = int64_t(dim) * bytes_per_value(config_.dtype);
  for (size_t n = 0; n < slots.size(); ++n) {
    if (slots[n] == kPadSlot) continue;
    encode_latent(latents.data() + n * size_t(dim), dim, config_.dtype, config_.scale,
                  bytes_.data() + slots[n] * row_bytes);
  }
}

void PagedCache::poison() {
  if (config_.dtype == KvDtype::bf16) {
    const bf16 nan = float_to_bf16(std::numeric_limits<float>::quiet_NaN());
    auto* p = reinterpret_cast<bf16*>(bytes_.data());
    std::fill(p, p + bytes_.size() / 2, nan);
  } else {
    std::fill(bytes_.begin(), bytes_.end(), float_to_fp8(std::numeric_limits<float>::quiet_NaN(), config_.dtype));
  }
}

float PagedCache::read(int64_t slot, int j) const {
  require(slot >= 0 && slot < config_.num_slots(), "slot", slot,
          fmt::format("a slot in [0, {})", config_.num_slots()));
  require(j >= 0 && j < config_.dim, "j", j, fmt::format("in [0, {})", config_.dim));
  const int64_t idx = slot * config_.dim + j;
  if (config_.dtype == KvDtype::bf16) {
    bf16 h;
    std::memcpy(&h, bytes_.data() + idx * 2, 2);
    return bf16_to_float(h);
  }
  return fp8_to_float(bytes_[size_t(idx)], config_.dtype) * config_.scale;
}

}  // namespace dcpmla
