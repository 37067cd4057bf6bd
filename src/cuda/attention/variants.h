// Which attention kernel serves which configuration, and the wgmma kernel's entry points.
// Two kernels compute the same function: the mma.sync kernel (kernel.cuh: any rows per
// CTA, the simple reference variant) and the wgmma kernel (kernel_wgmma.cuh: 64 rows per
// CTA on warpgroup MMA). The tests run every scenario on both.
#pragma once

#include <cuda_runtime_api.h>

#include "dcpmla/attention.h"

namespace dcpmla::cuda_detail {

inline constexpr int kKernelMma = 1;    // AttentionTuning::kernel values
inline constexpr int kKernelWgmma = 2;

// The library's choice where the tuning leaves the kernel open (from the H200 bench).
bool wgmma_by_default(int rows_per_cta, bool fp8);

template <bool FP8>
void launch_attention_wgmma(const AttentionParams& p, int grid, cudaStream_t stream);
template <bool FP8>
int attention_wgmma_smem_bytes();

}  // namespace dcpmla::cuda_detail
