// Host entry points of the device merges (merge.cu): validation before any launch.
#include "dcpmla/cuda.h"
#include "dcpmla/error.h"
#include "dcpmla/merge.h"
#include "common/params.h"

namespace dcpmla::cuda {

void merge_state(const bf16* o_a, const float* lse_a, const bf16* o_b, const float* lse_b, bf16* o, float* lse,
                 int64_t rows, int width, cudaStream_t stream) {
  require(rows >= 0, "rows", rows, ">= 0");
  require(width >= 1, "width", width, ">= 1");
  if (rows == 0) return;
  require(o_a && lse_a && o_b && lse_b && o && lse, "o/lse", "null", "device pointers");
  require_merge_state_disjoint(o_a, lse_a, o_b, lse_b, o, lse, rows, width);
  // Two partials as one stack: element distances between a and b (flat device addresses).
  const intptr_t do_bytes = reinterpret_cast<intptr_t>(o_b) - reinterpret_cast<intptr_t>(o_a);
  const intptr_t dl_bytes = reinterpret_cast<intptr_t>(lse_b) - reinterpret_cast<intptr_t>(lse_a);
  require(do_bytes % 2 == 0 && dl_bytes % 4 == 0, "o_b/lse_b", "misaligned", "aligned to their element types");
  cuda_detail::launch_merge(cuda_detail::MergeParams{o_a, lse_a, do_bytes / 2, dl_bytes / 4, 2, rows, width, o, lse},
                            stream);
}

void combine_partials(const bf16* o_parts, const float* lse_parts, int n, bf16* o, float* lse, int64_t rows,
                      int width, cudaStream_t stream) {
  require(n >= 1, "n", n, ">= 1");
  require(rows >= 0, "rows", rows, ">= 0");
  require(width >= 1, "width", width, ">= 1");
  if (rows == 0) return;
  require(o_parts && lse_parts && o && lse, "o/lse", "null", "device pointers");
  require_combine_disjoint(o_parts, lse_parts, n, o, lse, rows, width);
  cuda_detail::launch_merge(
      cuda_detail::MergeParams{o_parts, lse_parts, rows * width, rows, n, rows, width, o, lse}, stream);
}

}  // namespace dcpmla::cuda
