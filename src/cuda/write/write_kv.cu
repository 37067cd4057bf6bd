// KV write (SPEC §3) and the DCP slot mapping on the device: one latent row per token to its
// rank-local slot; PAD (-1) is skipped, a slot outside the cache is skipped and counted.
// bf16 caches copy; fp8 caches store rne(sat(x / scale)) of the bf16 latent, the division
// in float32 (IEEE, as the host encoder), saturating at the format's max (NaN stays NaN).
#include <algorithm>

#include "common/params.h"
#include "common/utils.cuh"

namespace dcpmla::cuda_detail {

// Grid-stride over (token, 8-value group); dim % 8 == 0 (checked by the caller).
template <KvDtype DT>
__global__ void write_kv_kernel(const WriteKvParams p) {
  const int groups = p.dim / 8;
  const int64_t total = p.n * groups;
  const float scale = p.scale_dev != nullptr ? *p.scale_dev : p.scale;
  for (int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t tok = idx / groups;
    const int grp = int(idx % groups);
    const int64_t slot = p.slots[tok];
    if (slot == -1) continue;  // PAD: another rank's token
    if (slot < 0 || slot >= p.num_slots) {
      if (grp == 0 && p.errors != nullptr) atomicAdd(p.errors, 1);
      continue;
    }
    const uint4 v = *reinterpret_cast<const uint4*>(p.latents + tok * p.dim + grp * 8);
    if constexpr (DT == KvDtype::bf16) {
      *reinterpret_cast<uint4*>(p.cache + (slot * p.dim + grp * 8) * 2) = v;
    } else {
      const uint32_t w[4] = {v.x, v.y, v.z, v.w};
      uint32_t packed[2] = {0u, 0u};
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const uint32_t bits = (w[k / 2] >> (16 * (k % 2))) & 0xffffu;
        const float x = __uint_as_float(bits << 16) / scale;
        const __nv_fp8_storage_t q = __nv_cvt_float_to_fp8(
            x, __NV_SATFINITE, DT == KvDtype::fp8_e4m3 ? __NV_E4M3 : __NV_E5M2);
        packed[k / 4] |= uint32_t(q) << (8 * (k % 4));
      }
      *reinterpret_cast<uint2*>(p.cache + slot * p.dim + grp * 8) = make_uint2(packed[0], packed[1]);
    }
  }
}

void launch_write_kv(const WriteKvParams& p, cudaStream_t stream) {
  if (p.n == 0) return;
  const int64_t total = p.n * (p.dim / 8);
  const int grid = int(std::min<int64_t>((total + 255) / 256, 65535));
  switch (p.dtype) {
    case KvDtype::bf16: write_kv_kernel<KvDtype::bf16><<<grid, 256, 0, stream>>>(p); break;
    case KvDtype::fp8_e4m3: write_kv_kernel<KvDtype::fp8_e4m3><<<grid, 256, 0, stream>>>(p); break;
    case KvDtype::fp8_e5m2: write_kv_kernel<KvDtype::fp8_e5m2><<<grid, 256, 0, stream>>>(p); break;
  }
  check(cudaGetLastError(), "write_kv_kernel launch");
}

// One thread per position: the host slot_of (layout.h) on the device.
__global__ void slot_mapping_kernel(const SlotMappingParams p) {
  for (int64_t k = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; k < p.n; k += int64_t(gridDim.x) * blockDim.x) {
    const int64_t pos = p.positions[k];
    const int32_t b = p.requests[k];
    int64_t slot = -1;
    bool bad = pos < 0 || b < 0 || b >= p.batch;
    if (!bad && (pos / p.interleave) % p.world_size == p.rank) {
      const int64_t i = (pos / (int64_t(p.interleave) * p.world_size)) * p.interleave + pos % p.interleave;
      const int64_t entry = i / p.block_size;
      bad = entry >= p.table_width;
      if (!bad) {
        const int32_t block = p.block_tables[int64_t(b) * p.table_width + entry];
        bad = block < 0 || block >= p.num_blocks;
        if (!bad) slot = int64_t(block) * p.block_size + i % p.block_size;
      }
    }
    if (bad && p.errors != nullptr) atomicAdd(p.errors, 1);
    p.slots[k] = slot;
  }
}

void launch_slot_mapping(const SlotMappingParams& p, cudaStream_t stream) {
  if (p.n == 0) return;
  const int grid = int(std::min<int64_t>((p.n + 255) / 256, 4096));
  slot_mapping_kernel<<<grid, 256, 0, stream>>>(p);
  check(cudaGetLastError(), "slot_mapping_kernel launch");
}

}  // namespace dcpmla::cuda_detail
