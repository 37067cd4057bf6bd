// One rank's paged latent cache (SPEC §3) and its write path.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "dcpmla/numeric.h"
#include "dcpmla/types.h"

namespace dcpmla {

// Kernel tile of the paged cache: min(128, largest power of two dividing block_size).
int subpage_size(int block_size);

struct CacheConfig {
  int64_t num_blocks = 0;
  int block_size = 64;
  int dim = 576;  // D
  KvDtype dtype = KvDtype::bf16;
  float scale = 1.0f;  // fp8 only; must be 1 for bf16

  void validate() const;
  int64_t num_slots() const { return num_blocks * block_size; }
  int64_t bytes() const { return num_slots() * dim * bytes_per_value(dtype); }
};

// Host storage [num_blocks, block_size, D] in the cache dtype.
class PagedCache {
 public:
  explicit PagedCache(const CacheConfig& config);

  const CacheConfig& config() const { return config_; }
  const uint8_t* data() const { return bytes_.data(); }
  uint8_t* data() { return bytes_.data(); }

  // Write n latents (bf16 [n, D]) to slots[n]; kPadSlot entries are skipped.
  // Every slot is checked against the cache before anything is written.
  void write(std::span<const bf16> latents, std::span<const int64_t> slots);

  // Fill every slot with NaN (bf16 / e4m3 / e5m2 NaN), so a read past a length shows.
  void poison();

  // Value j of slot s, dequantized (tests and references).
  float read(int64_t slot, int j) const;

 private:
  CacheConfig config_;
  std::vector<uint8_t> bytes_;
};

// Encode one bf16 latent row into the cache dtype (the write kernel's element rule).
void encode_latent(const bf16* src, int dim, KvDtype dtype, float scale, uint8_t* dst);

}  // namespace dcpmla
