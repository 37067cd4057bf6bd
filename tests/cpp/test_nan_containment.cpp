// NaN containment (docs/design.md, "Choices"): a NaN or inf in one request's q or kv reaches
// only the (row, head) cells that read it. Those cells propagate it (a NaN gives out = NaN and
// lse = NaN, never the empty-row 0 / -inf that a merge would drop); every other cell, of the
// same request or another, is bit-identical to the clean run. On every CPU route, with both
// merge forms, on one and on several ranks.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "dcpmla/merge.h"
#include "dcpmla/runner.h"
#include "test_helpers.h"

namespace dcpmla {
namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr int B = 4, kQlen = 3, H = 4, D = 576, R = 512, kMaxLen = 300;
// A long request, one exactly qlen long (shorter than the group), padding, a medium one.
const std::vector<int32_t> kLens{300, 3, 0, 130};

struct Group {
  Route route;
  MergeForm merge;
  int world, interleave;
};

std::string name(const Group& g) {
  return std::string(to_string(g.route)) + "_" + std::string(to_string(g.merge)) + "_N" + std::to_string(g.world) +
         "_I" + std::to_string(g.interleave);
}

AttentionResult run(const Group& g, const std::vector<float>& q, const std::vector<float>& kv) {
  AttentionOptions o;
  o.mode = Mode::verify;
  o.route = g.route;
  o.merge = g.merge;
  o.world_size = g.world;
  o.interleave = g.interleave;
  o.block_size = 16;
  o.min_segment_tokens = 16;  // several split-K segments per request
  o.seed = 11;
  return mla_attention(q, kv, kLens, B, kQlen, H, kMaxLen, D, o);
}

size_t q_at(int b, int t, int h, int j) { return ((size_t(b) * kQlen + size_t(t)) * H + size_t(h)) * D + size_t(j); }
size_t kv_at(int b, int64_t p, int j) { return (size_t(b) * kMaxLen + size_t(p)) * D + size_t(j); }
size_t cell(int b, int t, int h) { return (size_t(b) * kQlen + size_t(t)) * H + size_t(h); }

bool same_bits(float a, float b) { return std::memcmp(&a, &b, sizeof a) == 0; }

struct Poison {
  std::string what;
  std::function<void(std::vector<float>& q, std::vector<float>& kv)> apply;
  std::function<bool(int b, int t, int h)> affected;
  bool nan;  // the affected cells must be NaN (out and lse); else non-finite somewhere in out
};

// Row t of request b sees global positions [0, L - qlen + t] (verify).
bool sees(int b, int t, int64_t p) { return kLens[size_t(b)] > 0 && p <= kLens[size_t(b)] - kQlen + t; }

std::vector<Poison> poisons() {
  return {
      {"NaN in q of one (row, head)", [](auto& q, auto&) { q[q_at(0, 1, 2, 5)] = kNaN; },
       [](int b, int t, int h) { return b == 0 && t == 1 && h == 2; }, true},
      {"-inf in q of one (row, head) of the request shorter than the group",
       [](auto& q, auto&) { q[q_at(1, 0, 0, 3)] = -kInf; },
       [](int b, int t, int h) { return b == 1 && t == 0 && h == 0; }, true},
      // The verify block's last token: only the last row sees it (also through two_stage's stage B).
      {"NaN in the rope part of the last kv token", [](auto&, auto& kv) { kv[kv_at(3, 129, 540)] = kNaN; },
       [](int b, int t, int) { return b == 3 && sees(b, t, 129); }, true},
      {"NaN in the value part of an early kv token", [](auto&, auto& kv) { kv[kv_at(0, 10, 7)] = kNaN; },
       [](int b, int t, int) { return b == 0 && sees(b, t, 10); }, true},
      {"inf in the value part of a kv token", [](auto&, auto& kv) { kv[kv_at(3, 5, 7)] = kInf; },
       [](int b, int t, int) { return b == 3 && sees(b, t, 5); }, false},
      {"NaN in every kv token of one request", [](auto&, auto& kv) {
         for (int64_t p = 0; p < kLens[0]; ++p) kv[kv_at(0, p, 0)] = kNaN;
       },
       [](int b, int, int) { return b == 0; }, true},
  };
}

class NanContainment : public ::testing::TestWithParam<Group> {};

TEST_P(NanContainment, TouchesOnlyTheCellsThatReadIt) {
  const Group g = GetParam();
  const auto q0 = testing::random_normal(size_t(B) * kQlen * H * D, 1);
  const auto kv0 = testing::random_normal(size_t(B) * kMaxLen * D, 2);
  const AttentionResult clean = run(g, q0, kv0);
  for (float x : clean.out) ASSERT_TRUE(std::isfinite(x)) << "the clean run must be finite";

  for (const Poison& poison : poisons()) {
    SCOPED_TRACE(poison.what);
    auto q = q0, kv = kv0;
    poison.apply(q, kv);
    const AttentionResult got = run(g, q, kv);
    int affected_cells = 0;
    for (int b = 0; b < B; ++b)
      for (int t = 0; t < kQlen; ++t)
        for (int h = 0; h < H; ++h) {
          const size_t c = cell(b, t, h);
          const float* o = got.out.data() + c * R;
          const float* o_clean = clean.out.data() + c * R;
          if (!poison.affected(b, t, h)) {
            ASSERT_TRUE(same_bits(got.lse[c], clean.lse[c])) << "lse of untouched cell b=" << b << " t=" << t << " h=" << h;
            for (int j = 0; j < R; ++j)
              ASSERT_TRUE(same_bits(o[j], o_clean[j])) << "out of untouched cell b=" << b << " t=" << t << " h=" << h;
            continue;
          }
          ++affected_cells;
          if (poison.nan) {
            ASSERT_TRUE(std::isnan(got.lse[c])) << "lse " << got.lse[c] << " of b=" << b << " t=" << t << " h=" << h;
            for (int j = 0; j < R; ++j) ASSERT_TRUE(std::isnan(o[j])) << "b=" << b << " t=" << t << " h=" << h << " j=" << j;
          } else {
            bool non_finite = false;
            for (int j = 0; j < R; ++j) non_finite |= !std::isfinite(o[j]);
            ASSERT_TRUE(non_finite) << "b=" << b << " t=" << t << " h=" << h;
          }
        }
    ASSERT_GT(affected_cells, 0);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Routes, NanContainment,
    ::testing::Values(Group{Route::one_stage, MergeForm::all_heads, 1, 1}, Group{Route::split_k, MergeForm::all_heads, 1, 1},
                      Group{Route::two_stage, MergeForm::all_heads, 1, 1},
                      Group{Route::one_stage, MergeForm::all_heads, 4, 2}, Group{Route::split_k, MergeForm::all_heads, 4, 2},
                      Group{Route::two_stage, MergeForm::all_heads, 4, 2},
                      Group{Route::one_stage, MergeForm::scatter_heads, 4, 2},
                      Group{Route::split_k, MergeForm::scatter_heads, 4, 2},
                      Group{Route::two_stage, MergeForm::scatter_heads, 4, 2},
                      Group{Route::split_k, MergeForm::scatter_heads, 2, 1}, Group{Route::two_stage, MergeForm::all_heads, 3, 1}),
    [](const ::testing::TestParamInfo<Group>& info) { return name(info.param); });

// The merges themselves: a NaN partial poisons its row even when every other partial of
// the row is empty (-inf) -- the case that used to come out as an empty row (0, -inf) -- and
// never another row.
TEST(NanContainment, MergesPropagateANaNPartialToItsRowOnly) {
  const int n = 3, rows = 2, width = 4;
  const float ninf = -kInf;
  std::vector<bf16> o(size_t(n * rows * width), float_to_bf16(0.5f));
  // Row 0: rank 1 NaN, others empty. Row 1: all finite.
  const std::vector<float> lse{ninf, 1.0f, kNaN, 2.0f, ninf, 0.5f};
  for (int j = 0; j < width; ++j) o[size_t((1 * rows + 0) * width + j)] = float_to_bf16(kNaN);
  std::vector<bf16> out(size_t(rows * width));
  std::vector<float> out_lse(rows);
  combine_partials(o.data(), lse.data(), n, out.data(), out_lse.data(), rows, width);
  EXPECT_TRUE(std::isnan(out_lse[0]));
  for (int j = 0; j < width; ++j) EXPECT_TRUE(std::isnan(bf16_to_float(out[size_t(j)])));
  EXPECT_TRUE(std::isfinite(out_lse[1]));
  for (int j = 0; j < width; ++j) EXPECT_EQ(bf16_to_float(out[size_t(width + j)]), 0.5f);

  // merge_state: a NaN lse against an empty partner.
  const std::vector<float> la{kNaN}, lb{ninf};
  std::vector<bf16> oa(width, float_to_bf16(1.0f)), ob(width, bf16{}), om(width);
  float lm = 0.0f;
  merge_state(oa.data(), la.data(), ob.data(), lb.data(), om.data(), &lm, 1, width);
  EXPECT_TRUE(std::isnan(lm));

  // Split-K: a segment whose statistics are NaN (m = -inf, l = NaN: every score NaN).
  const std::vector<float> part_o(size_t(2 * width), 0.25f), part_m{ninf, ninf}, part_l{kNaN, 0.0f};
  std::vector<bf16> so(width);
  float slse = 0.0f;
  merge_split_k(part_o.data(), part_m.data(), part_l.data(), 2, width, 1, width, so.data(), &slse);
  EXPECT_TRUE(std::isnan(slse));
  for (int j = 0; j < width; ++j) EXPECT_TRUE(std::isnan(bf16_to_float(so[size_t(j)])));
  // ...while segments that are empty (l = 0) still give the empty row.
  const std::vector<float> empty_l{0.0f, 0.0f};
  merge_split_k(part_o.data(), part_m.data(), empty_l.data(), 2, width, 1, width, so.data(), &slse);
  EXPECT_EQ(slse, ninf);
  for (int j = 0; j < width; ++j) EXPECT_EQ(bf16_to_float(so[size_t(j)]), 0.0f);
}

}  // namespace
}  // namespace dcpmla
