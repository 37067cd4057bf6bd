// Which attention kernel serves which configuration, and the entry points of the kernels
// beside the mma.sync one. Three kernels compute the same function: the mma.sync kernel
// (kernel.cuh: any rows per CTA, the simple reference variant), the wgmma kernel
// (kernel_wgmma.cuh: 64 rows per CTA on warpgroup MMA) and the fp8 swap kernel
// (kernel_fp8_swap.cuh: 16 rows per CTA, fp8 caches on native fp8 wgmma). The tests run
// every scenario on each.
#pragma once

#include <cuda_runtime_api.h>

#include "dcpmla/attention.h"

namespace dcpmla::cuda_detail {

inline constexpr int kKernelMma = 1;    // AttentionTuning::kernel values
inline constexpr int kKernelWgmma = 2;
inline constexpr int kKernelFp8Swap = 3;

// The library's choice where the tuning leaves the kernel open (from the H200 bench).
int default_kernel(int rows_per_cta, bool fp8);

template <bool FP8>
void launch_attention_wgmma(const AttentionParams& p, int grid, cudaStream_t stream);
template <bool FP8>
int attention_wgmma_smem_bytes();
template <bool E5M2>
void launch_attention_fp8_swap(const AttentionParams& p, int grid, cudaStream_t stream);
template <bool E5M2>
int attention_fp8_swap_smem_bytes();

}  // namespace dcpmla::cuda_detail
