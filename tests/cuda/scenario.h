// A randomized batch on one rank, set up twice over the same bytes: the CPU engine API
// (Attention over a PagedCache: the reference kernel attention_cpu) and cuda::Attention over
// a device cache the test owns, written by the device slot mapping and write_kv. Caches are poisoned with
// NaN before the write and block tables are random permutations with a poisoned spare
// block in unused entries, so any read past a length or through a wrong table shows.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "cuda_helpers.h"
#include "dcpmla/layout.h"
#include "dcpmla/runner.h"

namespace dcpmla::testing {

struct Scenario {
  std::string name;
  Mode mode = Mode::verify;
  KvDtype dtype = KvDtype::bf16;
  int block_size = 64;
  int heads = 16;
  int world = 1, rank = 0, interleave = 1;
  Route route = Route::automatic;
  int qlen = 1, max_qlen = 1;
  std::vector<int32_t> lens;
  float kv_scale = 1.0f;
  uint64_t seed = 1;
  int max_batch = 0;  // 0: the batch size
  int num_workers = 0;  // the schedule's chunks (0: the backend's); few put chunk edges everywhere
  int min_segment_tokens = 256;
  // Query row r (of batch x qlen x heads) is scaled by 2^q_row_exp[r % size] (exact in
  // bf16): rows far from unit magnitude, which the fp8 swap kernel scales per row.
  std::vector<int> q_row_exp{};
  // Under the library's own kernel choice, the plan must cut some request into more than
  // this many pieces (0: not checked): a scenario meant for a path that only many pieces take.
  int min_cut_pieces = 0;

  std::string describe() const {
    std::ostringstream s;
    s << name << ": mode " << to_string(mode) << ", " << to_string(dtype) << " (scale " << kv_scale
      << "), block " << block_size << ", heads " << heads << ", world " << world << " rank " << rank
      << " interleave " << interleave << ", route " << to_string(route) << ", qlen " << qlen << "/" << max_qlen
      << ", lens [";
    for (size_t i = 0; i < lens.size(); ++i) s << (i ? " " : "") << lens[i];
    s << "]";
    return s.str();
  }
};

// Block tables and token writes of one batch against a cache of num_blocks blocks.
struct BatchData {
  std::vector<int32_t> lens, tables;
  std::vector<int32_t> qlens;  // per request (empty: qlen each); q, out and lse rows are packed
  int width = 1;
  int qlen = 1;
  std::vector<int64_t> positions;
  std::vector<int32_t> requests;
  std::vector<bf16> latents;
  std::vector<bf16> q;
  Mode mode = Mode::verify;
  BatchDesc desc() const { return BatchDesc{lens, qlen, tables, width, mode, qlens}; }
  int64_t rows() const {
    return qlens.empty() ? int64_t(lens.size()) * qlen : std::accumulate(qlens.begin(), qlens.end(), int64_t(0));
  }
};

inline int64_t blocks_needed(const Scenario& s, int32_t len) {
  const Layout group{s.world, 0, s.interleave};
  return (group.local_length_of(len, 0) + s.block_size - 1) / s.block_size;
}

// Tables take blocks from ids[next..] (a random permutation); unused entries name `spare`.
inline BatchData make_batch(const Scenario& s, const std::vector<int32_t>& lens, int qlen,
                            const std::vector<int32_t>& ids, size_t& next, int32_t spare, uint64_t seed,
                            const std::vector<int32_t>& qlens = {}) {
  BatchData d;
  d.lens = lens;
  d.qlen = qlen;
  d.qlens = qlens;
  d.mode = s.mode;
  const int batch = int(lens.size());
  for (int32_t L : lens) d.width = std::max<int>(d.width, int(blocks_needed(s, L)));
  d.tables.assign(size_t(batch) * d.width, spare);
  for (int b = 0; b < batch; ++b)
    for (int64_t j = 0; j < blocks_needed(s, lens[size_t(b)]); ++j) d.tables[size_t(b) * d.width + j] = ids[next++];
  for (int b = 0; b < batch; ++b)
    for (int32_t p = 0; p < lens[size_t(b)]; ++p) {
      d.positions.push_back(p);
      d.requests.push_back(b);
    }
  d.latents = random_bf16(d.positions.size() * 576, seed * 7 + 1);
  d.q = random_bf16(size_t(d.rows()) * s.heads * 576, seed * 7 + 2);
  if (!s.q_row_exp.empty())
    for (size_t i = 0; i < d.q.size(); ++i)
      d.q[i] = float_to_bf16(std::ldexp(bf16_to_float(d.q[i]), s.q_row_exp[(i / 576) % s.q_row_exp.size()]));
  return d;
}

inline AttentionConfig make_config(const Scenario& s, int max_batch, int64_t max_local) {
  AttentionConfig c;
  c.kv_dtype = s.dtype;
  c.heads = s.heads;
  c.layout = Layout{s.world, s.rank, s.interleave};
  c.block_size = s.block_size;
  c.route = s.route;
  c.limits = PlanLimits{max_batch, s.max_qlen, std::max<int64_t>(1, max_local)};
  c.num_workers = s.num_workers;
  c.min_segment_tokens = s.min_segment_tokens;
  return c;
}

// The GPU's rank partials against a float64 sum of their own, for a sample of rows: straight
// from the latents (no pages, no plan, no CPU kernel), each row's SPEC §1 window (decode and
// verify [0, L - qlen_b + t], draft [0, L); under the two_stage route, its stage A: the prefix
// [0, L - qlen_b) for every row), of it the positions this rank holds ((p / I) mod N == rank),
// values as the cache stores them. The CPU engine answers every row; this keeps
// the suite's answer tied to float64 and not only to another kernel of the library.
inline Comparison float64_sample(const Scenario& s, const BatchData& d, Route route, const std::vector<bf16>& out,
                                 const std::vector<float>& lse, int samples) {
  const int batch = int(d.lens.size()), H = s.heads, D = 576, R = 512;
  std::vector<int64_t> first_row(size_t(batch) + 1, 0), first_token(size_t(batch) + 1, 0);
  for (int b = 0; b < batch; ++b) {
    first_row[size_t(b) + 1] = first_row[size_t(b)] + (d.qlens.empty() ? d.qlen : d.qlens[size_t(b)]);
    first_token[size_t(b) + 1] = first_token[size_t(b)] + d.lens[size_t(b)];
  }
  const int64_t cells = first_row[size_t(batch)] * H;
  // The longest request's last row (the longest window) and random ones.
  std::vector<int64_t> picks;
  const int longest = int(std::max_element(d.lens.begin(), d.lens.end()) - d.lens.begin());
  if (first_row[size_t(longest) + 1] > first_row[size_t(longest)]) picks.push_back((first_row[size_t(longest) + 1] - 1) * H);
  std::mt19937_64 rng(s.seed * 31 + 7);
  for (int i = 0; i < samples && cells > 0; ++i) picks.push_back(int64_t(rng() % uint64_t(cells)));

  // The cache's value of each bf16 latent, by its bits (the fp8 round trip is slow per value).
  std::vector<double> stored(1 << 16);
  for (uint32_t bits = 0; bits < stored.size(); ++bits)
    stored[bits] = quantize_roundtrip(bf16_to_float(bf16{uint16_t(bits)}), s.dtype, s.kv_scale);

  Comparison c;
  double work = 0;
  const double scale = 1.0 / std::sqrt(double(D));
  std::vector<double> score, kv, o(R);
  for (const int64_t cell : picks) {
    if (work > 5e7) break;  // a fraction of the CPU engine's time for the same scenario
    const int64_t row = cell / H;
    const int b = int(std::upper_bound(first_row.begin(), first_row.end(), row) - first_row.begin()) - 1;
    const int64_t t = row - first_row[size_t(b)], qb = first_row[size_t(b) + 1] - first_row[size_t(b)];
    const int64_t L = d.lens[size_t(b)];
    const int64_t window = L == 0                    ? 0
                           : route == Route::two_stage ? L - qb
                           : s.mode == Mode::draft     ? L
                                                       : L - qb + t + 1;
    const bf16* q = d.q.data() + size_t(cell) * D;
    std::vector<int64_t> held;
    for (int64_t p = 0; p < window; ++p)
      if ((p / s.interleave) % s.world == s.rank) held.push_back(p);
    score.assign(held.size(), 0.0);
    double m = -std::numeric_limits<double>::infinity();
    work += double(held.size()) * (D + R);
    kv.resize(held.size() * D);  // the held tokens as the cache stores them
    for (size_t k = 0; k < held.size(); ++k)
      for (int j = 0; j < D; ++j)
        kv[k * D + size_t(j)] = stored[d.latents[size_t((first_token[size_t(b)] + held[k]) * D + j)].bits];
    for (size_t k = 0; k < held.size(); ++k) {
      double acc = 0;
      for (int j = 0; j < D; ++j) acc += double(bf16_to_float(q[j])) * kv[k * D + size_t(j)];
      score[k] = acc * scale;
      m = std::max(m, score[k]);
    }
    double sum = 0;
    for (const double x : score) sum += std::exp(x - m);
    std::fill(o.begin(), o.end(), 0.0);
    for (size_t k = 0; k < held.size(); ++k) {
      const double p = std::exp(score[k] - m) / sum;
      for (int j = 0; j < R; ++j) o[size_t(j)] += p * kv[k * D + size_t(j)];
    }
    const double want_lse = held.empty() ? -std::numeric_limits<double>::infinity() : m + std::log(sum);
    c.add(out.data() + cell * R, lse[size_t(cell)], [&](int j) { return o[size_t(j)]; }, want_lse, R, 1e-2, [&] {
      return row_name(cell, H, d.qlen, d.qlens) + ", " + std::to_string(held.size()) + " tokens held, against float64";
    });
  }
  return c;
}

// A device cache the test owns (as an engine would), poisoned with 0xff (NaN in every dtype).
struct DeviceCache {
  DeviceBuffer<uint8_t> bytes;
  KvCache view;
  DeviceCache(int64_t num_blocks, int block_size, KvDtype dtype, cudaStream_t stream = nullptr)
      : bytes(size_t(num_blocks) * block_size * 576 * bytes_per_value(dtype)),
        view{bytes.get(), num_blocks, block_size, 576, dtype} {
    cuda_ok(cudaMemsetAsync(bytes.get(), 0xff, bytes.size(), stream), "cudaMemsetAsync(cache poison)");
    cuda_ok(cudaStreamSynchronize(stream), "cache poison");
  }
};

// Writes tokens (global positions[k] of requests[k], latents [n, 576]) into a device cache as
// an engine would: positions, requests and tables go up, the device slot mapping computes
// the slots and write_kv stores the latents. Throws on a counted bad entry.
inline void device_write(const std::vector<int64_t>& positions, const std::vector<int32_t>& requests,
                         const std::vector<bf16>& latents, const BatchDesc& batch, const Layout& layout,
                         DeviceCache& cache, float kv_scale, cudaStream_t stream) {
  if (positions.empty()) return;
  DeviceBuffer<int64_t> pos(positions), slots(positions.size());
  DeviceBuffer<int32_t> req(requests), tables(std::vector<int32_t>(batch.block_tables.begin(), batch.block_tables.end()));
  DeviceBuffer<bf16> lat(latents);
  DeviceBuffer<int> errors(std::vector<int>{0});
  cuda::slot_mapping(pos.get(), req.get(), int64_t(positions.size()), tables.get(), int(batch.seq_lens.size()),
                     batch.table_width, cache.view.block_size, cache.view.num_blocks, layout, slots.get(), stream,
                     errors.get());
  cuda::write_kv(cache.view, lat.get(), slots.get(), int64_t(positions.size()), KvScale{kv_scale}, stream,
                 errors.get());
  cuda_ok(cudaStreamSynchronize(stream), "write");
  if (errors.download()[0] != 0) throw std::runtime_error("device write counted bad entries");
}
inline void device_write(const BatchData& d, const Layout& layout, DeviceCache& cache, float kv_scale,
                         cudaStream_t stream) {
  device_write(d.positions, d.requests, d.latents, d.desc(), layout, cache, kv_scale, stream);
}

inline float default_softmax_scale() { return 1.0f / std::sqrt(576.0f); }

// Kernel variant under test: DCPMLA_TEST_TUNING = "<tile tokens>x<CTAs per SM>" (e.g. 64x1,
// 32x2), "mma" (the mma.sync kernel at every shape), "wgmma" (the wgmma kernel at every
// shape, 16- and 32-row ones padded to 64), "fp8swap" (the fp8 swap kernel for every fp8
// cache, in groups of 16 or 32 rows) or "bf16swap" (the bf16 swap kernel for every bf16 cache, in
// groups of 16 or 32 rows); unset means the library's choice. ctest runs the scenarios once
// per variant.
inline cuda::AttentionTuning test_tuning() {
  cuda::AttentionTuning t;
  if (const char* env = std::getenv("DCPMLA_TEST_TUNING")) {
    const std::string v = env;
    if (v == "mma") t.kernel = 1;
    else if (v == "wgmma") t.kernel = 2;
    else if (v == "fp8swap") t.kernel = 3;
    else if (v == "bf16swap") t.kernel = 4;
    else std::sscanf(env, "%dx%d", &t.tile_tokens, &t.ctas_per_sm);
  }
  return t;
}

// Whether t leaves every choice to the library (the kernel, tile and occupancy it picks).
inline bool default_tuning(const cuda::AttentionTuning& t) {
  return t.kernel == 0 && t.tile_tokens == 0 && t.ctas_per_sm == 0;
}

// A traced call (AttentionParams::trace) beside the plain one: its output, bit for bit, and
// its stamps: attention CTAs 0 .. n - 1 stamped, each end at or after its start and with an
// SM id of the device, the rest untouched (their SM entries keep kUnstampedSm, so that an SM
// never written shows); the combine's CTAs stamped only when the plan cut a request, each
// after the first attention CTA started.
inline constexpr uint64_t kUnstampedSm = ~uint64_t(0);
struct TraceCheck {
  bool same_output = true, stamps_ok = true;
  int attention_ctas = 0, combine_ctas = 0;
  std::string problem;
};

struct ScenarioResult {
  Comparison cmp;
  Comparison float64;  // a sample of rows against float64_sample's own sum
  bool cache_ok = true;
  int64_t cache_mismatch = 0;
  bool plan_ok = true;
  Route route = Route::automatic;
  int max_segments = 0;  // the most pieces the device plan cut a request into
  std::optional<TraceCheck> trace;
};

inline TraceCheck check_trace(const std::vector<uint64_t>& t, bool cut, bool attention_stamps) {
  TraceCheck c;
  auto fail = [&](const std::string& what) {
    if (c.stamps_ok) c.problem = what;
    c.stamps_ok = false;
  };
  int device = 0, sm_count = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device);
  uint64_t first = 0;
  for (int b = 0; b < kTraceCtas; ++b) {
    const uint64_t start = t[size_t(2 * b)], end = t[size_t(2 * b + 1)];
    if (start == 0 && end == 0) continue;
    if (b != c.attention_ctas) fail("attention CTA " + std::to_string(b) + " stamped after a gap");
    if (start == 0 || end < start) fail("attention CTA " + std::to_string(b) + ": start/end out of order");
    if (t[size_t(kTraceSm + b)] >= uint64_t(sm_count))
      fail("attention CTA " + std::to_string(b) + ": SM id " + std::to_string(t[size_t(kTraceSm + b)]) +
           " not one of the device's " + std::to_string(sm_count));
    // At most 4 cycles a ns (the clock is under 2 GHz), over the stamps' ns plus a microsecond
    // for the global timer's step (32 ns on the H200, 1 us on some drivers): a CTA with no work
    // can start and end within one step.
    const uint64_t c0 = t[size_t(kTraceCycles + 2 * b)], c1 = t[size_t(kTraceCycles + 2 * b + 1)];
    if (c1 <= c0 || c1 - c0 > (end - start + 1000) * 4)
      fail("attention CTA " + std::to_string(b) + ": SM cycles " + std::to_string(c0) + ".." + std::to_string(c1) +
           " over " + std::to_string(end - start) + " ns (expected a rising count of at most 4 a ns)");
    first = c.attention_ctas == 0 ? start : std::min(first, start);
    ++c.attention_ctas;
  }
  for (int b = c.attention_ctas; b < kTraceCtas; ++b)
    if (t[size_t(kTraceSm + b)] != kUnstampedSm || t[size_t(kTraceCycles + 2 * b)] != 0 ||
        t[size_t(kTraceCycles + 2 * b + 1)] != 0)
      fail("unstamped CTA " + std::to_string(b) + " wrote an SM id or cycles");
  for (int b = 0; b < kTraceCtas; ++b) {
    const uint64_t start = t[size_t(kTraceCombine + 2 * b)], end = t[size_t(kTraceCombine + 2 * b + 1)];
    if (start == 0 && end == 0) continue;
    if (start == 0 || end < start || start < first)
      fail("combine CTA " + std::to_string(b) + ": start/end out of order or before the attention");
    ++c.combine_ctas;
  }
  if (attention_stamps != (c.attention_ctas > 0))
    fail(std::string("attention CTAs stamped: ") + std::to_string(c.attention_ctas) +
         (attention_stamps ? ", expected some" : ", expected none (the mma.sync kernel)"));
  if (cut != (c.combine_ctas > 0))
    fail(std::string("combine CTAs stamped: ") + std::to_string(c.combine_ctas) + (cut ? ", but the plan cut" : ", but nothing was cut"));
  return c;
}

// Runs one scenario on both backends and returns the comparison; `cache_ok` says whether
// the KV write kernel produced the CPU's cache bytes exactly. trace: also run the call traced
// (the mma.sync reference kernel stamps nothing).
inline ScenarioResult run_scenario(const Scenario& s, bool trace = false) {
  const int batch = int(s.lens.size());
  int64_t total = 0, max_local = 1;
  const Layout group{s.world, 0, s.interleave};
  for (int32_t L : s.lens) {
    total += blocks_needed(s, L);
    max_local = std::max<int64_t>(max_local, group.local_length_of(L, 0));
  }
  const int64_t num_blocks = total + 1;  // + the poisoned spare
  std::vector<int32_t> ids(static_cast<size_t>(total));
  std::iota(ids.begin(), ids.end(), 0);
  std::mt19937_64 rng(s.seed);
  std::shuffle(ids.begin(), ids.end(), rng);
  size_t next = 0;
  const BatchData d = make_batch(s, s.lens, s.qlen, ids, next, int32_t(num_blocks - 1), s.seed);
  const BatchDesc desc = d.desc();

  const AttentionConfig config = make_config(s, s.max_batch ? s.max_batch : batch, max_local);
  const Layout layout = config.layout;
  Attention cpu(config);
  PagedCache cpu_cache(CacheConfig{num_blocks, s.block_size, 576, s.dtype, s.kv_scale});
  cpu_cache.poison();
  const size_t cache_bytes = size_t(cpu_cache.config().bytes());
  cpu_cache.write(d.latents, slots_of(d.positions, d.requests, desc, s.block_size, num_blocks, layout));
  cpu.plan(desc);
  const size_t rows = size_t(batch) * s.qlen * s.heads;
  std::vector<bf16> ref_out(rows * 512);
  std::vector<float> ref_lse(rows);
  cpu.run(d.q.data(), cpu_cache.view(), KvScale{s.kv_scale}, ref_out.data(), ref_lse.data());

  cuda::Attention gpu(config);
  gpu.set_tuning(test_tuning());
  cudaStream_t stream;
  cuda_ok(cudaStreamCreate(&stream), "cudaStreamCreate");
  ScenarioResult res;
  {
    DeviceCache cache(num_blocks, s.block_size, s.dtype);
    device_write(d, layout, cache, s.kv_scale, stream);
    std::vector<uint8_t> bytes(cache_bytes);
    cuda_ok(cudaMemcpy(bytes.data(), cache.bytes.get(), cache_bytes, cudaMemcpyDeviceToHost), "cache download");
    const auto* want = static_cast<const uint8_t*>(cpu_cache.view().data);
    for (size_t i = 0; i < cache_bytes; ++i) res.cache_mismatch += bytes[i] != want[i];
    res.cache_ok = res.cache_mismatch == 0;

    // The device plan is what a host planner of the GPU's configuration writes (the CPU engine
    // schedules for its own rows per unit, so its plan may cut elsewhere; its answer may not).
    gpu.plan(desc, stream);
    cuda_ok(cudaStreamSynchronize(stream), "plan upload");
    const Planner host(gpu.planner().config());
    Plan planned = host.make_plan();
    host.plan(desc, planned);
    std::vector<int32_t> uploaded(planned.used_ints());
    cuda_ok(cudaMemcpy(uploaded.data(), gpu.params(nullptr, cache.view, KvScale{s.kv_scale}, nullptr, nullptr).plan.header,
                       uploaded.size() * sizeof(int32_t), cudaMemcpyDeviceToHost),
            "plan download");
    const auto staged = gpu.current_plan().arena(), expected = planned.arena();
    res.plan_ok = gpu.current_plan().used_ints() == planned.used_ints() &&
                  std::equal(uploaded.begin(), uploaded.end(), expected.begin()) &&
                  std::equal(staged.begin(), staged.end(), expected.begin(), expected.end());
    res.route = gpu.current_plan().route();
    res.max_segments = gpu.current_plan().stats().max_segments;
    DeviceBuffer<bf16> q(d.q.empty() ? std::vector<bf16>(1) : d.q);
    DeviceBuffer<bf16> out(rows * 512);
    DeviceBuffer<float> lse(rows);
    out.poison();
    lse.poison();
    gpu.run(q.get(), cache.view, KvScale{s.kv_scale}, out.get(), lse.get(), stream);
    cuda_ok(cudaStreamSynchronize(stream), "attend");
    const auto got_out = out.download();
    const auto got_lse = lse.download();
    res.cmp = compare_rows(got_out, got_lse, ref_out, ref_lse, 512, d.qlen, s.heads, 1e-2, d.qlens);
    res.float64 = float64_sample(s, d, res.route, got_out, got_lse, 24);
    if (trace) {
      std::vector<uint64_t> blank(kTraceEntries, 0);
      std::fill(blank.begin() + kTraceSm, blank.begin() + kTraceSm + kTraceCtas, kUnstampedSm);
      DeviceBuffer<uint64_t> stamps(blank);
      DeviceBuffer<bf16> out2(rows * 512);
      DeviceBuffer<float> lse2(rows);
      out2.poison();
      lse2.poison();
      AttentionParams tp = gpu.params(q.get(), cache.view, KvScale{s.kv_scale}, out2.get(), lse2.get());
      tp.trace = stamps.get();
      cuda::attention(tp, stream, 0, true, test_tuning());
      cuda_ok(cudaStreamSynchronize(stream), "traced call");
      const bool stamping = cuda::attention_variant(gpu.planner().config().limits.max_qlen, s.heads, s.dtype,
                                                    test_tuning()).kernel != 1;
      res.trace = check_trace(stamps.download(), gpu.current_plan().header().split_requests > 0, stamping);
      const auto o1 = out.download(), o2 = out2.download();
      const auto l1 = lse.download(), l2 = lse2.download();
      res.trace->same_output = std::memcmp(o1.data(), o2.data(), o1.size() * sizeof(bf16)) == 0 &&
                               std::memcmp(l1.data(), l2.data(), l1.size() * sizeof(float)) == 0;
    }
  }
  cudaStreamDestroy(stream);
  return res;
}

}  // namespace dcpmla::testing
