// The small kernels against their CPU definitions: the KV write kernel bit for bit on
// values chosen to hit fp8 rounding ties, saturation, subnormals and specials; merge_state
// and combine_partials (natural-log LSE merge) with -inf partials. Plus validation: the
// CUDA entry points refuse what the CPU path refuses, before any launch (these run
// without a GPU too).
#include <gtest/gtest.h>

#include <functional>
#include <numeric>

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
  for (int b = 0; b < (d == KvDtype::bf16 ? 0 : 256); ++b) {
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

      // The scale as a host float, then as a device float read at run time: same bytes.
      for (bool device_scale : {false, true}) {
        if (device_scale && d == KvDtype::bf16) continue;
        DeviceBuffer<uint8_t> cache(poisoned);
        DeviceBuffer<bf16> dl(lat);
        DeviceBuffer<int64_t> ds(slots);
        DeviceBuffer<float> dscale(std::vector<float>{scale});
        DeviceBuffer<int> errors(std::vector<int>{0});
        const KvScale ks = device_scale ? KvScale{1.0f, dscale.get()} : KvScale{scale};
        cuda::write_kv(KvCache{cache.get(), cfg.num_blocks, 1, dim, d}, dl.get(), ds.get(), int64_t(slots.size()), ks,
                       nullptr, errors.get());
        cuda_ok(cudaDeviceSynchronize(), "write_kv");
        const std::vector<uint8_t> got = cache.download();
        int64_t diff = 0;
        for (size_t i = 0; i < got.size(); ++i) diff += got[i] != host.data()[i];
        EXPECT_EQ(diff, 0) << to_string(d) << " scale " << scale << (device_scale ? " (device scale)" : "");
        EXPECT_EQ(errors.download()[0], 0);
      }
    }
}

// A device slot mapping outside the cache is never written: skipped and counted.
TEST(CudaWriteKv, OutOfRangeSlotsAreSkippedAndCounted) {
  DCPMLA_REQUIRE_GPU();
  const std::vector<bf16> lat = random_bf16(3 * 576, 9);
  const std::vector<int64_t> slots{1, 4, -7};  // a 4-slot cache: 4 and -7 are outside
  DeviceBuffer<uint8_t> cache(std::vector<uint8_t>(4 * 576 * 2, 0xff));
  DeviceBuffer<bf16> dl(lat);
  DeviceBuffer<int64_t> ds(slots);
  DeviceBuffer<int> errors(std::vector<int>{0});
  cuda::write_kv(KvCache{cache.get(), 4, 1, 576, KvDtype::bf16}, dl.get(), ds.get(), 3, KvScale{}, nullptr, errors.get());
  cuda_ok(cudaDeviceSynchronize(), "write_kv");
  EXPECT_EQ(errors.download()[0], 2);
  const std::vector<uint8_t> got = cache.download();
  for (size_t i = 0; i < got.size(); ++i) {
    if (i / (576 * 2) != 1) {
      EXPECT_EQ(got[i], 0xff) << "byte " << i << " outside slot 1 was written";
    }
  }
}

// The device slot mapping equals the host slot_of (layout.h) for every rank, interleave and
// block size, on random positions and permuted tables; bad entries give PAD and count.
TEST(CudaSlotMapping, EqualsTheHostMapping) {
  DCPMLA_REQUIRE_GPU();
  std::mt19937_64 rng(17);
  for (int world : {1, 3, 4})
    for (int interleave : {1, 2})
      for (int block : {2, 16, 64}) {
        const int batch = 3, width = 8;
        const int64_t num_blocks = batch * width;
        std::vector<int32_t> tables(size_t(batch) * width);
        std::iota(tables.begin(), tables.end(), 0);
        std::shuffle(tables.begin(), tables.end(), rng);
        std::vector<int64_t> positions;
        std::vector<int32_t> requests;
        const int64_t span = int64_t(width) * block * world;  // positions the tables cover
        for (int k = 0; k < 200; ++k) {
          positions.push_back(int64_t(rng() % uint64_t(span)));
          requests.push_back(int32_t(rng() % batch));
        }
        positions.push_back(span * 4);  // past the table on its owner
        requests.push_back(0);
        for (int rank = 0; rank < world; ++rank) {
          const Layout layout{world, rank, interleave};
          std::vector<int64_t> want(positions.size());
          int64_t bad = 0;
          for (size_t k = 0; k < positions.size(); ++k) {
            const auto table = std::span<const int32_t>(tables).subspan(size_t(requests[k]) * width, width);
            try {
              want[k] = slot_of(positions[k], table, block, num_blocks, layout);
            } catch (const Error&) {
              want[k] = kPadSlot;
              ++bad;
            }
          }
          DeviceBuffer<int64_t> dp(positions), dslots(positions.size());
          DeviceBuffer<int32_t> dr(requests), dt(tables);
          DeviceBuffer<int> errors(std::vector<int>{0});
          cuda::slot_mapping(dp.get(), dr.get(), int64_t(positions.size()), dt.get(), batch, width, block, num_blocks,
                             layout, dslots.get(), nullptr, errors.get());
          cuda_ok(cudaDeviceSynchronize(), "slot_mapping");
          EXPECT_EQ(dslots.download(), want) << "world " << world << " rank " << rank << " I " << interleave
                                             << " block " << block;
          EXPECT_EQ(errors.download()[0], bad);
        }
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

AttentionConfig good_config() {
  AttentionConfig c;
  c.heads = 16;
  c.limits = PlanLimits{4, 4, 4096};
  c.softmax_scale = 0.05f;
  return c;
}

// Construction checks come before any CUDA call: these run on machines without a GPU.
TEST(CudaValidation, AttentionRefusesBadConfigurationsBeforeTouchingTheDevice) {
  auto expect_error = [](AttentionConfig c, const char* field) {
    try {
      cuda::Attention a(c);
      ADD_FAILURE() << "accepted a configuration with a bad " << field;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(field), std::string::npos) << e.what();
    }
  };
  AttentionConfig c = good_config();
  c.heads = 4097;
  expect_error(c, "'heads' = 4097");
  c = good_config();
  c.dims = LatentDims{256, 64};
  expect_error(c, "dims");
  c = good_config();
  c.softmax_scale = 1e-40f;  // subnormal
  expect_error(c, "softmax_scale");
  c = good_config();
  c.layout = Layout{2, 2, 1};
  expect_error(c, "rank");
  c = good_config();
  c.limits.max_batch = 0;
  expect_error(c, "max_batch");
}

TEST(CudaValidation, AttentionRefusesBadParamsBeforeLaunch) {
  AttentionParams p{};
  EXPECT_THROW(cuda::attention(p, nullptr, 132), Error);
  // A plausible set of (fake, never dereferenced) pointers with one bad field each.
  alignas(16) static int32_t arena[64] = {};
  alignas(16) static bf16 q[8];
  alignas(16) static float f[8];
  p.q = q;
  p.kv = reinterpret_cast<const uint8_t*>(q);
  p.out = q;
  p.lse = f;
  p.part_o = p.part_m = p.part_l = f;
  p.plan = PlanView{reinterpret_cast<const PlanHeader*>(arena),
                    arena,
                    arena,
                    arena,
                    reinterpret_cast<const WorkItem*>(arena),
                    arena,
                    arena,
                    arena,
                    1,
                    1,
                    1,
                    1,
                    1};
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
  bad.heads = 4097;
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
  // Misaligned pointers (a vector access would fault on the device and kill the context):
  // q, kv and out need 16 bytes, lse and a device kv_scale 4.
  bad = p;
  bad.q = q + 1;
  expect_field(bad, "'q' = address");
  bad = p;
  bad.kv = reinterpret_cast<const uint8_t*>(q) + 8;
  expect_field(bad, "'kv_cache' = address");
  bad = p;
  bad.out = q + 4;  // 8 bytes: enough for the combine's stores, not for the 16 the API asks
  expect_field(bad, "'out' = address");
  bad = p;
  bad.lse = reinterpret_cast<float*>(reinterpret_cast<char*>(f) + 2);
  expect_field(bad, "'lse' = address");
  bad = p;
  bad.kv_scale_dev = reinterpret_cast<const float*>(reinterpret_cast<const char*>(f) + 2);
  expect_field(bad, "'kv_scale' = address");
  // The split-K workspace: partials move 16 bytes at a time, m and l as floats.
  bad = p;
  bad.part_o = f + 1;
  expect_field(bad, "'part_o' = address");
  bad = p;
  bad.part_l = reinterpret_cast<float*>(reinterpret_cast<char*>(f) + 2);
  expect_field(bad, "'part_l' = address");
  // The diagnostics stamps are uint64 (4-byte aligned was taken), the plan's arrays int32 read
  // by 4-byte cp.async (an odd view was taken: the tenth audit's second half).
  bad = p;
  bad.trace = reinterpret_cast<uint64_t*>(f + 1);
  expect_field(bad, "'trace' = address");
  bad = p;
  bad.plan.row_local_len = reinterpret_cast<const int32_t*>(reinterpret_cast<const char*>(arena) + 2);
  expect_field(bad, "'plan.row_local_len' = address");
  bad = p;
  bad.plan.header = reinterpret_cast<const PlanHeader*>(reinterpret_cast<const char*>(arena) + 1);
  expect_field(bad, "'plan.header' = address");
  // An SM count past any GPU made the grids overflow int (a CUDA launch error, not a refusal).
  try {
    cuda::attention(p, nullptr, 1 << 20);
    ADD_FAILURE() << "accepted num_sms 2^20";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'num_sms' = 1048576"), std::string::npos) << e.what();
  }
  // A negative SM count was taken as 0 ("ask the device").
  try {
    cuda::attention(p, nullptr, -1);
    ADD_FAILURE() << "accepted num_sms -1";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'num_sms' = -1"), std::string::npos) << e.what();
  }
}


// Bad batches at plan(), bad caches and scales at run(): refused before any launch, with an
// error naming the field.
TEST(CudaValidation, AttentionRefusesBadBatchesCachesAndRunWithoutPlan) {
  DCPMLA_REQUIRE_GPU();
  cuda::Attention a(good_config());
  DeviceBuffer<uint8_t> bytes(size_t(64) * 64 * 576 * 2 + 16);
  DeviceBuffer<bf16> q(4 * 4 * 16 * 576), out(4 * 4 * 16 * 512);
  DeviceBuffer<float> lse(4 * 4 * 16);
  const KvCache good{bytes.get(), 64, 64, 576, KvDtype::bf16};
  auto expect_field = [](const std::function<void()>& fn, const char* field) {
    try {
      fn();
      ADD_FAILURE() << "accepted a bad " << field;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(field), std::string::npos) << e.what();
    }
  };
  expect_field([&] { a.run(q.get(), good, KvScale{}, out.get(), lse.get(), nullptr); }, "plan");
  const std::vector<int32_t> lens{10, -3};
  const std::vector<int32_t> tables(2, 0);
  expect_field([&] { a.plan(BatchDesc{lens, 1, tables, 1}, nullptr); }, "seq_lens[1]");
  const std::vector<int32_t> lens3{10};
  expect_field([&] { a.plan(BatchDesc{lens3, 9, std::vector<int32_t>(1, 0), 1}, nullptr); }, "qlen");
  const std::vector<int32_t> many(5, 10);
  expect_field([&] { a.plan(BatchDesc{many, 1, std::vector<int32_t>(5, 0), 1}, nullptr); }, "batch");
  expect_field([&] { a.plan(BatchDesc{std::vector<int32_t>{5000}, 1, std::vector<int32_t>(79, 0), 79}, nullptr); },
               "max_local_kv_len");
  // A plan naming block 99: a 64-block cache is too small for it.
  const std::vector<int32_t> lens2{100};
  const std::vector<int32_t> table{3, 99};
  a.plan(BatchDesc{lens2, 1, table, 2}, nullptr);
  expect_field([&] { a.run(q.get(), good, KvScale{}, out.get(), lse.get(), nullptr); }, "num_blocks");
  a.plan(BatchDesc{lens2, 1, std::vector<int32_t>{3, 9}, 2}, nullptr);
  KvCache bad = good;
  bad.data = nullptr;
  expect_field([&] { a.run(q.get(), bad, KvScale{}, out.get(), lse.get(), nullptr); }, "kv_cache");
  bad = good;
  bad.data = bytes.get() + 1;
  expect_field([&] { a.run(q.get(), bad, KvScale{}, out.get(), lse.get(), nullptr); }, "aligned");
  bad = good;
  bad.dtype = KvDtype::fp8_e4m3;
  expect_field([&] { a.run(q.get(), bad, KvScale{}, out.get(), lse.get(), nullptr); }, "dtype");
  bad = good;
  bad.block_size = 16;
  expect_field([&] { a.run(q.get(), bad, KvScale{}, out.get(), lse.get(), nullptr); }, "block_size");
  expect_field([&] { a.run(q.get(), good, KvScale{0.5f}, out.get(), lse.get(), nullptr); }, "kv_scale");
  expect_field([&] { a.run(nullptr, good, KvScale{}, out.get(), lse.get(), nullptr); }, "'q/out/lse' = null");
  expect_field([&] { a.run(q.get(), good, KvScale{}, out.get(), nullptr, nullptr); }, "'q/out/lse' = null");
  // Misaligned q, out, lse and cache (2 bytes past 16: whole bf16 values, which the CPU backend
  // takes): refused before any launch (a fault would kill the context).
  {
    KvCache shifted = good;
    shifted.data = static_cast<uint8_t*>(good.data) + 2;
    shifted.num_blocks -= 1;  // inside the allocation
    expect_field([&] { a.run(q.get(), shifted, KvScale{}, out.get(), lse.get(), nullptr); }, "'kv_cache' = address");
  }
  expect_field([&] { a.run(q.get() + 1, good, KvScale{}, out.get(), lse.get(), nullptr); }, "'q' = address");
  expect_field([&] { a.run(q.get(), good, KvScale{}, out.get() + 4, lse.get(), nullptr); }, "'out' = address");
  expect_field(
      [&] {
        a.run(q.get(), good, KvScale{}, out.get(), reinterpret_cast<float*>(reinterpret_cast<char*>(lse.get()) + 2),
              nullptr);
      },
      "'lse' = address");
  // Outputs sharing memory with an input or with each other (the kernels would read what they
  // wrote): refused before any launch.
  expect_field([&] { a.run(q.get(), good, KvScale{}, q.get() + 1024, lse.get(), nullptr); }, "overlapping q");
  expect_field([&] { a.run(q.get(), good, KvScale{}, reinterpret_cast<bf16*>(bytes.get()), lse.get(), nullptr); },
               "overlapping kv_cache");
  expect_field([&] { a.run(q.get(), good, KvScale{}, out.get(), reinterpret_cast<float*>(out.get() + 64), nullptr); },
               "overlapping lse");
  cuda_ok(cudaDeviceSynchronize(), "nothing was launched");
}

// Which kernel runs where (host-side dispatch, no device needed): the wgmma kernel serves
// 64-row CTAs of every cache and bf16's 32-row ones (padded to 64), the fp8 swap kernel fp8
// caches below 64 rows (16- or 32-row CTAs), the bf16 swap kernel bf16's 16-row CTAs, the
// mma.sync kernel every knob only it has; each can be forced at any shape (the fp8 swap
// kernel for fp8 caches only, the bf16 swap kernel for bf16 ones, in groups of 16 or 32
// rows); an unknown kernel is refused.
TEST(CudaValidation, KernelVariantDispatch) {
  using cuda::AttentionTuning;
  for (KvDtype d : {KvDtype::bf16, KvDtype::fp8_e4m3, KvDtype::fp8_e5m2}) {
    const bool fp8 = d != KvDtype::bf16;
    // 64-row CTAs take the wgmma kernel for every cache (fp8 through its dequantising
    // producer); fewer rows take the fp8 swap kernel (fp8), or for bf16 the bf16 swap kernel
    // (16 rows) or the wgmma kernel padded to 64 rows (32 rows).
    const cuda::AttentionVariant v128 = cuda::attention_variant(1, 128, d);
    EXPECT_EQ(v128.kernel, 2);
    EXPECT_EQ(v128.rows_per_cta, 64);
    EXPECT_EQ(cuda::attention_variant(4, 16, d).kernel, 2);  // verify: 64 rows share each tile
    EXPECT_EQ(cuda::attention_variant(1, 32, d).kernel, fp8 ? 3 : 2);
    EXPECT_EQ(cuda::attention_variant(1, 32, d).rows_per_cta, fp8 ? 32 : 64);
    EXPECT_EQ(cuda::attention_variant(1, 16, d).kernel, fp8 ? 3 : 4);
    EXPECT_EQ(cuda::attention_variant(1, 16, d).rows_per_cta, 16);
    EXPECT_EQ(cuda::attention_variant(2, 16, d).kernel, fp8 ? 3 : 2);
    const cuda::AttentionVariant forced = cuda::attention_variant(1, 16, d, AttentionTuning{0, 0, 2});
    EXPECT_EQ(forced.kernel, 2);
    EXPECT_EQ(forced.rows_per_cta, 64);  // 16 rows padded inside the CTA
    EXPECT_GT(forced.smem_bytes, 200 * 1024);
    const cuda::AttentionVariant swap = cuda::attention_variant(1, 128, d, AttentionTuning{0, 0, 3});
    EXPECT_EQ(swap.kernel, fp8 ? 3 : 2);  // bf16: the default (wgmma at 128 heads)
    EXPECT_EQ(swap.rows_per_cta, fp8 ? 32 : 64);  // fp8: 128 rows in groups of 32
    EXPECT_EQ(cuda::attention_variant(1, 16, d, AttentionTuning{0, 0, 1}).kernel, 1);
    EXPECT_EQ(cuda::attention_variant(1, 16, d, AttentionTuning{32, 2, 0}).kernel, 1);  // 2 CTAs per SM
    EXPECT_EQ(cuda::attention_variant(1, 128, d, AttentionTuning{0, 0, 1}).kernel, 1);
    EXPECT_EQ(cuda::attention_variant(1, 128, d, AttentionTuning{32, 0, 0}).kernel, 1);  // 32-token tiles
    EXPECT_EQ(cuda::attention_variant(1, 128, d, AttentionTuning{64, 1, 0}).kernel, 2);
    const cuda::AttentionVariant bswap = cuda::attention_variant(1, 128, d, AttentionTuning{0, 0, 4});
    EXPECT_EQ(bswap.kernel, fp8 ? 2 : 4);  // fp8: the default (wgmma at 128 heads)
    EXPECT_EQ(bswap.rows_per_cta, fp8 ? 64 : 32);
    const cuda::AttentionVariant bswap16 = cuda::attention_variant(1, 16, d, AttentionTuning{0, 0, 4});
    EXPECT_EQ(bswap16.kernel, fp8 ? 3 : 4);
    EXPECT_EQ(bswap16.rows_per_cta, 16);
    EXPECT_EQ(cuda::attention_variant(3, 8, d, AttentionTuning{0, 0, 4}).rows_per_cta, 32);
  }
  EXPECT_THROW(cuda::attention_variant(1, 16, KvDtype::bf16, AttentionTuning{0, 0, 5}), Error);
  EXPECT_THROW(cuda::attention_variant(1, 16, KvDtype::bf16, AttentionTuning{0, 0, -1}), Error);
}

// fn throws dcpmla::Error whose message holds every one of `parts`.
void expect_error(const std::function<void()>& fn, const std::vector<std::string>& parts) {
  try {
    fn();
    ADD_FAILURE() << "accepted; expected an error with '" << parts.front() << "'";
  } catch (const Error& e) {
    for (const std::string& part : parts) EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
  }
}

// attention_variant() is public: a dtype, max_qlen or head count no kernel serves is refused,
// naming it (before the dtype reaches the variant table's bit per dtype). No device needed.
TEST(CudaValidation, AttentionVariantRefusesBadArguments) {
  expect_error([] { (void)cuda::attention_variant(1, 16, KvDtype(7)); }, {"'kv_dtype' = 7"});
  expect_error([] { (void)cuda::attention_variant(1, 16, KvDtype(40)); }, {"'kv_dtype' = 40"});
  expect_error([] { (void)cuda::attention_variant(1, 16, KvDtype(-1)); }, {"'kv_dtype' = -1"});
  expect_error([] { (void)cuda::attention_variant(0, 16, KvDtype::bf16); }, {"'max_qlen' = 0"});
  expect_error([] { (void)cuda::attention_variant(kMaxQlen + 1, 16, KvDtype::bf16); },
               {"'max_qlen' = " + std::to_string(kMaxQlen + 1)});
  expect_error([] { (void)cuda::attention_variant(1, 0, KvDtype::bf16); }, {"'heads' = 0"});
  expect_error([] { (void)cuda::attention_variant(1, 4097, KvDtype::fp8_e4m3); }, {"'heads' = 4097"});
  expect_error([] { (void)cuda::attention_variant(1, -4, KvDtype::bf16); }, {"'heads' = -4"});
  EXPECT_EQ(cuda::attention_variant(kMaxQlen, 128, KvDtype::fp8_e5m2).rows_per_cta, 64);  // the edges pass
  // A configuration with a bad field is still refused by the planner's check, naming it as before.
  AttentionConfig c = good_config();
  c.limits.max_qlen = 0;
  expect_error([&] { cuda::Attention a(c); }, {"'limits.max_qlen' = 0"});
  c = good_config();
  c.kv_dtype = KvDtype(7);
  expect_error([&] { cuda::Attention a(c); }, {"'kv_dtype' = 7"});
}

// Misaligned pointers to the device write path are refused before any launch (the kernel
// reads latents 16 bytes at a time). Fake, never dereferenced pointers: no device needed.
TEST(CudaValidation, WriteKvRefusesMisalignedPointers) {
  alignas(256) static uint8_t mem[4096];
  const KvCache bf16_cache{mem, 4, 1, 576, KvDtype::bf16};
  const KvCache fp8_cache{mem, 4, 1, 576, KvDtype::fp8_e4m3};
  const auto* latents = reinterpret_cast<const bf16*>(mem + 1024);
  const auto* slots = reinterpret_cast<const int64_t*>(mem + 2048);
  const auto* scale = reinterpret_cast<const float*>(mem + 3072);
  expect_error([&] { cuda::write_kv(bf16_cache, latents + 4, slots, 1, KvScale{}, nullptr); },
               {"'latents' = address", "16-byte aligned"});
  const KvCache shifted_cache{mem + 2, 3, 1, 576, KvDtype::bf16};  // whole bf16 values, not 16 bytes
  expect_error([&] { cuda::write_kv(shifted_cache, latents, slots, 1, KvScale{}, nullptr); },
               {"'kv_cache' = address", "16-byte aligned"});
  expect_error(
      [&] {
        cuda::write_kv(bf16_cache, latents, reinterpret_cast<const int64_t*>(mem + 2052), 1, KvScale{}, nullptr);
      },
      {"'slot_mapping' = address", "8-byte aligned"});
  expect_error(
      [&] {
        cuda::write_kv(fp8_cache, latents, slots, 1,
                       KvScale{1.0f, reinterpret_cast<const float*>(reinterpret_cast<const uint8_t*>(scale) + 2)},
                       nullptr);
      },
      {"'kv_scale' = address", "4-byte aligned"});
  expect_error(
      [&] {
        cuda::write_kv(bf16_cache, latents, slots, 1, KvScale{}, nullptr,
                       reinterpret_cast<int*>(reinterpret_cast<uint8_t*>(mem + 3072) + 2));
      },
      {"'errors' = address", "4-byte aligned"});
}

// The slot mapping and the merges read and write whole elements: misaligned pointers fault and
// kill the context, so they are refused, as are outputs over inputs. Fake, never dereferenced
// pointers: no device needed.
TEST(CudaValidation, SlotMappingAndMergesRefuseMisalignedOrOverlappingPointers) {
  alignas(256) static uint8_t mem[4096];
  const auto* positions = reinterpret_cast<const int64_t*>(mem);
  const auto* requests = reinterpret_cast<const int32_t*>(mem + 512);
  const auto* tables = reinterpret_cast<const int32_t*>(mem + 1024);
  auto* slots = reinterpret_cast<int64_t*>(mem + 1536);
  const Layout layout{1, 0, 1};
  auto map = [&](const int64_t* pos, const int32_t* req, const int32_t* tab, int64_t* out) {
    cuda::slot_mapping(pos, req, 2, tab, 1, 1, 16, 4, layout, out, nullptr);
  };
  expect_error([&] { map(positions + 0, requests, tables, reinterpret_cast<int64_t*>(mem + 1540)); },
               {"'slots' = address", "8-byte aligned"});
  expect_error([&] { map(reinterpret_cast<const int64_t*>(mem + 4), requests, tables, slots); },
               {"'positions' = address"});
  expect_error([&] { map(positions, reinterpret_cast<const int32_t*>(mem + 514), tables, slots); },
               {"'requests' = address"});
  expect_error([&] { map(positions, requests, tables, reinterpret_cast<int64_t*>(mem + 8)); },
               {"'slots' = 16 bytes at", "overlapping positions"});
  // batch x table_width x 4 bytes past int64 wrapped negative, and the table's overlap went unseen.
  expect_error(
      [&] { cuda::slot_mapping(positions, requests, 2, tables, INT32_MAX, INT32_MAX, 16, 4, layout, slots, nullptr); },
      {"'table_width' = 2147483647", "fit int64"});
  const auto* o = reinterpret_cast<const bf16*>(mem + 2048);
  const auto* l = reinterpret_cast<const float*>(mem + 3072);
  auto* o_out = reinterpret_cast<bf16*>(mem + 2560);
  auto* l_out = reinterpret_cast<float*>(mem + 3584);
  const auto* odd = reinterpret_cast<const bf16*>(mem + 2049);
  expect_error([&] { cuda::merge_state(odd, l, o + 8, l + 1, o_out, l_out, 1, 8, nullptr); }, {"'o_a' = address"});
  // Both lse partials misaligned alike: their offset is a whole float, each is not.
  const auto* l2 = reinterpret_cast<const float*>(mem + 3074);
  expect_error([&] { cuda::merge_state(o, l2, o + 8, l2 + 1, o_out, l_out, 1, 8, nullptr); }, {"'lse_a' = address"});
  expect_error([&] { cuda::combine_partials(o, l2, 2, o_out, l_out, 1, 8, nullptr); }, {"'lse_parts' = address"});
  expect_error([&] { cuda::combine_partials(o, l, 2, const_cast<bf16*>(o) + 8, l_out, 1, 8, nullptr); },
               {"'o' = 16 bytes at", "overlapping o_parts"});
}

// A device ordinal past the machine's GPUs is an input error naming `device` (not CUDA's
// "invalid device ordinal"), for the Attention constructors, workspace_bytes and the
// conformance ranks. No device needed (CI: 0 GPUs, so device 0 is already past them).
TEST(CudaValidation, BadDeviceOrdinalIsRefused) {
  const int n = cuda_device_count();
  const std::string field = "'device' = " + std::to_string(n);
  expect_error([&] { cuda::Attention a(good_config(), n); }, {field, "a CUDA device in [0, "});
  expect_error([&] { cuda::Attention a(good_config(), n + 5); }, {"'device' = " + std::to_string(n + 5)});
  expect_error([&] { cuda::Attention a(good_config(), nullptr, 0, n); }, {field});
  expect_error([&] { (void)cuda::Attention::workspace_bytes(good_config(), n); }, {field});
  const CacheConfig cache{8, 64, 576, KvDtype::bf16, 1.0f};
  expect_error([&] { (void)cuda::rank_engine_factory(n)(good_config(), cache); }, {field});
  expect_error([&] { (void)cuda::rank_engine_factory(-1)(good_config(), cache); }, {"'device' = -1"});
  // DeviceScope too, where it switches (it reached cudaSetDevice: CUDA's "invalid device ordinal");
  // without a GPU the current device it would switch from is refused first, also naming `device`.
  expect_error([&] { cuda::DeviceScope scope(n); }, {n > 0 ? field : "'device' = the current device"});
  expect_error([&] { cuda::DeviceScope scope(-3); }, {n > 0 ? "'device' = -3" : "'device' = the current device"});
}

// The current device (no ordinal) without a usable GPU is named alike, not reported as a
// failed cudaGetDevice (the ninth audit: cudaErrorInsufficientDriver on a machine without a
// driver). With a GPU the current device is used: nothing to refuse.
TEST(CudaValidation, CurrentDeviceWithoutAGpuIsRefused) {
  if (cuda_device_count() > 0) GTEST_SKIP() << "a GPU is present";
  const std::string field = "'device' = the current device: expected a CUDA device (this machine has no usable GPU";
  expect_error([] { cuda::Attention a(good_config()); }, {field});
  expect_error([] { (void)cuda::Attention::workspace_bytes(good_config()); }, {field});
}

// The caller's workspace is checked before anything is allocated: null with bytes > 0 is
// refused (it used to allocate a workspace of its own), as are a short or misaligned one.
TEST(CudaValidation, CallerWorkspaceIsCheckedFirst) {
  expect_error([] { cuda::Attention a(good_config(), nullptr, 4096); }, {"'workspace' = null", "4096 bytes"});
  DCPMLA_REQUIRE_GPU();
  const size_t need = cuda::Attention::workspace_bytes(good_config());
  DeviceBuffer<uint8_t> ws(need + 256);
  expect_error([&] { cuda::Attention a(good_config(), ws.get(), need - 1); },
               {"'workspace bytes' = " + std::to_string(need - 1), std::to_string(need)});
  expect_error([&] { cuda::Attention a(good_config(), ws.get() + 16, need); },
               {"'workspace' = address", "256-byte aligned"});
  cuda::Attention ok(good_config(), ws.get(), need);  // the right size at a 256-byte boundary
  cuda::Attention own(good_config(), nullptr, 0);     // null with 0 bytes: its own workspace
  EXPECT_EQ(ok.num_sms(), own.num_sms());
  // The run writes the caller's workspace (plan and partials): no buffer of the call may share it.
  ok.plan(BatchDesc{std::vector<int32_t>{100}, 1, std::vector<int32_t>{0, 1}, 2}, nullptr);
  DeviceBuffer<uint8_t> bytes(size_t(4) * 64 * 576 * 2);
  DeviceBuffer<bf16> q(16 * 576), out(16 * 512);
  DeviceBuffer<float> lse(16);
  const KvCache cache{bytes.get(), 4, 64, 576, KvDtype::bf16};
  auto* inside = reinterpret_cast<bf16*>(ws.get() + 256);
  expect_error([&] { ok.run(q.get(), cache, KvScale{}, inside, lse.get(), nullptr); },
               {"'out' = ", "overlapping workspace"});
  expect_error([&] { ok.run(inside, cache, KvScale{}, out.get(), lse.get(), nullptr); },
               {"'workspace' = ", "overlapping q"});
  cuda_ok(cudaDeviceSynchronize(), "nothing was launched");
}

// A planner that never cuts (one_stage) needs no split-K partials, so 4096 heads at max_qlen 64
// and max_batch 256 build with only the plan's region (the partials were 209 GB, refused by
// cudaMalloc); a split workspace larger than the device is refused by name before cudaMalloc.
TEST(CudaValidation, OneStageHasNoSplitWorkspaceAndAnImpossibleOneIsRefusedByName) {
  DCPMLA_REQUIRE_GPU();
  AttentionConfig c = good_config();
  c.heads = 4096;
  c.limits = PlanLimits{256, 64, 4096};
  c.route = Route::one_stage;
  EXPECT_LT(cuda::Attention::workspace_bytes(c), size_t(64) << 20);
  cuda::Attention one(c);
  c.route = Route::split_k;
  EXPECT_GT(cuda::Attention::workspace_bytes(c), size_t(150) << 30);
  expect_error([&] { cuda::Attention split(c); }, {"'split-K workspace'", "GiB"});
}

// A graph captured around run() replays with whatever plan is current: once a run() was
// captured over a cache of N blocks, plan() refuses tables naming block N or more (and keeps
// the previous plan), while before any capture such a table is planned (run() refuses it).
TEST(CudaGraphBound, PlanAfterCaptureRefusesTablesPastTheCapturedCache) {
  DCPMLA_REQUIRE_GPU();
  cuda::Attention a(good_config());
  DeviceBuffer<uint8_t> bytes(size_t(64) * 64 * 576 * 2);
  DeviceBuffer<bf16> q(4 * 4 * 16 * 576), out(4 * 4 * 16 * 512);
  DeviceBuffer<float> lse(4 * 4 * 16);
  const KvCache cache{bytes.get(), 64, 64, 576, KvDtype::bf16};
  cudaStream_t stream;
  cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  const std::vector<int32_t> lens{100};
  auto plan = [&](int32_t second_block) {
    const std::vector<int32_t> table{3, second_block};
    a.plan(BatchDesc{lens, 1, table, 2}, stream);
  };
  plan(99);  // no capture yet: planned (a run() would refuse the 64-block cache)
  EXPECT_EQ(a.current_plan().stats().max_block, 99);
  plan(9);
  cuda_ok(cudaStreamSynchronize(stream), "plan upload");
  cudaGraph_t graph;
  cuda_ok(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), "cudaStreamBeginCapture");
  a.run(q.get(), cache, KvScale{}, out.get(), lse.get(), stream);
  // plan() inside the capture would record the upload of its staging copy: refused first, before
  // any call the capture forbids.
  expect_error([&] { plan(9); }, {"'plan' = called while its stream captures a CUDA graph"});
  cuda_ok(cudaStreamEndCapture(stream, &graph), "cudaStreamEndCapture");
  expect_error([&] { plan(64); }, {"'block_tables' = block id 64", "a cache of 64 blocks would read past it"});
  EXPECT_EQ(a.current_plan().stats().max_block, 9);  // the refused batch left the previous plan
  // The captured run had 1 query row (16 heads each): with fit_captured_rows a batch of 2 is
  // refused (its replay would write past that run's buffers); without, the buffers are the caller's.
  const std::vector<int32_t> two{100, 100}, two_tables{3, 9, 3, 9};
  expect_error([&] { a.plan(BatchDesc{two, 1, two_tables, 2}, stream, true); }, {"'batch' = 2 query rows", "at most 1"});
  EXPECT_EQ(a.current_plan().header().batch, 1);
  a.plan(BatchDesc{two, 1, two_tables, 2}, stream);
  EXPECT_EQ(a.current_plan().header().batch, 2);
  plan(63);                                          // inside the captured cache
  EXPECT_EQ(a.current_plan().stats().max_block, 63);
  cudaGraphExec_t exec;
  cuda_ok(cudaGraphInstantiate(&exec, graph, 0), "cudaGraphInstantiate");
  cuda_ok(cudaGraphLaunch(exec, stream), "cudaGraphLaunch");
  cuda_ok(cudaStreamSynchronize(stream), "replay over block 63");
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  // A run outside a capture records nothing: a larger cache is no bound.
  DeviceBuffer<uint8_t> bigger(size_t(128) * 64 * 576 * 2);
  a.run(q.get(), KvCache{bigger.get(), 128, 64, 576, KvDtype::bf16}, KvScale{}, out.get(), lse.get(), stream);
  cuda_ok(cudaStreamSynchronize(stream), "run");
  expect_error([&] { plan(64); }, {"'block_tables' = block id 64"});
  cudaStreamDestroy(stream);
}

}  // namespace
}  // namespace dcpmla::testing
