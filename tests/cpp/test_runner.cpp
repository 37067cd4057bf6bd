#include "dcpmla/runner.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "cpu/parallel.h"
#include "dcpmla/attention.h"
#include "dcpmla/error.h"
#include "dcpmla/reference.h"
#include "test_helpers.h"

namespace dcpmla {

TEST(Runner, MergeFormsAgree) {
  const int n = 4, rows = 3, heads = 8, width = 64;
  std::vector<std::vector<bf16>> o(n);
  std::vector<std::vector<float>> lse(n);
  for (int r = 0; r < n; ++r) {
    for (float x : testing::random_normal(size_t(rows) * heads * width, 30 + uint64_t(r))) o[size_t(r)].push_back(float_to_bf16(x));
    lse[size_t(r)] = testing::random_normal(size_t(rows) * heads, 40 + uint64_t(r), 2.0f);
  }
  lse[1][5] = -INFINITY;  // rank 1 holds nothing of one (row, head)
  for (int r = 0; r < n; ++r) lse[size_t(r)][7] = -INFINITY;  // nobody holds anything
  std::vector<bf16> whole(size_t(rows) * heads * width), scattered(whole.size());
  std::vector<float> whole_lse(size_t(rows) * heads), scattered_lse(whole_lse.size());
  run_ranks(n, [&](int r, Communicator& comm) {
    std::vector<bf16> all(whole.size());
    std::vector<float> all_lse(whole_lse.size());
    merge_across_ranks(comm, MergeForm::all_heads, o[size_t(r)].data(), lse[size_t(r)].data(), rows, heads, width,
                       all.data(), all_lse.data());
    if (r == 0) whole = all, whole_lse = all_lse;
    const int kept = heads / n;
    std::vector<bf16> mine(size_t(rows) * kept * width);
    std::vector<float> mine_lse(size_t(rows) * kept);
    merge_across_ranks(comm, MergeForm::scatter_heads, o[size_t(r)].data(), lse[size_t(r)].data(), rows, heads,
                       width, mine.data(), mine_lse.data());
    for (int row = 0; row < rows; ++row)
      for (int k = 0; k < kept; ++k) {
        const int h = r * kept + k;
        scattered_lse[size_t(row * heads + h)] = mine_lse[size_t(row * kept + k)];
        for (int j = 0; j < width; ++j)
          scattered[size_t((row * heads + h) * width + j)] = mine[size_t((row * kept + k) * width + j)];
      }
  });
  for (size_t i = 0; i < whole_lse.size(); ++i) {
    if (std::isinf(whole_lse[i])) EXPECT_EQ(scattered_lse[i], whole_lse[i]);
    else EXPECT_NEAR(scattered_lse[i], whole_lse[i], 1e-5);
  }
  for (size_t i = 0; i < whole.size(); ++i) {
    EXPECT_NEAR(bf16_to_float(scattered[i]), bf16_to_float(whole[i]), 2e-2);
    EXPECT_FALSE(std::isnan(bf16_to_float(whole[i])));
  }
  EXPECT_EQ(whole_lse[7], -INFINITY);
}

TEST(Runner, EntryPointRefusesBadInput) {
  const auto q = testing::random_normal(2 * 1 * 2 * 576, 1);
  const auto kv = testing::random_normal(2 * 8 * 576, 2);
  const std::vector<int32_t> lens{8, 3};
  auto call = [&](AttentionOptions o, std::vector<int32_t> l = {8, 3}, int64_t max_len = 8, int qlen = 1) {
    return mla_attention(q, kv, l, 2, qlen, 2, max_len, 576, o);
  };
  using testing::expect_error;
  AttentionOptions o;
  expect_error([&] { call(o, {9, 3}); }, "'seq_lens[0]' = 9");
  expect_error([&] { call(o, {-2, 3}); }, "'seq_lens[0]' = -2");
  expect_error([&] { call(o, {8, 3}, 9); }, "'kv'");
  expect_error([&] { mla_attention(q, kv, lens, 2, 1, 2, 8, 576, [] { AttentionOptions a; a.kv_lora_rank = 576; return a; }()); }, "kv_lora_rank");
  // A factory that makes no engine (null) was a null dereference.
  expect_error([&] {
    mla_attention(q, kv, lens, 2, 1, 2, 8, 576, AttentionOptions{},
                  [](const AttentionConfig&, const CacheConfig&) { return std::unique_ptr<RankEngine>(); });
  }, "'engines' = a factory that returned null");
  // Mode and route are refused before any rank's cache is made (the planner refused them late).
  expect_error([&] { call([] { AttentionOptions a; a.mode = Mode(7); return a; }()); }, "'mode' = 7");
  expect_error([&] { call([] { AttentionOptions a; a.mode = Mode::draft; a.route = Route::two_stage; return a; }()); },
               "(two_stage is verify-only)");
  o.world_size = 0;
  expect_error([&] { call(o); }, "world_size");
  o = {};
  o.interleave = 3;
  expect_error([&] { call(o); }, "'interleave' = 3");
  o = {};
  o.world_size = 3;
  o.merge = MergeForm::scatter_heads;
  expect_error([&] { call(o); }, "'heads' = 2");
  o = {};
  o.backend = Backend::cuda;
  expect_error([&] { call(o); }, "'device' = cuda: expected cpu");
  o = {};
  o.kv_dtype = KvDtype::fp8_e4m3;
  o.kv_scale = -1.0f;
  expect_error([&] { call(o); }, "kv_scale");
  // Scales must be positive normal float32s: a subnormal one is refused, never run.
  o.kv_scale = 1e-40f;
  expect_error([&] { call(o); }, "'kv_scale' = 1e-40: expected a positive normal float32");
  o = {};
  o.softmax_scale = 1e-45f;
  expect_error([&] { call(o); }, "'softmax_scale' = 1e-45");
  o.softmax_scale = -0.0f;  // only +0 means "the default"
  expect_error([&] { call(o); }, "'softmax_scale' = -0");
  o = {};
  expect_error([&] { call(o, {8, 3}, 8, kMaxQlen + 1); }, "'qlen' = 4097");
  o = {};
  expect_error([&] { mla_attention(std::vector<float>(size_t(2) * 4097 * 576), kv, lens, 2, 1, 4097, 8, 576, o); },
               "'heads' = 4097");
  o = {};
  o.mode = Mode::draft;
  o.route = Route::two_stage;
  expect_error([&] { call(o); }, "'route' = two_stage: expected a route that serves mode draft");
  // Refused before allocating: a million threads; 14 GB of blocks for 11 tokens.
  o = {};
  o.world_size = 1000000;
  expect_error([&] { call(o); }, "world_size");
  // Named before the memory bound, whose rank count overflowed int at INT32_MAX (UBSan).
  o.block_size = 1;
  o.world_size = INT32_MAX;
  expect_error([&] { call(o); }, "'world_size' = 2147483647: expected in [1, 256]");
  o = {};
  o.world_size = 64;
  o.block_size = kMaxBlockSize;
  expect_error([&] { call(o); }, "GiB");
  o.block_size = kMaxBlockSize * 2;
  expect_error([&] { call(o); }, "'block_size' = 131072");
  expect_error([] { parse_route("fast"); }, "'route' = 'fast': expected auto, one_stage, two_stage or split_k");
  expect_error([] { parse_mode("prefill"); }, "'mode' = 'prefill': expected decode, verify or draft");
  expect_error([] { parse_kv_dtype("fp16"); }, "'kv_dtype' = 'fp16': expected bf16, fp8_e4m3 or fp8_e5m2");
  expect_error([] { parse_backend("tpu"); }, "'device' = 'tpu': expected cpu or cuda");
  // A NUL or control byte is shown escaped, not cut (the message crosses into Python as a C string).
  expect_error([] { parse_kv_dtype(std::string_view("fp8_e4m3\0\x01", 10)); },
               "'kv_dtype' = 'fp8_e4m3\\x00\\x01': expected bf16, fp8_e4m3 or fp8_e5m2");
}

// Enums cast from any integer (C and Python callers): one check per enum, from its name table.
TEST(Types, UnknownEnumValuesAreRefusedWithTheirMembers) {
  testing::expect_error([] { require_known("mode", Mode(3)); }, "'mode' = 3: expected decode (0), verify (1) or draft (2)");
  testing::expect_error([] { require_known("kv_dtype", KvDtype(-1)); },
               "'kv_dtype' = -1: expected bf16 (0), fp8_e4m3 (1) or fp8_e5m2 (2)");
  testing::expect_error([] { require_known("route", Route(4)); }, "'route' = 4: expected auto (0), one_stage (1)");
  testing::expect_error([] { require_known("backend", Backend(2)); }, "'backend' = 2: expected cpu (0) or cuda (1)");
  // An enum of another header joins through its own table (enum_names, found by ADL).
  testing::expect_error([] { require_known("merge", MergeForm(2)); },
                        "'merge' = 2: expected all_heads (0) or scatter_heads (1)");
  testing::expect_error([] { parse_merge_form("gather"); }, "'merge' = 'gather': expected all_heads or scatter_heads");
  EXPECT_EQ(parse_merge_form("scatter_heads"), MergeForm::scatter_heads);
  EXPECT_EQ(to_string(Route::automatic), "auto");
  EXPECT_EQ(parse_route("auto"), Route::automatic);
  for (const Mode m : {Mode::decode, Mode::verify, Mode::draft}) {
    EXPECT_TRUE(is_known(m));
    require_known("mode", m);
  }
  for (const KvDtype d : {KvDtype::bf16, KvDtype::fp8_e4m3, KvDtype::fp8_e5m2}) require_known("kv_dtype", d);
  for (const Route r : {Route::automatic, Route::one_stage, Route::two_stage, Route::split_k}) require_known("route", r);
  EXPECT_FALSE(is_known(KvDtype(3)));
  EXPECT_FALSE(is_known(Route(-1)));
}

TEST(Types, CheckedProductRefusesOverflowAndNegativeFactors) {
  EXPECT_EQ(checked_product({}), 1);
  EXPECT_EQ(checked_product({3, 0, int64_t(1) << 62}), 0);
  EXPECT_EQ(checked_product({int64_t(1) << 31, int64_t(1) << 31}), int64_t(1) << 62);
  EXPECT_EQ(checked_product({int64_t(1) << 31, int64_t(1) << 31, 2}), std::nullopt);  // 2^63
  EXPECT_EQ(checked_product({int64_t(1) << 62, 2}), std::nullopt);
  EXPECT_EQ(checked_product({-1, 5}), std::nullopt);
  EXPECT_EQ(checked_product({5, -1}), std::nullopt);
  EXPECT_EQ(checked_product({1, 576, 4611686018427387904}), std::nullopt);  // max_len 2^62
}

// Found by a hostile-input audit: each was a crash, a silent default or an allocation
// attempted before the refusal.
TEST(Runner, EntryPointRefusesHostileSizesAndEnumsBeforeAllocating) {
  using testing::expect_error;
  const auto q = testing::random_normal(576, 1);
  const std::vector<int32_t> one{1};
  const std::vector<float> tiny(576);
  // batch x max_len x D wrapped to 0: an empty kv was accepted, then read through null.
  expect_error([&] { mla_attention(q, {}, one, 1, 1, 1, int64_t(1) << 62, 576, AttentionOptions{}); },
               "'kv' = 1 x 4611686018427387904 x 576 values: expected a size that fits int64");
  // An unknown merge form ran as scatter_heads (and failed only after attention had run).
  AttentionOptions o;
  o.merge = MergeForm(5);
  expect_error([&] { mla_attention(q, tiny, one, 1, 1, 1, 1, 576, o); }, "'merge' = 5: expected all_heads (0)");
  EXPECT_EQ(to_string(MergeForm(5)), "?");
  // The inputs' own bf16 copies count: 8 M rows of kv (one token used) are 9.2 GB of copies.
  // The span is never read: the refusal comes before anything is copied.
  const int64_t max_len = int64_t(8) << 20;
  const std::span<const float> huge(tiny.data(), size_t(max_len) * 576);
  expect_error([&] { mla_attention(q, huge, one, 1, 1, 1, max_len, 576, AttentionOptions{}); },
               "'host memory (input copies; per rank: plans, cache, workspace, merge buffers; the CPU kernels' scratch)' = ");
  // One rank of many in this process has the same bound (it had none: 36 GiB of blocks were
  // left to the allocator; PagedCache's own cap would refuse later, naming num_blocks).
  AttentionOptions big;
  big.block_size = kMaxBlockSize;
  big.world_size = 1;
  const std::vector<int32_t> lens(512, 1);
  const auto q512 = testing::random_normal(size_t(512) * 576, 2);
  const std::vector<float> kv512(size_t(512) * 576);
  run_ranks(1, [&](int, Communicator& comm) {
    expect_error([&] { mla_attention_on_rank(q512, kv512, lens, 512, 1, 1, 1, 576, big, comm); },
                 "'host memory (input copies; per rank: plans, cache, workspace, merge buffers; the CPU kernels' scratch)' = ");
  });
}

// A rank engine whose cache contradicts its configuration was built, wrote its tokens at the
// configuration's block size into a cache of another, and refused only at attend() (the
// seventieth session's audit): refused when it is built now.
TEST(Runner, ARankEngineRefusesACacheOfAnotherLayoutWhenBuilt) {
  AttentionConfig config;
  config.heads = 2;
  config.block_size = 64;
  const CacheConfig good{4, 64, 576, KvDtype::bf16, 1.0f};
  EXPECT_NE(make_cpu_rank(config, good), nullptr);
  CacheConfig cache = good;
  cache.block_size = 16;
  testing::expect_error([&] { (void)make_cpu_rank(config, cache); },
                        "'kv_cache block_size' = 16: expected 64 (the Attention's block_size)");
  cache = good;
  cache.dtype = KvDtype::fp8_e4m3;
  testing::expect_error([&] { (void)make_cpu_rank(config, cache); }, "'kv_cache dtype' = fp8_e4m3: expected bf16");
  cache = good;
  cache.dim = 512;
  testing::expect_error([&] { (void)make_cpu_rank(config, cache); }, "'kv_cache dim' = 512: expected D = 576");
}

// check_mla_attention refuses from the sizes alone what mla_attention would, and counts the
// caller's own copies (the Python layer's of a strided q or kv) in the same bound: 1 M tokens of
// one request fit the bound alone (about 2.5 GiB), not beside 6 GiB the caller holds.
TEST(Runner, TheCheckFromTheSizesCountsTheCallersBytes) {
  const int64_t max_len = 1 << 20;
  const std::vector<int32_t> lens{int32_t(max_len)};
  const uint64_t q_size = 576, kv_size = uint64_t(max_len) * 576;
  AttentionOptions o;
  o.mode = Mode::decode;
  EXPECT_NO_THROW(check_mla_attention(q_size, kv_size, lens, 1, 1, 1, max_len, 576, o));
  testing::expect_error([&] { check_mla_attention(q_size, kv_size, lens, 1, 1, 1, max_len, 576, o, {}, 6.0 * (1 << 30)); },
                        "for 1 rank(s) here, 6 GiB (6442450944 bytes) of it the caller's copies of strided inputs: "
                        "expected <= 8 GiB");
  // The arguments as mla_attention checks them: a size q's shape does not describe, a length past kv's.
  testing::expect_error([&] { check_mla_attention(q_size + 1, kv_size, lens, 1, 1, 1, max_len, 576, o); },
                        "'q' = 577 values: expected batch x qlen x heads x D = 576");
  testing::expect_error([&] { check_mla_attention(q_size, kv_size, lens, 1, 1, 1, max_len - 1, 576, o); },
                        "'kv' = ");
}

// Each rank's thread opens its own OpenMP team, so the CPU kernels' scratch is held by up to
// ranks x threads threads at once; it was counted for max(ranks, threads), which let a latent
// width through whose scratch ran past the bound. Here one thread's scratch is 1.1 / (8 t) of the
// bound: max(8, t) of them fit, 8 t do not. (It needs two threads or more to tell the two apart.)
TEST(Runner, EveryRanksThreadsCountTheirScratch) {
  const int threads = detail::parallel_threads(), ranks = 8;
  if (threads < 2) GTEST_SKIP() << "one OpenMP thread: ranks x threads = max(ranks, threads)";
  const auto scratch = [](int R) { return double(cpu_attention_scratch_bytes(LatentDims{R, 64})); };
  const double target = 1.1 * double(kMaxInProcessBytes) / (ranks * threads), per_r = scratch(2) - scratch(1);
  const int R = int(std::ceil((target - scratch(1)) / per_r)) + 1;
  ASSERT_LT(double(std::max(ranks, threads)) * scratch(R), 0.9 * double(kMaxInProcessBytes));
  ASSERT_GT(double(ranks) * threads * scratch(R), double(kMaxInProcessBytes));
  AttentionOptions o;
  o.world_size = ranks;
  o.kv_lora_rank = R;
  o.route = Route::one_stage;
  const int D = R + 64;
  const auto q = testing::random_normal(size_t(D), 3), kv = testing::random_normal(size_t(D), 4);
  testing::expect_error([&] { mla_attention(q, kv, std::vector<int32_t>{1}, 1, 1, 1, 1, D, o); },
                        "'host memory (input copies; per rank: plans, cache, workspace, merge buffers; the CPU kernels' scratch)' = ");
}

// Each rank's plans are sized by the batch even when no request has a query row: 4 M padding
// requests with qlens all 0 on 64 ranks hold about 13 GiB of plans (arena and batch copy, 52
// bytes a request a rank) beside empty inputs. They were not counted (the audit of the
// sixtieth session: 16 M on 16 ranks ran 22 s to 12.9 GiB, then std::bad_alloc); refused up
// front now.
TEST(Runner, PlansCountTowardTheMemoryBound) {
  const int B = 4 << 20;
  AttentionOptions o;
  o.mode = Mode::draft;
  o.world_size = 64;
  o.block_size = 1;
  o.kv_lora_rank = 1;
  o.qlens.assign(size_t(B), 0);
  const std::vector<int32_t> lens(size_t(B), 0);
  testing::expect_error([&] { mla_attention({}, {}, lens, B, 1, 1, 0, 2, o); },
                        "'host memory (input copies; per rank: plans, cache, workspace, merge buffers; the CPU kernels' scratch)' = ");
}

// Each rank gathers every rank's partial to merge, so the merge buffers grow as N^2: 128
// one-token requests x 16 heads on 64 ranks needs about 9 GiB of them alone, with tiny
// caches. Refused up front (naming the merge buffers), never left to the allocator.
TEST(Runner, MergeBuffersCountTowardTheMemoryBound) {
  const int B = 128, H = 16;
  const auto q = testing::random_normal(size_t(B) * H * 576, 3);
  const auto kv = testing::random_normal(size_t(B) * 576, 4);
  const std::vector<int32_t> lens(B, 1);
  AttentionOptions o;
  o.mode = Mode::decode;
  o.world_size = 64;
  testing::expect_error([&] { mla_attention(q, kv, lens, B, 1, H, 1, 576, o); }, "merge buffers");
  o.world_size = 8;  // a sixty-fourth of the merge term: runs
  const AttentionResult r = mla_attention(q, kv, lens, B, 1, H, 1, 576, o);
  EXPECT_EQ(r.lse.size(), size_t(B) * H);
}

}  // namespace dcpmla