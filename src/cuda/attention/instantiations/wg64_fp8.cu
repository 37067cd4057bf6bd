// wgmma kernel: 64 query rows per CTA, 64-token tiles, fp8 cache (dequantised by the producer warpgroup).
#include "../kernel_wgmma.cuh"

DCPMLA_INSTANTIATE_ATTENTION_WGMMA(true)
