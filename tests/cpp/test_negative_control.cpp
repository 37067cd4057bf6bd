// SPEC §2's classic bug: a verify row's local length must be n_r(w_t), counted from the
// global window end, not n_r(L) - (qlen - 1 - t). Run both rules through the same kernel
// and merge: the conformance check must catch the subtracting rule and pass the planner's.
#include <gtest/gtest.h>

#include <cmath>

#include "dcpmla/merge.h"
#include "dcpmla/reference.h"
#include "dcpmla/runner.h"
#include "test_helpers.h"

namespace dcpmla {
namespace {

enum class Rule { planner, subtracting };

ErrorReport run_with_rule(Rule rule, uint64_t seed) {
  const int N = 2, L = 10, qlen = 3, H = 2, D = 576, R = 512;
  const auto qf = testing::random_normal(size_t(qlen) * H * D, seed);
  const auto kvf = testing::random_normal(size_t(L) * D, seed + 1);
  std::vector<bf16> q, kv;
  for (float x : qf) q.push_back(float_to_bf16(x));
  for (float x : kvf) kv.push_back(float_to_bf16(x));
  const std::vector<int32_t> lens{L}, tables{1, 0};
  const BatchDesc batch{lens, qlen, tables, 2, Mode::verify};
  const float scale = 1.0f / std::sqrt(float(D));

  std::vector<bf16> parts(size_t(N) * qlen * H * R);
  std::vector<float> part_lse(size_t(N) * qlen * H);
  for (int r = 0; r < N; ++r) {
    AttentionConfig c;
    c.heads = H;
    c.layout = Layout{N, r, 1};
    c.block_size = 4;
    c.route = Route::one_stage;
    c.limits = PlanLimits{1, qlen, 8};
    c.softmax_scale = scale;
    Attention attention(c);
    PagedCache cache(CacheConfig{2, 4, D, KvDtype::bf16, 1.0f});
    cache.poison();
    std::vector<int64_t> positions;
    std::vector<int32_t> requests(L, 0);
    for (int p = 0; p < L; ++p) positions.push_back(p);
    cache.write(kv, slots_of(positions, requests, batch, 4, 2, c.layout));
    attention.plan(batch);

    // The same plan with its row lengths rewritten by the rule under test.
    const Plan& plan = attention.current_plan();
    std::vector<int32_t> arena(plan.arena().begin(), plan.arena().end());
    const PlanView original = plan.view();
    int32_t* rows = arena.data() + (original.row_local_len - plan.arena().data());
    for (int t = 0; t < qlen; ++t)
      if (rule == Rule::subtracting) rows[t] = int32_t(Layout{N, r, 1}.local_length(L) - (qlen - 1 - t));
    AttentionParams p = attention.params(q.data(), cache.view(), KvScale{}, parts.data() + size_t(r) * qlen * H * R,
                                         part_lse.data() + size_t(r) * qlen * H);
    p.plan = plan.view_at(arena.data());
    attention_cpu(p);
  }
  std::vector<bf16> out(size_t(qlen) * H * R);
  std::vector<float> lse(size_t(qlen) * H);
  combine_partials(parts.data(), part_lse.data(), N, out.data(), lse.data(), qlen * H, R);
  std::vector<float> outf;
  for (bf16 o : out) outf.push_back(bf16_to_float(o));
  const auto ref = reference_attention(qf, kvf, lens, 1, qlen, H, L, D, Mode::verify, KvDtype::bf16, 1.0f,
                                       scale, R);
  return compare(outf, lse, ref.out, ref.lse, 1, qlen, H, R);
}

}  // namespace

TEST(NegativeControl, RankOneRowLengths) {
  EXPECT_EQ(row_local_lengths(Mode::verify, 10, 3, Layout{2, 1, 1}), (std::vector<int64_t>{4, 4, 5}));
}

TEST(NegativeControl, SubtractingRuleIsCaughtAndPlannerRuleIsExact) {
  for (uint64_t seed : {1u, 2u, 3u}) {
    const ErrorReport right = run_with_rule(Rule::planner, seed);
    EXPECT_TRUE(right.within(1e-2)) << "planner rule: rel " << right.max_rel_l2 << " lse " << right.max_lse_err;
    const ErrorReport wrong = run_with_rule(Rule::subtracting, seed);
    EXPECT_FALSE(wrong.within(1e-2)) << "the subtracting rule passed the check: rel " << wrong.max_rel_l2;
    EXPECT_GT(wrong.max_rel_l2, 0.05);
  }
}

}  // namespace dcpmla
