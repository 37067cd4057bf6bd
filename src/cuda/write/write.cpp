// Host entry points of the device write path (write_kv.cu): validation before any launch.
#include "dcpmla/cuda.h"
#include "dcpmla/error.h"
#include "common/params.h"
#include "common/resources.h"

namespace dcpmla::cuda {

void write_kv(const KvCache& cache, const bf16* latents, const int64_t* slots, int64_t n, const KvScale& scale,
              cudaStream_t stream, int* errors) {
  cache.validate();
  scale.validate(cache.dtype);
  require(n >= 0, "n", n, ">= 0");
  require(cache.dim % 8 == 0, "dim", cache.dim, "a multiple of 8 on the CUDA backend");
  cuda_detail::require_cache_aligned(cache.data);
  if (n == 0) return;
  require(latents != nullptr && slots != nullptr, "latents/slot_mapping", "null", "device pointers");
  // The kernel reads latents 16 bytes at a time, slots as int64 and a device scale as a float:
  // a misaligned address would fault on the device (plain comparisons: per-layer hot path).
  require_aligned(latents, 16, "latents", "16-byte aligned device memory (the write reads latents 16 bytes at a time)");
  require_aligned(slots, 8, "slot_mapping", "8-byte aligned device memory (int64)");
  require_aligned(scale.device, 4, "kv_scale", "a 4-byte aligned device float (the device scale)");
  require_aligned(errors, 4, "errors", "a 4-byte aligned device int (an atomic count)");
  require_write_disjoint(cache, latents, slots, n, scale.device, errors);
  cuda_detail::launch_write_kv(cuda_detail::WriteKvParams{latents, slots, n, cache.num_slots(), cache.dim, cache.dtype,
                                                          scale.value, scale.device, errors,
                                                          static_cast<uint8_t*>(cache.data)},
                               stream);
}

void slot_mapping(const int64_t* positions, const int32_t* requests, int64_t n, const int32_t* block_tables,
                  int batch, int table_width, int block_size, int64_t num_blocks, const Layout& layout,
                  int64_t* slots, cudaStream_t stream, int* errors) {
  layout.validate_with_block_size(block_size);
  require(n >= 0, "n", n, ">= 0");
  require(batch >= 0, "batch", batch, ">= 0");
  require(table_width >= 0, "table_width", table_width, ">= 0");
  require(num_blocks >= 1, "num_blocks", num_blocks, ">= 1");
  if (n == 0) return;
  require(positions && requests && slots && (block_tables || batch * int64_t(table_width) == 0),
          "positions/requests/block_tables/slots", "null", "device pointers");
  // Every element is read or written whole: a misaligned one faults and kills the context.
  require_aligned(positions, 8, "positions", "8-byte aligned device memory (int64)");
  require_aligned(requests, 4, "requests", "4-byte aligned device memory (int32)");
  require_aligned(block_tables, 4, "block_tables", "4-byte aligned device memory (int32)");
  require_aligned(slots, 8, "slots", "8-byte aligned device memory (int64)");
  require_aligned(errors, 4, "errors", "a 4-byte aligned device int (an atomic count)");
  if (!checked_product({n, 8}))
    fail("n", n, "a count of positions whose bytes fit int64");
  if (!checked_product({batch, table_width, 4}))
    fail("table_width", table_width, fmt::format("batch ({}) x table_width int32 whose bytes fit int64", batch));
  require_disjoint({{"slots", slots, n * 8}, {"errors", errors, errors != nullptr ? 4 : 0}},
                   {{"positions", positions, n * 8},
                    {"requests", requests, n * 4},
                    {"block_tables", block_tables, int64_t(batch) * table_width * 4}});
  cuda_detail::launch_slot_mapping(
      cuda_detail::SlotMappingParams{positions, requests, n, block_tables, batch, table_width, block_size, num_blocks,
                                     layout.world_size, layout.rank, layout.interleave, slots, errors},
      stream);
}

}  // namespace dcpmla::cuda
