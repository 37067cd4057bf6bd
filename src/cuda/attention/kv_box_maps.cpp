// kv_box_maps: the driver's tensor-map encoder, reached through the runtime (no link to libcuda),
// and a process-wide table of the maps by cache address.
#include "kv_box_maps.h"

#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled
#include <cuda_runtime_api.h>

#include <array>
#include <climits>
#include <mutex>
#include <string>

#include "attention/config.h"
#include "common/params.h"
#include "dcpmla/cuda.h"

namespace dcpmla::cuda_detail {

namespace {

PFN_cuTensorMapEncodeTiled_v12000 encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    PFN_cuTensorMapEncodeTiled_v12000 f = nullptr;
    cudaDriverEntryPointQueryResult found{};
    check(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", reinterpret_cast<void**>(&f), 12000,
                                           cudaEnableDefault, &found),
          "cudaGetDriverEntryPointByVersion(cuTensorMapEncodeTiled)");
    if (found != cudaDriverEntryPointSuccess || f == nullptr)
      throw CudaError("cuTensorMapEncodeTiled: not in this driver (the bf16 64-row kernel fills its tiles by TMA)");
    return f;
  }();
  return fn;
}

KvBoxMaps encode(const void* kv) {
  KvBoxMaps m;
  // Rows: as many as int32 coordinates reach; the kernels address only the plan's sub-pages.
  for (int k = 0; k < kBoxHeights; ++k) m.box[k] = bf16_rows_map(kv, INT_MAX, kMinBoxRows << k);
  return m;
}

}  // namespace

CUtensorMap bf16_rows_map(const void* base, unsigned long long rows, int box_rows) {
  CUtensorMap map{};
  const cuuint64_t dims[2] = {cuuint64_t(kDim), cuuint64_t(rows)};
  const cuuint64_t strides[1] = {cuuint64_t(kDim * 2)};
  const cuuint32_t box[2] = {64, cuuint32_t(box_rows)}, elem[2] = {1, 1};
  const CUresult r = encoder()(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(base), dims, strides, box,
                               elem, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                               CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    throw CudaError("cuTensorMapEncodeTiled of bf16 rows (box of " + std::to_string(box_rows) +
                    " rows): CUresult " + std::to_string(int(r)));
  return map;
}

KvBoxMaps kv_box_maps(const void* kv) {
  struct Entry {
    const void* kv;
    KvBoxMaps maps;
  };
  static std::mutex mutex;
  static std::array<Entry, kMapCaches> table{};
  static int next = 0;  // the slot a new address takes (round robin: the oldest entry)
  const std::lock_guard<std::mutex> lock(mutex);
  for (const Entry& e : table)
    if (e.kv == kv) return e.maps;
  Entry& e = table[size_t(next)];
  e.maps = encode(kv);  // may throw: the slot keeps its old entry
  e.kv = kv;
  next = (next + 1) % kMapCaches;
  return e.maps;
}

}  // namespace dcpmla::cuda_detail
