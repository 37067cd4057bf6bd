// 64 query rows per CTA, fp8 (e4m3 / e5m2) cache. One variant per file so the build parallelises.
#include "../kernel.cuh"

DCPMLA_INSTANTIATE_ATTENTION(4, true)
