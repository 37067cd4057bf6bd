// 64 query rows per CTA, 64-token tiles, 1 CTA(s) per SM, fp8 (e4m3 / e5m2) cache.
// One variant per file so that the build parallelises.
#include "../kernel.cuh"

DCPMLA_INSTANTIATE_ATTENTION(4, 64, 1, true)
