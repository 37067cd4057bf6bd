#include "dcpmla/plan.h"

#include <gtest/gtest.h>

#include <numeric>

#include "dcpmla/error.h"
#include "test_helpers.h"

namespace dcpmla {
namespace {

PlannerConfig config(Route route = Route::automatic) {
  PlannerConfig c;
  c.route = route;
  c.heads = 16;
  c.block_size = 64;
  c.limits = PlanLimits{8, 4, 1 << 16};
  return c;
}

struct Batch {
  std::vector<int32_t> lens;
  std::vector<int32_t> tables;
  int width;
  int qlen;
  Mode mode;
  BatchDesc desc() const { return BatchDesc{lens, qlen, tables, width, mode}; }
};

Batch batch_of(std::vector<int32_t> lens, int qlen, int block_size = 64, int width = 1100, Mode mode = Mode::verify) {
  Batch b{std::move(lens), {}, width, qlen, mode};
  b.tables.resize(b.lens.size() * size_t(width));
  for (size_t i = 0; i < b.tables.size(); ++i) b.tables[i] = int32_t((i * 7919) % 4096);
  (void)block_size;
  return b;
}

using testing::expect_error;

}  // namespace

TEST(Plan, RowLengthsAndRoute) {
  auto c = config();
  c.layout = Layout{2, 1, 1};
  Planner planner(c);
  Plan plan = planner.make_plan();
  const auto b = batch_of({10, 0, 5}, 3);
  planner.plan(b.desc(), plan);
  EXPECT_EQ(plan.header().batch, 3);
  EXPECT_EQ(plan.route(), Route::one_stage);
  EXPECT_EQ(plan.row_local_len(0, 0), 4);
  EXPECT_EQ(plan.row_local_len(0, 1), 4);
  EXPECT_EQ(plan.row_local_len(0, 2), 5);
  for (int t = 0; t < 3; ++t) EXPECT_EQ(plan.row_local_len(1, t), 0);
  EXPECT_EQ(plan.stats().active_requests, 2);
  EXPECT_EQ(plan.stats().min_local_len, 3);  // rank 0's share of 5
}

TEST(Plan, SubpagesExpandBlocks) {
  auto c = config();
  c.block_size = 256;  // page 128: two sub-pages per block
  Planner planner(c);
  Plan plan = planner.make_plan();
  const auto b = batch_of({600}, 1, 64, 1100, Mode::draft);
  planner.plan(b.desc(), plan);
  const PlanView v = plan.view();
  EXPECT_EQ(v.header->page, 128);
  for (int k = 0; k < 5; ++k) EXPECT_EQ(v.subpage_table[k], b.tables[size_t(k / 2)] * 2 + k % 2);
}

TEST(Plan, AutoSplitsLongWindowsOfSmallBatches) {
  Planner planner(config());
  Plan plan = planner.make_plan();
  planner.plan(batch_of({40000, 1000}, 1).desc(), plan);
  EXPECT_EQ(plan.route(), Route::split_k);
  // Segments cover each request's tiles exactly once, in order.
  std::vector<int> covered(2, 0);
  const PlanView v = plan.view();
  for (int b = 0; b < 2; ++b)
    for (int i = v.request_work[b]; i < v.request_work[b + 1]; ++i) {
      EXPECT_EQ(v.work[i].request, b);
      EXPECT_EQ(v.work[i].tile_begin, covered[size_t(b)]);
      covered[size_t(b)] = v.work[i].tile_end;
    }
  EXPECT_EQ(covered[0], (40000 + 63) / 64);
  EXPECT_EQ(covered[1], (1000 + 63) / 64);
  EXPECT_GT(plan.stats().max_segments, 8) << "the long request gets most segments";
  // A full batch of long requests fills the workers without splitting.
  auto c = config();
  c.limits.max_batch = 256;
  Planner big(c);
  Plan p2 = big.make_plan();
  planner.plan(batch_of({100, 200}, 1).desc(), plan);
  EXPECT_EQ(plan.route(), Route::one_stage) << "short windows are not split";
  big.plan(batch_of(std::vector<int32_t>(200, 4096), 1, 64, 70).desc(), p2);
  EXPECT_EQ(p2.route(), Route::one_stage);
}

TEST(Plan, AutoSplitsOnlyWhenItLowersTheLongestLoad) {
  auto c = config();
  c.limits = PlanLimits{132, 4, 1 << 17};
  Planner planner(c);
  Plan plan = planner.make_plan();
  // A full uniform batch: every SM already holds about one request.
  planner.plan(batch_of(std::vector<int32_t>(128, 4096), 1, 64, 2100).desc(), plan);
  EXPECT_EQ(plan.route(), Route::one_stage);
  // The ragged batch: one request holds most of the tokens.
  planner.plan(batch_of({4641, 45118, 1730, 1696}, 4, 64, 2100).desc(), plan);
  EXPECT_EQ(plan.route(), Route::split_k);
  EXPECT_GE(plan.stats().max_segments, 30) << "the long request is cut finest";
  // Few long requests leave most SMs idle.
  planner.plan(batch_of(std::vector<int32_t>(32, 32768), 1, 64, 2100).desc(), plan);
  EXPECT_EQ(plan.route(), Route::split_k);
}

TEST(Plan, PaddingNeverShrinksParallelism) {
  Planner planner(config());
  Plan a = planner.make_plan(), b = planner.make_plan();
  planner.plan(batch_of({30000, 20000}, 1).desc(), a);
  planner.plan(batch_of({30000, 20000, 0, 0, 0, 0, 0, 0}, 1).desc(), b);
  EXPECT_EQ(a.route(), Route::split_k);
  EXPECT_EQ(b.route(), Route::split_k);
  EXPECT_EQ(a.stats().active_requests, b.stats().active_requests);
  EXPECT_EQ(a.stats().min_local_len, b.stats().min_local_len) << "padding counted as a length";
  ASSERT_EQ(b.header().work_count, a.header().work_count) << "padding changed the split";
  for (int i = 0; i < a.header().work_count; ++i) {
    EXPECT_EQ(a.work()[size_t(i)].tile_begin, b.work()[size_t(i)].tile_begin);
    EXPECT_EQ(a.work()[size_t(i)].tile_end, b.work()[size_t(i)].tile_end);
  }
  EXPECT_EQ(b.view().request_work[2], b.view().request_work[8]) << "padding got work";
}

TEST(Plan, ArenaStaysPutAcrossReplans) {
  Planner planner(config());
  Plan plan = planner.make_plan();
  const int32_t* base = plan.arena().data();
  const size_t size = plan.arena().size();
  planner.plan(batch_of({100, 7, 0}, 4).desc(), plan);
  planner.plan(batch_of({5000, 9000, 4, 4, 0, 33, 2, 8}, 2).desc(), plan);
  EXPECT_EQ(plan.arena().data(), base);
  EXPECT_EQ(plan.arena().size(), size);
  EXPECT_EQ(plan.header().batch, 8);
  EXPECT_EQ(plan.header().qlen, 2);
}

TEST(Plan, ForcedRoutesAndCapabilities) {
  Planner two(config(Route::two_stage));
  Plan plan = two.make_plan();
  two.plan(batch_of({10, 3}, 3).desc(), plan);
  EXPECT_EQ(plan.route(), Route::two_stage);
  EXPECT_EQ(plan.row_local_len(0, 0), 7) << "stage A sees the prefix L - qlen on every row";
  EXPECT_EQ(plan.row_local_len(0, 2), 7);
  EXPECT_EQ(plan.row_local_len(1, 0), 0);
  // two_stage is verify-only: the step's mode is checked against the forced route.
  expect_error([&] { two.plan(batch_of({10}, 1, 64, 1100, Mode::draft).desc(), plan); }, "'route' = two_stage");
  expect_error([&] { two.plan(batch_of({10}, 1, 64, 1100, Mode::decode).desc(), plan); }, "mode decode");
  auto c = config();
  c.backend = Backend::cuda;
  c.heads = 129;
  expect_error([&] { Planner p(c); }, "'heads' = 129: expected in [1, 128] on the cuda backend");
  // More heads than any route serves is the heads' fault, not the route's.
  c = config();
  c.heads = 4097;
  expect_error([&] { Planner p(c); }, "'heads' = 4097");
  EXPECT_TRUE(is_supported(Backend::cpu, Route::split_k, Mode::draft, KvDtype::fp8_e5m2, 1));
  EXPECT_FALSE(is_supported(Backend::cpu, Route::two_stage, Mode::draft, KvDtype::bf16, 1));
}

TEST(Plan, RefusesBadConfigurations) {
  auto c = config();
  c.layout = Layout{4, 4, 1};
  expect_error([&] { Planner p(c); }, "'rank' = 4");
  c = config();
  c.layout = Layout{2, 0, 0};
  expect_error([&] { Planner p(c); }, "'interleave' = 0");
  c = config();
  c.layout = Layout{2, 0, 3};
  expect_error([&] { Planner p(c); }, "'interleave' = 3");
  c = config();
  c.heads = 0;
  expect_error([&] { Planner p(c); }, "heads");
  c = config();
  c.limits.max_qlen = 0;
  expect_error([&] { Planner p(c); }, "max_qlen");
  c.limits.max_qlen = kMaxQlen + 1;
  expect_error([&] { Planner p(c); }, "'limits.max_qlen' = 4097");
  c = config();
  c.limits.max_batch = 1 << 20;
  c.limits.max_local_kv_len = int64_t(1) << 40;
  expect_error([&] { Planner p(c); }, "limits");
}

// Each of these overflowed int arithmetic in the planner before it was refused: the first
// three were found by tests/fuzz/fuzz_planner (UBSan: signed overflow), the sub-page one by
// its oracle (sub-page ids are int32 in the plan).
TEST(Plan, RefusesConfigurationsWhoseArithmeticWouldOverflow) {
  auto c = config();
  c.limits.max_batch = INT32_MAX;
  c.num_workers = INT32_MAX;  // work capacity max_batch + num_workers
  expect_error([&] { Planner p(c); }, "limits");
  c = config();
  c.limits.max_local_kv_len = INT64_MAX - 3;  // table stride ceil(len / page)
  expect_error([&] { Planner p(c); }, "'limits.max_local_kv_len' = 9223372036854775804");
  c = config();
  c.dims = LatentDims{512, INT32_MAX - 3};  // D = R + P
  expect_error([&] { Planner p(c); }, "'rope_dim' = 2147483644");
  c = config();
  c.block_size = 3;  // page 1: three sub-pages per block: block ids past INT32_MAX / 3 would overflow
  c.limits = PlanLimits{1, 1, 16};
  Planner small(c);
  Plan plan = small.make_plan();
  const std::vector<int32_t> lens{2}, table{INT32_MAX / 3 + 1};
  expect_error([&] { small.plan(BatchDesc{lens, 1, table, 1, Mode::draft}, plan); }, "'block_tables[0][0]' = 715827883");
  c = config();
  c.block_size = kMaxBlockSize * 2;
  expect_error([&] { Planner p(c); }, "'block_size' = 131072");
}

TEST(Plan, SubpageIdsAtTheInt32Edge) {
  auto c = config();
  c.block_size = 3;
  const int64_t num_blocks = INT32_MAX / 3;  // the largest cache whose sub-page ids fit int32
  c.limits = PlanLimits{1, 1, 16};
  Planner planner(c);
  Plan plan = planner.make_plan();
  const std::vector<int32_t> lens{6}, table{int32_t(num_blocks - 1), 7};
  planner.plan(BatchDesc{lens, 1, table, 2, Mode::draft}, plan);
  EXPECT_EQ(plan.stats().max_block, num_blocks - 1);
  const PlanView v = plan.view();
  const int64_t last = (num_blocks - 1) * 3;
  for (int k = 0; k < 3; ++k) EXPECT_EQ(v.subpage_table[k], last + k);
  EXPECT_EQ(v.subpage_table[3], 21);
  EXPECT_EQ(v.subpage_table[2], INT32_MAX - 2);  // the largest id: num_blocks x 3 - 1
}

TEST(Plan, RefusesBadBatches) {
  Planner planner(config());
  Plan plan = planner.make_plan();
  expect_error([&] { planner.plan(batch_of({-1}, 1).desc(), plan); }, "'seq_lens[0]' = -1");
  expect_error([&] { planner.plan(batch_of({5, 2}, 3).desc(), plan); }, "'seq_lens[1]' = 2");
  expect_error([&] { planner.plan(batch_of({5}, 0).desc(), plan); }, "'qlen' = 0");
  expect_error([&] { planner.plan(batch_of({5}, 5).desc(), plan); }, "'qlen' = 5");
  expect_error([&] { planner.plan(batch_of(std::vector<int32_t>(9, 5), 1).desc(), plan); }, "'batch' = 9");
  expect_error([&] { planner.plan(batch_of({70000}, 1).desc(), plan); }, "max_local_kv_len");
  auto b = batch_of({200}, 1, 64, 3);  // needs 4 entries
  expect_error([&] { planner.plan(b.desc(), plan); }, "'table_width' = 3");
  b = batch_of({200}, 1, 64, 4);
  b.tables[2] = -5;
  expect_error([&] { planner.plan(b.desc(), plan); }, "'block_tables[0][2]' = -5");
  b = batch_of({200}, 1, 64, 4);
  b.tables.pop_back();
  expect_error([&] { planner.plan(b.desc(), plan); }, "block_tables");
  Planner other([] { auto c = config(); c.limits.max_batch = 3; return c; }());
  Plan foreign = other.make_plan();
  expect_error([&] { planner.plan(batch_of({5}, 1).desc(), foreign); }, "plan");
}

}  // namespace dcpmla
