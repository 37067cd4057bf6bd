// Fuzzes the planner with the layout (SPEC §2, §4): arbitrary bytes become a planner
// configuration and a batch (lengths, qlen, mode, world, rank, interleave, block size, block
// tables drawn mostly from a cache of num_blocks, capture limits, heads, route, dtype). Every
// input must either give a plan or raise dcpmla::Error -- any other exception, crash,
// sanitizer report or hang is a bug. The planner must refuse exactly the configurations and batches the contract
// calls bad (an independent oracle below), and every plan it accepts must hold:
//  - per-row local lengths are n_r(w_t), and summed over the ranks they equal the window;
//  - every rank of the group accepts or refuses the same batch and takes the same route;
//  - every sub-page id is the spec's expansion of the table and fits int32; the plan's
//    largest block id (which run() checks the engine's cache against) is the tables' own;
//  - the schedule holds its invariants (tests/common/schedule_check.h): each request's pieces
//    cover its tokens exactly once, in order, cut on tile edges, and cut requests are listed;
//  - padding requests get zero rows and an empty piece, and never move a cut;
//  - per-request query lengths (qlens) pack the rows by request, each with its own windows.
#include <algorithm>
#include <array>
#include <cstdint>
#include <optional>
#include <vector>

#include "dcpmla/cache.h"
#include "dcpmla/error.h"
#include "dcpmla/layout.h"
#include "dcpmla/plan.h"
#include "../common/schedule_check.h"
#include "fuzz_common.h"

using namespace dcpmla;
using dcpmla::fuzz::field;
using dcpmla::fuzz::pick;
using dcpmla::fuzz::spec_local_length;

namespace {

// Harness caps: values the library accepts by design but that would make one execution
// slow. The library itself refuses what is absurd (its own limits are in the oracles).
constexpr int64_t kArenaCapInts = int64_t(1) << 22;  // per planned rank (the library allows 1 << 30)
constexpr int kMaxBatch = 64;
constexpr int kMaxTableWidth = 256;
constexpr int64_t kMaxTableEntries = 1 << 14;
constexpr int kMaxRanksPlanned = 16;  // plan every rank of the group up to this world size

int64_t ceil_div(int64_t a, int64_t b) { return a / b + (a % b != 0); }

int64_t spec_page(int64_t block_size) {
  int64_t p = 1;
  while (p < 128 && block_size % (p * 2) == 0) p *= 2;
  return p;
}

struct Batch {
  std::vector<int32_t> lens, tables, qlens;  // qlens empty: qlen rows per request
  int qlen = 1, width = 0;
  int64_t stride = 0;  // rows `stride` ints apart in `tables` (0: packed)
  Mode mode = Mode::verify;
  BatchDesc desc() const { return BatchDesc{lens, qlen, tables, width, mode, qlens, stride}; }
  int qlen_of(size_t r) const { return qlens.empty() ? qlen : qlens[r]; }
  int64_t pitch() const { return stride != 0 ? stride : width; }
  int32_t entry(int64_t r, int64_t j) const { return tables[size_t(r * pitch() + j)]; }
};

// Global window of row t (SPEC §1), or two_stage's sharded prefix.
int64_t window(Mode mode, bool two_stage, int64_t len, int64_t qlen, int64_t t) {
  if (len == 0) return 0;
  if (two_stage) return len - qlen;
  return mode == Mode::draft ? len : len - qlen + t + 1;
}

// Plan ints the planner's arena needs (as plan.h lays it out), without overflow.
__int128 arena_ints(const PlannerConfig& c, int64_t page) {
  const __int128 stride = (__int128(c.limits.max_local_kv_len) + page - 1) / page;
  const __int128 work = __int128(c.limits.max_batch) + c.num_workers;
  return __int128(c.limits.max_batch) * (__int128(c.limits.max_qlen) + stride + 3) + work * 4 + c.num_workers;
}

// Host ints one plan holds: its arena and its copy of the batch (lengths, qlens, table starts
// and each request's used entries, stride at most), bounded together.
__int128 plan_host_ints(const PlannerConfig& c, int64_t page) {
  const __int128 stride = (__int128(c.limits.max_local_kv_len) + page - 1) / page;
  return arena_ints(c, page) + __int128(c.limits.max_batch) * (stride + 3) + 1;
}

// The configurations the contract and docs/design.md accept.
bool config_is_valid(const PlannerConfig& c) {
  const Layout& l = c.layout;
  if (l.world_size < 1 || l.rank < 0 || l.rank >= l.world_size || l.interleave < 1) return false;
  if (c.block_size < 1 || c.block_size > kMaxBlockSize || c.block_size % l.interleave) return false;
  if (c.dims.kv_lora_rank < 1 || c.dims.rope_dim < 1) return false;
  if (int64_t(c.dims.kv_lora_rank) + c.dims.rope_dim > INT32_MAX) return false;
  if (c.limits.max_batch < 1 || c.limits.max_qlen < 1 || c.limits.max_qlen > kMaxQlen) return false;
  if (c.limits.max_local_kv_len < 1 || c.limits.max_local_kv_len > kMaxLocalKvLen) return false;
  if (c.num_workers < 1 || c.num_workers > (1 << 16) || c.rows_per_unit < 1 || c.min_segment_tokens < 1 ||
      c.heads < 1)
    return false;
  // A forced route must be served for some mode; the step's mode is checked per batch.
  const Route checked = c.route == Route::automatic ? Route::one_stage : c.route;
  if (!is_supported(c.backend, checked, Mode::decode, c.kv_dtype, c.heads) &&
      !is_supported(c.backend, checked, Mode::verify, c.kv_dtype, c.heads))
    return false;
  return plan_host_ints(c, spec_page(c.block_size)) < (int64_t(1) << 30);
}

bool batch_is_valid(const PlannerConfig& c, const Batch& b) {
  const int64_t n = int64_t(b.lens.size());
  if (n < 1 || n > c.limits.max_batch || b.qlen < 1 || b.qlen > c.limits.max_qlen) return false;
  if (b.mode == Mode::decode && b.qlen != 1) return false;
  if (c.route != Route::automatic && !is_supported(c.backend, c.route, b.mode, c.kv_dtype, c.heads)) return false;
  if (!b.qlens.empty() && int64_t(b.qlens.size()) != n) return false;
  for (size_t r = 0; r < b.qlens.size(); ++r)
    if (b.qlens[r] < 0 || b.qlens[r] > b.qlen || (c.route == Route::two_stage && b.qlens[r] != b.qlen)) return false;
  if (b.width < 0 || (b.stride != 0 && b.stride < b.width)) return false;
  if (__int128(b.tables.size()) != (n - 1) * __int128(b.pitch()) + b.width) return false;
  const Layout& l = c.layout;
  // int32 sub-page ids; on CUDA with a bf16 cache, int32 row indices (the TMA boxes).
  const int64_t block_limit = c.backend == Backend::cuda && c.kv_dtype == KvDtype::bf16
                                  ? (int64_t(1) << 31) / c.block_size
                                  : INT32_MAX / (c.block_size / spec_page(c.block_size));
  for (int64_t r = 0; r < n; ++r) {
    const int64_t len = b.lens[size_t(r)];
    if (len < 0 || (b.mode != Mode::draft && len != 0 && len < b.qlen_of(size_t(r)))) return false;
    const int64_t largest = spec_local_length(len, l.world_size, 0, l.interleave);
    if (largest > c.limits.max_local_kv_len) return false;
    const int64_t entries = ceil_div(largest, c.block_size);
    if (entries > b.width) return false;
    for (int64_t j = 0; j < entries; ++j) {
      const int32_t id = b.entry(r, j);
      if (id < 0 || id >= block_limit) return false;
    }
  }
  return true;
}

// Tiles (of `page` local tokens) request r covers on this rank.
int64_t request_tiles(const Plan& plan, int r) {
  const PlanView v = plan.view();
  int64_t longest = 0;
  for (int i = v.q_start[r]; i < v.q_start[r + 1]; ++i) longest = std::max<int64_t>(longest, v.row_local_len[i]);
  return ceil_div(longest, v.header->page);
}

// Invariants of one accepted plan on one rank.
void check_plan(const Planner& planner, const Batch& b, const Plan& plan) {
  const PlannerConfig& c = planner.config();
  const Layout& l = c.layout;
  const PlanView v = plan.view();
  const PlanHeader& h = *v.header;
  const int n = int(b.lens.size()), qlen = b.qlen;
  const int64_t page = spec_page(c.block_size);

  FUZZ_CHECK(h.batch == n && h.qlen == qlen && h.page == page);
  FUZZ_CHECK(n <= v.max_batch && qlen <= v.max_qlen && h.work_count >= 0 && h.work_count <= v.work_capacity);
  const Route route = Route(h.route);
  FUZZ_CHECK(route == Route::one_stage || route == Route::two_stage || route == Route::split_k);
  FUZZ_CHECK(c.route == Route::automatic ? route != Route::two_stage : route == c.route);
  FUZZ_CHECK(testing::schedule_error(c, plan).empty());
  FUZZ_CHECK(route != Route::two_stage || b.mode == Mode::verify);
  FUZZ_CHECK(h.mode == int32_t(b.mode));

  // Rows: n_r of the row's global window, counted from the global window end.
  int active = 0;
  int64_t max_share = 0, min_share = 0;
  int rows = 0;
  for (int r = 0; r < n; ++r) {
    const int64_t len = b.lens[size_t(r)];
    const int qb = b.qlen_of(size_t(r));
    FUZZ_CHECK(v.q_start[r] == rows && v.q_start[r + 1] == rows + qb);
    for (int t = 0; t < qb; ++t) {
      const int64_t w = window(b.mode, route == Route::two_stage, len, qb, t);
      FUZZ_CHECK(v.row_local_len[rows + t] == spec_local_length(w, l.world_size, l.rank, l.interleave));
      FUZZ_CHECK(v.row_local_len[rows + t] <= c.limits.max_local_kv_len);
    }
    if (route != Route::two_stage && qb > 0) {  // the layout's own per-row rule agrees with the plan
      const std::vector<int64_t> lens = row_local_lengths(b.mode, len, qb, l);
      for (int t = 0; t < qb; ++t) FUZZ_CHECK(lens[size_t(t)] == v.row_local_len[rows + t]);
    }
    rows += qb;
    if (len == 0) continue;
    const int64_t share = spec_local_length(len, l.world_size, 0, l.interleave);
    min_share = active == 0 ? share : std::min(min_share, share);
    max_share = std::max(max_share, share);
    ++active;
  }
  FUZZ_CHECK(plan.stats().active_requests == active);
  FUZZ_CHECK(plan.stats().max_local_len == max_share && plan.stats().min_local_len == min_share);

  // Sub-pages: sub-page k is table[k / per_block] * per_block + k % per_block, in rows of the
  // step's widest request. The plan's largest block id is the largest the rows use (and the
  // largest of the table entries the lengths need: run() checks the cache against it).
  const int64_t per_block = c.block_size / page;
  const int64_t stride = h.table_stride;
  int64_t widest = 0, max_block = -1;
  for (int r = 0; r < n; ++r) {
    const int64_t tiles = request_tiles(plan, r);
    widest = std::max(widest, tiles);
    FUZZ_CHECK(tiles <= stride && stride <= v.table_capacity);
    for (int64_t k = 0; k < tiles; ++k) {
      const int64_t want = int64_t(b.entry(r, k / per_block)) * per_block + k % per_block;
      const int32_t got = v.subpage_table[int64_t(r) * stride + k];
      FUZZ_CHECK(got == want);
      FUZZ_CHECK(got >= 0);
    }
    const int64_t entries = ceil_div(spec_local_length(b.lens[size_t(r)], l.world_size, 0, l.interleave), c.block_size);
    for (int64_t j = 0; j < entries; ++j) max_block = std::max<int64_t>(max_block, b.entry(int64_t(r), j));
  }
  FUZZ_CHECK(stride == widest);
  FUZZ_CHECK(plan.stats().max_block == max_block);
  FUZZ_CHECK(plan.used_ints() <= plan.arena().size());

  // Padding requests attend nothing here (the schedule's invariants cover their pieces).
  for (int r = 0; r < n; ++r)
    if (b.lens[size_t(r)] == 0)
      for (int i = v.q_start[r]; i < v.q_start[r + 1]; ++i) FUZZ_CHECK(v.row_local_len[i] == 0);
}

// Pieces (tok_begin, tok_end, slot >= 0) of request r, in order.
std::vector<std::array<int32_t, 3>> pieces_of(const Plan& plan, int r) {
  const PlanView v = plan.view();
  std::vector<std::array<int32_t, 3>> out;
  for (int w = 0; w < v.header->work_count; ++w)
    if (v.work[w].request == r) out.push_back({v.work[w].tok_begin, v.work[w].tok_end, v.work[w].slot >= 0});
  return out;
}

// The same batch with its padding requests removed: the route and every active request's
// split must not change (seed 002: one padded row collapsed 17 KV splits to 1).
void check_padding_is_neutral(const Planner& planner, const Batch& b, Plan& plan) {
  Batch active;
  active.qlen = b.qlen;
  active.width = b.width;
  active.mode = b.mode;
  std::vector<int> kept;
  for (size_t r = 0; r < b.lens.size(); ++r) {
    if (b.lens[r] == 0) continue;
    kept.push_back(int(r));
    active.lens.push_back(b.lens[r]);
    if (!b.qlens.empty()) active.qlens.push_back(b.qlens[r]);
    for (int64_t j = 0; j < b.width; ++j) active.tables.push_back(b.entry(int64_t(r), j));
  }
  if (kept.empty() || kept.size() == b.lens.size()) return;
  const Route route = plan.route();
  std::vector<std::vector<std::array<int32_t, 3>>> pieces;
  for (int r : kept) pieces.push_back(pieces_of(plan, r));
  // Re-plan into the same arena: a replayed graph sees only what this plan wrote.
  planner.plan(active.desc(), plan);
  check_plan(planner, active, plan);
  FUZZ_CHECK(plan.route() == route);
  for (size_t i = 0; i < kept.size(); ++i) FUZZ_CHECK(pieces_of(plan, int(i)) == pieces[i]);
}

// The planner's configuration, the step's mode and the size of the cache the tables' ids are
// mostly drawn from (read in this order, the order of the committed corpus).
struct Fuzzed {
  PlannerConfig config;
  Mode mode;
  int64_t num_blocks;
};

Fuzzed read_config(FuzzedDataProvider& in) {
  Fuzzed f;
  PlannerConfig& c = f.config;
  c.backend = in.ConsumeBool() ? Backend::cpu : Backend::cuda;
  f.mode = Mode(in.ConsumeIntegralInRange<int>(0, 2));
  c.kv_dtype = KvDtype(in.ConsumeIntegralInRange<int>(0, 2));
  c.route = Route(in.ConsumeIntegralInRange<int>(0, 3));
  c.heads = field<int32_t>(in, 1, 160);
  c.dims = LatentDims{field<int32_t>(in, 1, 600), field<int32_t>(in, 1, 100)};
  const int32_t world = field<int32_t>(in, 1, 16);
  c.layout = Layout{world, field<int32_t>(in, 0, int32_t(std::max<int64_t>(1, world) - 1)), field<int32_t>(in, 1, 8)};
  // Mostly a multiple of the interleave (the contract's rule), sometimes anything.
  const int64_t blocks_of_runs = int64_t(c.layout.interleave) * in.ConsumeIntegralInRange<int>(1, 300);
  c.block_size = in.ConsumeIntegralInRange<int>(0, 3) && blocks_of_runs <= INT32_MAX ? int32_t(blocks_of_runs)
                                                                                       : pick<int32_t>(in);
  f.num_blocks = field<int64_t>(in, 1, 1 << 16);
  c.limits = PlanLimits{field<int32_t>(in, 1, kMaxBatch), field<int32_t>(in, 1, 16), field<int64_t>(in, 1, 1 << 16)};
  c.num_workers = field<int32_t>(in, 1, 300);
  c.min_segment_tokens = field<int32_t>(in, 1, 1024);
  c.rows_per_unit = 16 << in.ConsumeIntegralInRange<int>(0, 2);
  return f;
}

Batch read_batch(FuzzedDataProvider& in, const Fuzzed& f) {
  const PlannerConfig& c = f.config;
  Batch b;
  b.mode = f.mode;
  const int n = in.ConsumeIntegralInRange<int>(0, kMaxBatch);
  b.qlen = field<int32_t>(in, 1, std::clamp(c.limits.max_qlen, 1, 16));
  b.width = in.ConsumeIntegralInRange<int>(-1, kMaxTableWidth);
  if (int64_t(n) * std::max(b.width, 0) > kMaxTableEntries) b.width = int(kMaxTableEntries / std::max(n, 1));
  const int64_t longest = std::clamp<int64_t>(c.limits.max_local_kv_len, 1, 1 << 20) * std::clamp(c.layout.world_size, 1, 16);
  for (int r = 0; r < n; ++r) {
    switch (in.ConsumeIntegralInRange<int>(0, 3)) {
      case 0: b.lens.push_back(0); break;  // padding
      case 1: b.lens.push_back(int32_t(std::clamp<int64_t>(int64_t(b.qlen) + in.ConsumeIntegralInRange<int>(-1, 40), INT32_MIN, INT32_MAX))); break;
      case 2: b.lens.push_back(int32_t(in.ConsumeIntegralInRange<int64_t>(0, longest))); break;
      default: b.lens.push_back(pick<int32_t>(in));
    }
  }
  // Table ids: mostly valid ids of the cache, sometimes anything.
  const bool any_id = in.ConsumeIntegralInRange<int>(0, 7) == 0;
  const int64_t hi = std::clamp<int64_t>(f.num_blocks, 1, INT32_MAX) - 1;
  for (int64_t i = 0; i < int64_t(n) * std::max(b.width, 0); ++i)
    b.tables.push_back(any_id ? pick<int32_t>(in) : int32_t(in.ConsumeIntegralInRange<int64_t>(0, hi)));
  // Sometimes the rows lie apart (a slice of a wider table), the gaps poisoned; sometimes the
  // stride is below the width or huge (refused).
  if (n > 0 && b.width >= 0 && in.ConsumeIntegralInRange<int>(0, 3) == 0) {
    const int64_t gap = in.ConsumeIntegralInRange<int64_t>(-2, 5);
    b.stride = in.ConsumeIntegralInRange<int>(0, 31) == 0 ? pick<int64_t>(in) : b.width + gap;
    if (b.stride >= b.width && b.stride > 0 && (__int128(n) - 1) * b.stride + b.width <= kMaxTableEntries) {
      std::vector<int32_t> apart(size_t((int64_t(n) - 1) * b.stride + b.width), INT32_MIN);
      for (int64_t r = 0; r < n; ++r)
        std::copy_n(b.tables.begin() + r * b.width, b.width, apart.begin() + r * b.stride);
      b.tables = std::move(apart);
    }
  }
  if (!b.tables.empty() && in.ConsumeIntegralInRange<int>(0, 15) == 0) b.tables.pop_back();  // wrong size
  // Per-request query lengths, sometimes: mostly within [0, qlen], sometimes out of range or short.
  if (in.ConsumeBool()) {
    // In int64: qlen itself may be any int (a refused one included).
    const int64_t lo = std::min<int64_t>(-1, b.qlen), hi = std::max<int64_t>(-1, int64_t(b.qlen) + 1);
    for (int r = 0; r < n; ++r)
      b.qlens.push_back(int32_t(std::clamp<int64_t>(in.ConsumeIntegralInRange<int64_t>(lo, hi), INT32_MIN, INT32_MAX)));
    if (!b.qlens.empty() && in.ConsumeIntegralInRange<int>(0, 15) == 0) b.qlens.pop_back();
  }
  return b;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  const Fuzzed fuzzed = read_config(in);
  const PlannerConfig& config = fuzzed.config;
  const Batch batch = read_batch(in, fuzzed);

  std::optional<Planner> planner;
  try {
    planner.emplace(config);
  } catch (const Error&) {
    FUZZ_CHECK(!config_is_valid(config));
    return 0;
  }
  FUZZ_CHECK(config_is_valid(config));
  FUZZ_CHECK(planner->page() == spec_page(config.block_size));

  const int world = config.layout.world_size;
  const bool all_ranks = world <= kMaxRanksPlanned;
  const int planned = all_ranks ? world : 1;
  if (plan_host_ints(config, planner->page()) * planned > kArenaCapInts) return 0;  // harness cap

  // Plan the batch on the fuzzed rank, then (small groups) on every rank of the group.
  const bool valid = batch_is_valid(config, batch);
  std::vector<std::vector<int32_t>> rows;  // per planned rank, [batch, qlen]
  std::optional<Route> route;
  for (int k = 0; k < planned; ++k) {
    PlannerConfig rc = config;
    if (all_ranks) rc.layout.rank = k;
    std::optional<Planner> p;
    if (!all_ranks) {
      p.emplace(*planner);
    } else {
      try {
        p.emplace(rc);
      } catch (const Error&) {
        FUZZ_CHECK(false && "a configuration valid on one rank is refused on another");
      }
    }
    Plan plan = p->make_plan();
    try {
      p->plan(batch.desc(), plan);
    } catch (const Error&) {
      FUZZ_CHECK(!valid);  // every rank refuses alike: the oracle does not depend on the rank
      continue;
    }
    FUZZ_CHECK(valid);
    check_plan(*p, batch, plan);
    // A forced route is every rank's; the automatic one follows each rank's own cuts.
    FUZZ_CHECK(config.route == Route::automatic || !route || *route == plan.route());
    route = plan.route();
    const PlanView v = plan.view();
    rows.emplace_back(v.row_local_len, v.row_local_len + v.header->rows);
    check_padding_is_neutral(*p, batch, plan);
  }

  // Summed over the ranks, each row's local lengths give its global window.
  if (all_ranks && valid) {
    FUZZ_CHECK(int(rows.size()) == world);
    for (size_t r = 0, row = 0; r < batch.lens.size(); ++r)
      for (int t = 0; t < batch.qlen_of(r); ++t, ++row) {
        int64_t sum = 0;
        for (const auto& per_rank : rows) sum += per_rank[row];
        FUZZ_CHECK(sum == window(batch.mode, *route == Route::two_stage, batch.lens[r], batch.qlen_of(r), t));
      }
  }
  return 0;
}
