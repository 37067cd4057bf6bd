#include "dcpmla/merge.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "dcpmla/comm.h"
#include "dcpmla/runner.h"
#include "test_helpers.h"

namespace dcpmla {
namespace {

std::vector<bf16> to_bf16(const std::vector<float>& x) {
  std::vector<bf16> y;
  for (float v : x) y.push_back(float_to_bf16(v));
  return y;
}

}  // namespace

TEST(Merge, MergeStateIsTheLseRule) {
  const int rows = 5, width = 32;
  const auto oa = to_bf16(testing::random_normal(rows * width, 1));
  const auto ob = to_bf16(testing::random_normal(rows * width, 2));
  const std::vector<float> la{0.5f, -3.0f, kNegInf, 7.0f, kNegInf};
  const std::vector<float> lb{1.5f, 2.0f, 0.25f, kNegInf, kNegInf};
  std::vector<bf16> o(rows * width);
  std::vector<float> lse(rows);
  merge_state(oa.data(), la.data(), ob.data(), lb.data(), o.data(), lse.data(), rows, width);
  for (int r = 0; r < rows; ++r) {
    if (la[r] == kNegInf && lb[r] == kNegInf) {
      EXPECT_EQ(lse[r], kNegInf);
      for (int j = 0; j < width; ++j) EXPECT_EQ(bf16_to_float(o[r * width + j]), 0.0f);
      continue;
    }
    const double ea = la[r] == kNegInf ? 0 : std::exp(double(la[r]));
    const double eb = lb[r] == kNegInf ? 0 : std::exp(double(lb[r]));
    EXPECT_NEAR(lse[r], std::log(ea + eb), 1e-5);
    for (int j = 0; j < width; ++j) {
      const double want = (ea * bf16_to_float(oa[r * width + j]) + eb * bf16_to_float(ob[r * width + j])) / (ea + eb);
      EXPECT_NEAR(bf16_to_float(o[r * width + j]), want, 1e-2 * (1 + std::fabs(want)));
      EXPECT_FALSE(std::isnan(bf16_to_float(o[r * width + j])));
    }
  }
}

TEST(Merge, CombineEqualsRepeatedMergeState) {
  const int n = 4, rows = 3, width = 16;
  const auto parts = to_bf16(testing::random_normal(n * rows * width, 3));
  std::vector<float> lses = testing::random_normal(n * rows, 4, 3.0f);
  lses[1 * rows + 2] = kNegInf;  // a rank holding no key of row 2
  std::vector<bf16> o(rows * width), acc(parts.begin(), parts.begin() + rows * width);
  std::vector<float> lse(rows), acc_lse(lses.begin(), lses.begin() + rows);
  combine_partials(parts.data(), lses.data(), n, o.data(), lse.data(), rows, width);
  for (int k = 1; k < n; ++k)
    merge_state(acc.data(), acc_lse.data(), parts.data() + k * rows * width, lses.data() + k * rows,
                acc.data(), acc_lse.data(), rows, width);
  for (int r = 0; r < rows; ++r) {
    EXPECT_NEAR(lse[r], acc_lse[r], 1e-5);
    for (int j = 0; j < width; ++j)
      EXPECT_NEAR(bf16_to_float(o[r * width + j]), bf16_to_float(acc[r * width + j]), 2e-2);
  }
}

TEST(Merge, SplitKUsesBase2StatisticsAndReturnsNaturalLog) {
  // Scores of one row cut into three segments; the merge must equal one softmax over all.
  const std::vector<std::vector<float>> seg_scores{{0.3f, -1.2f}, {2.5f}, {}};
  const std::vector<std::vector<float>> seg_values{{1.0f, -2.0f}, {0.5f}, {}};
  const int segments = 3;
  std::vector<float> o(segments), m(segments), l(segments);
  double total = 0, weighted = 0;
  for (int s = 0; s < segments; ++s) {
    float mx = kNegInf;
    for (float x : seg_scores[s]) mx = std::max(mx, x * 1.4426950408889634f);
    float sum = 0, acc = 0;
    for (size_t j = 0; j < seg_scores[s].size(); ++j) {
      const float w = std::exp2(seg_scores[s][j] * 1.4426950408889634f - mx);
      sum += w;
      acc += w * seg_values[s][j];
      total += std::exp(double(seg_scores[s][j]));
      weighted += std::exp(double(seg_scores[s][j])) * seg_values[s][j];
    }
    m[s] = mx;
    l[s] = sum;
    o[s] = sum > 0 ? acc / sum : 0;
  }
  bf16 out;
  float lse;
  merge_split_k(o.data(), m.data(), l.data(), segments, 1, 1, 1, &out, &lse);
  EXPECT_NEAR(lse, std::log(total), 1e-5);
  EXPECT_NEAR(bf16_to_float(out), weighted / total, 1e-2);
  // An empty row is segments whose l is 0 (zero segments is an error: see MergesRejectBadInput).
  const std::vector<float> empty_l(segments, 0.0f);
  merge_split_k(o.data(), m.data(), empty_l.data(), segments, 1, 1, 1, &out, &lse);
  EXPECT_EQ(lse, kNegInf);
  EXPECT_EQ(bf16_to_float(out), 0.0f);
}

TEST(Merge, MergesRejectBadInput) {
  using testing::expect_error;
  const int width = 8;
  std::vector<bf16> parts(2 * width), o(width);
  std::vector<float> lses{0.0f, 1.0f}, lse(1);
  // combine_partials: a merge of no partials has no answer (it used to return o = 0, lse = -inf).
  expect_error([&] { combine_partials(parts.data(), lses.data(), 0, o.data(), lse.data(), 1, width); }, "'n' = 0");
  expect_error([&] { combine_partials(parts.data(), lses.data(), -3, o.data(), lse.data(), 1, width); }, "'n' = -3");
  expect_error([&] { combine_partials(parts.data(), lses.data(), 2, o.data(), lse.data(), -5, width); }, "'rows' = -5");
  expect_error([&] { combine_partials(parts.data(), lses.data(), 2, o.data(), lse.data(), 1, -4); }, "'width' = -4");
  expect_error([&] { combine_partials(parts.data(), lses.data(), 2, o.data(), lse.data(), 1, 0); }, "'width' = 0");
  expect_error([&] { combine_partials(nullptr, lses.data(), 2, o.data(), lse.data(), 1, width); }, "'o_parts' = null");
  expect_error([&] { combine_partials(parts.data(), nullptr, 2, o.data(), lse.data(), 1, width); }, "'lse_parts'");
  expect_error([&] { combine_partials(parts.data(), lses.data(), 2, nullptr, lse.data(), 1, width); }, "'o' = null");
  expect_error([&] { combine_partials(parts.data(), lses.data(), 2, o.data(), nullptr, 1, width); }, "'lse' = null");
  expect_error([&] { combine_partials(parts.data(), lses.data(), 2, o.data(), lse.data(), int64_t(1) << 62, width); },
               "'rows'");
  // rows = 0 is an empty call: nothing is read, so no pointer is needed.
  EXPECT_NO_THROW(combine_partials(nullptr, nullptr, 2, nullptr, nullptr, 0, width));
  // Outputs over the partials (the second partial's row would be read after o overwrote it) or
  // over each other: refused, nothing written.
  const std::vector<bf16> parts_before = parts;
  expect_error([&] { combine_partials(parts.data(), lses.data(), 2, parts.data() + width, lse.data(), 1, width); },
               "'o' = 16 bytes at");
  expect_error([&] { combine_partials(parts.data(), lses.data(), 2, o.data(), lses.data() + 1, 1, width); },
               "overlapping lse_parts (8 bytes at");
  expect_error(
      [&] { combine_partials(parts.data(), lses.data(), 2, o.data(), reinterpret_cast<float*>(o.data() + 2), 1, width); },
      "overlapping lse (4 bytes at");
  EXPECT_EQ(std::memcmp(parts.data(), parts_before.data(), parts.size() * sizeof(bf16)), 0);

  // merge_state
  const bf16* a = parts.data();
  const bf16* b = parts.data() + width;
  expect_error([&] { merge_state(a, &lses[0], b, &lses[1], o.data(), lse.data(), -1, width); }, "'rows' = -1");
  expect_error([&] { merge_state(a, &lses[0], b, &lses[1], o.data(), lse.data(), 1, -4); }, "'width' = -4");
  expect_error([&] { merge_state(nullptr, &lses[0], b, &lses[1], o.data(), lse.data(), 1, width); }, "'o_a' = null");
  expect_error([&] { merge_state(a, nullptr, b, &lses[1], o.data(), lse.data(), 1, width); }, "'lse_a' = null");
  expect_error([&] { merge_state(a, &lses[0], nullptr, &lses[1], o.data(), lse.data(), 1, width); }, "'o_b' = null");
  expect_error([&] { merge_state(a, &lses[0], b, nullptr, o.data(), lse.data(), 1, width); }, "'lse_b' = null");
  expect_error([&] { merge_state(a, &lses[0], b, &lses[1], nullptr, lse.data(), 1, width); }, "'o' = null");
  expect_error([&] { merge_state(a, &lses[0], b, &lses[1], o.data(), nullptr, 1, width); }, "'lse' = null");
  EXPECT_NO_THROW(merge_state(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, 0, width));
  // In place (o = o_a or o_b, lse = lse_a or lse_b) is the documented use; any other overlap gave
  // wrong rows (o one row past o_a: row 1 read what row 0 had just written).
  {
    std::vector<bf16> two(3 * width);
    std::vector<float> two_lse{0.0f, 1.0f, 2.0f};
    bf16* s = two.data();
    float* ls = two_lse.data();
    expect_error([&] { merge_state(s, ls, s, ls, s + width, ls, 2, width); }, "'o' = 32 bytes at");
    expect_error([&] { merge_state(s, ls, s, ls, s, ls + 1, 2, width); }, "'lse' = 8 bytes at");
    expect_error([&] { merge_state(s, ls, s, ls, s, reinterpret_cast<float*>(s + 2), 1, width); },
                 "overlapping lse (4 bytes at");
    expect_error([&] { merge_state(s, ls, s, ls, reinterpret_cast<bf16*>(ls), ls + 2, 1, width); },
                 "overlapping lse_a");
    EXPECT_NO_THROW(merge_state(s, ls, s + width, ls + 1, s, ls, 1, width));
    EXPECT_NO_THROW(merge_state(s, ls, s + width, ls + 1, s + width, ls + 1, 1, width));
  }

  // merge_split_k: two segments of `width` floats each.
  std::vector<float> po(2 * width, 1.0f), pm{0.0f, 1.0f}, pl{1.0f, 2.0f};
  bf16 so[width];
  float slse;
  const auto split = [&](int segments, int64_t stride_o, int64_t stride_ml, int w) {
    merge_split_k(po.data(), pm.data(), pl.data(), segments, stride_o, stride_ml, w, so, &slse);
  };
  expect_error([&] { split(0, width, 1, width); }, "'segments' = 0");
  expect_error([&] { split(-2, width, 1, width); }, "'segments' = -2");
  expect_error([&] { split(2, width, 1, 0); }, "'width' = 0");
  expect_error([&] { split(2, width - 1, 1, width); }, "'segment_stride_o' = 7");
  expect_error([&] { split(2, -width, 1, width); }, "'segment_stride_o' = -8");
  expect_error([&] { split(2, width, 0, width); }, "'segment_stride_ml' = 0");
  expect_error([&] { merge_split_k(nullptr, pm.data(), pl.data(), 2, width, 1, width, so, &slse); }, "'part_o' = null");
  expect_error([&] { merge_split_k(po.data(), nullptr, pl.data(), 2, width, 1, width, so, &slse); }, "'part_m' = null");
  expect_error([&] { merge_split_k(po.data(), pm.data(), nullptr, 2, width, 1, width, so, &slse); }, "'part_l' = null");
  expect_error([&] { merge_split_k(po.data(), pm.data(), pl.data(), 2, width, 1, width, nullptr, &slse); }, "'o'");
  expect_error([&] { merge_split_k(po.data(), pm.data(), pl.data(), 2, width, 1, width, so, nullptr); }, "'lse'");
  // The output over a partial: refused.
  expect_error([&] { merge_split_k(po.data(), pm.data(), pl.data(), 2, width, 1, width, so, pl.data()); },
               "'lse' = 4 bytes at");
  // One segment: its strides are never used.
  EXPECT_NO_THROW(split(1, 0, 0, width));
  EXPECT_NEAR(slse, 0.0f, 1e-6);
}

// The merges at the edges of float32, both forms against the exact answer:
// - scatter_heads weighted rank r by exp(lse_r - lse) with lse = m + log(sum) in float32: at
//   lse 1e30 the log rounded away and N equal partials of out 1 merged to N (all_heads gave 1);
// - an empty partial (lse -inf) with NaN in its out poisoned scatter_heads' row (0 x NaN);
// - two partials of out 3e38 merged to inf (the weights were applied before they were
//   normalised), where their mean is finite.
TEST(Merge, MergesAtTheEdgesOfFloat32) {
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  struct Case {
    const char* what;
    std::vector<float> lse, out;  // per rank (one cell of width 1)
    float want_out, want_lse;
  };
  const std::vector<Case> cases{
      {"lse 1e30 twice", {1e30f, 1e30f}, {1.0f, 1.0f}, 1.0f, 1e30f},
      {"lse 1e30 four times", {1e30f, 1e30f, 1e30f, 1e30f}, {1.0f, 1.0f, 1.0f, 1.0f}, 1.0f, 1e30f},
      {"lse -FLT_MAX twice", {-3.4e38f, -3.4e38f}, {1.0f, 1.0f}, 1.0f, -3.4e38f},
      {"an empty partial holding NaN", {0.0f, -inf}, {1.0f, nan}, 1.0f, 0.0f},
      {"every partial empty, NaN in out", {-inf, -inf}, {nan, nan}, 0.0f, -inf},
      {"out 3e38 twice", {0.0f, 0.0f}, {3e38f, 3e38f}, bf16_to_float(float_to_bf16(3e38f)), std::log(2.0f)},
  };
  for (const Case& c : cases)
    for (MergeForm form : {MergeForm::all_heads, MergeForm::scatter_heads}) {
      const int n = int(c.lse.size());
      std::vector<float> outs(static_cast<size_t>(n)), lses(static_cast<size_t>(n));
      run_ranks(n, [&](int r, Communicator& comm) {
        // scatter_heads keeps heads / N each: N heads of one row, every head the same cell.
        const int heads = n;
        std::vector<bf16> o(size_t(heads), float_to_bf16(c.out[size_t(r)]));
        std::vector<float> lse(size_t(heads), c.lse[size_t(r)]);
        const int kept = form == MergeForm::all_heads ? heads : 1;
        std::vector<bf16> out(static_cast<size_t>(kept));
        std::vector<float> out_lse(static_cast<size_t>(kept));
        merge_across_ranks(comm, form, o.data(), lse.data(), 1, heads, 1, out.data(), out_lse.data());
        outs[size_t(r)] = bf16_to_float(out[0]);
        lses[size_t(r)] = out_lse[0];
      });
      for (int r = 0; r < n; ++r) {
        EXPECT_EQ(outs[size_t(r)], c.want_out) << c.what << ", " << to_string(form) << ", rank " << r;
        if (std::isinf(c.want_lse))
          EXPECT_EQ(lses[size_t(r)], c.want_lse) << c.what;
        else
          EXPECT_NEAR(lses[size_t(r)], c.want_lse, std::abs(c.want_lse) * 1e-6f + 1e-6f) << c.what;
      }
    }
  // combine_partials (all_heads' local merge) and merge_state alike.
  const std::vector<bf16> big{float_to_bf16(3e38f), float_to_bf16(3e38f)};
  const std::vector<float> zeros{0.0f, 0.0f};
  bf16 o;
  float lse;
  combine_partials(big.data(), zeros.data(), 2, &o, &lse, 1, 1);
  EXPECT_EQ(bf16_to_float(o), bf16_to_float(float_to_bf16(3e38f)));
  merge_state(&big[0], &zeros[0], &big[1], &zeros[1], &o, &lse, 1, 1);
  EXPECT_EQ(bf16_to_float(o), bf16_to_float(float_to_bf16(3e38f)));
}

TEST(Merge, MergeAcrossRanksRejectsBadInput) {
  using testing::expect_error;
  InProcessGroup group(1);
  const auto comm = group.communicator(0);
  const int width = 8;
  std::vector<bf16> o(2 * width), out(2 * width);
  std::vector<float> lse(2), out_lse(2);
  const auto merge = [&](MergeForm form, int64_t rows, int heads, int w) {
    merge_across_ranks(*comm, form, o.data(), lse.data(), rows, heads, w, out.data(), out_lse.data());
  };
  // An unknown form used to run as scatter_heads; the message shows its number.
  expect_error([&] { merge(MergeForm(7), 1, 1, width); }, "'merge' = 7");
  expect_error([&] { merge(MergeForm(-1), 1, 1, width); }, "'merge' = -1");
  expect_error([&] { merge(MergeForm::all_heads, -1, 1, width); }, "'rows' = -1");
  expect_error([&] { merge(MergeForm::scatter_heads, -1, 1, width); }, "'rows' = -1");
  expect_error([&] { merge(MergeForm::all_heads, 1, 0, width); }, "'heads' = 0");
  expect_error([&] { merge(MergeForm::all_heads, 1, 1, -4); }, "'width' = -4");
  expect_error([&] { merge(MergeForm::all_heads, int64_t(1) << 62, 1, width); }, "'rows'");
  expect_error([&] {
    merge_across_ranks(*comm, MergeForm::all_heads, nullptr, lse.data(), 1, 1, width, out.data(), out_lse.data());
  }, "'o' = null");
  expect_error([&] {
    merge_across_ranks(*comm, MergeForm::all_heads, o.data(), lse.data(), 1, 1, width, out.data(), nullptr);
  }, "'out_lse' = null");
  // A value split across its alignment, named as the caller passed it and before any
  // collective, in both forms (all_heads named combine_partials' o after two gathers; scatter_heads
  // read and wrote it: undefined behaviour, the audit of 2026-12-07).
  const auto byte_past = [](auto* p) { return reinterpret_cast<decltype(p)>(reinterpret_cast<uintptr_t>(p) + 1); };
  for (MergeForm form : {MergeForm::all_heads, MergeForm::scatter_heads}) {
    expect_error([&] {
      merge_across_ranks(*comm, form, o.data(), lse.data(), 1, 1, width, byte_past(out.data()), out_lse.data());
    }, "'out' = address");
    expect_error([&] {
      merge_across_ranks(*comm, form, o.data(), lse.data(), 1, 1, width, out.data(), byte_past(out_lse.data()));
    }, "'out_lse' = address");
    expect_error([&] {
      merge_across_ranks(*comm, form, byte_past(o.data()), lse.data(), 1, 1, width, out.data(), out_lse.data());
    }, "'o' = address");
    expect_error([&] {
      merge_across_ranks(*comm, form, o.data(), byte_past(lse.data()), 1, 1, width, out.data(), out_lse.data());
    }, "'lse' = address");
  }
  // In place (scatter_heads reads lse after it wrote out_lse): refused before any collective.
  expect_error([&] {
    merge_across_ranks(*comm, MergeForm::scatter_heads, o.data(), lse.data(), 1, 1, width, out.data(), lse.data());
  }, "'out_lse' = 4 bytes at");
  expect_error([&] {
    merge_across_ranks(*comm, MergeForm::all_heads, o.data(), lse.data(), 1, 1, width, o.data(), out_lse.data());
  }, "overlapping o (");
  // Valid calls still merge: one rank's partial (fresh random values) is the result; a row
  // with lse -inf is all zeros.
  lse = {0.5f, kNegInf};
  o = to_bf16(testing::random_normal(o.size(), 11));
  for (MergeForm form : {MergeForm::all_heads, MergeForm::scatter_heads}) {
    // Poisoned before each form, so that neither passes on what the other wrote.
    std::fill(out.begin(), out.end(), float_to_bf16(NAN));
    std::fill(out_lse.begin(), out_lse.end(), NAN);
    merge(form, 2, 1, width);
    EXPECT_FLOAT_EQ(out_lse[0], 0.5f);
    EXPECT_EQ(out_lse[1], kNegInf);
    for (int j = 0; j < width; ++j) {
      EXPECT_EQ(bf16_to_float(out[size_t(j)]), bf16_to_float(o[size_t(j)])) << "column " << j;
      EXPECT_EQ(bf16_to_float(out[size_t(width + j)]), 0.0f) << "column " << j;
    }
  }
}

}  // namespace dcpmla
