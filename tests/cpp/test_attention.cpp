// The CPU kernel on one rank's shard, against the float64 reference over global windows.
#include "dcpmla/attention.h"

#include <gtest/gtest.h>

#include <array>
#include <cmath>

#include "dcpmla/reference.h"
#include "dcpmla/runner.h"
#include "test_helpers.h"

namespace dcpmla {
namespace {

// World 1, so the shard is the whole request: the kernel alone must match the reference.
AttentionResult run(const std::vector<float>& q, const std::vector<float>& kv, const std::vector<int32_t>& lens,
                    int qlen, int heads, int64_t max_len, Route route, int block_size, Mode mode) {
  AttentionOptions o;
  o.mode = mode;
  o.route = route;
  o.block_size = block_size;
  o.seed = 11;
  o.min_segment_tokens = 32;
  return mla_attention(q, kv, lens, int(lens.size()), qlen, heads, max_len, 576, o);
}

}  // namespace

TEST(Attention, RoutesAgreeWithReferenceAcrossTileBoundaries) {
  const int qlen = 3, heads = 4;
  // Lengths around sub-page (16) boundaries, one padding request, one exactly qlen.
  const std::vector<int32_t> lens{15, 16, 17, 0, 3, 33, 700};
  const int64_t max_len = 700;
  const int B = int(lens.size());
  const auto q = testing::random_normal(size_t(B) * qlen * heads * 576, 21);
  const auto kv = testing::random_normal(size_t(B) * max_len * 576, 22);
  const auto ref = reference_attention(q, kv, lens, B, qlen, heads, max_len, 576, Mode::verify,
                                       KvDtype::bf16, 1.0f, 1.0 / std::sqrt(576.0), 512);
  for (Route route : {Route::one_stage, Route::split_k, Route::two_stage}) {
    const auto got = run(q, kv, lens, qlen, heads, max_len, route, 16, Mode::verify);
    EXPECT_EQ(got.routes[0], route);
    const auto err = compare(got.out, got.lse, ref.out, ref.lse, B, qlen, heads, 512);
    EXPECT_TRUE(err.within(1e-2)) << to_string(route) << ": rel " << err.max_rel_l2 << " lse "
                                  << err.max_lse_err << " nan " << err.nan_count;
  }
}

// A task of the CPU kernel covers 16 heads at 16 query positions: long query blocks and more
// heads than one task holds are split across tasks, whole requests and cut pieces alike, with
// per-request qlens that end inside a task's positions (and a request of no rows), on 2 ranks.
TEST(Attention, TasksSplitLongQueryBlocksAndManyHeads) {
  const int qlen = 37, heads = 20;
  const std::vector<int32_t> lens{300, 0, 95, 41, 137}, qlens{37, 0, 16, 0, 17};
  const int64_t max_len = 300;
  const int B = int(lens.size()), rows = 37 + 16 + 17;
  const auto q = testing::random_normal(size_t(rows) * heads * 576, 31);
  const auto kv = testing::random_normal(size_t(B) * max_len * 576, 32);
  const auto ref = reference_attention(q, kv, lens, B, qlen, heads, max_len, 576, Mode::verify, KvDtype::bf16, 1.0f,
                                       1.0 / std::sqrt(576.0), 512, qlens);
  for (Route route : {Route::one_stage, Route::split_k}) {
    AttentionOptions o;
    o.mode = Mode::verify;
    o.world_size = 2;
    o.interleave = 2;
    o.route = route;
    o.block_size = 16;
    o.seed = 12;
    o.min_segment_tokens = 32;
    o.qlens = qlens;
    const auto got = mla_attention(q, kv, lens, B, qlen, heads, max_len, 576, o);
    const auto err = compare(got.out, got.lse, ref.out, ref.lse, rows, 1, heads, 512);
    EXPECT_TRUE(err.within(1e-2)) << to_string(route) << ": rel " << err.max_rel_l2 << " lse " << err.max_lse_err
                                  << " nan " << err.nan_count;
  }
}

TEST(Attention, EmptyRowsGiveZeroAndMinusInf) {
  // Rank 3 of 4 holds nothing of a request of length 2.
  AttentionConfig c;
  c.heads = 2;
  c.layout = Layout{4, 3, 1};
  c.block_size = 16;
  c.limits = PlanLimits{2, 1, 64};
  c.softmax_scale = 0.05f;
  Attention attention(c);
  PagedCache cache(CacheConfig{2, 16, 576, KvDtype::bf16, 1.0f});
  cache.poison();
  const std::vector<int32_t> lens{2, 0}, tables{0, 1};
  attention.plan(BatchDesc{lens, 1, tables, 1, Mode::decode});
  const auto qf = testing::random_normal(2 * 2 * 576, 5);
  std::vector<bf16> q;
  for (float x : qf) q.push_back(float_to_bf16(x));
  std::vector<bf16> out(2 * 2 * 512, float_to_bf16(7.0f));
  std::vector<float> lse(4, 7.0f);
  attention.run(q.data(), cache.view(), KvScale{}, out.data(), lse.data());
  for (float l : lse) EXPECT_EQ(l, -INFINITY);
  for (bf16 o : out) EXPECT_EQ(bf16_to_float(o), 0.0f);
}

TEST(Attention, BlockAttentionIsCausalInsideTheBlock) {
  const int qlen = 3, heads = 2, D = 576, R = 512;
  const auto qf = testing::random_normal(size_t(qlen) * heads * D, 8);
  const auto kf = testing::random_normal(size_t(qlen) * D, 9);
  std::vector<bf16> q, k;
  for (float x : qf) q.push_back(float_to_bf16(x));
  for (float x : kf) k.push_back(float_to_bf16(x));
  const std::vector<int32_t> lens{qlen};
  std::vector<bf16> out(size_t(qlen) * heads * R);
  std::vector<float> lse(size_t(qlen) * heads);
  block_attention_cpu(BlockAttentionParams{q.data(), k.data(), lens.data(), KvDtype::bf16, 1.0f, 0.04f, 1,
                                           qlen, heads, 0, heads, D, R, out.data(), lse.data()});
  // Row 0 sees only key 0: its output is that key's value and lse its score.
  for (int h = 0; h < heads; ++h) {
    double s = 0;
    for (int j = 0; j < D; ++j) s += double(round_to_bf16(qf[size_t(h) * D + j])) * round_to_bf16(kf[size_t(j)]);
    EXPECT_NEAR(lse[size_t(h)], 0.04 * s, 1e-3);
    for (int r = 0; r < R; ++r) EXPECT_EQ(bf16_to_float(out[size_t(h) * R + r]), round_to_bf16(kf[size_t(r)]));
  }
  // Every row against the float64 reference: a verify request of exactly qlen tokens has the
  // block's causal windows (row t sees keys 0..t).
  const auto ref = reference_attention(qf, kf, lens, 1, qlen, heads, qlen, D, Mode::verify, KvDtype::bf16, 1.0f,
                                       0.04, R);
  std::vector<float> got(out.size());
  for (size_t i = 0; i < out.size(); ++i) got[i] = bf16_to_float(out[i]);
  const auto err = compare(got, lse, ref.out, ref.lse, 1, qlen, heads, R);
  EXPECT_TRUE(err.within(1e-2)) << "rel " << err.max_rel_l2 << " lse " << err.max_lse_err;
}

// The split-K workspace size: a negative rank_dim gave a wrong count (-2: 0 floats, -1: 80 for
// 5 x 4 x 4), not an error (the ninth audit); every argument below 1 is refused by name.
TEST(Attention, SplitWorkspaceFloatsRefusesArgumentsBelowOne) {
  EXPECT_EQ(split_workspace_floats(5, 4, 4, 512), 5 * 4 * 4 * 514);
  for (const auto& [w, q, h, r] : {std::array<int64_t, 4>{5, 4, 4, -2}, std::array<int64_t, 4>{5, 4, 4, -1},
                                   std::array<int64_t, 4>{5, 4, 4, 0}, std::array<int64_t, 4>{0, 4, 4, 512},
                                   std::array<int64_t, 4>{5, -1, 4, 512}, std::array<int64_t, 4>{5, 4, 0, 512}})
    testing::expect_error([&] { (void)split_workspace_floats(w, int(q), int(h), int(r)); },
                          "expected work_capacity, max_qlen, heads and rank_dim >= 1");
  testing::expect_error([] { (void)split_workspace_floats(INT64_MAX, 2, 1, 512); }, "a count that fits int64");
}

TEST(Attention, ReferenceRejectsBadInput) {
  // The reference the tests trust: bad sizes used to read past kv (seq_lens > max_len) or
  // return NaN / -inf rows that look like answers. A valid call: B 1, qlen 2, H 1, L 4, D 4, R 2.
  struct Args {
    std::vector<float> q = std::vector<float>(8, 0.5f), kv = std::vector<float>(16, 0.25f);
    std::vector<int32_t> lens{4}, qlens;
    int batch = 1, qlen = 2, heads = 1;
    int64_t max_len = 4;
    int dim = 4;
    Mode mode = Mode::verify;
    KvDtype dtype = KvDtype::bf16;
    float kv_scale = 1.0f;
    double softmax_scale = 0.5;
    int rank_dim = 2;
    ReferenceResult operator()() const {
      return reference_attention(q, kv, lens, batch, qlen, heads, max_len, dim, mode, dtype, kv_scale, softmax_scale,
                                 rank_dim, qlens);
    }
  };
  const auto expect_error = [](const std::function<void(Args&)>& change, const std::string& needle) {
    Args a;
    change(a);
    testing::expect_error([&] { a(); }, needle);
  };
  const auto ok = Args{}();
  EXPECT_EQ(ok.lse.size(), 2u);
  EXPECT_NEAR(ok.lse[0], std::log(3.0) + 0.5 * 4 * 0.5 * 0.25, 1e-6);  // 3 equal keys, score 0.25 each

  // The audit's case: seq_lens = {100} with max_len 1 (a heap overflow before).
  testing::expect_error([] {
    const std::vector<float> q(16), kv(16);
    reference_attention(q, kv, std::vector<int32_t>{100}, 1, 1, 1, 1, 16, Mode::verify, KvDtype::bf16, 1.f, 1.0, 8);
  }, "'seq_lens[0]' = 100: expected <= max_len (1)");
  expect_error([](Args& a) { a.lens = {4, 4}; }, "'seq_lens' = 2 entries");
  expect_error([](Args& a) { a.lens = {-1}; }, "'seq_lens[0]' = -1");
  expect_error([](Args& a) { a.lens = {1}; }, "'seq_lens[0]' = 1: expected >= qlen (2)");  // verify needs L >= qlen
  expect_error([](Args& a) { a.batch = -1; }, "'batch' = -1");
  expect_error([](Args& a) { a.qlen = 0; }, "'qlen' = 0");
  expect_error([](Args& a) { a.mode = Mode::decode; }, "'qlen' = 2: expected 1 in decode mode");
  expect_error([](Args& a) { a.mode = Mode(7); }, "'mode' = 7");
  expect_error([](Args& a) { a.heads = 0; }, "'heads' = 0");
  expect_error([](Args& a) { a.max_len = -1; }, "'max_len' = -1");
  expect_error([](Args& a) { a.dim = 0; }, "'dim' = 0");
  expect_error([](Args& a) { a.rank_dim = 0; }, "'rank_dim' = 0");
  expect_error([](Args& a) { a.rank_dim = 5; }, "'rank_dim' = 5");
  expect_error([](Args& a) { a.dtype = KvDtype(9); }, "'kv_dtype' = 9");
  expect_error([](Args& a) { a.kv_scale = 2.0f; }, "'kv_scale' = 2");
  expect_error([](Args& a) {
    a.dtype = KvDtype::fp8_e4m3;
    a.kv_scale = NAN;
  }, "'kv_scale'");
  expect_error([](Args& a) { a.softmax_scale = NAN; }, "'softmax_scale'");
  expect_error([](Args& a) { a.softmax_scale = 0; }, "'softmax_scale' = 0");
  expect_error([](Args& a) { a.q.pop_back(); }, "'q' = 7 values");
  expect_error([](Args& a) { a.kv.resize(12); }, "'kv' = 12 values");
  expect_error([](Args& a) { a.max_len = int64_t(1) << 62; }, "'kv' = 16 values");  // no overflowing product
  expect_error([](Args& a) { a.qlens = {1, 1}; }, "'qlens' = 2 entries");
  expect_error([](Args& a) { a.qlens = {3}; }, "'qlens[0]' = 3");
  expect_error([](Args& a) { a.qlens = {1}; }, "'q' = 8 values");  // sum(qlens) = 1 row
  // batch = 0 is an empty call.
  Args empty;
  empty.batch = 0;
  empty.lens.clear();
  empty.q.clear();
  empty.kv.clear();
  EXPECT_TRUE(empty().lse.empty());

  // compare: every span must hold batch x qlen rows.
  const std::vector<float> out(4), lse(2);
  EXPECT_NO_THROW(compare(out, lse, ok.out, ok.lse, 1, 2, 1, 2));
  testing::expect_error([&] { compare(out, std::vector<float>(1), ok.out, ok.lse, 1, 2, 1, 2); }, "'lse' = 1 values");
  testing::expect_error([&] { compare(out, lse, ok.out, ok.lse, 2, 2, 1, 2); }, "'out' = 4 values");
  testing::expect_error([&] { compare(out, lse, ok.out, ok.lse, 1, 2, 1, -1); }, "'rank_dim' = -1");
}

}  // namespace dcpmla
