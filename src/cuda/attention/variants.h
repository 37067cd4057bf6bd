// Which attention kernel serves which configuration: the one table of compiled kernel
// variants (variants.cpp) and the library's choice among them. Four kernels compute the same
// function: the mma.sync kernel (kernel.cuh: 16, 32 or 64 rows per CTA, 32- or 64-token
// tiles, the simple reference variant), the wgmma kernel (kernel_wgmma.cuh: 64 rows per CTA
// on warpgroup MMA), the fp8 swap kernel (kernel_fp8_swap.cuh: 16 or 32 rows per CTA, fp8
// caches on native fp8 wgmma) and the bf16 swap kernel (kernel_bf16_swap.cuh: 16 or 32 rows per CTA,
// bf16 caches on warpgroup MMA with the tokens as M). The tests run every scenario on each.
#pragma once

#include <cstdint>
#include <span>

#include <cuda_runtime_api.h>

#include "dcpmla/attention.h"

namespace dcpmla::cuda {
struct AttentionTuning;
}

namespace dcpmla::cuda_detail {

// Refuses knobs outside their values (dcpmla::Error naming tuning.<knob>); host only, touches
// no device (attention.cpp; the DCP step checks its tuning with it before it allocates).
void validate_tuning(const cuda::AttentionTuning& t);

// The kernels; the values are AttentionTuning::kernel's and AttentionVariant::kernel's.
enum class Kernel : int { mma = 1, wgmma = 2, fp8_swap = 3, bf16_swap = 4 };

// One compiled variant: its kernel and shape, the cache dtypes it reads (bit per KvDtype),
// its launcher (grid = 0 only opts it into its shared memory) and its shared memory.
struct KernelVariant {
  Kernel kernel;
  int rows_per_cta, tile_tokens, ctas_per_sm;
  uint32_t dtypes;
  void (*launch)(const AttentionParams& p, int grid, cudaStream_t stream);
  int (*smem_bytes)();
};

std::span<const KernelVariant> variant_table();

// The table's entry for this kernel, shape and cache dtype; throws std::logic_error when none
// is compiled (a dispatch bug: attention_variant() only asks for compiled ones).
const KernelVariant& find_variant(Kernel kernel, int rows_per_cta, int tile_tokens, int ctas_per_sm, KvDtype dtype);

// The library's choice where the tuning leaves the kernel open (from the H200 sweeps).
Kernel default_kernel(int rows_per_cta, bool fp8);

template <bool FP8>
void launch_attention_wgmma(const AttentionParams& p, int grid, cudaStream_t stream);
template <bool FP8>
int attention_wgmma_smem_bytes();
template <bool E5M2, int M>
void launch_attention_fp8_swap(const AttentionParams& p, int grid, cudaStream_t stream);
template <bool E5M2, int M>
int attention_fp8_swap_smem_bytes();
template <int M>
void launch_attention_bf16_swap(const AttentionParams& p, int grid, cudaStream_t stream);
template <int M>
int attention_bf16_swap_smem_bytes();

}  // namespace dcpmla::cuda_detail
