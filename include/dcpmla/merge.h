// Merging partial attention results with the LSE rule (SPEC §2, §4).
// All lse here are natural log; split-K statistics are base 2 and say so.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#include "dcpmla/numeric.h"

namespace dcpmla {

// max(a, b) that keeps a NaN: the merges take their reference maximum with it, so a NaN
// partial poisons its row (NaN out and lse) instead of being skipped, or of turning a row
// whose other partials are empty into an empty row. std::max drops a NaN second argument.
inline float nan_max(float a, float b) {
  if (std::isnan(a) || std::isnan(b)) return std::numeric_limits<float>::quiet_NaN();
  return a < b ? b : a;
}

// The LSE rule's statistics of one row's n partials lse_at(k): their maximum m (nan_max; -inf
// when every partial is empty) and sum = sum_k e^(lse_k - m) over the non-empty ones, so that
// lse = m + ln sum and partial k weighs e^(lse_k - m) / sum. Shared by every host merge.
struct LseStats {
  float m, sum;
};
template <class LseAt>
LseStats lse_stats(int n, LseAt lse_at) {
  LseStats s{kNegInf, 0.0f};
  for (int k = 0; k < n; ++k) s.m = nan_max(s.m, lse_at(k));
  if (s.m != kNegInf)
    for (int k = 0; k < n; ++k)
      if (lse_at(k) != kNegInf) s.sum += std::exp(lse_at(k) - s.m);
  return s;
}

// Every merge below validates its arguments (dcpmla::Error naming the field): counts of
// partials and segments >= 1 (a merge of nothing has no answer; an empty row is a partial with
// lse = -inf or l = 0), width >= 1, rows >= 0 where there are rows (0 is an empty call that
// touches no pointer), and every pointer it touches non-null. Sizes the pointers cover cannot
// be checked here.

// (o, lse) = merge of two partials over disjoint key sets, row by row:
// lse = ln(e^a + e^b), o = e^(a-lse) o_a + e^(b-lse) o_b. -inf partials contribute nothing,
// whatever their o holds; both -inf gives o = 0, lse = -inf; a +inf lse (no attention gives
// one) makes the row NaN, as a NaN does. An output may be either input of its kind (in place:
// o = o_a or o_b, lse = lse_a or lse_b); any other overlap is refused.
void merge_state(const bf16* o_a, const float* lse_a, const bf16* o_b, const float* lse_b, bf16* o,
                 float* lse, int64_t rows, int width);
// merge_state's (and the CUDA form's) check of that rule; rows >= 0 and width >= 1 checked before.
void require_merge_state_disjoint(const bf16* o_a, const float* lse_a, const bf16* o_b, const float* lse_b,
                                  const bf16* o, const float* lse, int64_t rows, int width);

// Combine n partials stacked [n, rows, width] / [n, rows] into one (the cross-rank merge
// after an all-gather or all-to-all). The outputs may not share memory with the partials.
void combine_partials(const bf16* o_parts, const float* lse_parts, int n, bf16* o, float* lse,
                      int64_t rows, int width);
// combine_partials' (and the CUDA form's) check that o and lse share no byte with the partials
// or with each other (require_disjoint); n >= 1, rows >= 0 and width >= 1 checked before.
void require_combine_disjoint(const bf16* o_parts, const float* lse_parts, int n, const bf16* o, const float* lse,
                              int64_t rows, int width);

// Split-K: segments s of one row, o_s normalised, (m_s, l_s) base 2:
// M = max m_s, l = sum l_s 2^(m_s - M), lse = (M + log2 l) ln 2 (natural log).
// Segment s is at part_o + s * segment_stride_o, part_m / part_l + s * segment_stride_ml;
// with several segments the strides must keep them apart (>= width and >= 1).
void merge_split_k(const float* part_o, const float* part_m, const float* part_l, int segments,
                   int64_t segment_stride_o, int64_t segment_stride_ml, int width, bf16* o, float* lse);

namespace detail {
// merge_split_k without the argument checks, for the CPU kernel: it runs per cut row inside an
// OpenMP loop (where a throw would terminate) on arguments the plan already bounds.
void merge_split_k_unchecked(const float* part_o, const float* part_m, const float* part_l, int segments,
                             int64_t segment_stride_o, int64_t segment_stride_ml, int width, bf16* o, float* lse);
}  // namespace detail

}  // namespace dcpmla
