// The whole CPU path (shard -> page -> write -> plan -> attention -> merge) against the
// float64 reference over global windows, on a covering grid of the contract's axes.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>

#include <fmt/format.h>

#include "dcpmla/layout.h"
#include "dcpmla/reference.h"
#include "dcpmla/runner.h"
#include "../common/case_options.h"
#include "test_helpers.h"

namespace dcpmla {
namespace {

struct Case {
  Mode mode;
  int world, interleave, block_size;
  KvDtype dtype;
  Route route;
  int heads;
  MergeForm merge;
  int index;
};

std::string name(const Case& c) {
  return fmt::format("{}_{}_N{}_I{}_bs{}_{}_H{}_{}", c.index, to_string(c.mode), c.world, c.interleave,
                     c.block_size, to_string(c.dtype), c.heads, to_string(c.route));
}

void PrintTo(const Case& c, std::ostream* os) { *os << name(c); }

// Every value of every axis meets every mode: axis j of case k cycles at its own rate.
std::vector<Case> covering_cases() {
  const Mode modes[] = {Mode::decode, Mode::verify, Mode::draft};
  const int interleaves[] = {1, 2, 4}, block_sizes[] = {1, 16, 64, 256}, heads[] = {1, 16, 128};
  const KvDtype dtypes[] = {KvDtype::bf16, KvDtype::fp8_e4m3, KvDtype::fp8_e5m2};
  std::vector<Case> cases;
  for (int m = 0; m < 3; ++m)
    for (int j = 0; j < 12; ++j) {
      Case c{};
      c.mode = modes[m];
      c.world = 1 + (j * 3 + m) % 8;
      c.interleave = interleaves[j % 3];
      c.block_size = block_sizes[(j / 3 + m) % 4];
      if (c.block_size % c.interleave) c.block_size = 16;
      c.dtype = dtypes[(j + m) % 3];
      c.heads = heads[(j / 4 + m) % 3];
      const Route verify_routes[] = {Route::automatic, Route::one_stage, Route::two_stage, Route::split_k};
      const Route other_routes[] = {Route::automatic, Route::one_stage, Route::split_k};
      c.route = c.mode == Mode::verify ? verify_routes[j % 4] : other_routes[j % 3];
      c.merge = (j % 2 && c.heads % c.world == 0) ? MergeForm::scatter_heads : MergeForm::all_heads;
      c.index = int(cases.size());
      cases.push_back(c);
    }
  return cases;
}

class Conformance : public ::testing::TestWithParam<Case> {};

TEST_P(Conformance, MatchesFloat64Reference) {
  const Case c = GetParam();
  std::mt19937_64 rng(1000 + uint64_t(c.index));
  const int qlen = c.mode == Mode::decode ? 1 : 1 + int(rng() % 4);
  const int longest = c.heads == 128 ? 120 : 300;
  // A padding request, a short one (the last rank holds none of it where the mode allows), one
  // of exactly qlen and a long one; for a forced split_k the long one gives rank 0 three tiles,
  // so that the plan must cut it.
  std::vector<int32_t> lens{0, testing::short_length(c, qlen, rng), qlen, int(qlen + rng() % longest)};
  const Layout rank0{c.world, 0, c.interleave};
  if (c.route == Route::split_k)
    while (rank0.local_length(lens[3]) <= 128) ++lens[3];
  const int B = int(lens.size());
  const int64_t max_len = *std::max_element(lens.begin(), lens.end());
  const auto q = testing::random_normal(size_t(B) * qlen * c.heads * 576, rng());
  const auto kv = testing::random_normal(size_t(B) * size_t(max_len) * 576, rng());
  AttentionOptions o = testing::case_options(c, c.dtype == KvDtype::bf16 ? 1.0f : 0.05f, rng());
  o.merge = c.merge;
  o.min_segment_tokens = 16;  // several split_k segments even on short rows
  const auto got = mla_attention(q, kv, lens, B, qlen, c.heads, max_len, 576, o);
  const auto ref = reference_attention(q, kv, lens, B, qlen, c.heads, max_len, 576, c.mode, c.dtype, o.kv_scale,
                                       1.0 / std::sqrt(576.0), 512);
  const auto err = compare(got.out, got.lse, ref.out, ref.lse, B, qlen, c.heads, 512);
  EXPECT_TRUE(err.within(1e-2)) << name(c) << " lens " << lens[1] << "," << lens[3] << " qlen " << qlen
                                << ": rel " << err.max_rel_l2 << " lse " << err.max_lse_err << " nan "
                                << err.nan_count;
  for (int t = 0; t < qlen; ++t)
    for (int h = 0; h < c.heads; ++h) ASSERT_EQ(got.lse[size_t(t * c.heads + h)], -INFINITY) << "padding row";
  if (c.route != Route::automatic)
    for (Route r : got.routes) EXPECT_EQ(r, c.route);
  if (c.route == Route::split_k)  // a cut, not one piece a request under the split_k label
    EXPECT_GT(*std::max_element(got.max_segments.begin(), got.max_segments.end()), 1) << "split_k cut nothing";
}

INSTANTIATE_TEST_SUITE_P(Grid, Conformance, ::testing::ValuesIn(covering_cases()),
                         [](const auto& info) { return name(info.param); });

}  // namespace
}  // namespace dcpmla
