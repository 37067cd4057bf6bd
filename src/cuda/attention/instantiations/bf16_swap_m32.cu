// bf16 swap kernel: 32 query rows per CTA on warpgroup MMA, bf16 cache.
#include "../kernel_bf16_swap.cuh"

DCPMLA_INSTANTIATE_ATTENTION_BF16_SWAP(32)
