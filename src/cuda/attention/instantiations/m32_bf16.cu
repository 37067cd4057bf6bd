// 32 query rows per CTA, bf16 cache. One variant per file so the build parallelises.
#include "../kernel.cuh"

DCPMLA_INSTANTIATE_ATTENTION(2, false)
