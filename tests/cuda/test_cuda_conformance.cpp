// The conformance path (SPEC §5) with CUDA engines: mla_attention(..., cuda::rank_engine_factory())
// against the same call with the CPU engines, over ranks, routes, merge forms and dtypes, and
// (CudaEnginesMatchCpuEngines) against the float64 reference.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <string>

#include "../common/case_options.h"
#include "cuda_helpers.h"
#include "dcpmla/reference.h"
#include "dcpmla/runner.h"

namespace dcpmla::testing {
namespace {

struct ConformanceCase {
  const char* name;
  Mode mode;
  KvDtype dtype;
  int world, interleave, block_size;
  Route route;
  MergeForm merge;
  int qlen, heads;
  std::vector<int32_t> lens;
  float kv_scale = 1.0f;
};

std::vector<float> normal(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

// Row `row` of out (R values a row): the relative L2 distance of `got` from `want` (absolute
// where `want` is all zeros); NaN when either holds a NaN.
double row_rel_l2(const std::vector<float>& got, const std::vector<float>& want, size_t row, int R) {
  double num = 0, den = 0;
  for (int j = 0; j < R; ++j) {
    const double a = got[row * R + j], e = want[row * R + j];
    num += (a - e) * (a - e);
    den += e * e;
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

// A point of the grids of the NaN and rising-scores tests: a cache dtype, a (mode, qlen,
// heads) shape, a route and a world size.
struct Shape {
  Mode mode;
  int qlen, heads;
};
struct GridPoint {
  KvDtype dtype;
  Shape sh;
  Route route;
  int world;
  std::string name() const {
    return std::string(to_string(dtype)) + " " + std::string(to_string(route)) + " N" + std::to_string(world) + " H" +
           std::to_string(sh.heads) + " q" + std::to_string(sh.qlen);
  }
};
// bf16 and fp8_e4m3, each shape, one_stage and split_k, one rank and three.
std::vector<GridPoint> grid(std::initializer_list<Shape> shapes) {
  std::vector<GridPoint> g;
  for (const KvDtype dtype : {KvDtype::bf16, KvDtype::fp8_e4m3})
    for (const Shape sh : shapes)
      for (const Route route : {Route::one_stage, Route::split_k})
        for (const int world : {1, 3}) g.push_back({dtype, sh, route, world});
  return g;
}
// The same call on the CPU engines and on the CUDA engines.
struct EnginePair {
  AttentionResult cpu, gpu;
};
EnginePair run_on_both(const GridPoint& g, const std::vector<float>& q, const std::vector<float>& kv,
                       const std::vector<int32_t>& lens, int64_t max_len, int block_size, int min_segment_tokens,
                       uint64_t seed) {
  const int B = int(lens.size()), D = 576;
  const struct {
    Mode mode;
    int world, interleave, block_size;
    KvDtype dtype;
    Route route;
  } c{g.sh.mode, g.world, 1, block_size, g.dtype, g.route};
  AttentionOptions o = testing::case_options(c, 1.0f, seed);
  o.min_segment_tokens = min_segment_tokens;
  EnginePair r;
  r.cpu = mla_attention(q, kv, lens, B, g.sh.qlen, g.sh.heads, max_len, D, o);
  o.backend = Backend::cuda;
  r.gpu = mla_attention(q, kv, lens, B, g.sh.qlen, g.sh.heads, max_len, D, o, cuda::rank_engine_factory());
  return r;
}

TEST(CudaConformance, CudaEnginesMatchCpuEngines) {
  DCPMLA_REQUIRE_GPU();
  const std::vector<ConformanceCase> cases{
      {"verify_w4", Mode::verify, KvDtype::bf16, 4, 1, 16, Route::automatic, MergeForm::all_heads, 3, 16,
       {300, 0, 45, 1000}},
      {"verify_two_stage_scatter_e4m3", Mode::verify, KvDtype::fp8_e4m3, 2, 1, 64, Route::two_stage,
       MergeForm::scatter_heads, 4, 16, {500, 4, 77}, 0.5f},
      {"decode_split_e5m2_h128", Mode::decode, KvDtype::fp8_e5m2, 8, 2, 64, Route::split_k, MergeForm::all_heads, 1,
       128, {2000, 1, 0}, 2.0f},
      {"draft_block1", Mode::draft, KvDtype::bf16, 1, 1, 1, Route::one_stage, MergeForm::all_heads, 2, 5, {33, 700}},
  };
  const int D = 576, R = 512;
  for (const auto& c : cases) {
    const int B = int(c.lens.size());
    int64_t max_len = 1;
    for (int32_t L : c.lens) max_len = std::max<int64_t>(max_len, L);
    const auto q = normal(size_t(B) * c.qlen * c.heads * D, 1);
    const auto kv = normal(size_t(B) * size_t(max_len) * D, 2);
    AttentionOptions o = testing::case_options(c, c.kv_scale, 3);
    o.merge = c.merge;
    // Rank 0 holds 250 tokens of decode_split's 2000: a cut needs pieces shorter than the default 256.
    if (c.route == Route::split_k) o.min_segment_tokens = 16;
    const AttentionResult cpu = mla_attention(q, kv, c.lens, B, c.qlen, c.heads, max_len, D, o);
    o.backend = Backend::cuda;
    const AttentionResult gpu = mla_attention(q, kv, c.lens, B, c.qlen, c.heads, max_len, D, o, cuda::rank_engine_factory());
    EXPECT_EQ(cpu.routes, gpu.routes) << c.name;
    if (c.route == Route::split_k) {  // both engines cut (their schedules are their own)
      EXPECT_GT(*std::max_element(cpu.max_segments.begin(), cpu.max_segments.end()), 1) << c.name;
      EXPECT_GT(*std::max_element(gpu.max_segments.begin(), gpu.max_segments.end()), 1) << c.name;
    }
    ASSERT_EQ(cpu.out.size(), gpu.out.size());
    int64_t bad = 0, nan = 0;
    double worst = 0;
    for (size_t row = 0; row < cpu.lse.size(); ++row) {
      for (int j = 0; j < R; ++j) nan += std::isnan(gpu.out[row * R + j]);
      const double rel = row_rel_l2(gpu.out, cpu.out, row, R);
      const float la = gpu.lse[row], lb = cpu.lse[row];
      const double lerr = (std::isinf(la) || std::isinf(lb)) ? (la == lb ? 0.0 : 1e9) : std::fabs(double(la) - lb);
      worst = std::max({worst, rel, lerr});
      if (rel > 1e-2 || lerr > 1e-2 || std::isnan(la)) ++bad;
    }
    EXPECT_EQ(nan, 0) << c.name;
    EXPECT_EQ(bad, 0) << c.name << ": worst error " << worst;
    // And the CUDA engines' answer straight against the float64 reference, at the CPU grid's bound.
    const auto ref = reference_attention(q, kv, c.lens, B, c.qlen, c.heads, max_len, D, c.mode, c.dtype, c.kv_scale,
                                         1.0 / std::sqrt(double(D)), R);
    const ErrorReport err = compare(gpu.out, gpu.lse, ref.out, ref.lse, B, c.qlen, c.heads, R);
    EXPECT_TRUE(err.within(1e-2)) << c.name << " against float64: rel " << err.max_rel_l2 << " lse "
                                  << err.max_lse_err << " nan " << err.nan_count;
  }
}

// NaN containment (docs/design.md): a NaN in one request's kv, and a NaN and infinities in
// q, reach exactly the cells that read them, on the GPU as on the CPU: the NaN cells of out and
// lse are the same, and every other cell matches. The default kernels at 16 and 64 rows for
// bf16 and fp8_e4m3 caches, one_stage and split_k (several segments), one rank and three.
TEST(CudaConformance, NanReachesTheSameCellsAsOnTheCpu) {
  DCPMLA_REQUIRE_GPU();
  const int D = 576;
  const std::vector<int32_t> lens{900, 4, 0, 300};
  const int B = int(lens.size());
  const int64_t max_len = 900;
  for (const GridPoint& g : grid({Shape{Mode::decode, 1, 4}, Shape{Mode::verify, 4, 16}})) {
    const Shape sh = g.sh;
    auto q = normal(size_t(B) * sh.qlen * sh.heads * D, 5);
    auto kv = normal(size_t(B) * size_t(max_len) * D, 6);
    kv[(size_t(0) * max_len + 5) * D + 7] = std::numeric_limits<float>::quiet_NaN();  // request 0, position 5
    // request 3, row 0, head 1
    q[((size_t(3) * sh.qlen + 0) * sh.heads + 1) * D] = std::numeric_limits<float>::quiet_NaN();
    // An infinity in q makes its scores +-inf, and the cell NaN as on the CPU: request 3,
    // row 0, head 0 (+inf, a nope dim) and request 0, last row, head 2 (-inf, a rope dim).
    // The fp8 kernels scale q's rows (pow2_row_scale), where an infinity must poison the row.
    q[((size_t(3) * sh.qlen + 0) * sh.heads + 0) * D + 100] = std::numeric_limits<float>::infinity();
    q[((size_t(0) * sh.qlen + sh.qlen - 1) * sh.heads + 2) * D + 530] = -std::numeric_limits<float>::infinity();
    const auto [cpu, gpu] = run_on_both(g, q, kv, lens, max_len, 16, 32, 9);
    const std::string what = g.name();
    int64_t cpu_nan = 0, mismatched = 0, far = 0;
    for (size_t i = 0; i < cpu.lse.size(); ++i) {
      cpu_nan += std::isnan(cpu.lse[i]);
      mismatched += std::isnan(cpu.lse[i]) != std::isnan(gpu.lse[i]);
      if (!std::isnan(cpu.lse[i]) && std::isfinite(cpu.lse[i]) && std::fabs(cpu.lse[i] - gpu.lse[i]) > 1e-2) ++far;
    }
    for (size_t i = 0; i < cpu.out.size(); ++i) {
      mismatched += std::isnan(cpu.out[i]) != std::isnan(gpu.out[i]);
      if (!std::isnan(cpu.out[i]) && std::fabs(cpu.out[i] - gpu.out[i]) > 2e-2 * (1.0f + std::fabs(cpu.out[i]))) ++far;
    }
    EXPECT_GT(cpu_nan, 0) << what << ": the planted NaNs reached no cell";
    EXPECT_LT(cpu_nan, int64_t(cpu.lse.size()) / 2) << what << ": the NaN spread";
    EXPECT_EQ(mismatched, 0) << what << ": NaN cells differ from the CPU's";
    EXPECT_EQ(far, 0) << what << ": clean cells differ";
  }
}

// Scores that rise along the context (docs/design.md, the lazy running maximum): in every
// request a ramp on q's and kv's first 64 dims lifts the scores by about 38 (base 2) from the
// first token to the last, so a row's running maximum lags the scores by up to its slack and
// moves several times a unit; in requests 0 and 1 one token three quarters in scores about 190
// (base 2) above the ramp, past what float32 holds (2^128), so a maximum that failed to move
// there turns the row into inf / NaN. Heads h with h % 16 < 8 take the ramp negated: their
// scores fall, so their maxima settle on a unit's first tile while the other heads' keep
// moving. A thread of the 64-row kernel holds rows r and r + 8 (heads h and h + 8 of a query
// row), and its warp must redo the exponentials it computed ahead when only the second row's
// maximum moves. GPU against CPU engines, cell by cell, at 16 and 64 rows (the swap kernels
// keep the exact maximum, the wgmma kernel the lazy one), bf16 and fp8_e4m3, one_stage and
// split_k, one rank and three.
TEST(CudaConformance, RisingScoresMatchTheCpu) {
  DCPMLA_REQUIRE_GPU();
  const int D = 576, R = 512, kRamp = 64;
  const std::vector<int32_t> lens{1000, 700, 450, 130};
  const int B = int(lens.size());
  const int64_t max_len = 1000;
  for (const GridPoint& g :
       grid({Shape{Mode::decode, 1, 16}, Shape{Mode::verify, 4, 16}, Shape{Mode::decode, 1, 128}})) {
    const Shape sh = g.sh;
    auto q = normal(size_t(B) * sh.qlen * sh.heads * D, 11);
    auto kv = normal(size_t(B) * size_t(max_len) * D, 12);
    for (size_t row = 0; row < size_t(B) * sh.qlen * sh.heads; ++row)
      for (int d = 0; d < kRamp; ++d) q[row * D + d] += row % size_t(sh.heads) % 16 < 8 ? -2.0f : 2.0f;
    for (int b = 0; b < B; ++b)
      for (int t = 0; t < lens[size_t(b)]; ++t) {
        // The jump's 30 and the ramp's values are exact in e4m3 and bf16 up to rounding
        // of the noise, which both engines share.
        const float lift = b < 2 && t == 3 * lens[size_t(b)] / 4 ? 30.0f : 5.0f * float(t) / float(lens[size_t(b)]);
        for (int d = 0; d < kRamp; ++d) kv[(size_t(b) * max_len + t) * D + d] += lift;
      }
    const auto [cpu, gpu] = run_on_both(g, q, kv, lens, max_len, 64, 64, 13);
    const std::string what = g.name();
    ASSERT_EQ(cpu.out.size(), gpu.out.size()) << what;
    int64_t bad = 0;
    double worst_rel = 0, worst_lse = 0;
    for (size_t row = 0; row < cpu.lse.size(); ++row) {
      const double rel = row_rel_l2(gpu.out, cpu.out, row, R);
      // lse to 2e-2, and for the fp8 swap kernel (16 rows) to 2^-9 of its size beyond that:
      // its tensor cores add fp8 products with truncation (docs/design.md), which a
      // block of 64 large, alike products (the jump's score, about 160) accumulates to
      // 0.15 (measured on the H200); a maximum that failed to move gives inf or NaN.
      const bool fp8_swap = g.dtype != KvDtype::bf16 && sh.qlen * sh.heads <= 32;
      const double ltol = 2e-2 + (fp8_swap ? std::ldexp(std::fabs(double(cpu.lse[row])), -9) : 0.0);
      const double lerr = std::fabs(double(gpu.lse[row]) - double(cpu.lse[row]));
      if (!(rel <= 1e-2) || !(lerr <= ltol) || !std::isfinite(cpu.lse[row])) ++bad;
      if (std::isfinite(rel)) worst_rel = std::max(worst_rel, rel);
      if (std::isfinite(lerr)) worst_lse = std::max(worst_lse, lerr);
    }
    EXPECT_EQ(bad, 0) << what << ": rows off the CPU's (or not finite); worst finite out rel L2 " << worst_rel
                      << ", lse " << worst_lse;
  }
}

}  // namespace
}  // namespace dcpmla::testing
