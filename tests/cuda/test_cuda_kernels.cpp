// The small kernels against their CPU definitions: the KV write kernel bit for bit on
// values chosen to hit fp8 rounding ties, saturation, subnormals and specials; merge_state
// and combine_partials (natural-log LSE merge) with -inf partials. Plus validation: the
// CUDA entry points refuse what the CPU path refuses, before any launch (these run
// without a GPU too).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>

#include "cuda_helpers.h"
#include "dcpmla/error.h"
#include "dcpmla/layout.h"
#include "dcpmla/merge.h"

namespace dcpmla::testing {
namespace {

std::vector<float> special_values(KvDtype d, float scale) {
  std::vector<float> v{0.0f, -0.0f, 1.0f, -1.0f, 448.0f, 449.0f, 464.0f, 480.0f, 1e6f, -1e6f, 57344.0f,
                       60000.0f, 61440.0f, 1e-3f, 1e-5f, 1e-7f, 3e-8f, -2e-3f, 0.0625f, 0.09375f, 0.1015625f,
                       std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity()};
  // Every representable fp8 value and the midpoints between neighbours (ties), times scale.
  for (int b = 0; b < 256; ++b) {
    const float x = fp8_to_float(uint8_t(b), d);
    if (std::isfinite(x)) v.push_back(x * scale);
    const float y = fp8_to_float(uint8_t(b + 1 < 256 ? b + 1 : b), d);
    if (std::isfinite(x) && std::isfinite(y)) v.push_back(0.5f * (x + y) * scale);
  }
  std::mt19937_64 rng(5);
  std::normal_distribution<float> dist(0.0f, 3.0f);
  while (v.size() % 576 != 0) v.push_back(dist(rng));
  return v;
}

TEST(CudaWriteKv, BitExactAgainstHostEncoder) {
  DCPMLA_REQUIRE_GPU();
  for (KvDtype d : {KvDtype::bf16, KvDtype::fp8_e4m3, KvDtype::fp8_e5m2})
    for (float scale : {1.0f, 0.37f, 3.0f}) {
      if (d == KvDtype::bf16 && scale != 1.0f) continue;
      const std::vector<float> vals = special_values(d, scale);
      const int dim = 576;
      const int64_t n = int64_t(vals.size()) / dim;
      std::vector<bf16> lat(vals.size());
      for (size_t i = 0; i < vals.size(); ++i) lat[i] = float_to_bf16(vals[i]);
      const CacheConfig cfg{n + 2, 1, dim, d, scale};
      // Reverse slot order, and one PAD row that must not be written.
      std::vector<int64_t> slots(size_t(n) + 1);
      for (int64_t k = 0; k < n; ++k) slots[size_t(k)] = n - 1 - k;
      slots[size_t(n)] = kPadSlot;
      lat.resize(lat.size() + dim, float_to_bf16(7.0f));
      PagedCache host(cfg);
      host.poison();
      const std::vector<uint8_t> poisoned(host.data(), host.data() + cfg.bytes());
      host.write(lat, slots);

      DeviceBuffer<uint8_t> cache(poisoned);
      DeviceBuffer<bf16> dl(lat);
      DeviceBuffer<int64_t> ds(slots);
      cuda::write_kv(dl.get(), ds.get(), int64_t(slots.size()), cfg, cache.get(), nullptr);
      cuda_ok(cudaDeviceSynchronize(), "write_kv");
      const std::vector<uint8_t> got = cache.download();
      int64_t diff = 0;
      for (size_t i = 0; i < got.size(); ++i) diff += got[i] != host.data()[i];
      EXPECT_EQ(diff, 0) << to_string(d) << " scale " << scale;
    }
}

std::vector<float> random_lse(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.0f, 4.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = rng() % 5 == 0 ? -std::numeric_limits<float>::infinity() : dist(rng);
  return v;
}

TEST(CudaMerge, MergeStateAndCombineMatchCpu) {
  DCPMLA_REQUIRE_GPU();
  const int64_t rows = 333;
  const int width = 512;
  {
    const auto oa = random_bf16(size_t(rows) * width, 1), ob = random_bf16(size_t(rows) * width, 2);
    auto la = random_lse(size_t(rows), 3), lb = random_lse(size_t(rows), 4);
    la[0] = lb[0] = -std::numeric_limits<float>::infinity();  // both empty
    std::vector<bf16> ro(oa.size());
    std::vector<float> rl(static_cast<size_t>(rows));
    merge_state(oa.data(), la.data(), ob.data(), lb.data(), ro.data(), rl.data(), rows, width);
    DeviceBuffer<bf16> doa(oa), dob(ob), dout(oa.size());
    DeviceBuffer<float> dla(la), dlb(lb), dlse(la.size());
    cuda::merge_state(doa.get(), dla.get(), dob.get(), dlb.get(), dout.get(), dlse.get(), rows, width, nullptr);
    // In place (out aliases a).
    cuda::merge_state(doa.get(), dla.get(), dob.get(), dlb.get(), doa.get(), dla.get(), rows, width, nullptr);
    cuda_ok(cudaDeviceSynchronize(), "merge_state");
    for (auto* pair : {&dout, &doa}) {
      const Comparison c = compare_rows(pair->download(), pair == &dout ? dlse.download() : dla.download(), ro, rl,
                                        width, 1, 1, 1e-2);
      EXPECT_EQ(c.bad_rows, 0) << c.worst;
      EXPECT_EQ(c.nonzero_empty, 0);
    }
  }
  {
    const int n = 5;
    const auto op = random_bf16(size_t(n) * rows * width, 5);
    auto lp = random_lse(size_t(n) * rows, 6);
    for (int k = 0; k < n; ++k) lp[size_t(k) * rows + 7] = -std::numeric_limits<float>::infinity();
    std::vector<bf16> ro(size_t(rows) * width);
    std::vector<float> rl(static_cast<size_t>(rows));
    combine_partials(op.data(), lp.data(), n, ro.data(), rl.data(), rows, width);
    DeviceBuffer<bf16> dop(op), dout(ro.size());
    DeviceBuffer<float> dlp(lp), dlse(rl.size());
    cuda::combine_partials(dop.get(), dlp.get(), n, dout.get(), dlse.get(), rows, width, nullptr);
    cuda_ok(cudaDeviceSynchronize(), "combine_partials");
    const Comparison c = compare_rows(dout.download(), dlse.download(), ro, rl, width, 1, 1, 1e-2);
    EXPECT_EQ(c.bad_rows, 0) << c.worst;
    EXPECT_EQ(c.nonzero_empty, 0);
  }
}

PlannerConfig good_config() {
  PlannerConfig c;
  c.backend = Backend::cuda;
  c.mode = Mode::verify;
  c.heads = 16;
  c.num_blocks = 64;
  c.limits = PlanLimits{4, 4, 4096};
  return c;
}

// Construction checks come before any CUDA call: these run on machines without a GPU.
TEST(CudaValidation, RunnerRefusesBadConfigurationsBeforeTouchingTheDevice) {
  auto expect_error = [](PlannerConfig c, float kv_scale, const char* field) {
    try {
      CudaRankRunner r(c, kv_scale, 0.05f);
      ADD_FAILURE() << "accepted a configuration with a bad " << field;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(field), std::string::npos) << e.what();
    }
  };
  PlannerConfig c = good_config();
  c.heads = 129;
  expect_error(c, 1.0f, "heads");
  c = good_config();
  c.backend = Backend::cpu;
  expect_error(c, 1.0f, "backend");
  c = good_config();
  c.dims = LatentDims{256, 64};
  expect_error(c, 1.0f, "dims");
  c = good_config();
  expect_error(c, 0.5f, "kv_scale");  // bf16 cache with a scale
  c = good_config();
  c.kv_dtype = KvDtype::fp8_e4m3;
  expect_error(c, -1.0f, "kv_scale");
  c = good_config();
  c.layout = Layout{2, 2, 1};
  expect_error(c, 1.0f, "rank");
  c = good_config();
  c.mode = Mode::decode;
  c.route = Route::two_stage;
  expect_error(c, 1.0f, "route");
}

TEST(CudaValidation, AttentionRefusesBadParamsBeforeLaunch) {
  AttentionParams p{};
  EXPECT_THROW(cuda::attention(p, nullptr, 132), Error);
  // A plausible set of (fake, never dereferenced) pointers with one bad field each.
  alignas(16) static int32_t arena[64] = {};
  static bf16 q[8];
  static float f[8];
  p.q = q;
  p.kv = reinterpret_cast<const uint8_t*>(q);
  p.out = q;
  p.lse = f;
  p.part_o = p.part_m = p.part_l = f;
  p.plan = PlanView{reinterpret_cast<const PlanHeader*>(arena), arena, arena,
                    reinterpret_cast<const WorkItem*>(arena), arena, 1, 1, 1, 1};
  p.kv_dtype = KvDtype::bf16;
  p.kv_scale = 1.0f;
  p.softmax_scale = 0.05f;
  p.heads = 16;
  p.dim = 576;
  p.rank_dim = 512;
  auto expect_field = [&](AttentionParams bad, const char* field) {
    try {
      cuda::attention(bad, nullptr, 132);
      ADD_FAILURE() << "accepted bad " << field;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(field), std::string::npos) << e.what();
    }
  };
  AttentionParams bad = p;
  bad.heads = 0;
  expect_field(bad, "heads");
  bad = p;
  bad.heads = 200;
  expect_field(bad, "heads");
  bad = p;
  bad.dim = 512;
  expect_field(bad, "dim");
  bad = p;
  bad.rank_dim = 448;
  expect_field(bad, "rank_dim");
  bad = p;
  bad.kv_dtype = KvDtype(7);
  expect_field(bad, "kv_dtype");
  bad = p;
  bad.softmax_scale = std::nanf("");
  expect_field(bad, "softmax_scale");
  bad = p;
  bad.q = nullptr;
  expect_field(bad, "q");
}

TEST(CudaValidation, RunnerRefusesBadBatchesAndAttendWithoutPlan) {
  DCPMLA_REQUIRE_GPU();
  CudaRankRunner r(good_config(), 1.0f, 0.05f);
  static bf16 dummy[4];
  EXPECT_THROW(r.attend(dummy, dummy, reinterpret_cast<float*>(dummy), nullptr), Error);
  const std::vector<int32_t> lens{10, -3};
  const std::vector<int32_t> tables(2, 0);
  try {
    r.plan(BatchDesc{lens, 1, tables, 1}, nullptr);
    ADD_FAILURE() << "accepted a negative length";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("seq_lens[1]"), std::string::npos) << e.what();
  }
  const std::vector<int32_t> lens2{100};
  const std::vector<int32_t> bad_table{99, 99};
  EXPECT_THROW(r.plan(BatchDesc{lens2, 1, bad_table, 2}, nullptr), Error);  // block id out of range
  const std::vector<int32_t> lens3{10};
  EXPECT_THROW(r.plan(BatchDesc{lens3, 9, std::vector<int32_t>(1, 0), 1}, nullptr), Error);  // qlen > max
}

// Which kernel runs where (host-side dispatch, no device needed): the wgmma kernel serves
// 64-row CTAs by default, the fp8 swap kernel 16-row CTAs of fp8 caches, the mma.sync
// kernel the other 16/32-row ones and every knob only it has; each can be forced at any
// shape (the fp8 swap kernel for fp8 caches only); an unknown kernel is refused.
TEST(CudaValidation, KernelVariantDispatch) {
  using cuda::AttentionTuning;
  for (KvDtype d : {KvDtype::bf16, KvDtype::fp8_e4m3, KvDtype::fp8_e5m2}) {
    const bool fp8 = d != KvDtype::bf16;
    const cuda::AttentionVariant v128 = cuda::attention_variant(1, 128, d);
    EXPECT_EQ(v128.kernel, 2);
    EXPECT_EQ(v128.rows_per_cta, 64);
    EXPECT_EQ(cuda::attention_variant(4, 16, d).kernel, 2);  // verify: 64 rows share each tile
    EXPECT_EQ(cuda::attention_variant(1, 16, d).kernel, fp8 ? 3 : 1);
    EXPECT_EQ(cuda::attention_variant(2, 16, d).kernel, 1);
    const cuda::AttentionVariant forced = cuda::attention_variant(1, 16, d, AttentionTuning{0, 0, 2});
    EXPECT_EQ(forced.kernel, 2);
    EXPECT_EQ(forced.rows_per_cta, 64);  // 16 rows padded inside the CTA
    EXPECT_GT(forced.smem_bytes, 200 * 1024);
    const cuda::AttentionVariant swap = cuda::attention_variant(1, 128, d, AttentionTuning{0, 0, 3});
    EXPECT_EQ(swap.kernel, fp8 ? 3 : 2);  // bf16: the default (wgmma at 128 heads)
    EXPECT_EQ(swap.rows_per_cta, fp8 ? 16 : 64);
    EXPECT_EQ(cuda::attention_variant(1, 16, d, AttentionTuning{0, 0, 1}).kernel, 1);
    EXPECT_EQ(cuda::attention_variant(1, 16, d, AttentionTuning{32, 2, 0}).kernel, 1);  // 2 CTAs per SM
    EXPECT_EQ(cuda::attention_variant(1, 128, d, AttentionTuning{0, 0, 1}).kernel, 1);
    EXPECT_EQ(cuda::attention_variant(1, 128, d, AttentionTuning{32, 0, 0}).kernel, 1);  // 32-token tiles
    EXPECT_EQ(cuda::attention_variant(1, 128, d, AttentionTuning{64, 1, 0}).kernel, 2);
  }
  EXPECT_THROW(cuda::attention_variant(1, 16, KvDtype::bf16, AttentionTuning{0, 0, 4}), Error);
  EXPECT_THROW(cuda::attention_variant(1, 16, KvDtype::bf16, AttentionTuning{0, 0, -1}), Error);
}

}  // namespace
}  // namespace dcpmla::testing
