#include "dcpmla/merge.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <vector>

#include "dcpmla/error.h"

namespace dcpmla {
namespace {

// The checks below are plain comparisons, formatted only on failure.
template <class T>
void require_pointer(const T* p, std::string_view field) {
  if (p == nullptr) fail(field, "null", "a host pointer");
  require_value_aligned(p, field);
}

// rows >= 0, width >= 1, and `parts` x rows x width elements addressable in int64.
void require_shape(int64_t rows, int width, int64_t parts) {
  if (rows < 0) fail("rows", rows, ">= 0 (0 is an empty call)");
  if (width < 1) fail("width", width, ">= 1");
  if (!checked_product({parts, rows, width}))
    fail("rows", rows, fmt::format("{} partials x rows x width {} values that fit int64", parts, width));
}

// `width` zeros in this thread's scratch: the merges run per row (inside OpenMP loops on the
// CPU backend, every step), so the buffer is allocated once per thread, not once per row.
float* zeroed_scratch(int width) {
  thread_local std::vector<float> acc;
  acc.assign(size_t(width), 0.0f);
  return acc.data();
}

// Row-wise LSE merge of n partials at o_at(k), lse_at(k). Ranks whose lse is -inf
// hold no key of the row and get weight 0; all -inf gives o = 0, lse = -inf.
// A NaN lse (a NaN or inf read by the row) is not empty: it makes the row's out and lse NaN.
template <class OAt, class LseAt>
void merge_row(int n, OAt o_at, LseAt lse_at, int width, bf16* o, float* lse) {
  const auto [m, sum] = lse_stats(n, lse_at);
  if (m == kNegInf) {
    std::fill(o, o + width, bf16{});
    *lse = kNegInf;
    return;
  }
  // Weights normalised before they scale a partial: the sum of two partials near FLT_MAX
  // overflowed where their mean is finite.
  float* acc = zeroed_scratch(width);
  for (int k = 0; k < n; ++k) {
    const float l = lse_at(k);
    if (l == kNegInf) continue;
    const float w = std::exp(l - m) / sum;
    const bf16* src = o_at(k);
    for (int j = 0; j < width; ++j) acc[j] += w * bf16_to_float(src[j]);
  }
  for (int j = 0; j < width; ++j) o[j] = float_to_bf16(acc[j]);
  *lse = m + std::log(sum);
}

}  // namespace

void require_merge_state_disjoint(const bf16* o_a, const float* lse_a, const bf16* o_b, const float* lse_b,
                                  const bf16* o, const float* lse, int64_t rows, int width) {
  if (!checked_product({rows, width, 4}))
    fail("rows", rows, fmt::format("rows x width {} values whose bytes fit int64", width));
  const int64_t ob = rows * width * 2, lb = rows * 4;
  // An input that is exactly its kind's output (in place) is left out: every overlap with it is
  // an overlap with that output, which the checks against the outputs see.
  const auto in = [](std::string_view field, const void* at, const void* out, int64_t bytes) {
    return NamedBytes{field, at, at == out ? 0 : bytes};
  };
  require_disjoint({{"o", o, ob}, {"lse", lse, lb}},
                   {in("o_a", o_a, o, ob), in("o_b", o_b, o, ob), in("lse_a", lse_a, lse, lb),
                    in("lse_b", lse_b, lse, lb)});
}

void merge_state(const bf16* o_a, const float* lse_a, const bf16* o_b, const float* lse_b, bf16* o,
                 float* lse, int64_t rows, int width) {
  require_shape(rows, width, 2);
  if (rows == 0) return;
  require_pointer(o_a, "o_a");
  require_pointer(lse_a, "lse_a");
  require_pointer(o_b, "o_b");
  require_pointer(lse_b, "lse_b");
  require_pointer(o, "o");
  require_pointer(lse, "lse");
  require_merge_state_disjoint(o_a, lse_a, o_b, lse_b, o, lse, rows, width);
  for (int64_t r = 0; r < rows; ++r) {
    const bf16* parts[2] = {o_a + r * width, o_b + r * width};
    const float lses[2] = {lse_a[r], lse_b[r]};
    merge_row(2, [&](int k) { return parts[k]; }, [&](int k) { return lses[k]; }, width,
              o + r * width, lse + r);
  }
}

void require_combine_disjoint(const bf16* o_parts, const float* lse_parts, int n, const bf16* o, const float* lse,
                              int64_t rows, int width) {
  // Four bytes a value bounds every extent below (bf16 partials, and float32 lse at width 1).
  if (!checked_product({n, rows, width, 4}))
    fail("rows", rows, fmt::format("{} partials x rows x width {} values whose bytes fit int64", n, width));
  require_disjoint({{"o", o, rows * width * 2}, {"lse", lse, rows * 4}},
                   {{"o_parts", o_parts, n * rows * width * 2}, {"lse_parts", lse_parts, n * rows * 4}});
}

void combine_partials(const bf16* o_parts, const float* lse_parts, int n, bf16* o, float* lse,
                      int64_t rows, int width) {
  if (n < 1) fail("n", n, ">= 1 partials");
  require_shape(rows, width, n);
  if (rows == 0) return;
  require_pointer(o_parts, "o_parts");
  require_pointer(lse_parts, "lse_parts");
  require_pointer(o, "o");
  require_pointer(lse, "lse");
  require_combine_disjoint(o_parts, lse_parts, n, o, lse, rows, width);
  for (int64_t r = 0; r < rows; ++r)
    merge_row(n, [&](int k) { return o_parts + (int64_t(k) * rows + r) * width; },
              [&](int k) { return lse_parts[int64_t(k) * rows + r]; }, width, o + r * width, lse + r);
}

void merge_split_k(const float* part_o, const float* part_m, const float* part_l, int segments,
                   int64_t segment_stride_o, int64_t segment_stride_ml, int width, bf16* o, float* lse) {
  if (segments < 1) fail("segments", segments, ">= 1 (an empty segment has l = 0)");
  if (width < 1) fail("width", width, ">= 1");
  // Overlapping segments would silently count keys twice: refused, not merged.
  if (segments > 1 && segment_stride_o < width)
    fail("segment_stride_o", segment_stride_o, fmt::format(">= width ({}) with {} segments", width, segments));
  if (segments > 1 && segment_stride_ml < 1)
    fail("segment_stride_ml", segment_stride_ml, fmt::format(">= 1 with {} segments", segments));
  require_pointer(part_o, "part_o");
  require_pointer(part_m, "part_m");
  require_pointer(part_l, "part_l");
  require_pointer(o, "o");
  require_pointer(lse, "lse");
  // The segments' extents (strides checked above to keep them apart; a stride that does not fit
  // int64 bytes is refused with them).
  const auto extent = [&](int64_t stride, int64_t last) {
    const std::optional<int64_t> span = segments == 1 ? 0 : checked_product({segments - 1, stride});
    int64_t end = 0;
    if (!span || __builtin_add_overflow(*span, last, &end) || !checked_product({end, 4}))
      fail("segment_stride", stride, fmt::format("segments ({}) x stride within int64 bytes", segments));
    return end * 4;
  };
  require_disjoint({{"o", o, int64_t(width) * 2}, {"lse", lse, 4}},
                   {{"part_o", part_o, extent(segment_stride_o, width)},
                    {"part_m", part_m, extent(segment_stride_ml, 1)},
                    {"part_l", part_l, extent(segment_stride_ml, 1)}});
  detail::merge_split_k_unchecked(part_o, part_m, part_l, segments, segment_stride_o, segment_stride_ml, width, o, lse);
}

void detail::merge_split_k_unchecked(const float* part_o, const float* part_m, const float* part_l, int segments,
                                     int64_t segment_stride_o, int64_t segment_stride_ml, int width, bf16* o,
                                     float* lse) {
  // l = 0 marks an empty segment; a NaN l (a NaN or inf score or value) must poison the row,
  // also when its m is -inf (every score NaN), so it counts as not empty.
  float m = kNegInf;
  bool any = false;
  for (int s = 0; s < segments; ++s)
    if (part_l[s * segment_stride_ml] != 0.0f) {
      any = true;
      m = nan_max(m, part_m[s * segment_stride_ml]);
    }
  if (!any) {
    std::fill(o, o + width, bf16{});
    *lse = kNegInf;
    return;
  }
  float* acc = zeroed_scratch(width);
  float l = 0.0f;
  for (int s = 0; s < segments; ++s) {
    const float ls = part_l[s * segment_stride_ml];
    if (ls == 0.0f) continue;
    const float w = ls * std::exp2(part_m[s * segment_stride_ml] - m);
    l += w;
    const float* src = part_o + s * segment_stride_o;
    for (int j = 0; j < width; ++j) acc[j] += w * src[j];
  }
  for (int j = 0; j < width; ++j) o[j] = float_to_bf16(acc[j] / l);
  *lse = (m + std::log2(l)) * kLn2;
}

}  // namespace dcpmla
