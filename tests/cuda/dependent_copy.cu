// The kernel of dependent_copy.h.
#include "dependent_copy.h"

#include "common/utils.cuh"
#include "cuda_helpers.h"

namespace dcpmla::testing {
namespace {

__global__ void dependent_copy_kernel(const uint4* src, uint4* dst, size_t words) {
  cuda_detail::wait_prior_grids();
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < words; i += size_t(gridDim.x) * blockDim.x)
    dst[i] = src[i];
}

}  // namespace

void enqueue_dependent_copy(const void* src, void* dst, size_t bytes, cudaStream_t stream) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(64);
  cfg.blockDim = dim3(256);
  cfg.stream = stream;
  cudaLaunchAttribute early{};
  early.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  early.val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = &early;
  cfg.numAttrs = 1;
  cuda_ok(cudaLaunchKernelEx(&cfg, dependent_copy_kernel, static_cast<const uint4*>(src), static_cast<uint4*>(dst),
                             bytes / 16),
          "dependent_copy_kernel launch");
}

}  // namespace dcpmla::testing
