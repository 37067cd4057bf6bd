// Host entry points of the device merges (merge.cu): validation before any launch.
#include "dcpmla/cuda.h"

#include <initializer_list>
#include <utility>

#include "dcpmla/error.h"
#include "dcpmla/merge.h"
#include "common/params.h"

namespace dcpmla::cuda {
namespace {

// The merges read and write bf16 and float32 elements whole: a misaligned one faults and kills
// the context (equal offsets between the two partials did not catch both misaligned alike).
void require_elements_aligned(std::initializer_list<std::pair<const char*, const void*>> bf16s,
                              std::initializer_list<std::pair<const char*, const void*>> floats) {
  for (const auto& [field, at] : bf16s) require_aligned(at, 2, field, "2-byte aligned device memory (bf16)");
  for (const auto& [field, at] : floats) require_aligned(at, 4, field, "4-byte aligned device memory (float32)");
}

}  // namespace

void merge_state(const bf16* o_a, const float* lse_a, const bf16* o_b, const float* lse_b, bf16* o, float* lse,
                 int64_t rows, int width, cudaStream_t stream) {
  require(rows >= 0, "rows", rows, ">= 0");
  require(width >= 1, "width", width, ">= 1");
  if (rows == 0) return;
  require(o_a && lse_a && o_b && lse_b && o && lse, "o/lse", "null", "device pointers");
  require_elements_aligned({{"o_a", o_a}, {"o_b", o_b}, {"o", o}}, {{"lse_a", lse_a}, {"lse_b", lse_b}, {"lse", lse}});
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
  require_elements_aligned({{"o_parts", o_parts}, {"o", o}}, {{"lse_parts", lse_parts}, {"lse", lse}});
  require_combine_disjoint(o_parts, lse_parts, n, o, lse, rows, width);
  cuda_detail::launch_merge(
      cuda_detail::MergeParams{o_parts, lse_parts, rows * width, rows, n, rows, width, o, lse}, stream);
}

}  // namespace dcpmla::cuda
