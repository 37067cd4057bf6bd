#include "dcpmla/plan.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <functional>
#include <numeric>
#include <random>

#include "dcpmla/error.h"
#include "../common/schedule_check.h"
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

// An engine's persistent block table is wider than the step's: a [:B, :W] slice of it is read
// in place at its row pitch (table_stride) and plans exactly as its packed copy; a stride below
// the width or a span that is not the rows' own is refused by name.
TEST(Plan, StridedTableRowsPlanAsTheirPackedCopy) {
  auto c = config();
  c.layout = Layout{2, 1, 2};
  Planner planner(c);
  const std::vector<int32_t> lens{300, 0, 129, 64};
  const int B = 4, width = 3, pitch = 11;
  // The wide table: each request's three entries, then columns of other values (never read).
  std::vector<int32_t> wide(size_t((B - 1) * pitch + width), -7);
  std::vector<int32_t> packed(size_t(B * width));
  for (int b = 0; b < B; ++b)
    for (int j = 0; j < width; ++j) packed[size_t(b * width + j)] = wide[size_t(b * pitch + j)] = 100 * b + 17 * j;
  Plan from_packed = planner.make_plan(), from_wide = planner.make_plan();
  planner.plan(BatchDesc{lens, 2, packed, width, Mode::verify}, from_packed);
  planner.plan(BatchDesc{lens, 2, wide, width, Mode::verify, {}, pitch}, from_wide);
  ASSERT_EQ(from_packed.used_ints(), from_wide.used_ints());
  EXPECT_TRUE(std::equal(from_packed.arena().begin(), from_packed.arena().begin() + ptrdiff_t(from_packed.used_ints()),
                         from_wide.arena().begin()));
  EXPECT_EQ(from_wide.view().subpage_table[0], 0);  // request 0's first block, not a gap's -7
  // A stride below the width, and spans one int short or long, are refused.
  expect_error([&] { planner.plan(BatchDesc{lens, 2, wide, width, Mode::verify, {}, width - 1}, from_wide); },
               "'table_stride' = 2: expected 0 (packed rows) or >= table_width (3)");
  const std::span<const int32_t> all(wide);
  expect_error([&] { planner.plan(BatchDesc{lens, 2, all.first(all.size() - 1), width, Mode::verify, {}, pitch}, from_wide); },
               "'block_tables' = 35 entries: expected (batch (4) - 1) x table_stride (11) + table_width (3)");
  std::vector<int32_t> longer(wide);
  longer.push_back(0);
  expect_error([&] { planner.plan(BatchDesc{lens, 2, longer, width, Mode::verify, {}, pitch}, from_wide); },
               "'block_tables' = 37 entries");
  // A stride so large that (B - 1) x stride overflows int64 matches no span.
  expect_error([&] { planner.plan(BatchDesc{lens, 2, wide, width, Mode::verify, {}, INT64_MAX / 2}, from_wide); },
               "'block_tables' = 36 entries");
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

// Pieces (tok_begin, tok_end, chunk) of request b, in order.
std::vector<std::array<int, 3>> pieces_of(const Plan& plan, int b) {
  const PlanView v = plan.view();
  std::vector<std::array<int, 3>> out;
  for (int k = 0; k < v.header->chunks; ++k)
    for (int w = v.chunk_work[k]; w < v.chunk_work[k + 1]; ++w)
      if (v.work[w].request == b) out.push_back({v.work[w].tok_begin, v.work[w].tok_end, k});
  return out;
}

// Each chunk's cost (tiles plus the per-piece cost, and the cut cost of a partial).
std::vector<double> chunk_costs(const Planner& planner, const Plan& plan) {
  const PlanView v = plan.view();
  const ScheduleCost& cost = planner.config().cost;
  std::vector<double> out;
  for (int k = 0; k < v.header->chunks; ++k) {
    double chunk = 0;
    for (int w = v.chunk_work[k]; w < v.chunk_work[k + 1]; ++w) {
      const int tiles = (v.work[w].tok_end - v.work[w].tok_begin + kCutTokens - 1) / kCutTokens;
      if (tiles > 0) chunk += tiles + cost.piece + (v.work[w].slot >= 0 ? cost.cut : 0.0);
    }
    out.push_back(chunk);
  }
  return out;
}

double heaviest(const Planner& planner, const Plan& plan) {
  const std::vector<double> c = chunk_costs(planner, plan);
  return *std::max_element(c.begin(), c.end());
}

// The largest chunk's cost over the even share of the total.
double imbalance(const Planner& planner, const Plan& plan) {
  const std::vector<double> c = chunk_costs(planner, plan);
  return *std::max_element(c.begin(), c.end()) / (std::accumulate(c.begin(), c.end(), 0.0) / double(c.size()));
}

#define EXPECT_SCHEDULE_OK(planner, plan) EXPECT_EQ(testing::schedule_error((planner).config(), (plan)), "")

TEST(Plan, AutoCutsLongWindowsOfSmallBatches) {
  Planner planner(config());
  Plan plan = planner.make_plan();
  planner.plan(batch_of({40000, 1000}, 1).desc(), plan);
  EXPECT_SCHEDULE_OK(planner, plan);
  EXPECT_EQ(plan.route(), Route::split_k);
  EXPECT_EQ(plan.header().chunks, 132) << "16 rows: one row group, a chunk per worker";
  EXPECT_GT(plan.stats().max_segments, 100) << "the long request runs over most chunks";
  EXPECT_LT(imbalance(planner, plan), 1.15);
  planner.plan(batch_of({100, 200}, 1).desc(), plan);
  EXPECT_SCHEDULE_OK(planner, plan);
  EXPECT_EQ(plan.route(), Route::one_stage) << "short windows are not cut";
  // A step of fewer tiles than chunks: pieces shorter than min_segment_tokens (256), a tile
  // each, fill the chunks (at the floor only 32 of the 132 would work).
  planner.plan(batch_of({8192}, 1).desc(), plan);
  EXPECT_SCHEDULE_OK(planner, plan);
  EXPECT_EQ(plan.stats().max_segments, 128) << "one 64-token piece a chunk";
  planner.plan(batch_of({3000, 3000, 3000}, 1).desc(), plan);
  EXPECT_SCHEDULE_OK(planner, plan);
  EXPECT_GT(plan.header().work_count, 60) << "141 tiles over 132 chunks in pieces of one or two (of four: about 35)";
}

TEST(Plan, UniformBatchesAreNotCutForAFewPercent) {
  auto c = config();
  c.limits = PlanLimits{132, 4, 1 << 17};
  Planner planner(c);
  Plan plan = planner.make_plan();
  // A full uniform batch: one request per chunk is within the slack of the even share.
  planner.plan(batch_of(std::vector<int32_t>(128, 4096), 1, 64, 2100).desc(), plan);
  EXPECT_SCHEDULE_OK(planner, plan);
  EXPECT_EQ(plan.route(), Route::one_stage);
  for (int b = 0; b < 128; ++b) EXPECT_EQ(pieces_of(plan, b).size(), 1u);
  // More requests than chunks: whole requests would leave some chunks two, so the
  // schedule cuts to even them out.
  planner.plan(batch_of(std::vector<int32_t>(132, 4096 + 2048), 1, 64, 2100).desc(), plan);
  EXPECT_SCHEDULE_OK(planner, plan);
  EXPECT_LT(imbalance(planner, plan), 1.1);
}

TEST(Plan, RaggedAndLongBatchesAreBalanced) {
  auto c = config();
  c.limits = PlanLimits{132, 4, 1 << 17};
  Planner planner(c);
  Plan plan = planner.make_plan();
  // The ragged batch: one request holds most of the tokens.
  planner.plan(batch_of({4641, 45118, 1730, 1696}, 4, 64, 2100).desc(), plan);
  EXPECT_SCHEDULE_OK(planner, plan);
  EXPECT_EQ(plan.route(), Route::split_k);
  EXPECT_GE(plan.stats().max_segments, 60) << "the long request is cut finest";
  EXPECT_LT(imbalance(planner, plan), 1.5) << "pieces of min_segment_tokens bound the balance of tiny chunks";
  // Few long requests leave most chunks idle unless cut.
  planner.plan(batch_of(std::vector<int32_t>(32, 32768), 1, 64, 2100).desc(), plan);
  EXPECT_SCHEDULE_OK(planner, plan);
  EXPECT_EQ(plan.route(), Route::split_k);
  EXPECT_LT(imbalance(planner, plan), 1.05);
  // A serving-like mix of 64 requests, 512..16.5k tokens: chunks run across request edges.
  std::vector<int32_t> lens;
  std::mt19937 rng(7);
  for (int i = 0; i < 64; ++i) lens.push_back(512 + int(rng() % 16000));
  planner.plan(batch_of(lens, 2, 64, 2100).desc(), plan);
  EXPECT_SCHEDULE_OK(planner, plan);
  EXPECT_LT(imbalance(planner, plan), 1.1);
  int multi = 0;
  for (int k = 0; k < plan.header().chunks; ++k)
    multi += plan.view().work[plan.view().chunk_work[k]].request !=
             plan.view().work[plan.view().chunk_work[k + 1] - 1].request;
  EXPECT_GT(multi, 30) << "chunks hold the ends of one request and the start of the next";
}

// Plans `lens` at each qlen and expects a split schedule whose heaviest chunk is below `bound`
// times the mean.
void expect_balanced(const PlannerConfig& c, const std::vector<int32_t>& lens, std::initializer_list<int> qlens,
                     int width, double bound) {
  Planner planner(c);
  Plan plan = planner.make_plan();
  for (int qlen : qlens) {
    planner.plan(batch_of(lens, qlen, 64, width).desc(), plan);
    EXPECT_SCHEDULE_OK(planner, plan);
    EXPECT_EQ(plan.route(), Route::split_k);
    EXPECT_LT(imbalance(planner, plan), bound) << "qlen " << qlen;
  }
}

// The bench's uniform serving batch (serve_uniform_*: 64 requests of 512..16384 tokens). The
// shares once counted one piece per request, and the cuts' own pieces and cut costs piled up
// in the last chunk, which took every rest: 58 tiles against 52-54 on the others (1.09x the
// mean cost), and the kernels waited for that chunk.
TEST(Plan, TheLastChunkDoesNotCollectWhatTheSharesMissed) {
  auto c = config();
  c.limits = PlanLimits{64, 2, 1 << 17};
  expect_balanced(c,
                  {2637,  2677,  7674, 845,   6081,  14977, 7984, 1693, 9557,  10595, 1931, 9340, 13046,
                   4029,  7157,  4476, 5144,  13261, 8045,  4796, 5052, 12400, 7783,  5372, 5619, 2308,
                   2406,  1609,  11539, 10794, 13054, 6742, 8923, 6835,  3533,  9988, 14613, 6394, 1122,
                   5008,  14564, 4667, 8773,  821,   8554,  16367, 10173, 15279, 14358, 3084, 13142, 8358,
                   9254,  12080, 734,  7651,  3420,  1412,  3558, 706,  1854,  521,  2641,  4179},
                  {1, 2}, 300, 1.04);
}

// The bench's one-long-among-short serving batch (serve_one128k_*: a 131072-token request among
// 63 of 256..2048). Dealt into shares recomputed from what was left, the chunks closed early
// (a short request that did not fit their rest and was too short to cut) raised the last
// shares until the last chunks took 30-31 tiles whole against about 25 elsewhere (1.19x the
// mean cost; the H200 waited 12 us for those CTAs). Filling every chunk to the least cost
// that fits leaves no such pile.
TEST(Plan, OneLongRequestAmongShortOnesLeavesNoPileAtTheEnd) {
  auto c = config();
  c.rows_per_unit = 64;  // 16 heads x qlen 2: one row group, the 64-row kernel
  c.cost = calibrated_schedule_cost(64, KvDtype::bf16, 1);
  c.limits = PlanLimits{64, 2, 1 << 17};
  expect_balanced(c,
                  {131072, 1257, 607,  1314, 877,  1259, 903,  1577, 1013, 1519, 553,  457,  1316, 1274, 1893, 724,
                   292,    766,  1676, 2010, 1140, 938,  640,  312,  395,  1716, 713,  881,  909,  1425, 1232, 310,
                   1390,   703,  1070, 1403, 1850, 1589, 421,  1866, 1032, 1996, 1400, 1423, 1412, 963,  1301, 1934,
                   1350,   1660, 2028, 852,  1804, 431,  1890, 1071, 436,  988,  1157, 1080, 1030, 1973, 1867, 1635},
                  {2}, 2100, 1.05);
}

TEST(Plan, ChunksHoldManyShortRequestsAndOneRequestRunsOverManyChunks) {
  auto c = config();
  c.num_workers = 4;
  c.limits = PlanLimits{128, 4, 1 << 17};
  Planner few(c);
  Plan plan = few.make_plan();
  few.plan(batch_of(std::vector<int32_t>(100, 100), 1, 64, 1100).desc(), plan);
  EXPECT_SCHEDULE_OK(few, plan);
  EXPECT_EQ(plan.header().chunks, 4);
  for (int k = 0; k < 4; ++k) EXPECT_EQ(plan.view().chunk_work[k + 1] - plan.view().chunk_work[k], 25);
  Planner planner(config());
  Plan one = planner.make_plan();
  planner.plan(batch_of({65536}, 1, 64, 1100, Mode::draft).desc(), one);
  EXPECT_SCHEDULE_OK(planner, one);
  // 1024 tiles over 132 chunks: pieces of 8 tiles at most, so 128 of them (a ninth tile in
  // more chunks would not lighten the heaviest).
  EXPECT_EQ(one.stats().max_segments, 128);
  EXPECT_LT(imbalance(planner, one), 1.05 * 132 / 128);
}

TEST(Plan, RowGroupsShareTheChunks) {
  auto c = config();
  c.heads = 128;
  c.limits = PlanLimits{16, 8, 1 << 17};
  Planner planner(c);
  Plan plan = planner.make_plan();
  planner.plan(batch_of({60000, 60000}, 1).desc(), plan);  // 128 rows: two groups of 64
  EXPECT_EQ(plan.header().chunks, 66);
  planner.plan(batch_of({60000, 60000}, 4).desc(), plan);  // 512 rows: eight groups
  EXPECT_EQ(plan.header().chunks, 16);
  EXPECT_SCHEDULE_OK(planner, plan);
  EXPECT_EQ(row_groups_of(129, 64), 3);
  EXPECT_EQ(row_groups_of(0, 64), 1) << "a step of no rows still has its chunks";
  EXPECT_EQ(row_groups_of(64, 0), 1) << "a unit size the planner refuses";
  EXPECT_EQ(row_groups_of(int64_t(1) << 40, 1), INT32_MAX);
  // rows + rows_per_unit - 1 overflowed here: INT64_MAX rows in units of 2 gave 0 groups.
  EXPECT_EQ(row_groups_of(INT64_MAX, 2), INT32_MAX);
  EXPECT_EQ(row_groups_of(INT64_MAX, INT32_MAX), INT32_MAX);
}

// A small step at 128 heads (two row groups, 66 chunks, 3 tiles a piece; the H100's varlen
// sweep, bench/NOTES.md): whole, the 8-tile request bounds the step at 11, the 7-tile ones at
// 10. Cutting the 8 into 4 + 4 saves that one tile and costs the combine (24.5 us cut, 21.2
// whole), so the schedule keeps it whole; a cut that saves more than the combine still
// happens, and a forced split_k still cuts. verify128_q2 is kept whole too: 4 tiles more
// (260 against 256) and no combine of its 32 cut requests' 64 pieces (437.1 us cut, 427.5
// whole). The combine's cost grows with the cut pieces a chunk (combine_piece): 22 requests of
// 640 tokens on 66 chunks cut in 66 pieces save 5.5 tiles, more than the fixed 3 and exactly
// 3 + 2.5 per piece a chunk (a tie keeps the whole deal).
TEST(Plan, ACutMustSaveMoreThanTheCombineCosts) {
  auto c = config();
  c.heads = 128;
  c.rows_per_unit = 64;
  c.cost = calibrated_schedule_cost(64, KvDtype::bf16, 2);
  c.limits = PlanLimits{32, 4, 1 << 17};
  const std::vector<int32_t> small{402, 289, 443, 383, 480, 422, 363, 260, 412, 368, 358, 267};
  auto cuts = [&](const PlannerConfig& cfg, const std::vector<int32_t>& lens) {
    Planner planner(cfg);
    Plan plan = planner.make_plan();
    planner.plan(batch_of(lens, 1).desc(), plan);
    EXPECT_SCHEDULE_OK(planner, plan);
    EXPECT_EQ(plan.header().chunks, 66);
    return plan.header().split_requests;
  };
  EXPECT_EQ(cuts(c, small), 0) << "one tile saved does not pay for the combine";
  auto free_combine = c;
  free_combine.cost.combine = free_combine.cost.combine_piece = 0.0;
  EXPECT_EQ(cuts(free_combine, small), 1) << "without its cost the 480-token request is cut";
  auto tight = c;
  tight.cost.combine = 0.5;
  tight.cost.combine_piece = 0.0;
  EXPECT_EQ(cuts(tight, small), 1) << "a tile saved beats a combine of half a tile";
  tight.cost.combine_piece = 2.5;
  EXPECT_EQ(cuts(tight, small), 1) << "two pieces on 66 chunks add a tenth of a tile";
  auto forced = c;
  forced.route = Route::split_k;
  EXPECT_EQ(cuts(forced, small), 1) << "a forced split_k cuts whatever the combine costs";
  // Cuts that save more than the combine: 12 x 512 in pieces of 2 tiles (5.5 a chunk against
  // 11 whole), 1 x 8192 and a 4712-token request among short ones over many chunks.
  EXPECT_EQ(cuts(c, std::vector<int32_t>(12, 512)), 12);
  EXPECT_EQ(cuts(c, {8192}), 1);
  EXPECT_EQ(cuts(c, {444, 369, 4712}), 1);
  // Many cut pieces a chunk: 22 x 640 whole is 13 tiles a chunk (one request each), cut 7.5
  // (66 pieces of 3-4 tiles, one a chunk); only the per-piece cost keeps it whole.
  const std::vector<int32_t> many(22, 640);
  EXPECT_EQ(cuts(c, many), 0) << "5.5 tiles saved, 3 + 2.5 x 1 piece a chunk to pay: a tie";
  auto fixed_only = c;
  fixed_only.cost.combine_piece = 0.0;
  EXPECT_EQ(cuts(fixed_only, many), 22) << "without the per-piece cost the 5.5 tiles pay for 3";
  fixed_only.cost.combine_piece = 2.0;
  EXPECT_EQ(cuts(fixed_only, many), 22) << "3 + 2 x 1 is less than the 5.5 tiles saved";

  // The whole deal is the least one, not any that fits within the combine: 8, 4, 4 and 1
  // tiles on 4 chunks (piece 1) are 9, 5, 5 and 2 whole; the cut deal's heaviest is 7, and a
  // whole deal at 7 + 4 would put both 4-tile requests in one chunk (10).
  auto four = config();
  four.num_workers = 4;
  {
    Planner planner(four);
    Plan plan = planner.make_plan();
    planner.plan(batch_of({512, 256, 256, 64}, 1).desc(), plan);
    EXPECT_SCHEDULE_OK(planner, plan);
    EXPECT_EQ(plan.header().split_requests, 0);
    EXPECT_EQ(heaviest(planner, plan), 9.0);
    four.cost.combine = four.cost.combine_piece = 0.0;
    Planner cutting(four);
    cutting.plan(batch_of({512, 256, 256, 64}, 1).desc(), plan);
    EXPECT_EQ(plan.header().split_requests, 1);
    EXPECT_EQ(heaviest(cutting, plan), 7.0);
  }

  auto verify = c;
  verify.cost = calibrated_schedule_cost(64, KvDtype::bf16, 4);
  verify.limits = PlanLimits{64, 2, 1 << 13};
  auto verify_cuts = [&](const PlannerConfig& cfg) {
    Planner planner(cfg);
    Plan plan = planner.make_plan();
    planner.plan(batch_of(std::vector<int32_t>(64, 8192), 2, 64, 128).desc(), plan);
    EXPECT_SCHEDULE_OK(planner, plan);
    EXPECT_EQ(plan.header().chunks, 33) << "256 rows: four row groups";
    return plan.header().split_requests;
  };
  EXPECT_EQ(verify_cuts(verify), 0) << "verify128_q2: 260 tiles whole against 256 cut";
  verify.cost.combine = 3.5;
  verify.cost.combine_piece = 0.0;
  EXPECT_EQ(verify_cuts(verify), 32) << "a combine of less than the 4 tiles the cuts save";
  verify.cost.combine = 0.0;
  verify.cost.combine_piece = 2.5;
  EXPECT_EQ(verify_cuts(verify), 0) << "64 pieces on 33 chunks: 4.8 tiles of partials";
  verify.cost.combine_piece = 2.0;
  EXPECT_EQ(verify_cuts(verify), 32) << "64 pieces on 33 chunks at 2 tiles each: 3.9";
}

TEST(Plan, PaddingNeverMovesACut) {
  Planner planner(config());
  Plan a = planner.make_plan(), b = planner.make_plan();
  planner.plan(batch_of({30000, 20000}, 1).desc(), a);
  planner.plan(batch_of({30000, 0, 20000, 0, 0, 0, 0, 0}, 1).desc(), b);
  EXPECT_SCHEDULE_OK(planner, a);
  EXPECT_SCHEDULE_OK(planner, b);
  EXPECT_EQ(a.route(), Route::split_k);
  EXPECT_EQ(b.route(), Route::split_k);
  EXPECT_EQ(a.stats().active_requests, b.stats().active_requests);
  EXPECT_EQ(a.stats().min_local_len, b.stats().min_local_len) << "padding counted as a length";
  EXPECT_EQ(pieces_of(a, 0), pieces_of(b, 0)) << "padding moved a cut";
  EXPECT_EQ(pieces_of(a, 1), pieces_of(b, 2)) << "padding moved a cut";
  for (int p : {1, 3, 7}) {
    const auto pieces = pieces_of(b, p);
    ASSERT_EQ(pieces.size(), 1u) << "a padding request's rows need their zeros";
    EXPECT_EQ(pieces[0][0], 0);
    EXPECT_EQ(pieces[0][1], 0);
  }
}

TEST(Plan, PerRequestQueryLengths) {
  auto c = config();
  c.layout = Layout{2, 1, 1};
  Planner planner(c);
  Plan plan = planner.make_plan();
  auto b = batch_of({10, 7, 0, 5}, 3);
  const std::vector<int32_t> qlens{3, 0, 2, 1};
  BatchDesc d = b.desc();
  d.qlens = qlens;
  planner.plan(d, plan);
  EXPECT_SCHEDULE_OK(planner, plan);
  EXPECT_EQ(plan.header().rows, 6);
  EXPECT_EQ(plan.header().widest_qlen, 3);
  EXPECT_EQ(plan.qlen_of(0), 3);
  EXPECT_EQ(plan.qlen_of(1), 0);
  EXPECT_EQ(plan.qlen_of(2), 2);
  // Request 3: L = 5, one row: window [0, 5), rank 1 of 2 holds positions 1 and 3.
  EXPECT_EQ(plan.row_local_len(3, 0), 2);
  // Request 0: rows see 8, 9, 10 tokens: rank 1 holds 4, 4, 5.
  EXPECT_EQ(plan.row_local_len(0, 0), 4);
  EXPECT_EQ(plan.row_local_len(0, 2), 5);
  EXPECT_TRUE(pieces_of(plan, 1).empty()) << "a request without rows has nothing to compute";
  EXPECT_EQ(pieces_of(plan, 2).size(), 1u) << "a padding request's rows get zeros";

  d.qlens = std::span<const int32_t>(qlens.data(), 3);
  expect_error([&] { planner.plan(d, plan); }, "'qlens' = 3 entries");
  const std::vector<int32_t> over{3, 4, 0, 1}, negative{3, -1, 0, 1}, too_long{3, 0, 0, 6};
  d.qlens = over;
  expect_error([&] { planner.plan(d, plan); }, "'qlens[1]' = 4: expected in [0, qlen (3)]");
  d.qlens = negative;
  expect_error([&] { planner.plan(d, plan); }, "'qlens[1]' = -1");
  d.qlens = too_long;  // L = 5 < 6 rows
  expect_error([&] { planner.plan(d, plan); }, "qlens[3]");
  const std::vector<int32_t> uneven{3, 2, 0, 1};
  d.qlens = uneven;
  Planner two(config(Route::two_stage));
  Plan tp = two.make_plan();
  expect_error([&] { two.plan(d, tp); }, "'qlens[1]' = 2: expected qlen (3) under route two_stage");
}

TEST(Plan, EverySchedulesInvariantsOnRandomBatches) {
  std::mt19937_64 rng(11);
  for (int trial = 0; trial < 400; ++trial) {
    auto c = config(std::array{Route::automatic, Route::one_stage, Route::split_k}[trial % 3]);
    c.num_workers = 1 + int(rng() % 140);
    c.heads = 1 + int(rng() % 128);
    c.rows_per_unit = std::array{16, 32, 64}[rng() % 3];
    c.min_segment_tokens = 1 + int(rng() % 600);
    c.block_size = std::array{1, 16, 64, 256}[rng() % 4];
    c.layout = Layout{1 + int(rng() % 8), 0, 1};
    c.layout.rank = int(rng() % uint64_t(c.layout.world_size));
    c.limits = PlanLimits{16, 4, 1 << 17};
    // No combine cost (the cut deal), the default, one that keeps whatever fits whole, and the
    // per-piece part alone.
    c.cost.combine = std::array{0.0, 3.0, 1e3, 0.0}[(trial / 3) % 4];
    c.cost.combine_piece = std::array{0.0, 2.5, 0.0, 40.0}[(trial / 3) % 4];
    Planner planner(c);
    Plan plan = planner.make_plan();
    const int n = 1 + int(rng() % 16), qlen = 1 + int(rng() % 4);
    const bool per_request = trial % 2;
    std::vector<int32_t> lens, qlens;
    for (int i = 0; i < n; ++i) {  // one draw per statement: the order is the same for every compiler
      const int q = int(rng() % uint64_t(qlen + 1));
      qlens.push_back(q);
      const bool padding = rng() % 5 == 0;
      const uint64_t range = rng() % 3 == 0 ? 100000 : 3000;
      const int32_t len = int32_t(rng() % range);
      lens.push_back(padding ? 0 : std::max<int32_t>(per_request ? q : qlen, len));
    }
    const int32_t longest = *std::max_element(lens.begin(), lens.end());
    auto b = batch_of(lens, qlen, c.block_size, std::max(1, (longest + c.block_size - 1) / c.block_size));
    BatchDesc d = b.desc();
    if (per_request) d.qlens = qlens;
    planner.plan(d, plan);
    ASSERT_EQ(testing::schedule_error(c, plan), "") << "trial " << trial;
  }
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
  c.heads = 4096;
  EXPECT_NO_THROW(Planner p(c));
  c.heads = 4097;
  expect_error([&] { Planner p(c); }, "'heads' = 4097: expected in [1, 4096] on the cuda backend");
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
  expect_error([&] { Planner p(c); }, "'heads' = 0: expected in [1, 4096]");
  c = config();
  c.limits.max_qlen = 0;
  expect_error([&] { Planner p(c); }, "'limits.max_qlen' = 0");
  c.limits.max_qlen = kMaxQlen + 1;
  expect_error([&] { Planner p(c); }, "'limits.max_qlen' = 4097");
  // A plan arena past its bound (each limit within its own): 2^20 requests of 2^30 tokens.
  c = config();
  c.limits.max_batch = 1 << 20;
  c.limits.max_local_kv_len = kMaxLocalKvLen;
  expect_error([&] { Planner p(c); }, "'limits' = 35184386769571 plan ints (arena and batch copy): expected < 1073741824");
}

// Each of these overflowed int arithmetic in the planner before it was refused: the first
// three were found by tests/fuzz/fuzz_planner (UBSan: signed overflow), the sub-page one by
// its oracle (sub-page ids are int32 in the plan).
TEST(Plan, RefusesConfigurationsWhoseArithmeticWouldOverflow) {
  auto c = config();
  c.limits.max_batch = INT32_MAX;
  c.num_workers = INT32_MAX;  // work capacity max_batch + num_workers
  expect_error([&] { Planner p(c); }, "'num_workers' = 2147483647");
  c.num_workers = 1 << 16;
  expect_error([&] { Planner p(c); }, "limits");
  c = config();
  c.limits.max_local_kv_len = INT64_MAX - 3;  // table stride ceil(len / page)
  expect_error([&] { Planner p(c); }, "'limits.max_local_kv_len' = 9223372036854775804");
  // The kernels count a request's tokens in int32 and step a tile past its end: at 2^31 - 63
  // local tokens (a table that repeats one block) that wrapped (a hang, or a wrong answer).
  c = config();
  c.limits.max_local_kv_len = INT32_MAX;
  expect_error([&] { Planner p(c); }, "'limits.max_local_kv_len' = 2147483647: expected in [1, 1073741824]");
  c.limits.max_local_kv_len = kMaxLocalKvLen;
  EXPECT_NO_THROW(Planner{c});
  c = config();
  c.dims = LatentDims{512, INT32_MAX - 3};  // D = R + P
  expect_error([&] { Planner p(c); }, "'kv_lora_rank + rope_dim' = 512 + 2147483644");
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

// On CUDA a bf16 cache's rows have int32 indices (the 64-row kernel's TMA box coordinates):
// a table naming a block whose rows reach 2^31 is refused by name (there the boxes would read
// zeros, not fault), the last block below is planned, and fp8 caches and the CPU keep the
// sub-page bound.
TEST(Plan, CudaBf16TablesStayBelowRow2To31) {
  const int32_t first_past = int32_t((int64_t(1) << 31) / 64);  // rows [2^31, 2^31 + 64)
  auto refusal = [&](Backend backend, KvDtype dtype, int32_t block) {
    auto c = config();
    c.backend = backend;
    c.kv_dtype = dtype;
    const Planner planner(c);
    Plan plan = planner.make_plan();
    const std::vector<int32_t> lens{100, 7}, table{3, block, 0, 0};
    return testing::error_of([&] { planner.plan(BatchDesc{lens, 1, table, 2, Mode::decode}, plan); });
  };
  const std::string refused = refusal(Backend::cuda, KvDtype::bf16, first_past);
  EXPECT_NE(refused.find(fmt::format("'block_tables[0][1]' = {}: expected a block id in [0, {})", first_past,
                                     first_past)),
            std::string::npos)
      << refused;
  EXPECT_EQ(refusal(Backend::cuda, KvDtype::bf16, first_past - 1), "");
  EXPECT_EQ(refusal(Backend::cuda, KvDtype::fp8_e4m3, first_past), "");
  EXPECT_EQ(refusal(Backend::cpu, KvDtype::bf16, first_past), "");
}

// Found by a hostile-input audit of the public API: each was a crash, undefined behaviour or a
// message that blamed the wrong field.
TEST(Plan, RefusesHostileCapacitiesCostsAndEnums) {
  // A schedule cost of 1e308 made the tile count an out-of-range double -> int64 cast.
  for (double bad : {1e308, 1e7, -1.0, double(NAN), double(INFINITY)}) {
    auto c = config();
    c.cost.piece = bad;
    expect_error([&] { Planner p(c); }, "'cost.piece' = ");
    c = config();
    c.cost.cut = bad;
    expect_error([&] { Planner p(c); }, "'cost.cut' = ");
    c = config();
    c.cost.slack = bad;
    expect_error([&] { Planner p(c); }, "'cost.slack' = ");
    c = config();
    c.cost.combine = bad;
    expect_error([&] { Planner p(c); }, "'cost.combine' = ");
    c = config();
    c.cost.combine_piece = bad;
    expect_error([&] { Planner p(c); }, "'cost.combine_piece' = ");
  }
  // An unknown backend blamed the heads ("in [1, 0] on the ? backend"), an unknown route
  // showed '?' for its value.
  auto c = config();
  c.backend = Backend(7);
  expect_error([&] { Planner p(c); }, "'backend' = 7: expected cpu (0) or cuda (1)");
  c = config();
  c.route = Route(9);
  expect_error([&] { Planner p(c); }, "'route' = 9: expected auto (0), one_stage (1), two_stage (2) or split_k (3)");
  // A hand-made Plan of negative capacities got a wrapped, 15-int arena.
  expect_error([] { Plan p(PlanLimits{-1, 1, 1}, 1, 1, 1); }, "'limits.max_batch' = -1");
  expect_error([] { Plan p(PlanLimits{1, 1, 1}, 0, 1, 1); }, "'table_capacity' = 0");
  expect_error([] { (void)Plan::ints(PlanLimits{1, 1, 1}, -1, 1, 1); }, "'table_capacity' = -1");
  expect_error([] { Plan p(PlanLimits{1 << 20, 1, 1}, 1 << 20, 1, 1); }, "'plan capacities' = ");
  // A plan's copy of the batch counts with its arena (the sixtieth session's audit): one request
  // of 3 x 2^28 one-token sub-pages is an arena of 0.8 G ints and a copy as large, 6 GiB that
  // an engine took at construction. Refused before anything is allocated.
  auto one_token_pages = config();
  one_token_pages.block_size = 1;
  one_token_pages.limits = PlanLimits{1, 1, 3 << 28};
  expect_error([&] { Planner p(one_token_pages); }, "plan ints (arena and batch copy): expected < 1073741824");
  expect_error([] { Plan p(PlanLimits{1, 1, 1}, 3 << 28, 1, 1); }, "'plan capacities' = ");
  one_token_pages.limits = PlanLimits{1, 1, 3 << 26};  // a quarter: 1.5 GiB, within the bound
  const Planner fits(one_token_pages);  // the arena (work: a request and 132 chunks) and the copy
  EXPECT_EQ(fits.plan_host_bytes(),
            sizeof(int32_t) * (Plan::ints(one_token_pages.limits, 3 << 26, 1 + 132, 132) + 3 + 1 + (3 << 26)));
  // The capability query shifted by the enums' values (Mode(40): undefined behaviour); an
  // unknown dtype took the fp8 calibration.
  expect_error([] { (void)is_supported(Backend::cpu, Route::one_stage, Mode(40), KvDtype::bf16, 16); }, "'mode' = 40");
  expect_error([] { (void)is_supported(Backend::cpu, Route::one_stage, Mode::verify, KvDtype(-1), 16); },
               "'kv_dtype' = -1");
  expect_error([] { (void)is_supported(Backend(5), Route::one_stage, Mode::verify, KvDtype::bf16, 16); },
               "'backend' = 5");
  expect_error([] { (void)is_supported(Backend::cpu, Route(8), Mode::verify, KvDtype::bf16, 16); }, "'route' = 8");
  // require_heads named no range for an unknown backend ("expected in [1, 0] on the ? backend").
  expect_error([] { require_heads("heads", 0, Backend(7)); }, "'backend' = 7");
  EXPECT_TRUE(is_supported(Backend::cpu, Route::two_stage, Mode::verify, KvDtype::bf16, 16));
  EXPECT_FALSE(is_supported(Backend::cpu, Route::two_stage, Mode::decode, KvDtype::bf16, 16));
  expect_error([] { (void)calibrated_schedule_cost(64, KvDtype(9), 1); }, "'kv_dtype' = 9");
}

// Moving a plan left the source pointing into the arena the new owner frees (a use after
// free on the next plan()); the source now holds none and a planner refuses it.
TEST(Plan, MovedFromPlansAreRefusedAndInspectionIsChecked) {
  Planner planner(config());
  Plan a = planner.make_plan();
  planner.plan(batch_of({100, 7}, 2).desc(), a);
  {
    Plan b = std::move(a);
    EXPECT_EQ(b.header().batch, 2);
    EXPECT_EQ(b.qlen_of(1), 2);
  }
  expect_error([&] { planner.plan(batch_of({100, 7}, 2).desc(), a); }, "'plan' = a moved-from Plan");
  // Its accessors read no arena it no longer has (they dereferenced null: the ninth audit).
  const std::vector<std::function<void()>> reads{
      [&] { (void)a.header(); },       [&] { (void)a.route(); },         [&] { (void)a.view(); },
      [&] { (void)a.used_ints(); },    [&] { (void)a.work(); },          [&] { (void)a.qlen_of(0); },
      [&] { (void)a.row_local_len(0, 0); }};
  for (const auto& read : reads) expect_error(read, "'plan' = a moved-from Plan");
  EXPECT_TRUE(a.arena().empty());
  Plan c = planner.make_plan();
  planner.plan(batch_of({100, 7}, 2).desc(), c);
  expect_error([&] { (void)c.row_local_len(2, 0); }, "'b' = 2: expected a request of the plan, in [0, 2)");
  expect_error([&] { (void)c.row_local_len(1, 2); }, "'t' = 2: expected a query row of request 1, in [0, 2)");
  expect_error([&] { (void)c.qlen_of(-1); }, "'b' = -1");
  // A view over no copy, or over ints split across their alignment; storage likewise.
  expect_error([&] { (void)c.view_at(nullptr); }, "'base' = null");
  std::vector<int32_t> ints(c.used_ints() + 1);
  const auto* odd = reinterpret_cast<const int32_t*>(reinterpret_cast<uintptr_t>(ints.data()) + 2);
  expect_error([&] { (void)c.view_at(odd); }, "'base' = address");
  std::vector<int32_t> storage(planner.plan_ints() + 1);
  auto* odd_storage = reinterpret_cast<int32_t*>(reinterpret_cast<uintptr_t>(storage.data()) + 1);
  expect_error([&] { (void)planner.make_plan(odd_storage); }, "'storage' = address");
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

// Every table entry of a step is copied and bounded in one pass, vectorised (with AVX2 where
// the CPU has it): a bad id, or the largest, is found wherever it lies in the vector body or
// its tail, and the copy is the table.
TEST(Plan, BoundsAndCopiesEveryTableEntry) {
  auto c = config();
  c.block_size = 1;
  c.limits = PlanLimits{2, 1, 1024};
  const Planner planner(c);
  Plan plan = planner.make_plan();
  const int n = 301;  // entries a request: not a multiple of any vector width
  std::vector<int32_t> lens{n, n - 37}, table(2 * size_t(n));
  for (size_t i = 0; i < table.size(); ++i) table[i] = int32_t((i * 7919 + 13) % 100000);
  const int32_t read_max = *std::max_element(table.begin(), table.begin() + 2 * n - 37);  // the entries read
  for (int j = 0; j < n; ++j) {
    for (const int b : {0, 1}) {
      if (b == 1 && j >= n - 37) continue;  // past the second request's entries: never read
      const size_t at = size_t(b) * n + size_t(j);
      const std::string where = fmt::format("'block_tables[{}][{}]' = ", b, j);
      for (const int32_t bad : {-1, INT32_MIN, INT32_MAX}) {
        auto t = table;
        t[at] = bad;
        expect_error([&] { planner.plan(BatchDesc{lens, 1, t, n, Mode::decode}, plan); }, where + std::to_string(bad));
      }
      auto t = table;
      t[at] = 7654321;  // the largest id, at this position
      planner.plan(BatchDesc{lens, 1, t, n, Mode::decode}, plan);
      EXPECT_EQ(plan.stats().max_block, 7654321) << where;
      const PlanView v = plan.view();
      for (int k = 0; k < lens[size_t(b)]; ++k)
        ASSERT_EQ(v.subpage_table[int64_t(b) * v.header->table_stride + k], t[size_t(b) * n + size_t(k)]) << k;
    }
  }
  planner.plan(BatchDesc{lens, 1, table, n, Mode::decode}, plan);
  EXPECT_EQ(plan.stats().max_block, read_max);
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
  expect_error([&] { planner.plan(batch_of({5}, 1).desc(), foreign); }, "'plan' = a plan of other capacities");
}

}  // namespace dcpmla
