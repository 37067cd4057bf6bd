// Random bf16 and fp8 data on the device for the benchmarks (not the library: timing inputs only).
#include <algorithm>
#include <stdexcept>
#include <string>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "dcp_bench_core.h"

namespace dcpmla::bench {
namespace {

__device__ __forceinline__ uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Irwin-Hall of four uniforms, scaled to unit variance: close enough to normal for timing.
__global__ void fill_random_kernel(__nv_bfloat16* dst, int64_t n, uint64_t seed, float stddev) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const uint64_t h = splitmix64(seed * 0x2545f4914f6cdd1dull + uint64_t(i));
    float s = 0.0f;
#pragma unroll
    for (int k = 0; k < 4; ++k) s += float((h >> (16 * k)) & 0xffffu) * (1.0f / 65536.0f);
    dst[i] = __float2bfloat16((s - 2.0f) * 1.7320508f * stddev);
  }
}

// Finite fp8 values of magnitude 2^-3 .. 2^2 (e4m3 or e5m2 bytes), signs random.
__global__ void fill_random_fp8_kernel(uint8_t* dst, int64_t n, uint64_t seed, bool e5m2) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const uint64_t r = splitmix64(seed * 0x2545f4914f6cdd1dull + uint64_t(i));
    const uint32_t sign = uint32_t(r & 0x80), e = uint32_t((r >> 8) % 5);
    dst[i] = e5m2 ? uint8_t(sign | ((e + 12) << 2) | ((r >> 16) & 3)) : uint8_t(sign | ((e + 4) << 3) | ((r >> 16) & 7));
  }
}

void check_fill_launch(const char* what) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + " launch: " + cudaGetErrorString(e));
}

int fill_grid(int64_t n) { return int(std::min<int64_t>((n + 255) / 256, 8192)); }

}  // namespace

void fill_random(bf16* dst, int64_t n, uint64_t seed, float stddev, cudaStream_t stream) {
  if (n == 0) return;
  fill_random_kernel<<<fill_grid(n), 256, 0, stream>>>(reinterpret_cast<__nv_bfloat16*>(dst), n, seed, stddev);
  check_fill_launch("fill_random_kernel");
}

void fill_random_cache(void* dst, int64_t values, KvDtype dtype, uint64_t seed, cudaStream_t stream) {
  if (dtype == KvDtype::bf16) return fill_random(static_cast<bf16*>(dst), values, seed, 1.0f, stream);
  if (values == 0) return;
  fill_random_fp8_kernel<<<fill_grid(values), 256, 0, stream>>>(static_cast<uint8_t*>(dst), values, seed,
                                                                 dtype == KvDtype::fp8_e5m2);
  check_fill_launch("fill_random_fp8_kernel");
}

}  // namespace dcpmla::bench
