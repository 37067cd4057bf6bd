// fp8 swap kernel: 16 query rows per CTA on native fp8 wgmma, e5m2 cache.
#include "../kernel_fp8_swap.cuh"

DCPMLA_INSTANTIATE_ATTENTION_FP8_SWAP(true, 16)
