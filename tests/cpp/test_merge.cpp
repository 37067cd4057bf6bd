#include "dcpmla/merge.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "test_helpers.h"

namespace dcpmla {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

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
  merge_split_k(o.data(), m.data(), l.data(), 0, 1, 1, 1, &out, &lse);
  EXPECT_EQ(lse, kNegInf);
  EXPECT_EQ(bf16_to_float(out), 0.0f);
}

}  // namespace dcpmla
