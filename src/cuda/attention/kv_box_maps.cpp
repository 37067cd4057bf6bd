// kv_box_maps: the driver's tensor-map encoder, reached through the runtime (no link to libcuda),
// and a process-wide table of the maps by cache address.
#include "kv_box_maps.h"

#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled
#include <cuda_runtime_api.h>

#include <array>
#include <cstdint>
#include <mutex>
#include <string>

#include "attention/config.h"
#include "common/params.h"
#include "dcpmla/cuda.h"

namespace dcpmla::cuda_detail {

namespace {

// A driver function through the runtime's entry points (so the library needs no link to libcuda).
template <typename Fn>
Fn driver_function(const char* name, int version) {
  Fn f = nullptr;
  cudaDriverEntryPointQueryResult found{};
  check(cudaGetDriverEntryPointByVersion(name, reinterpret_cast<void**>(&f), unsigned(version), cudaEnableDefault,
                                         &found),
        (std::string("cudaGetDriverEntryPointByVersion(") + name + ")").c_str());
  if (found != cudaDriverEntryPointSuccess || f == nullptr)
    throw CudaError(std::string(name) + ": not in this driver (the bf16 64-row kernel fills its tiles by TMA)");
  return f;
}

// The encoder needs a current context (CUDA_ERROR_INVALID_CONTEXT, 201, otherwise). A thread
// whose first CUDA call is a launch has none yet: it gets the current device's primary
// context, as the runtime's own first call would give it. A context the caller made current
// (the driver API's) is left as it is.
void ensure_context() {
  static const auto get = driver_function<PFN_cuCtxGetCurrent_v4000>("cuCtxGetCurrent", 4000);
  CUcontext ctx = nullptr;
  if (get(&ctx) == CUDA_SUCCESS && ctx != nullptr) return;
  int device = 0;
  check(cudaGetDevice(&device), "cudaGetDevice");
  check(cudaSetDevice(device), "cudaSetDevice (a context for the tensor-map encoder)");
}

KvBoxMaps encode(const void* kv) {
  KvBoxMaps m;
  // Rows: every one an int32 coordinate reaches, [0, 2^31) (the planner refuses tables past
  // them); the kernels address only the plan's sub-pages.
  for (int k = 0; k < kBoxHeights; ++k) m.box[k] = bf16_rows_map(kv, 1ull << 31, kMinBoxRows << k);
  return m;
}

}  // namespace

CUtensorMap bf16_rows_map(const void* base, unsigned long long rows, int box_rows) {
  static const auto encode_tiled =
      driver_function<PFN_cuTensorMapEncodeTiled_v12000>("cuTensorMapEncodeTiled", 12000);
  ensure_context();
  CUtensorMap map{};
  const cuuint64_t dims[2] = {cuuint64_t(kDim), cuuint64_t(rows)};
  const cuuint64_t strides[1] = {cuuint64_t(kDim * 2)};
  const cuuint32_t box[2] = {64, cuuint32_t(box_rows)}, elem[2] = {1, 1};
  const CUresult r = encode_tiled(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(base), dims, strides,
                                  box, elem, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                  CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    throw CudaError("cuTensorMapEncodeTiled of bf16 rows (box of " + std::to_string(box_rows) +
                    " rows): CUresult " + std::to_string(int(r)));
  return map;
}

KvBoxMaps kv_box_maps(const void* kv) {
  // Open addressing on the address (keys apart from the maps, so that a probe reads 8 bytes a
  // slot); a null key is a free slot (kernels never get a null cache).
  static std::mutex mutex;
  static std::array<const void*, kMapSlots> keys{};
  static std::array<KvBoxMaps, kMapSlots> maps;
  static int used = 0;
  static_assert((kMapSlots & (kMapSlots - 1)) == 0 && kMapCaches < kMapSlots);
  const std::lock_guard<std::mutex> lock(mutex);
  const uint64_t h = (uint64_t(reinterpret_cast<uintptr_t>(kv)) >> 4) * 0x9E3779B97F4A7C15ull;
  size_t slot = size_t(h >> 40) & (kMapSlots - 1);
  for (; keys[slot] != nullptr; slot = (slot + 1) & (kMapSlots - 1))
    if (keys[slot] == kv) return maps[slot];
  if (used == kMapCaches) {  // full: start again (every probe chain ends at a free slot)
    keys.fill(nullptr);
    used = 0;
    slot = size_t(h >> 40) & (kMapSlots - 1);
  }
  maps[slot] = encode(kv);  // may throw: the slot stays free
  keys[slot] = kv;
  ++used;
  return maps[slot];
}

}  // namespace dcpmla::cuda_detail
