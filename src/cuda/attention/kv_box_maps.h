// Tensor maps of a bf16 cache for the TMA unit: the cache as rows of 576 bf16 (1152 bytes),
// boxes of 64 columns (one 128-byte-swizzled column block of a stage) by 8, 16, 32 or 64 rows,
// the rows of one sub-page run. The 64-row kernel's producer (stream_bf16_tiles) fills a whole
// tile with 9 x 64 / min(page, 64) such boxes from one thread instead of 36 cp.async a thread.
#pragma once

#include <cuda.h>  // CUtensorMap

namespace dcpmla::cuda_detail {

inline constexpr int kBoxHeights = 4;  // 8, 16, 32, 64 rows
inline constexpr int kMinBoxRows = 8;
// The smallest sub-page the producer fills by boxes: below it a tile takes 36+ boxes from one
// thread, and 72 (8-token sub-pages) ran at 0.6x cp.async (bench/NOTES.md, sixteenth session).
inline constexpr int kMinBoxPage = 32;
struct KvBoxMaps {
  CUtensorMap box[kBoxHeights];  // box[k]: 8 << k rows
};

// A tensor map of `rows` rows of 576 bf16 (1152 bytes) from base (16-byte aligned): boxes of
// 64 columns by box_rows rows, 128-byte swizzle (the stages' layout). Throws CudaError if the
// driver refuses it.
CUtensorMap bf16_rows_map(const void* base, unsigned long long rows, int box_rows);

// The maps of the bf16 cache at kv (16-byte aligned; rows from kv on are addressed by int32
// coordinates, 2^31 rows, 2.4 TB: the planner refuses tables past them), encoded on a
// cache address's first launch and kept in a process-wide hash table (a serving engine
// launches every layer's cache each step, on every GPU it drives, and the driver's encoder is
// not free): up to kMapCaches addresses, 3 in 4 of its slots; the next new address clears it
// and the caches are encoded again as they come back. No allocation: the table is static
// storage, guarded by a mutex (distinct Attention objects may launch from threads at once).
inline constexpr int kMapSlots = 1024;
inline constexpr int kMapCaches = kMapSlots / 4 * 3;
KvBoxMaps kv_box_maps(const void* kv);

}  // namespace dcpmla::cuda_detail
