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

// The most host memory one object of the library takes (a PagedCache, a CPU engine's split-K
// workspace): more is refused with its size before anything is allocated, never attempted (a
// 1.2 TB cache of valid-looking sizes was a std::bad_alloc, or an OOM kill).
inline constexpr int64_t kMaxHostBytes = int64_t(8) << 30;

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

// One layer's paged latent cache as an engine owns it (SPEC §6): [num_blocks, block_size, D]
// values of `dtype` (bf16, or one byte per value for fp8) at `data`: host memory for the CPU
// backend, device memory for CUDA. The library reads and writes it and never owns it.
struct KvCache {
  void* data = nullptr;
  int64_t num_blocks = 0;
  int block_size = 0;
  int dim = 576;
  KvDtype dtype = KvDtype::bf16;

  // Shape (as CacheConfig::validate), dtype and a non-null data pointer aligned to a whole value
  // (2 bytes for bf16; the CUDA backend asks 16: its kernels read the cache 16 bytes at a time).
  void validate() const;
  int64_t num_slots() const { return num_blocks * block_size; }
  int64_t row_bytes() const { return int64_t(dim) * bytes_per_value(dtype); }
};

// The fp8 cache scale (read = stored * scale): a host value, or (CUDA) a device float read
// when the kernels run, so a replayed graph sees the current scale. bf16 caches take 1.
struct KvScale {
  float value = 1.0f;
  const float* device = nullptr;

  // value: a positive normal float (1 for bf16); device: fp8 caches on CUDA only.
  void validate(KvDtype dtype) const;
};

// Refuses a write whose cache shares memory with its latents (bf16 [n, D]), slots (int64 [n]) or
// device scale, or with `errors` (the CUDA write's device count); null pointers take no bytes
// (require_disjoint). For a validated cache and n >= 0.
void require_write_disjoint(const KvCache& cache, const bf16* latents, const int64_t* slots, int64_t n,
                            const float* device_scale = nullptr, const int* errors = nullptr);

// CPU write path (SPEC §3): latents bf16 [n, D] to cache slots[n], kPadSlot skipped, every
// slot checked against the cache before anything is written; fp8 stores rne(sat(x / scale)).
// Two tokens with one slot: the later token's row is kept. Pointers aligned to whole values.
void write_kv(const KvCache& cache, const bf16* latents, const int64_t* slots, int64_t n, float scale);

// Host storage [num_blocks, block_size, D] in the cache dtype (tests and the conformance path
// own their caches with it, as an engine would), at most kMaxHostBytes.
class PagedCache {
 public:
  explicit PagedCache(const CacheConfig& config);

  const CacheConfig& config() const { return config_; }
  KvCache view() { return KvCache{bytes_.data(), config_.num_blocks, config_.block_size, config_.dim, config_.dtype}; }
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

// Encode one bf16 latent row into the cache dtype (the write kernel's element rule); dim >= 1,
// a known dtype and its scale (KvScale::validate), non-null pointers.
void encode_latent(const bf16* src, int dim, KvDtype dtype, float scale, uint8_t* dst);

}  // namespace dcpmla
