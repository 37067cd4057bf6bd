// The engine path (SPEC §6) on the CPU backend, as a serving engine drives it: per rank one
// Attention and an engine-owned cache per layer; per step one plan, then per layer write_kv of
// the step's new tokens and run, the partials merged across ranks with combine_partials.
// Every layer of every step must give its own float64 reference and mla_attention's answer;
// bad input must be refused before anything runs.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "dcpmla/engine.h"
#include "dcpmla/error.h"
#include "dcpmla/merge.h"
#include "dcpmla/reference.h"
#include "dcpmla/runner.h"
#include "../common/case_options.h"
#include "test_helpers.h"

namespace dcpmla {
namespace {

constexpr int kHeads = 8, kDim = 576, kRankDim = 512, kLayers = 3;
constexpr int kMinSegment = 16;  // several split_k segments even on short rows
const double kSoftmaxScale = 1.0 / std::sqrt(double(kDim));

struct Case {
  Mode mode;
  int world, interleave, block_size;
  KvDtype dtype;
  Route route;
  int index;
  float kv_scale() const { return dtype == KvDtype::bf16 ? 1.0f : 0.05f; }
};

std::string name(const Case& c) {
  return fmt::format("{}_{}_N{}_I{}_bs{}_{}_{}", c.index, to_string(c.mode), c.world, c.interleave, c.block_size,
                     to_string(c.dtype), to_string(c.route));
}

void PrintTo(const Case& c, std::ostream* os) { *os << name(c); }

// Every value of every axis meets every mode: axis j of case k cycles at its own rate.
std::vector<Case> covering_cases() {
  const Mode modes[] = {Mode::decode, Mode::verify, Mode::draft};
  const int worlds[] = {1, 2, 3, 4, 8}, block_sizes[] = {1, 16, 64, 256};
  const KvDtype dtypes[] = {KvDtype::bf16, KvDtype::fp8_e4m3, KvDtype::fp8_e5m2};
  const Route verify_routes[] = {Route::two_stage, Route::automatic, Route::one_stage, Route::split_k};
  const Route other_routes[] = {Route::automatic, Route::one_stage, Route::split_k};
  std::vector<Case> cases;
  for (int m = 0; m < 3; ++m)
    for (int j = 0; j < 6; ++j) {
      Case c{};
      c.mode = modes[m];
      c.world = worlds[(j + m) % 5];
      c.interleave = 1 + (j + m) % 2;
      c.block_size = block_sizes[(j / 2 + m) % 4];
      if (c.block_size % c.interleave) c.block_size = 16;
      c.dtype = dtypes[(j + m) % 3];
      c.route = c.mode == Mode::verify ? verify_routes[j % 4] : other_routes[j % 3];
      // A forced split must cut some row into several tiles: keep the pages short.
      if (c.route == Route::split_k && c.block_size > 16) c.block_size = 16;
      c.index = int(cases.size());
      cases.push_back(c);
    }
  return cases;
}

// The requests of two consecutive steps, sharing one set of block tables (a random
// permutation of the blocks; unused entries name a spare block that stays NaN).
struct Sequence {
  int batch = 0, qlen[2] = {1, 1};
  std::vector<int32_t> lens[2];       // per step: L_b incl. the query block, 0 = padding
  std::vector<int32_t> first_new[2];  // per step: the first position request b writes
  std::vector<int32_t> tables;
  int width = 0;
  int64_t num_blocks = 0, max_len = 0, longest_local = 1;
};

// Step 1: a padding request, a short one (at most (N - 1) x I tokens where the mode allows it:
// the last rank holds nothing of it; verify and decode need L >= qlen), one of exactly qlen and
// a long one. Step 2 (other qlen): the padding request arrives with
// exactly qlen tokens, the short and long ones grow by qlen, the qlen one finishes (padding).
Sequence make_sequence(const Case& c, std::mt19937_64& rng) {
  Sequence s;
  s.qlen[0] = c.mode == Mode::decode ? 1 : 1 + int(rng() % 4);
  s.qlen[1] = c.mode == Mode::decode ? 1 : s.qlen[0] % 4 + 1;
  const int q0 = s.qlen[0], q1 = s.qlen[1];
  const int shorter = testing::short_length(c, q0, rng);
  // A forced split needs a row of several 64-token tiles on some rank to cut.
  const int longer = q0 + 24 * c.world + int(rng() % 64) + (c.route == Route::split_k ? 150 * c.world : 0);
  s.lens[0] = {0, shorter, q0, longer};
  s.first_new[0] = {0, 0, 0, 0};
  s.lens[1] = {q1, shorter + q1, 0, longer + q1};
  s.first_new[1] = {0, shorter, 0, longer};
  s.batch = 4;

  const Layout group{c.world, 0, c.interleave};
  std::vector<int64_t> needed(size_t(s.batch));
  for (int b = 0; b < s.batch; ++b) {
    const int64_t len = std::max(s.lens[0][size_t(b)], s.lens[1][size_t(b)]);
    const int64_t largest = group.local_length_of(len, 0);  // rank 0 holds the largest share
    needed[size_t(b)] = (largest + c.block_size - 1) / c.block_size;
    s.width = std::max(s.width, int(needed[size_t(b)]));
    s.max_len = std::max(s.max_len, len);
    s.longest_local = std::max(s.longest_local, largest);
  }
  const int64_t total = std::accumulate(needed.begin(), needed.end(), int64_t(0));
  s.num_blocks = total + 1;
  std::vector<int32_t> ids(static_cast<size_t>(total));
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  s.tables.assign(size_t(s.batch * s.width), int32_t(s.num_blocks - 1));
  for (int b = 0, next = 0; b < s.batch; ++b)
    for (int64_t j = 0; j < needed[size_t(b)]; ++j) s.tables[size_t(b * s.width + j)] = ids[size_t(next++)];
  return s;
}

std::vector<bf16> to_bf16(const std::vector<float>& x) {
  std::vector<bf16> y(x.size());
  std::transform(x.begin(), x.end(), y.begin(), float_to_bf16);
  return y;
}

std::vector<float> to_float(const std::vector<bf16>& x) {
  std::vector<float> y(x.size());
  std::transform(x.begin(), x.end(), y.begin(), bf16_to_float);
  return y;
}

// One rank of the engine: its Attention and its caches, one per layer (the engine's memory).
struct Rank {
  Attention attention;
  std::vector<PagedCache> caches;
};

AttentionConfig rank_config(const Case& c, const Sequence& s, int rank) {
  AttentionConfig a;
  a.heads = kHeads;
  a.kv_dtype = c.dtype;
  a.block_size = c.block_size;
  a.layout = Layout{c.world, rank, c.interleave};
  a.limits = PlanLimits{s.batch, std::max(s.qlen[0], s.qlen[1]), s.longest_local};
  a.route = c.route;
  a.min_segment_tokens = kMinSegment;
  return a;
}

// The conformance entry point's options for the same case (its own block tables: `seed`).
AttentionOptions conformance_options(const Case& c, float scale, uint64_t seed) {
  AttentionOptions o = testing::case_options(c, scale, seed);
  o.min_segment_tokens = kMinSegment;
  return o;
}

class Engine : public ::testing::TestWithParam<Case> {};

TEST_P(Engine, EveryLayerMatchesItsReferenceAndMlaAttention) {
  const Case c = GetParam();
  std::mt19937_64 rng(2000 + uint64_t(c.index));
  const Sequence s = make_sequence(c, rng);
  const int B = s.batch, N = c.world;
  const float scale = c.kv_scale();

  // Each layer's global latents [B, max_len, D], drawn afresh per layer.
  std::vector<std::vector<float>> kv(kLayers);
  for (auto& x : kv) x = testing::random_normal(size_t(B) * size_t(s.max_len) * kDim, rng());

  std::vector<Rank> ranks;
  for (int r = 0; r < N; ++r) {
    Rank rank{Attention(rank_config(c, s, r)), {}};
    for (int l = 0; l < kLayers; ++l) {
      rank.caches.emplace_back(CacheConfig{s.num_blocks, c.block_size, kDim, c.dtype, scale});
      rank.caches.back().poison();
    }
    ranks.push_back(std::move(rank));
  }

  for (int step = 0; step < 2; ++step) {
    const int qlen = s.qlen[step];
    const auto& lens = s.lens[step];
    const int64_t rows = int64_t(B) * qlen, cells = rows * kHeads;
    const BatchDesc batch{lens, qlen, s.tables, s.width, c.mode};
    for (auto& r : ranks) r.attention.plan(batch);  // once per step, for every layer
    const Route route = ranks[0].attention.current_plan().route();
    if (c.route != Route::automatic) ASSERT_EQ(route, c.route);
    if (N > 1 && step == 0) {  // the edge the contract names: a rank that holds no token of a row
      bool empty = false;
      for (auto& r : ranks)
        for (int b = 0; b < B; ++b)
          for (int t = 0; t < qlen && lens[size_t(b)] > 0; ++t)
            empty |= r.attention.current_plan().row_local_len(b, t) == 0;
      ASSERT_TRUE(empty) << "every rank holds a token of every row";
    }
    if (c.route == Route::split_k && step == 0) {
      int segments = 0;
      for (auto& r : ranks) segments = std::max(segments, r.attention.current_plan().stats().max_segments);
      ASSERT_GT(segments, 1) << "split_k did not split";
    }

    // The step's new tokens and each rank's slots for them (the same for every layer).
    std::vector<int64_t> positions;
    std::vector<int32_t> requests;
    for (int b = 0; b < B; ++b)
      for (int64_t p = s.first_new[step][size_t(b)]; p < lens[size_t(b)]; ++p) {
        positions.push_back(p);
        requests.push_back(b);
      }
    std::vector<std::vector<int64_t>> slots;
    for (int r = 0; r < N; ++r)
      slots.push_back(slots_of(positions, requests, batch, c.block_size, s.num_blocks, Layout{N, r, c.interleave}));

    for (int l = 0; l < kLayers; ++l) {
      SCOPED_TRACE(fmt::format("step {} layer {} route {}", step, l, to_string(route)));
      const auto q = testing::random_normal(size_t(cells) * kDim, rng());
      const auto q16 = to_bf16(q);
      std::vector<bf16> latents;
      for (size_t n = 0; n < positions.size(); ++n) {
        const float* row = kv[size_t(l)].data() + (size_t(requests[n]) * size_t(s.max_len) + size_t(positions[n])) * kDim;
        for (int d = 0; d < kDim; ++d) latents.push_back(float_to_bf16(row[d]));
      }

      std::vector<bf16> parts(size_t(N * cells * kRankDim));
      std::vector<float> part_lse(size_t(N * cells));
      for (int r = 0; r < N; ++r) {
        auto& rank = ranks[size_t(r)];
        const KvCache cache = rank.caches[size_t(l)].view();
        write_kv(cache, latents.data(), slots[size_t(r)].data(), int64_t(positions.size()), scale);
        rank.attention.run(q16.data(), cache, KvScale{scale}, parts.data() + r * cells * kRankDim,
                           part_lse.data() + r * cells);
      }
      std::vector<bf16> out(size_t(cells * kRankDim));
      std::vector<float> lse(static_cast<size_t>(cells));
      combine_partials(parts.data(), part_lse.data(), N, out.data(), lse.data(), cells, kRankDim);

      if (route == Route::two_stage) {
        // run() gave stage A: the committed prefix [0, L - qlen) on every row.
        std::vector<int32_t> prefix(lens);
        for (auto& len : prefix) len = len == 0 ? 0 : len - qlen;
        const auto ref_a = reference_attention(q, kv[size_t(l)], prefix, B, qlen, kHeads, s.max_len, kDim, Mode::draft,
                                               c.dtype, scale, kSoftmaxScale, kRankDim);
        const auto err_a = compare(to_float(out), lse, ref_a.out, ref_a.lse, B, qlen, kHeads, kRankDim);
        EXPECT_TRUE(err_a.within(1e-2)) << "stage A: rel " << err_a.max_rel_l2 << " lse " << err_a.max_lse_err
                                        << " nan " << err_a.nan_count;
        // Stage B on every rank (all heads kept): the verify block's latents, then the local merge.
        std::vector<bf16> block(size_t(rows * kDim));
        for (int b = 0; b < B; ++b)
          for (int t = 0; t < qlen && lens[size_t(b)] > 0; ++t) {
            const float* src = kv[size_t(l)].data() + (size_t(b) * size_t(s.max_len) + size_t(lens[size_t(b)] - qlen + t)) * kDim;
            std::transform(src, src + kDim, block.begin() + (int64_t(b) * qlen + t) * kDim, float_to_bf16);
          }
        std::vector<bf16> out_b(out.size());
        std::vector<float> lse_b(lse.size());
        block_attention_cpu(BlockAttentionParams{q16.data(), block.data(), lens.data(), c.dtype, scale,
                                                 float(kSoftmaxScale), B, qlen, kHeads, 0, kHeads, kDim, kRankDim,
                                                 out_b.data(), lse_b.data()});
        merge_state(out.data(), lse.data(), out_b.data(), lse_b.data(), out.data(), lse.data(), cells, kRankDim);
      }

      const auto got = to_float(out);
      const auto ref = reference_attention(q, kv[size_t(l)], lens, B, qlen, kHeads, s.max_len, kDim, c.mode, c.dtype,
                                           scale, kSoftmaxScale, kRankDim);
      const auto err = compare(got, lse, ref.out, ref.lse, B, qlen, kHeads, kRankDim);
      EXPECT_TRUE(err.within(1e-2)) << name(c) << ": rel " << err.max_rel_l2 << " lse " << err.max_lse_err << " nan "
                                    << err.nan_count;
      for (int b = 0; b < B; ++b)
        if (lens[size_t(b)] == 0)
          for (int64_t i = int64_t(b) * qlen * kHeads; i < int64_t(b + 1) * qlen * kHeads; ++i)
            ASSERT_EQ(lse[size_t(i)], -INFINITY) << "padding request " << b;

      // The conformance entry point on the same arrays: the same plan and kernels, the same
      // bits. Once per step (it runs every rank again), on the layer written last.
      if (l != kLayers - 1) continue;
      const auto conf =
          mla_attention(q, kv[size_t(l)], lens, B, qlen, kHeads, s.max_len, kDim, conformance_options(c, scale, rng()));
      EXPECT_EQ(conf.routes[0], route);
      EXPECT_TRUE(std::equal(got.begin(), got.end(), conf.out.begin())) << "out differs from mla_attention's";
      EXPECT_TRUE(std::equal(lse.begin(), lse.end(), conf.lse.begin())) << "lse differs from mla_attention's";
    }
  }
}

// Per-request query lengths (BatchDesc::qlens): rows packed by request, each request's
// windows those of its own qlen, requests without rows, padding rows, ranks holding nothing.
TEST_P(Engine, EveryRequestsOwnQueryLength) {
  const Case c = GetParam();
  if (c.route == Route::two_stage) GTEST_SKIP() << "two_stage takes uniform query blocks";
  std::mt19937_64 rng(3000 + uint64_t(c.index));
  const Sequence s = make_sequence(c, rng);
  const int B = s.batch, N = c.world, qlen = s.qlen[0];
  const auto& lens = s.lens[0];
  std::vector<int32_t> qlens(static_cast<size_t>(B));
  for (int b = 0; b < B; ++b) qlens[size_t(b)] = int32_t(rng() % uint64_t(qlen + 1));
  qlens[size_t(B - 1)] = qlen == 1 ? 1 : qlen - 1;  // the long request has rows
  const int rows = std::accumulate(qlens.begin(), qlens.end(), 0);
  const int64_t cells = int64_t(rows) * kHeads;
  const float scale = c.kv_scale();
  const auto kv = testing::random_normal(size_t(B) * size_t(s.max_len) * kDim, rng());
  const auto q = testing::random_normal(size_t(cells) * kDim, rng());
  const auto q16 = to_bf16(q);
  BatchDesc batch{lens, qlen, s.tables, s.width, c.mode, qlens};

  std::vector<int64_t> positions;
  std::vector<int32_t> requests;
  for (int b = 0; b < B; ++b)
    for (int64_t p = 0; p < lens[size_t(b)]; ++p) {
      positions.push_back(p);
      requests.push_back(b);
    }
  std::vector<bf16> latents;
  for (size_t n = 0; n < positions.size(); ++n) {
    const float* row = kv.data() + (size_t(requests[n]) * size_t(s.max_len) + size_t(positions[n])) * kDim;
    for (int d = 0; d < kDim; ++d) latents.push_back(float_to_bf16(row[d]));
  }
  std::vector<bf16> parts(size_t(N * cells * kRankDim));
  std::vector<float> part_lse(size_t(N * cells));
  for (int r = 0; r < N; ++r) {
    Attention att(rank_config(c, s, r));
    PagedCache cache(CacheConfig{s.num_blocks, c.block_size, kDim, c.dtype, scale});
    cache.poison();
    const auto slots = slots_of(positions, requests, batch, c.block_size, s.num_blocks, Layout{N, r, c.interleave});
    write_kv(cache.view(), latents.data(), slots.data(), int64_t(positions.size()), scale);
    att.plan(batch);
    ASSERT_EQ(att.current_plan().header().rows, rows);
    att.run(q16.data(), cache.view(), KvScale{scale}, parts.data() + r * cells * kRankDim, part_lse.data() + r * cells);
  }
  std::vector<bf16> out(size_t(cells * kRankDim));
  std::vector<float> lse(static_cast<size_t>(cells));
  combine_partials(parts.data(), part_lse.data(), N, out.data(), lse.data(), cells, kRankDim);
  const auto ref = reference_attention(q, kv, lens, B, qlen, kHeads, s.max_len, kDim, c.mode, c.dtype, scale,
                                       kSoftmaxScale, kRankDim, qlens);
  const auto err = compare(to_float(out), lse, ref.out, ref.lse, rows, 1, kHeads, kRankDim);
  EXPECT_TRUE(err.within(1e-2)) << name(c) << " qlens " << fmt::format("{}", fmt::join(qlens, ",")) << ": rel "
                                << err.max_rel_l2 << " lse " << err.max_lse_err << " nan " << err.nan_count;

  // The conformance entry point with the same qlens: the same plans and kernels, the same bits.
  AttentionOptions o = conformance_options(c, scale, rng());
  o.qlens = qlens;
  const auto conf = mla_attention(q, kv, lens, B, qlen, kHeads, s.max_len, kDim, o);
  const auto got = to_float(out);
  EXPECT_TRUE(std::equal(got.begin(), got.end(), conf.out.begin(), conf.out.end())) << "out differs from mla_attention's";
  EXPECT_TRUE(std::equal(lse.begin(), lse.end(), conf.lse.begin(), conf.lse.end())) << "lse differs from mla_attention's";
}

INSTANTIATE_TEST_SUITE_P(Grid, Engine, ::testing::ValuesIn(covering_cases()),
                         [](const auto& info) { return name(info.param); });

// "field 'name' = value" as every refusal starts (dcpmla/error.h).
std::string field(std::string_view name, std::string_view value) { return fmt::format("'{}' = {}", name, value); }

#define EXPECT_REFUSED(call, needle)                                 \
  do {                                                               \
    const std::string message = testing::error_of([&] { call; });   \
    EXPECT_NE(message.find(needle), std::string::npos)               \
        << #call << ": expected an error naming " << (needle)        \
        << (message.empty() ? ", got none" : ", got: " + message);   \
  } while (0)

// A valid rank-0-of-2 engine (fp8_e4m3, block 16) and a batch that plans on it; each refusal
// spoils one input. Request 0 (40 tokens, 20 on rank 0) uses blocks 5 and 2, request 1 (3
// tokens, 2 on rank 0) block 7: the cache must hold blocks 0..7.
struct Refusals : ::testing::Test {
  AttentionConfig config = [] {
    AttentionConfig a;
    a.heads = 4;
    a.kv_dtype = KvDtype::fp8_e4m3;
    a.block_size = 16;
    a.layout = Layout{2, 0, 1};
    a.limits = PlanLimits{2, 4, 32};
    return a;
  }();
  std::vector<int32_t> lens{40, 3}, tables{5, 2, 7, 0};
  BatchDesc batch{lens, 2, tables, 2, Mode::verify};
  PagedCache cache{CacheConfig{8, 16, kDim, KvDtype::fp8_e4m3, 0.05f}};
  std::vector<bf16> q = to_bf16(testing::random_normal(2 * 2 * 4 * kDim, 5));
  std::vector<bf16> out = std::vector<bf16>(2 * 2 * 4 * kRankDim, float_to_bf16(7.0f));
  std::vector<float> lse = std::vector<float>(2 * 2 * 4, 7.0f);

  // The batch's history in the cache (random latents: a zero cache made every out 0 whatever
  // the plan, so a test comparing outputs could not see a wrong one), NaN everywhere else.
  Refusals() {
    cache.poison();
    std::vector<int64_t> positions;
    std::vector<int32_t> requests;
    for (int b = 0; b < 2; ++b)
      for (int p = 0; p < lens[size_t(b)]; ++p) {
        positions.push_back(p);
        requests.push_back(b);
      }
    const auto latents = to_bf16(testing::random_normal(positions.size() * kDim, 6));
    const auto slots =
        slots_of(positions, requests, batch, cache.config().block_size, cache.config().num_blocks, config.layout);
    write_kv(cache.view(), latents.data(), slots.data(), int64_t(positions.size()), 0.05f);
  }

  void run(Attention& att, const KvCache& kv, const KvScale& scale) {
    att.run(q.data(), kv, scale, out.data(), lse.data());
  }
  // What a fresh engine planned with `batch` writes: the answer a kept or restored plan must give,
  // and no NaN (no read past a length).
  bool matches_a_fresh_plan() {
    if (std::any_of(lse.begin(), lse.end(), [](float v) { return std::isnan(v); })) return false;
    const std::vector<bf16> got_out = out;
    const std::vector<float> got_lse = lse;
    Attention fresh(config);
    fresh.plan(batch);
    run(fresh, cache.view(), KvScale{0.05f});
    const bool same = std::equal(out.begin(), out.end(), got_out.begin(), [](bf16 x, bf16 y) { return x.bits == y.bits; }) &&
                      std::equal(lse.begin(), lse.end(), got_lse.begin(), [](float x, float y) {
                        return std::bit_cast<uint32_t>(x) == std::bit_cast<uint32_t>(y);
                      });
    out = got_out;
    lse = got_lse;
    return same;
  }
  // A refused run wrote nothing.
  bool untouched() const {
    return std::all_of(lse.begin(), lse.end(), [](float v) { return v == 7.0f; }) &&
           std::all_of(out.begin(), out.end(), [](bf16 v) { return bf16_to_float(v) == 7.0f; });
  }
};

TEST_F(Refusals, BadCacheBeforeAnythingRuns) {
  Attention att(config);
  EXPECT_REFUSED(run(att, cache.view(), KvScale{0.05f}), field("plan", "none"));
  att.plan(batch);
  KvCache kv = cache.view();
  kv.data = nullptr;
  EXPECT_REFUSED(run(att, kv, KvScale{0.05f}), field("kv_cache", "null"));
  // A bf16 value split across its 2 bytes (fp8 values are bytes: any address holds them).
  kv.data = cache.data() + 1;
  kv.dtype = KvDtype::bf16;
  EXPECT_REFUSED(run(att, kv, KvScale{0.05f}),
                 fmt::format("'kv_cache' = address {}: expected 2-byte aligned memory (whole bf16 values)", kv.data));
  kv = cache.view();
  kv.dtype = KvDtype::fp8_e5m2;
  EXPECT_REFUSED(run(att, kv, KvScale{0.05f}), field("kv_cache dtype", "fp8_e5m2"));
  kv = cache.view();
  kv.block_size = 32;
  kv.num_blocks = 4;
  EXPECT_REFUSED(run(att, kv, KvScale{0.05f}), field("kv_cache block_size", "32"));
  kv = cache.view();
  kv.num_blocks = 7;  // block 7 is named by request 1's table
  EXPECT_REFUSED(run(att, kv, KvScale{0.05f}), field("kv_cache num_blocks", "7"));
  EXPECT_TRUE(untouched());
  cache.poison();
  run(att, cache.view(), KvScale{0.05f});  // 8 blocks hold block 7: runs (NaN: nothing written)
  EXPECT_FALSE(untouched());
}

// A planner that never cuts takes no workspace: its parameters hold no partials, not offsets
// from a null pointer (undefined behaviour on every one_stage run, which clang's UBSan reports
// and GCC's does not: the audit of 2026-12-07).
TEST_F(Refusals, OneStageParamsHoldNoPartials) {
  AttentionConfig one = config;
  one.route = Route::one_stage;
  Attention att(one);
  att.plan(batch);
  const AttentionParams p = att.params(q.data(), cache.view(), KvScale{0.05f}, out.data(), lse.data());
  EXPECT_EQ(p.part_o, nullptr);
  EXPECT_EQ(p.part_m, nullptr);
  EXPECT_EQ(p.part_l, nullptr);
  EXPECT_NO_THROW(run(att, cache.view(), KvScale{0.05f}));
  EXPECT_FALSE(untouched());
}

// `n` values of T from `offset` values past a 16-byte boundary inside `storage` (which holds
// n + offset + 16 / sizeof(T) values).
template <class T>
T* past_16_bytes(std::vector<T>& storage, size_t offset) {
  const uintptr_t at = (reinterpret_cast<uintptr_t>(storage.data()) + 15) & ~uintptr_t(15);
  return reinterpret_cast<T*>(at) + offset;
}

// The CPU backend reads whole values, not the CUDA kernels' 16 bytes: q, out, lse and a bf16
// cache one value past a 16-byte boundary run and give the bits of aligned buffers. A value
// split across its own alignment is refused by name before anything is written, at the run,
// the write and the merge.
TEST(CpuAlignment, WholeValuesSuffice) {
  AttentionConfig config;
  config.heads = 4;
  config.block_size = 16;
  config.limits = PlanLimits{2, 2, 48};
  const std::vector<int32_t> lens{40, 3}, tables{2, 0, 1, 1, 0, 0};
  const BatchDesc batch{lens, 2, tables, 3, Mode::verify};
  constexpr size_t kCells = 2 * 2 * 4, kCacheValues = 3 * 16 * size_t(kDim);
  Attention att(config);
  att.plan(batch);
  const auto cache_values = to_bf16(testing::random_normal(kCacheValues, 21));
  const auto q_values = to_bf16(testing::random_normal(kCells * kDim, 22));
  std::vector<bf16> cache_mem(kCacheValues + 16), q_mem(kCells * kDim + 16), out_mem(kCells * kRankDim + 16);
  std::vector<float> lse_mem(kCells + 8);
  std::vector<float> first_out, first_lse;
  for (const size_t offset : {0, 1}) {
    bf16* cache = past_16_bytes(cache_mem, offset);
    bf16* q = past_16_bytes(q_mem, offset);
    bf16* out = past_16_bytes(out_mem, offset);
    float* lse = past_16_bytes(lse_mem, offset);
    std::copy(cache_values.begin(), cache_values.end(), cache);
    // Past the lengths, NaN: block 1's tokens 8.. (request 0's last 8 tokens and request 1's 3
    // are its first); finite outputs below show that no run reads them.
    std::fill(cache + (16 + 8) * size_t(kDim), cache + 32 * size_t(kDim), float_to_bf16(std::nanf("")));
    std::copy(q_values.begin(), q_values.end(), q);
    std::fill_n(out, kCells * kRankDim, float_to_bf16(std::nanf("")));
    std::fill_n(lse, kCells, std::nanf(""));
    att.run(q, KvCache{cache, 3, 16, kDim, KvDtype::bf16}, KvScale{}, out, lse);
    std::vector<float> got_out = to_float(std::vector<bf16>(out, out + kCells * kRankDim));
    std::vector<float> got_lse(lse, lse + kCells);
    ASSERT_TRUE(std::all_of(got_lse.begin(), got_lse.end(), [](float v) { return std::isfinite(v); }));
    ASSERT_TRUE(std::all_of(got_out.begin(), got_out.end(), [](float v) { return std::isfinite(v); }));
    if (offset == 0) {
      first_out = got_out;
      first_lse = got_lse;
      continue;
    }
    EXPECT_EQ(got_out, first_out) << "out at 2 bytes past 16 differs from the aligned run's";
    EXPECT_EQ(got_lse, first_lse) << "lse at 4 bytes past 16 differs from the aligned run's";
  }
  // One byte past a whole value: refused, nothing written.
  bf16* q = past_16_bytes(q_mem, 0);
  bf16* out = past_16_bytes(out_mem, 0);
  float* lse = past_16_bytes(lse_mem, 0);
  const KvCache cache{past_16_bytes(cache_mem, 0), 3, 16, kDim, KvDtype::bf16};
  const auto byte_past = [](auto* p) { return reinterpret_cast<decltype(p)>(reinterpret_cast<char*>(p) + 1); };
  std::fill_n(out, kCells * kRankDim, float_to_bf16(7.0f));
  EXPECT_REFUSED(att.run(byte_past(q), cache, KvScale{}, out, lse), "'q' = address");
  EXPECT_REFUSED(att.run(q, cache, KvScale{}, byte_past(out), lse), "'out' = address");
  EXPECT_REFUSED(att.run(q, cache, KvScale{}, out, byte_past(lse)), "'lse' = address");
  EXPECT_REFUSED(att.run(q, KvCache{byte_past(past_16_bytes(cache_mem, 0)), 3, 16, kDim, KvDtype::bf16}, KvScale{}, out,
                         lse),
                 "'kv_cache' = address");
  EXPECT_TRUE(std::all_of(out, out + kCells * kRankDim, [](bf16 v) { return bf16_to_float(v) == 7.0f; }));
  std::vector<int64_t> slot_mem(4);
  int64_t* slots = past_16_bytes(slot_mem, 0);
  slots[0] = 5;
  EXPECT_REFUSED(write_kv(cache, byte_past(q), slots, 1, 1.0f), "'latents' = address");
  EXPECT_REFUSED(write_kv(cache, q, reinterpret_cast<int64_t*>(reinterpret_cast<char*>(slots) + 4), 1, 1.0f),
                 "'slot_mapping' = address");
  EXPECT_REFUSED(combine_partials(q, lse, 1, byte_past(out), lse + 4, 1, kRankDim), "'o' = address");
  EXPECT_REFUSED(combine_partials(q, byte_past(lse), 1, out, lse + 4, 1, kRankDim), "'lse_parts' = address");
}

// An engine kept in a std::vector that grows is moved: the moved-from object kept its
// "planned" flag, and run() read the header of a plan with no arena behind it (SIGSEGV, the
// ninth audit). Now refused by name, writing nothing; the moved-into object runs.
TEST_F(Refusals, MovedFromAttentionRefusesToRun) {
  Attention a(config);
  a.plan(batch);
  Attention b(std::move(a));
  EXPECT_REFUSED(run(a, cache.view(), KvScale{0.05f}), field("plan", "a moved-from Plan"));
  EXPECT_REFUSED((void)a.current_plan().route(), field("plan", "a moved-from Plan"));
  EXPECT_TRUE(untouched());
  run(b, cache.view(), KvScale{0.05f});
  EXPECT_TRUE(matches_a_fresh_plan());
}

// A defaulted move assignment, moved onto itself, freed the plan's arena and kept pointing at
// it (a use after free on the next run: the twelfth audit). A self-move now leaves it as it was.
TEST_F(Refusals, SelfMovedAttentionStillRuns) {
  Attention a(config);
  a.plan(batch);
  Attention& same = a;
  a = std::move(same);
  EXPECT_EQ(a.current_plan().header().batch, 2);
  run(a, cache.view(), KvScale{0.05f});
  EXPECT_TRUE(matches_a_fresh_plan());
  a.plan(batch);  // plan() writes into the same arena
  run(a, cache.view(), KvScale{0.05f});
  EXPECT_TRUE(matches_a_fresh_plan());
}

TEST_F(Refusals, BadScales) {
  Attention att(config);
  att.plan(batch);
  const float denormal = 1e-40f;
  for (float bad : {0.0f, -1.0f, NAN, INFINITY, denormal})
    EXPECT_REFUSED(run(att, cache.view(), KvScale{bad}), field("kv_scale", fmt::format("{}", bad)));
  const float device_scale = 0.05f;
  EXPECT_REFUSED(run(att, cache.view(), KvScale{0.05f, &device_scale}), field("kv_scale", "a device pointer"));
  EXPECT_TRUE(untouched());
  for (float bad : {0.0f, -1.0f, NAN, INFINITY, denormal, 1e37f}) {
    AttentionConfig c = config;
    c.softmax_scale = bad;
    EXPECT_REFUSED(Attention{c}, field("softmax_scale", fmt::format("{}", bad)));
  }
}

// The CPU split-K workspace is sized and taken at construction (plan() allocates nothing):
// heads 4096 over a big batch was accepted, then the first plan that cut a request asked for
// terabytes (std::bad_alloc) and left the engine planned without a workspace (a segfault on
// the next run). Refused now with its size; one_stage never cuts and takes none.
TEST_F(Refusals, WorkspaceBeyondTheHostCapIsRefusedAtConstruction) {
  AttentionConfig c = config;
  c.heads = 4096;
  c.limits = PlanLimits{1024, 8, 32};  // (1024 + 132) x 8 x 4096 x 514 floats: 73 GiB
  for (Route r : {Route::automatic, Route::split_k})
    EXPECT_REFUSED(
        [&] {
          c.route = r;
          Attention{c};
        }(),
        "'host memory (plan, split-K workspace and the threads' scratch)' = ");
  c.route = Route::one_stage;
  EXPECT_NO_THROW(Attention{c});
  // The kernel's scratch on each thread grows with the latent width: a width the host cannot
  // hold was accepted, and the first run's allocation failed inside an OpenMP loop, which ends
  // the process (std::terminate; the twelfth audit). One thread's scratch alone is past the cap here.
  c = config;
  c.route = Route::one_stage;
  c.dims = LatentDims{1 << 22, 64};
  EXPECT_REFUSED(Attention{c}, "'host memory (plan, split-K workspace and the threads' scratch)' = ");
  EXPECT_GT(cpu_attention_scratch_bytes(c.dims), kMaxHostBytes);
  c = config;
  c.num_workers = -5;  // was silently the backend's 132
  EXPECT_REFUSED(Attention{c}, field("num_workers", "-5"));
}

// A step whose every request has qlen 0 has no rows: its buffers may be empty (null data).
TEST_F(Refusals, StepWithoutRowsRunsOnNullBuffers) {
  Attention att(config);
  const std::vector<int32_t> none{0, 0};
  att.plan(BatchDesc{lens, 2, tables, 2, Mode::verify, none});
  EXPECT_NO_THROW(att.run(nullptr, cache.view(), KvScale{0.05f}, nullptr, nullptr));
}

// An output that shares memory with an input or the other output gave silently wrong answers
// (the kernels read what they had written); refused before anything runs, as in Python.
TEST_F(Refusals, OutputsSharingMemoryWithInputs) {
  Attention att(config);
  att.plan(batch);  // 4 rows x 4 heads: out 16384 bytes, lse 64, q 18432
  const std::vector<uint8_t> cache_before(cache.data(), cache.data() + cache.config().bytes());
  EXPECT_REFUSED(att.run(q.data(), cache.view(), KvScale{0.05f}, q.data() + 64, lse.data()),
                 fmt::format("'out' = 16384 bytes at {}, overlapping q", static_cast<const void*>(q.data() + 64)));
  EXPECT_REFUSED(att.run(q.data(), cache.view(), KvScale{0.05f}, out.data(), reinterpret_cast<float*>(q.data())),
                 "'lse' = 64 bytes at");
  EXPECT_REFUSED(att.run(q.data(), cache.view(), KvScale{0.05f}, out.data(), reinterpret_cast<float*>(out.data()) + 8),
                 "overlapping lse (64 bytes at");
  EXPECT_REFUSED(att.run(q.data(), cache.view(), KvScale{0.05f}, reinterpret_cast<bf16*>(cache.data()) + 100,
                         lse.data()),
                 "overlapping kv_cache (73728 bytes at");
  EXPECT_TRUE(untouched());
  EXPECT_TRUE(std::equal(cache_before.begin(), cache_before.end(), cache.data()));
  // Adjacent buffers share no byte: they run.
  std::vector<uint8_t> both(16384 + 64);
  att.run(q.data(), cache.view(), KvScale{0.05f}, reinterpret_cast<bf16*>(both.data()),
          reinterpret_cast<float*>(both.data() + 16384));
}

// The CPU kernel's own entry checked nothing in its parameter struct (a bad dtype or scale ran
// to zeros; a null buffer crashed); block_attention_cpu read past q for a head range beyond it.
TEST_F(Refusals, KernelEntriesValidateTheirParameters) {
  Attention att(config);
  att.plan(batch);
  const AttentionParams good = att.params(q.data(), cache.view(), KvScale{0.05f}, out.data(), lse.data());
  auto expect = [&](auto spoil, const char* needle) {
    AttentionParams p = good;
    spoil(p);
    EXPECT_REFUSED(attention_cpu(p), needle);
  };
  expect([](AttentionParams& p) { p.kv_dtype = KvDtype(7); }, "'kv_dtype' = 7");
  expect([](AttentionParams& p) { p.heads = 0; }, "'heads' = 0");
  expect([](AttentionParams& p) { p.rank_dim = 0; }, "'rank_dim' = 0");
  expect([](AttentionParams& p) { p.dim = p.rank_dim; }, "'dim' = 512");
  expect([](AttentionParams& p) { p.kv_scale = 0.0f; }, "'kv_scale' = 0");
  expect([](AttentionParams& p) { p.softmax_scale = -1.0f; }, "'softmax_scale' = -1");
  expect([](AttentionParams& p) { p.kv_scale_dev = &p.kv_scale; }, "'kv_scale_dev' = a device pointer");
  expect([](AttentionParams& p) { p.q = nullptr; }, "'q' = null");
  expect([](AttentionParams& p) { p.lse = nullptr; }, "'lse' = null");
  expect([](AttentionParams& p) { p.plan.work = nullptr; }, "'plan' = a view with null buffers");
  // A value split across its alignment (undefined behaviour to read).
  const auto byte_past = [](auto* p) { return reinterpret_cast<decltype(p)>(reinterpret_cast<uintptr_t>(p) + 1); };
  expect([&](AttentionParams& p) { p.q = byte_past(p.q); }, "'q' = address");
  expect([&](AttentionParams& p) { p.out = byte_past(p.out); }, "'out' = address");
  expect([&](AttentionParams& p) { p.lse = byte_past(p.lse); }, "'lse' = address");
  ASSERT_NE(good.part_o, nullptr);
  expect([&](AttentionParams& p) { p.part_o = byte_past(p.part_o); }, "'part_o' = address");
  expect([&](AttentionParams& p) { p.part_l = byte_past(p.part_l); }, "'part_l' = address");
  expect([&](AttentionParams& p) {
    p.kv_dtype = KvDtype::bf16;
    p.kv_scale = 1.0f;
    p.kv = byte_past(p.kv);
  }, "'kv' = address");
  expect([&](AttentionParams& p) { p.plan.q_start = byte_past(p.plan.q_start); }, "'plan.q_start' = address");
  // Outputs over q or the partials (sized by the plan's rows and capacities): refused here too,
  // not only by the engine's run.
  expect([&](AttentionParams& p) { p.out = const_cast<bf16*>(p.q) + 64; }, "overlapping q");
  expect([&](AttentionParams& p) { p.lse = p.part_m; }, "overlapping part_m");
  EXPECT_TRUE(untouched());

  // Stage B over heads [head_begin, head_begin + heads) of q.
  const std::vector<bf16> block(size_t(2 * 2 * kDim), float_to_bf16(0.5f));
  const BlockAttentionParams ok{q.data(), block.data(), lens.data(), KvDtype::fp8_e4m3, 0.05f, 0.04f, 2, 2, 4, 0, 4,
                                kDim, kRankDim, out.data(), lse.data()};
  auto expect_block = [&](auto spoil, const char* needle) {
    BlockAttentionParams p = ok;
    spoil(p);
    EXPECT_REFUSED(block_attention_cpu(p), needle);
  };
  expect_block([](BlockAttentionParams& p) { p.head_begin = 1; }, "'head_begin' = 1");
  expect_block([](BlockAttentionParams& p) { p.heads = 0; }, "'heads' = 0");
  expect_block([](BlockAttentionParams& p) { p.kv_dtype = KvDtype(7); }, "'kv_dtype' = 7");
  expect_block([](BlockAttentionParams& p) { p.kv_scale = 0.0f; }, "'kv_scale' = 0");
  expect_block([](BlockAttentionParams& p) { p.softmax_scale = 0.0f; }, "'softmax_scale' = 0");
  expect_block([](BlockAttentionParams& p) { p.dim = p.rank_dim; }, "'dim' = 512");
  expect_block([](BlockAttentionParams& p) { p.qlen = 4; }, "'seq_lens[1]' = 3");
  expect_block([](BlockAttentionParams& p) { p.out = nullptr; }, "null");
  expect_block([&](BlockAttentionParams& p) { p.lse = byte_past(p.lse); }, "'lse' = address");
  expect_block([&](BlockAttentionParams& p) { p.block_kv = byte_past(p.block_kv); }, "'block_kv' = address");
  // Outputs over its inputs (out over q rewrote rows not yet read, lse over seq_lens the
  // lengths: the twelfth audit).
  expect_block([&](BlockAttentionParams& p) { p.out = const_cast<bf16*>(p.q) + kDim; }, "overlapping q");
  expect_block([&](BlockAttentionParams& p) { p.out = const_cast<bf16*>(p.block_kv); }, "overlapping block_kv");
  expect_block([&](BlockAttentionParams& p) { p.lse = reinterpret_cast<float*>(const_cast<int32_t*>(p.seq_lens)); },
               "overlapping seq_lens");
  EXPECT_TRUE(untouched());
  EXPECT_NO_THROW(block_attention_cpu(ok));

  // The softmax scale's default needs a valid latent width (D = 0 gave inf, a negative one NaN).
  AttentionConfig bad = config;
  bad.dims = LatentDims{0, 0};
  EXPECT_REFUSED(softmax_scale_of(bad), "'kv_lora_rank' = 0");
  bad.dims = LatentDims{-5, 1};
  EXPECT_REFUSED(softmax_scale_of(bad), "'kv_lora_rank' = -5");
  bad.dims = LatentDims{INT32_MAX, 1};
  EXPECT_REFUSED(softmax_scale_of(bad), "fits int32");
}

TEST_F(Refusals, BatchBeyondTheCaptureLimitsLeavesThePlan) {
  Attention att(config);
  att.plan(batch);
  const std::vector<int32_t> three{40, 3, 3}, three_tables(6, 0), long_len{70, 3};
  EXPECT_REFUSED(att.plan(BatchDesc{three, 2, three_tables, 2, Mode::verify}), field("batch", "3"));
  EXPECT_REFUSED(att.plan(BatchDesc{lens, 5, tables, 2, Mode::verify}), field("qlen", "5"));
  // 70 tokens put 35 on rank 0, beyond max_local_kv_len 32.
  EXPECT_REFUSED(att.plan(BatchDesc{long_len, 2, tables, 2, Mode::verify}), field("seq_lens[0]", "70"));
  EXPECT_EQ(att.current_plan().header().batch, 2);
  EXPECT_EQ(att.current_plan().header().qlen, 2);
  run(att, cache.view(), KvScale{0.05f});  // the step's plan still runs, unchanged
  EXPECT_TRUE(matches_a_fresh_plan());
}

TEST_F(Refusals, TwoStageIsVerifyOnly) {
  config.route = Route::two_stage;
  Attention att(config);
  const std::vector<int32_t> decode_lens{40, 3};
  EXPECT_REFUSED(att.plan(BatchDesc{decode_lens, 1, tables, 2, Mode::decode}), field("route", "two_stage"));
  EXPECT_REFUSED(run(att, cache.view(), KvScale{0.05f}), field("plan", "none"));
  att.plan(batch);  // verify is served
  EXPECT_EQ(att.current_plan().route(), Route::two_stage);
}

// write_kv into engine-owned memory (a plain byte vector): PAD slots are skipped, the stored
// bytes are encode_latent's, and they read back as the contract's rounding (SPEC §3).
class WriteKv : public ::testing::TestWithParam<KvDtype> {};

TEST_P(WriteKv, StoresEncodedLatentsAndSkipsPad) {
  const KvDtype d = GetParam();
  const float scale = d == KvDtype::bf16 ? 1.0f : 0.05f;
  const int dim = 64;
  std::vector<uint8_t> memory(size_t(3 * 4 * dim * bytes_per_value(d)));
  std::mt19937_64 rng(9);
  for (auto& byte : memory) byte = uint8_t(rng());
  const KvCache cache{memory.data(), 3, 4, dim, d};
  const auto x = testing::random_normal(3 * size_t(dim), 11);
  const auto latents = to_bf16(x);
  const std::vector<int64_t> slots{7, kPadSlot, 2};
  std::vector<uint8_t> expected = memory;
  encode_latent(latents.data(), dim, d, scale, expected.data() + 7 * cache.row_bytes());
  encode_latent(latents.data() + 2 * dim, dim, d, scale, expected.data() + 2 * cache.row_bytes());
  write_kv(cache, latents.data(), slots.data(), 3, scale);
  EXPECT_EQ(memory, expected);
  for (int j = 0; j < dim; ++j) {
    const uint8_t* stored = memory.data() + 7 * cache.row_bytes() + j * bytes_per_value(d);
    bf16 h;
    std::memcpy(&h, stored, sizeof h);
    const float read = d == KvDtype::bf16 ? bf16_to_float(h) : fp8_to_float(*stored, d) * scale;
    EXPECT_EQ(read, quantize_roundtrip(x[size_t(j)], d, scale)) << "value " << j;
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, WriteKv, ::testing::Values(KvDtype::bf16, KvDtype::fp8_e4m3, KvDtype::fp8_e5m2),
                         [](const auto& info) { return std::string(to_string(info.param)); });

// An AttentionConfig without its own schedule cost gets the calibration of the backend
// kernel's rows per CTA, its cache's dtype and its row groups; one that sets it keeps it,
// whatever the rows.
TEST(ScheduleCostOfAConfig, CalibratedUnlessSet) {
  AttentionConfig c;
  struct Case {
    int rows, heads, max_qlen;
    KvDtype dtype;
    double piece;
  };
  for (const Case& k : {Case{16, 16, 1, KvDtype::bf16, 1.0}, Case{16, 16, 1, KvDtype::fp8_e4m3, 4.0},
                        Case{16, 16, 1, KvDtype::fp8_e5m2, 4.0}, Case{32, 16, 2, KvDtype::fp8_e4m3, 2.0},
                        Case{64, 16, 2, KvDtype::bf16, 2.0}, Case{64, 16, 4, KvDtype::bf16, 2.0},
                        Case{64, 16, 4, KvDtype::fp8_e4m3, 5.0}, Case{64, 128, 1, KvDtype::bf16, 3.0},
                        Case{64, 16, 8, KvDtype::bf16, 3.0}, Case{32, 16, 4, KvDtype::fp8_e4m3, 3.0},
                        Case{64, 128, 2, KvDtype::bf16, 2.0}, Case{64, 128, 4, KvDtype::fp8_e4m3, 5.0},
                        Case{64, 128, 1, KvDtype::fp8_e5m2, 5.0}, Case{64, 16, 8, KvDtype::fp8_e4m3, 5.0}}) {
    c.heads = k.heads;
    c.limits.max_qlen = k.max_qlen;
    c.kv_dtype = k.dtype;
    const ScheduleCost want = calibrated_schedule_cost(k.rows, k.dtype, (k.heads * k.max_qlen + k.rows - 1) / k.rows);
    const ScheduleCost got = planner_config(c, Backend::cpu, 132, k.rows).cost;
    EXPECT_EQ(got.piece, k.piece) << k.rows << " rows, " << k.heads << " heads x " << k.max_qlen << ", "
                                  << to_string(k.dtype);
    EXPECT_EQ(got.piece, want.piece);
    EXPECT_EQ(got.cut, want.cut);
    EXPECT_EQ(got.slack, want.slack);
    EXPECT_EQ(got.combine, want.combine);
    EXPECT_EQ(got.combine, 3.0);
    EXPECT_EQ(got.combine_piece, want.combine_piece);
    EXPECT_EQ(got.combine_piece, 2.5);
  }
  c.schedule_cost = ScheduleCost{0.25, 3.0, 0.5, 7.0, 1.5};
  for (int rows : {16, 64}) {
    const ScheduleCost got = planner_config(c, Backend::cpu, 132, rows).cost;
    EXPECT_EQ(got.piece, 0.25);
    EXPECT_EQ(got.cut, 3.0);
    EXPECT_EQ(got.slack, 0.5);
    EXPECT_EQ(got.combine, 7.0);
    EXPECT_EQ(got.combine_piece, 1.5);
  }
}

TEST(WriteKvRefusals, BadSlotOrScaleWritesNothing) {
  std::vector<uint8_t> memory(size_t(3 * 4 * 64));
  std::iota(memory.begin(), memory.end(), uint8_t(1));
  const std::vector<uint8_t> before = memory;
  const KvCache cache{memory.data(), 3, 4, 64, KvDtype::fp8_e5m2};
  const auto latents = to_bf16(testing::random_normal(2 * 64, 3));
  const std::vector<int64_t> past_end{0, 12}, below_pad{0, -2}, good{0, 1};
  EXPECT_REFUSED(write_kv(cache, latents.data(), past_end.data(), 2, 0.05f), field("slot_mapping[1]", "12"));
  EXPECT_REFUSED(write_kv(cache, latents.data(), below_pad.data(), 2, 0.05f), field("slot_mapping[1]", "-2"));
  EXPECT_REFUSED(write_kv(cache, latents.data(), good.data(), 2, 0.0f), field("kv_scale", "0"));
  KvCache null_cache = cache;
  null_cache.data = nullptr;
  EXPECT_REFUSED(write_kv(null_cache, latents.data(), good.data(), 2, 0.05f), field("kv_cache", "null"));
  // A cache that overlaps the latents or the slots (it would overwrite what the write reads).
  EXPECT_REFUSED(write_kv(cache, reinterpret_cast<const bf16*>(memory.data() + 64), good.data(), 2, 0.05f),
                 "'kv_cache' = 768 bytes at");
  EXPECT_REFUSED(write_kv(cache, latents.data(), reinterpret_cast<const int64_t*>(memory.data() + 760), 1, 0.05f),
                 "overlapping slot_mapping (8 bytes at");
  EXPECT_REFUSED(write_kv(cache, latents.data(), good.data(), int64_t(1) << 60, 0.05f), field("n", "1152921504606846976"));
  // A one-value cache: the latents' bytes fit int64, the slots' did not (n x 8 overflowed).
  const KvCache narrow{memory.data(), 3, 4, 1, KvDtype::fp8_e5m2};
  EXPECT_REFUSED(write_kv(narrow, latents.data(), good.data(), (int64_t(1) << 61) + 1, 0.05f), "'n' = ");
  // encode_latent, the write's element rule, checks its own arguments (dim -1 was a memcpy of
  // -2 bytes).
  std::vector<uint8_t> row(64);
  EXPECT_REFUSED(encode_latent(latents.data(), -1, KvDtype::bf16, 1.0f, row.data()), field("dim", "-1"));
  EXPECT_REFUSED(encode_latent(latents.data(), 64, KvDtype(7), 1.0f, row.data()), field("kv_dtype", "7"));
  EXPECT_REFUSED(encode_latent(latents.data(), 64, KvDtype::fp8_e4m3, 0.0f, row.data()), field("kv_scale", "0"));
  EXPECT_REFUSED(encode_latent(latents.data(), 64, KvDtype::bf16, 0.5f, row.data()), field("kv_scale", "0.5"));
  EXPECT_REFUSED(encode_latent(nullptr, 64, KvDtype::bf16, 1.0f, row.data()), field("src", "null"));
  EXPECT_EQ(memory, before) << "a refused write changed the cache";
  write_kv(cache, latents.data(), good.data(), 2, 0.05f);
  EXPECT_NE(memory, before);
}

}  // namespace
}  // namespace dcpmla
