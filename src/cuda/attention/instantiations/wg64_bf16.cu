// wgmma kernel: 64 query rows per CTA, 64-token tiles, bf16 cache.
#include "../kernel_wgmma.cuh"

DCPMLA_INSTANTIATE_ATTENTION_WGMMA(false)
