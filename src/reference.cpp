#include "dcpmla/reference.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include "dcpmla/cache.h"
#include "dcpmla/error.h"
#include "dcpmla/layout.h"
#include "dcpmla/numeric.h"
#include "cpu/parallel.h"

namespace dcpmla {
namespace {

// Whether size == count x per (a product past int64 holds no span).
bool holds(size_t size, int64_t count, int64_t per) {
  const auto n = checked_product({count, per});
  return n && uint64_t(*n) == size;
}

}  // namespace

ReferenceResult reference_attention(std::span<const float> q, std::span<const float> kv,
                                    std::span<const int32_t> seq_lens, int batch, int qlen,
                                    int heads, int64_t max_len, int dim, Mode mode,
                                    KvDtype kv_dtype, float kv_scale, double softmax_scale,
                                    int rank_dim, std::span<const int32_t> qlens) {
  // Every size and span before anything is read: the tests trust this reference, so bad input
  // must be an error, never a read past kv or a NaN/-inf row that looks like an answer.
  if (batch < 0) fail("batch", batch, ">= 0");
  if (qlen < 1) fail("qlen", qlen, ">= 1");
  require_known("mode", mode);
  if (mode == Mode::decode && qlen != 1) fail("qlen", qlen, "1 in decode mode");
  if (heads < 1) fail("heads", heads, ">= 1");
  if (max_len < 0) fail("max_len", max_len, ">= 0");
  if (dim < 1) fail("dim", dim, ">= 1");
  if (rank_dim < 1 || rank_dim > dim) fail("rank_dim", rank_dim, fmt::format("in [1, D = {}]", dim));
  require_known("kv_dtype", kv_dtype);
  KvScale{kv_scale}.validate(kv_dtype);
  if (!(std::isfinite(softmax_scale) && softmax_scale > 0)) fail("softmax_scale", softmax_scale, "finite and > 0");
  if (seq_lens.size() != size_t(batch))
    fail("seq_lens", fmt::format("{} entries", seq_lens.size()), fmt::format("batch = {}", batch));
  if (!qlens.empty() && qlens.size() != size_t(batch))
    fail("qlens", fmt::format("{} entries", qlens.size()), fmt::format("none or batch = {}", batch));
  int64_t row_count = 0;
  for (int b = 0; b < batch; ++b) {
    const int qb = qlens.empty() ? qlen : qlens[size_t(b)];
    if (qb < 0 || qb > qlen) fail(fmt::format("qlens[{}]", b), qb, fmt::format("in [0, qlen ({})]", qlen));
    validate_seq_len(mode, seq_lens[size_t(b)], qb, b);
    if (seq_lens[size_t(b)] > max_len)
      fail(fmt::format("seq_lens[{}]", b), seq_lens[size_t(b)], fmt::format("<= max_len ({})", max_len));
    row_count += qb;
  }
  if (!holds(q.size(), row_count, int64_t(heads) * dim))
    fail("q", fmt::format("{} values", q.size()),
         fmt::format("{} ({}) x heads ({}) x D ({})", qlens.empty() ? "batch x qlen" : "sum(qlens)", row_count,
                     heads, dim));
  if (!holds(kv.size(), max_len, int64_t(batch) * dim))
    fail("kv", fmt::format("{} values", kv.size()),
         fmt::format("batch ({}) x max_len ({}) x D ({})", batch, max_len, dim));

  // Packed rows: (request, row in its block) of each.
  std::vector<std::pair<int, int>> rows;
  for (int b = 0; b < batch; ++b)
    for (int t = 0; t < (qlens.empty() ? qlen : qlens[size_t(b)]); ++t) rows.emplace_back(b, t);
  ReferenceResult r;
  r.out.assign(rows.size() * heads * rank_dim, 0.0);
  r.lse.assign(rows.size() * heads, -std::numeric_limits<double>::infinity());
  detail::parallel_for(int64_t(rows.size()), detail::Schedule::dynamic, [&](int64_t bt) {
    const auto [b, t] = rows[size_t(bt)];
    const int qb = qlens.empty() ? qlen : qlens[size_t(b)];
    const int64_t w = detail::row_window_unchecked(mode, seq_lens[size_t(b)], qb, t);
    if (w <= 0) return;
    std::vector<double> k(size_t(w) * dim);
    for (int64_t j = 0; j < w; ++j)
      for (int d = 0; d < dim; ++d)
        k[size_t(j * dim + d)] = quantize_roundtrip(kv[size_t((b * max_len + j) * dim + d)], kv_dtype, kv_scale);
    std::vector<double> s(static_cast<size_t>(w)), qd(static_cast<size_t>(dim));
    for (int h = 0; h < heads; ++h) {
      const int64_t row = bt * heads + h;
      for (int d = 0; d < dim; ++d) qd[size_t(d)] = round_to_bf16(q[size_t(row * dim + d)]);
      double m = -std::numeric_limits<double>::infinity();
      for (int64_t j = 0; j < w; ++j) {
        double acc = 0;
        for (int d = 0; d < dim; ++d) acc += qd[size_t(d)] * k[size_t(j * dim + d)];
        s[size_t(j)] = acc * softmax_scale;
        m = std::max(m, s[size_t(j)]);
      }
      double sum = 0;
      for (int64_t j = 0; j < w; ++j) sum += std::exp(s[size_t(j)] - m);
      double* o = r.out.data() + row * rank_dim;
      for (int64_t j = 0; j < w; ++j) {
        const double p = std::exp(s[size_t(j)] - m) / sum;
        for (int d = 0; d < rank_dim; ++d) o[d] += p * k[size_t(j * dim + d)];
      }
      r.lse[size_t(row)] = m + std::log(sum);
    }
  });
  return r;
}

ErrorReport compare(std::span<const float> out, std::span<const float> lse,
                    std::span<const double> ref_out, std::span<const double> ref_lse, int batch,
                    int qlen, int heads, int rank_dim) {
  if (batch < 0) fail("batch", batch, ">= 0");
  if (qlen < 1) fail("qlen", qlen, ">= 1");
  if (heads < 1) fail("heads", heads, ">= 1");
  if (rank_dim < 1) fail("rank_dim", rank_dim, ">= 1");
  const int64_t rows = int64_t(batch) * qlen;
  const auto expect = [&](size_t size, std::string_view field, int64_t per, std::string_view shape) {
    if (!holds(size, rows, per))
      fail(field, fmt::format("{} values", size),
           fmt::format("batch x qlen ({}) x {} ({})", rows, shape, per));
  };
  expect(out.size(), "out", int64_t(heads) * rank_dim, "heads x rank_dim");
  expect(ref_out.size(), "ref_out", int64_t(heads) * rank_dim, "heads x rank_dim");
  expect(lse.size(), "lse", heads, "heads");
  expect(ref_lse.size(), "ref_lse", heads, "heads");
  ErrorReport e;
  for (int64_t bt = 0; bt < int64_t(batch) * qlen; ++bt) {
    double diff = 0, norm = 0;
    for (int64_t i = bt * heads * rank_dim; i < (bt + 1) * heads * rank_dim; ++i) {
      if (std::isnan(out[size_t(i)])) ++e.nan_count;
      const double d = double(out[size_t(i)]) - ref_out[size_t(i)];
      diff += d * d;
      norm += ref_out[size_t(i)] * ref_out[size_t(i)];
    }
    // A row whose reference is all zero (empty window) is judged by its absolute norm.
    const double rel = norm > 0 ? std::sqrt(diff / norm) : std::sqrt(diff);
    e.max_rel_l2 = std::max(e.max_rel_l2, std::isnan(rel) ? INFINITY : rel);
    for (int64_t i = bt * heads; i < (bt + 1) * heads; ++i) {
      const double a = lse[size_t(i)], b = ref_lse[size_t(i)];
      if (std::isnan(a)) ++e.nan_count;
      const double err = (std::isinf(a) && std::isinf(b) && (a > 0) == (b > 0)) ? 0.0 : std::fabs(a - b);
      e.max_lse_err = std::max(e.max_lse_err, std::isnan(err) ? INFINITY : err);
    }
  }
  return e;
}

}  // namespace dcpmla
