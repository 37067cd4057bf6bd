// 64 query rows per CTA, 32-token tiles, 1 CTA(s) per SM, bf16 cache.
// One variant per file so that the build parallelises.
#include "../kernel.cuh"

DCPMLA_INSTANTIATE_ATTENTION(4, 32, 1, false)
