#include "dcpmla/plan.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <stdexcept>
#include <utility>

#include "dcpmla/cache.h"
#include "dcpmla/error.h"

namespace dcpmla {
namespace {

constexpr uint32_t bit(Mode m) { return 1u << int(m); }
constexpr uint32_t bit(KvDtype d) { return 1u << int(d); }
constexpr uint32_t kAllModes = bit(Mode::decode) | bit(Mode::verify) | bit(Mode::draft);
constexpr uint32_t kAllDtypes = bit(KvDtype::bf16) | bit(KvDtype::fp8_e4m3) | bit(KvDtype::fp8_e5m2);
// Both backends index query rows generically (64-bit offsets, row groups of the kernels' rows per
// CTA); the bound keeps a request's qlen x heads rows and the split workspace in int range.
constexpr int kMaxHeads = 4096;

// two_stage is verify-only: its stage B is the causal verify block.
constexpr std::array<Capability, 6> kCapabilities{{
    {Backend::cpu, Route::one_stage, kAllModes, kAllDtypes, 1, kMaxHeads},
    {Backend::cpu, Route::two_stage, bit(Mode::verify), kAllDtypes, 1, kMaxHeads},
    {Backend::cpu, Route::split_k, kAllModes, kAllDtypes, 1, kMaxHeads},
    {Backend::cuda, Route::one_stage, kAllModes, kAllDtypes, 1, kMaxHeads},
    {Backend::cuda, Route::two_stage, bit(Mode::verify), kAllDtypes, 1, kMaxHeads},
    {Backend::cuda, Route::split_k, kAllModes, kAllDtypes, 1, kMaxHeads},
}};

constexpr int64_t kMaxArenaInts = int64_t(1) << 30;
// More chunks than any GPU has SMs (times CTAs per SM) buy nothing and cost host time per step.
constexpr int kMaxWorkers = 1 << 16;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

constexpr size_t kHeaderInts = sizeof(PlanHeader) / sizeof(int32_t);
constexpr size_t kWorkInts = sizeof(WorkItem) / sizeof(int32_t);

// The arena's parts, and beside it the plan's host copy of the batch (Plan::batch_copy_).
struct ArenaOffsets {
  size_t rows, q_start, chunk_work, work, split_request, split_slot, subpages, total;
  size_t batch_copy;
  // What one plan holds in host memory, in int32s: both are bounded together.
  size_t host_ints() const { return total + batch_copy; }
};
ArenaOffsets arena_offsets(const PlanLimits& limits, int64_t table_capacity, int64_t work_capacity, int chunk_capacity) {
  ArenaOffsets o;
  o.rows = kHeaderInts;
  o.q_start = o.rows + size_t(limits.max_batch) * size_t(limits.max_qlen);
  o.chunk_work = o.q_start + size_t(limits.max_batch) + 1;
  o.work = o.chunk_work + size_t(chunk_capacity) + 1;
  o.split_request = o.work + size_t(work_capacity) * kWorkInts;
  o.split_slot = o.split_request + size_t(limits.max_batch);
  o.subpages = o.split_slot + size_t(limits.max_batch) + 1;
  o.total = o.subpages + size_t(limits.max_batch) * size_t(table_capacity);
  o.batch_copy = 3 * size_t(limits.max_batch) + 1 + size_t(limits.max_batch) * size_t(table_capacity);
  return o;
}

// The arena of a Plan of these capacities, checked: Plan is public, and a hand-made one must
// not wrap its offsets (a max_batch of -1 made a 15-int arena). Each capacity is at least 1
// and at most an int (the table's at most 2^30), so no product below overflows size_t before
// the host total (arena and batch copy) is compared with kMaxArenaInts.
ArenaOffsets checked_offsets(const PlanLimits& limits, int64_t table_capacity, int work_capacity,
                             int chunk_capacity) {
  require(limits.max_batch >= 1, "limits.max_batch", limits.max_batch, ">= 1");
  require(limits.max_qlen >= 1, "limits.max_qlen", limits.max_qlen, ">= 1");
  require(table_capacity >= 1 && table_capacity <= kMaxArenaInts, "table_capacity", table_capacity,
          fmt::format("in [1, {}]", kMaxArenaInts));
  require(work_capacity >= 1, "work_capacity", work_capacity, ">= 1");
  require(chunk_capacity >= 1, "chunk_capacity", chunk_capacity, ">= 1");
  const ArenaOffsets o = arena_offsets(limits, table_capacity, work_capacity, chunk_capacity);
  require(o.host_ints() < size_t(kMaxArenaInts), "plan capacities",
          fmt::format("{} plan ints (arena and batch copy)", o.host_ints()),
          fmt::format("< {} (lower max_batch, max_qlen, table_capacity or work_capacity)", kMaxArenaInts));
  return o;
}

}  // namespace

int max_heads(Backend backend) {
  int most = 0;
  for (const Capability& c : kCapabilities)
    if (c.backend == backend) most = std::max(most, c.max_heads);
  return most;
}

void require_heads(std::string_view field, int heads, Backend backend) {
  require_known("backend", backend);  // an unknown one has no head range to name
  if (heads < 1 || heads > max_heads(backend))
    fail(field, heads, fmt::format("in [1, {}] on the {} backend", max_heads(backend), to_string(backend)));
}

std::span<const Capability> capability_table() { return kCapabilities; }

bool is_supported(Backend backend, Route route, Mode mode, KvDtype dtype, int heads) {
  // The table's bit masks shift by the enums' values.
  require_known("backend", backend);
  require_known("route", route);
  require_known("mode", mode);
  require_known("kv_dtype", dtype);
  return std::any_of(kCapabilities.begin(), kCapabilities.end(), [&](const Capability& c) {
    return c.backend == backend && c.route == route && (c.modes & bit(mode)) &&
           (c.dtypes & bit(dtype)) && heads >= c.min_heads && heads <= c.max_heads;
  });
}

size_t Plan::ints(const PlanLimits& limits, int64_t table_capacity, int work_capacity, int chunk_capacity) {
  return checked_offsets(limits, table_capacity, work_capacity, chunk_capacity).total;
}

void Plan::fail_moved_from() {
  fail("plan", "a moved-from Plan", "a plan that holds its arena (made by make_plan(), not moved from since)");
}

int Plan::qlen_of(int b) const {
  if (b < 0 || b >= header().batch) fail("b", b, fmt::format("a request of the plan, in [0, {})", header().batch));
  return view().q_start[b + 1] - view().q_start[b];
}

int32_t Plan::row_local_len(int b, int t) const {
  const int qlen = qlen_of(b);
  if (t < 0 || t >= qlen) fail("t", t, fmt::format("a query row of request {}, in [0, {})", b, qlen));
  return view().row_local_len[view().q_start[b] + t];
}

Plan::Plan(const PlanLimits& limits, int64_t table_capacity, int work_capacity, int chunk_capacity,
           int32_t* storage)
    : limits_(limits), table_capacity_(table_capacity), work_capacity_(work_capacity), chunk_capacity_(chunk_capacity) {
  const ArenaOffsets o = checked_offsets(limits, table_capacity, work_capacity, chunk_capacity);
  off_rows_ = o.rows;
  off_q_start_ = o.q_start;
  off_chunk_work_ = o.chunk_work;
  off_work_ = o.work;
  off_split_request_ = o.split_request;
  off_split_slot_ = o.split_slot;
  off_subpages_ = o.subpages;
  arena_.size = o.total;
  if (storage == nullptr) {
    owned_.assign(arena_.size, 0);
    arena_.base = owned_.data();
  } else {
    require_value_aligned(storage, "storage");
    arena_.base = storage;
    std::fill(arena_.base, arena_.base + arena_.size, 0);
  }
  mutable_header().route = int32_t(Route::one_stage);
  batch_copy_.assign(o.batch_copy, 0);
}

size_t Plan::used_ints() const {
  const PlanHeader& h = header();
  return off_subpages_ + size_t(h.batch) * size_t(h.table_stride);
}

PlanView Plan::view_at(const int32_t* base) const {
  if (base == nullptr) fail("base", "null", "a copy of the plan's arena (used_ints() ints)");
  require_value_aligned(base, "base");
  return PlanView{reinterpret_cast<const PlanHeader*>(base),
                  base + off_rows_,
                  base + off_q_start_,
                  base + off_subpages_,
                  reinterpret_cast<const WorkItem*>(base + off_work_),
                  base + off_chunk_work_,
                  base + off_split_request_,
                  base + off_split_slot_,
                  int32_t(table_capacity_),
                  limits_.max_batch,
                  limits_.max_qlen,
                  work_capacity_,
                  chunk_capacity_};
}

Planner::Planner(const PlannerConfig& config) : config_(config) {
  const auto& c = config_;
  c.layout.validate_with_block_size(c.block_size);
  c.dims.validate();
  require(c.limits.max_batch >= 1, "limits.max_batch", c.limits.max_batch, ">= 1");
  require(c.limits.max_qlen >= 1 && c.limits.max_qlen <= kMaxQlen, "limits.max_qlen", c.limits.max_qlen,
          fmt::format("in [1, {}]", kMaxQlen));
  // Row lengths are int32 in the plan and in the kernels (kMaxLocalKvLen).
  require(c.limits.max_local_kv_len >= 1 && c.limits.max_local_kv_len <= kMaxLocalKvLen, "limits.max_local_kv_len",
          c.limits.max_local_kv_len, fmt::format("in [1, {}]", kMaxLocalKvLen));
  require(c.num_workers >= 1 && c.num_workers <= kMaxWorkers, "num_workers", c.num_workers,
          fmt::format("in [1, {}]", kMaxWorkers));
  require(c.rows_per_unit >= 1, "rows_per_unit", c.rows_per_unit, ">= 1");
  require(c.min_segment_tokens >= 1, "min_segment_tokens", c.min_segment_tokens, ">= 1");
  // Costs are a few tiles; the bounds keep the schedule's tile counts (doubles cast to int64)
  // far inside int64 (a piece cost of 1e308 was an out-of-range cast).
  require(c.cost.piece >= 0 && c.cost.piece <= kMaxScheduleCost, "cost.piece", c.cost.piece,
          fmt::format("a cost in [0, {}] (tiles)", kMaxScheduleCost));
  require(c.cost.cut >= 0 && c.cost.cut <= kMaxScheduleCost, "cost.cut", c.cost.cut,
          fmt::format("a cost in [0, {}] (tiles)", kMaxScheduleCost));
  require(c.cost.slack >= 0 && c.cost.slack <= kMaxScheduleCost, "cost.slack", c.cost.slack,
          fmt::format("a fraction in [0, {}] of a chunk's share", kMaxScheduleCost));
  require(c.cost.combine >= 0 && c.cost.combine <= kMaxScheduleCost, "cost.combine", c.cost.combine,
          fmt::format("a cost in [0, {}] (tiles)", kMaxScheduleCost));
  require(c.cost.combine_piece >= 0 && c.cost.combine_piece <= kMaxScheduleCost, "cost.combine_piece",
          c.cost.combine_piece, fmt::format("a cost in [0, {}] (tiles per cut piece per chunk)", kMaxScheduleCost));
  require_known("backend", c.backend);
  require_known("route", c.route);
  // Heads beyond what any route serves are the heads' fault, not the route's.
  require_heads("heads", c.heads, c.backend);
  require_known("kv_dtype", c.kv_dtype);
  // Auto may take one_stage or split_k; a forced route must be served for some mode (the
  // step's mode is checked against it at plan time).
  const Route checked = c.route == Route::automatic ? Route::one_stage : c.route;
  const bool served = is_supported(c.backend, checked, Mode::decode, c.kv_dtype, c.heads) ||
                      is_supported(c.backend, checked, Mode::verify, c.kv_dtype, c.heads);
  if (!served)
    fail("route", to_string(c.route),
         fmt::format("a route the {} backend serves for kv_dtype {} and heads {} (see capability_table())",
                     to_string(c.backend), to_string(c.kv_dtype), c.heads));
  page_ = subpage_size(c.block_size);
  table_capacity_ = ceil_div(c.limits.max_local_kv_len, page_);
  // Every chunk boundary cuts at most one request: pieces <= requests + chunks. In int64:
  // the sum overflows int for absurd values (found by fuzz_planner); the arena limit keeps
  // the capacity far inside int once it passes.
  // The exact arena make_plan() takes (so that it never refuses this planner's plans).
  const int64_t work_capacity = int64_t(c.limits.max_batch) + c.num_workers;
  const size_t ints = arena_offsets(c.limits, table_capacity_, work_capacity, c.num_workers).host_ints();
  require(ints < size_t(kMaxArenaInts), "limits", fmt::format("{} plan ints (arena and batch copy)", ints),
          fmt::format("< {} (lower max_batch, max_local_kv_len or num_workers)", kMaxArenaInts));
  work_capacity_ = int(work_capacity);
}

size_t Planner::plan_host_bytes() const {
  return arena_offsets(config_.limits, table_capacity_, work_capacity_, config_.num_workers).host_ints() *
         sizeof(int32_t);
}

void validate_table_shape(const BatchDesc& batch) {
  if (batch.table_width < 0) fail("table_width", batch.table_width, ">= 0");
  if (batch.table_stride != 0 && batch.table_stride < batch.table_width)
    fail("table_stride", batch.table_stride, fmt::format("0 (packed rows) or >= table_width ({})", batch.table_width));
  if (!batch.tables_fit())
    fail("block_tables", fmt::format("{} entries", batch.block_tables.size()),
         batch.table_stride == 0
             ? fmt::format("batch ({}) x table_width ({})", batch.seq_lens.size(), batch.table_width)
             : fmt::format("(batch ({}) - 1) x table_stride ({}) + table_width ({})", batch.seq_lens.size(),
                           batch.table_stride, batch.table_width));
}

Plan Planner::make_plan(int32_t* storage) const {
  return Plan(config_.limits, table_capacity_, work_capacity_, config_.num_workers, storage);
}

int row_groups_of(int64_t rows, int rows_per_unit) {
  if (rows < 1 || rows_per_unit < 1) return 1;
  // (Not ceil_div: rows + rows_per_unit - 1 overflows near INT64_MAX.)
  const int64_t groups = rows / rows_per_unit + (rows % rows_per_unit != 0 ? 1 : 0);
  return int(std::min<int64_t>(groups, int64_t(INT32_MAX)));
}

int Planner::chunks_of(int64_t max_rows) const {
  return std::max(1, config_.num_workers / row_groups_of(max_rows, config_.rows_per_unit));
}

namespace {

// The pass over every table entry of a step: copies n entries and returns (min(0, least),
// max(-1, greatest)). Baseline x86-64 has no packed 32-bit min or max (SSE4.1), so the loop
// is also compiled for AVX2 and the loader picks the clone the CPU runs. On a 2-core EPYC VM
// the loop alone over 524 288 entries (128 x 4096 tokens in pages of one token) took 118 µs,
// 58 with AVX2, and whole plans 1.2-2x less time (docs/perf.md, planning).
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
__attribute__((target_clones("avx2", "default")))
#endif
std::pair<int32_t, int32_t> copy_bounded(const int32_t* src, int32_t* dst, int64_t n) {
  int32_t lo = 0, hi = -1;
  for (int64_t j = 0; j < n; ++j) {
    const int32_t v = src[j];
    dst[j] = v;
    lo = std::min(lo, v);
    hi = std::max(hi, v);
  }
  return {lo, hi};
}

}  // namespace

// Every check branches first and formats only when it fails: this runs every step over
// every table entry.
int64_t Planner::validate(const BatchDesc& batch, Plan& plan) const {
  const auto& c = config_;
  const int64_t b_count = int64_t(batch.seq_lens.size());
  if (b_count < 1 || b_count > c.limits.max_batch)
    fail("batch", b_count, fmt::format("1..limits.max_batch ({})", c.limits.max_batch));
  require_known("mode", batch.mode);
  if (batch.qlen < 1 || batch.qlen > c.limits.max_qlen)
    fail("qlen", batch.qlen, fmt::format("1..limits.max_qlen ({})", c.limits.max_qlen));
  if (batch.mode == Mode::decode && batch.qlen != 1) fail("qlen", batch.qlen, "1 in decode mode");
  if (!batch.qlens.empty() && int64_t(batch.qlens.size()) != b_count)
    fail("qlens", fmt::format("{} entries", batch.qlens.size()),
         fmt::format("none (qlen rows per request) or one per request ({})", b_count));
  if (c.route != Route::automatic && !is_supported(c.backend, c.route, batch.mode, c.kv_dtype, c.heads))
    fail("route", to_string(c.route), fmt::format("a route that serves mode {} (two_stage is verify-only)",
                                                  to_string(batch.mode)));
  validate_table_shape(batch);
  // Sub-page ids (block * block_size / page + k) are int32 in the plan; on CUDA so are a bf16
  // cache's rows (block * block_size + k: the 64-row kernel's TMA box coordinates, kv_box_maps,
  // rows [0, 2^31)), where a row past them would read as zeros, not fault. That bound is the
  // smaller one.
  const int64_t per_block = c.block_size / page_;
  const bool box_rows = c.backend == Backend::cuda && c.kv_dtype == KvDtype::bf16;
  const int64_t block_limit = box_rows ? (int64_t(1) << 31) / c.block_size : INT32_MAX / per_block;
  const auto [lens, qlens, table_start, tables] = plan.batch_copy();
  table_start[0] = 0;
  int64_t max_block = -1;
  for (int b = 0; b < int(b_count); ++b) {
    // Each caller value is read once, into the copy; the checks and the plan read the copy.
    const int64_t len = lens[b] = batch.seq_lens[size_t(b)];
    const int qb = qlens[b] = batch.qlens.empty() ? batch.qlen : batch.qlens[size_t(b)];
    if (qb < 0 || qb > batch.qlen) fail(fmt::format("qlens[{}]", b), qb, fmt::format("in [0, qlen ({})]", batch.qlen));
    // two_stage's stage B takes the verify block of every request at one shape.
    if (qb != batch.qlen && c.route == Route::two_stage)
      fail(fmt::format("qlens[{}]", b), qb,
           fmt::format("qlen ({}) under route two_stage (stage B takes uniform query blocks)", batch.qlen));
    validate_seq_len(batch.mode, len, qb, b);
    // Rank 0 holds the largest share; checking it makes every rank of the group agree.
    const int64_t largest = c.layout.local_length_of(len, 0);
    if (largest > c.limits.max_local_kv_len)
      fail(fmt::format("seq_lens[{}]", b), len,
           fmt::format("a length whose largest rank share ({}) fits limits.max_local_kv_len ({})", largest,
                       c.limits.max_local_kv_len));
    const int64_t entries = ceil_div(largest, c.block_size);
    if (entries > batch.table_width)
      fail("table_width", batch.table_width, fmt::format(">= {} entries for seq_lens[{}] = {}", entries, b, len));
    // entries <= table_capacity_: the length's share fits max_local_kv_len (checked above).
    const int32_t* src = batch.table_of(size_t(b)).data();
    int32_t* row = tables + table_start[b];
    table_start[b + 1] = table_start[b] + int32_t(entries);
    const auto [lo, hi] = copy_bounded(src, row, entries);
    if (lo < 0 || hi >= block_limit) {
      const int64_t j = std::find_if(row, row + entries, [&](int32_t v) { return v < 0 || v >= block_limit; }) - row;
      fail(fmt::format("block_tables[{}][{}]", b, j), row[j],
           fmt::format("a block id in [0, {}) ({} must fit int32)", block_limit,
                       box_rows ? "a CUDA bf16 cache's row indices" : "sub-page ids"));
    }
    max_block = std::max<int64_t>(max_block, hi);
  }
  return max_block;
}

ScheduleCost calibrated_schedule_cost(int rows_per_unit, KvDtype kv_dtype, int row_groups) {
  require_known("kv_dtype", kv_dtype);
  ScheduleCost cost;
  if (rows_per_unit >= 64 && kv_dtype != KvDtype::bf16) cost.piece = 5.0;
  else if (rows_per_unit > 16) cost.piece = row_groups == 2 ? 3.0 : 2.0;
  else if (kv_dtype != KvDtype::bf16) cost.piece = 4.0;
  return cost;
}

// The balanced schedule: the requests' tiles (plus a fixed cost per piece) are dealt in
// request order into `chunks` chunks, each filled up to a cost T; a request that does not fit
// the rest of a chunk is cut there (its pieces write partials, combined afterwards), unless
// its pieces would be shorter than min_segment_tokens (or than the even share of tiles, when
// that is shorter). T is the least cost for which that deal places everything within the
// chunks (bisected), so the most loaded chunk, which the step waits for, is as light as the
// deal can make it. The longest request may thus run over many chunks, and a chunk may hold
// many short requests. A batch of at most one request per chunk within the slack of the even
// share is not cut at all, nor one whose best deal of whole requests is within the combine's
// cost of the cut deal's most loaded chunk.
void Planner::schedule(const int32_t* longest, int b_count, int chunks, Plan& plan, PlanStats& stats) const {
  const auto& c = config_;
  const ScheduleCost& cost = c.cost;
  bool cut_allowed = may_cut();  // false also when whole requests fit the balanced share
  const double slack = c.route == Route::split_k ? 0.0 : cost.slack;  // for the uniform check only
  const int32_t* q_start = plan.at(plan.off_q_start_);
  auto* work = reinterpret_cast<WorkItem*>(plan.at(plan.off_work_));
  int32_t* chunk_work = plan.at(plan.off_chunk_work_);
  // The cut requests' list overwrites `longest`: entry i is written while request b >= i is
  // scheduled, after longest[b] was read.
  int32_t* split_request = plan.at(plan.off_split_request_);
  int32_t* split_slot = plan.at(plan.off_split_slot_);

  // The even share, a lower bound on T: every tile and one piece per request, or per chunk
  // when there are fewer requests than chunks (cuts must then make the pieces).
  int64_t tiles = 0, parts = 0, most = 0;
  for (int b = 0; b < b_count; ++b)
    if (q_start[b + 1] > q_start[b] && longest[b] > 0) {
      const int64_t t = ceil_div(longest[b], kCutTokens);
      tiles += t;
      most = std::max(most, t);
      ++parts;
    }
  // A request of fewer than two min_segment_tokens is never cut. A longer one's pieces have
  // at least min_segment_tokens, or the even share of tiles when that is shorter (at least a
  // tile): a step of few tiles (one request of a few thousand tokens on a whole GPU) would
  // otherwise fill only a few chunks with long pieces (H200: 1 x 8192 at 16 heads, 32 pieces
  // of 4 tiles 20.0 us, 128 of one 18.5; bench/NOTES.md, thirty-first session).
  const int64_t floor_tiles = ceil_div(c.min_segment_tokens, kCutTokens);
  const int64_t min_tiles = std::clamp<int64_t>(tiles / chunks, 1, floor_tiles);
  const double share = (double(tiles) + cost.piece * double(std::max<int64_t>(parts, chunks)) +
                        cost.cut * double(std::max<int64_t>(0, chunks - parts))) /
                       chunks;
  // Whole requests, one per chunk, within the slack of the share: no cut pays for its partials
  // (a uniform batch a little smaller than the GPU).
  if (cut_allowed && slack > 0.0 && parts <= chunks && double(most) + cost.piece <= share * (1.0 + slack))
    cut_allowed = false;

  // Deals the requests into chunks of cost up to T (a request no T can split takes an empty
  // chunk whole, over T if it must); false when they do not fit in the chunks. Only the final
  // deal writes the work items and the cut list (which overwrites `longest`).
  int count = 0, k = 0, splits = 0, slots = 0;
  double peak = 0.0;  // the most loaded chunk's cost
  auto deal = [&](double T, bool final) {
    count = k = splits = slots = 0;
    peak = 0.0;
    double used = 0.0;
    // A piece of a cut request has min_tiles..cap tiles (cap: what an empty chunk holds), so
    // a rest of r tiles goes in pieces only if ceil(r / cap) of them have min_tiles each.
    const int64_t cap = int64_t(std::floor(T - cost.piece - cost.cut + 1e-9));
    chunk_work[0] = 0;
    for (int b = 0; b < b_count; ++b) {
      if (q_start[b + 1] == q_start[b]) continue;  // no query rows: nothing to compute or write
      const int32_t len = longest[b];
      const int64_t n = ceil_div(len, kCutTokens);
      int64_t pos = 0;
      bool cut = false;
      const int first = count;
      auto emit = [&](int64_t end, bool partial) {
        if (count >= work_capacity_) throw std::logic_error("dcpmla: the schedule exceeds its work capacity");
        if (partial && !cut) {
          if (final) {
            split_request[splits] = b;
            split_slot[splits] = slots;
          }
          ++splits;
        }
        const int32_t slot = partial ? slots++ : -1;
        if (final) work[count] = WorkItem{b, int32_t(pos * kCutTokens), end == n ? len : int32_t(end * kCutTokens), slot};
        ++count;
      };
      if (n == 0) {
        // Padding, or no local token here: its rows get zeros, a cost the schedule ignores so
        // that padding never moves a cut (seed 002).
        emit(0, false);
        continue;
      }
      // A request T cannot split: cuts are off, or it is shorter than two min_segment_tokens.
      const bool whole_only = !cut_allowed || n < 2 * floor_tiles;
      for (;;) {
        const int64_t rest = n - pos;
        const double whole = double(rest) + cost.piece + (cut ? cost.cut : 0.0);
        const double room = T - used;
        // The rest fits, or it is cut to fill the chunk, or it goes to the next chunk.
        if (whole <= room) {
          emit(n, cut);
          used += whole;
          break;
        }
        int64_t take = 0;
        if (!whole_only && cap >= min_tiles) {
          // The most the room holds, less what keeps the rest in such pieces: the least rest
          // of at least r tiles that goes in them is max(r, ceil(r / cap) min_tiles) (11 tiles
          // do not go in pieces of 4..5, so 16 is cut 4 + 12, not 5 + 11).
          const int64_t room_tiles = int64_t(std::floor(room - cost.piece - cost.cut + 1e-9));
          const int64_t left = std::max(rest - room_tiles, min_tiles);
          take = rest - std::max(left, ceil_div(left, cap) * min_tiles);
        }
        if (take >= min_tiles) {
          emit(pos + take, true);
          cut = true;
          used += double(take) + cost.piece + cost.cut;
          pos += take;
        } else if (used == 0.0) {
          // An empty chunk cannot take a piece within T: T is too small, unless no T splits
          // the request (it then takes the chunk, the least any deal can give it).
          if (!whole_only) return false;
          emit(n, false);
          used += whole;
          break;
        }
        if (k == chunks - 1) return false;  // no chunk left for the rest
        chunk_work[++k] = count;  // (a dry deal's offsets are rewritten by the final one)
        peak = std::max(peak, used);  // (a chunk's load only grows until it closes)
        used = 0.0;
      }
      if (final) stats.max_segments = std::max(stats.max_segments, count - first);
    }
    peak = std::max(peak, used);
    return true;
  };
  // The least T that fits, to half a tile or 0.3 % of it (with the calibrated costs a deal
  // changes only where T crosses a multiple of half a tile, so up to 166 tiles a chunk half a
  // tile finds the least exactly). `lo` is a lower bound and the cuts' own costs usually need a
  // tile or two more: the bracket grows from it by doubling steps, then is bisected (about five
  // deals of O(batch + chunks) each).
  // fit_peak and fit_slots: the heaviest chunk and the cut requests' pieces of the deal at the T
  // it returns (the last deal that fitted), for the combine's check below.
  double fit_peak = 0.0;
  int fit_slots = 0;
  auto fits = [&](double T) {
    if (!deal(T, false)) return false;
    fit_peak = peak;
    fit_slots = slots;
    return true;
  };
  auto least_fit = [&](double lo) {
    const double from = lo;
    double step = 1.0, hi = from + step;
    while (!fits(hi)) {
      lo = hi;
      step *= 2.0;
      hi = from + step;
    }
    while (hi - lo > std::max(0.5, 0.003 * hi)) {
      const double mid = 0.5 * (lo + hi);
      (fits(mid) ? hi : lo) = mid;
    }
    return hi;
  };
  double T = least_fit(share);
  // A deal that cuts launches the combine, a cost of the step rather than of a chunk: it must
  // beat the best deal of whole requests by more than the combine costs, its launch and its
  // reads of the cut pieces' partials (a small step whose longest request is cut to save a tile
  // or two: H100, 12 requests of at most 480 tokens at 128 heads took 24.5 us cut and 21.2
  // whole; verify128_q2, 1.9 cut pieces a chunk, saved 4 tiles cut and took 9 us more,
  // bench/NOTES.md). A forced split_k keeps its cuts.
  const double combine = cost.combine + cost.combine_piece * double(fit_slots) / chunks;
  if (cut_allowed && c.route != Route::split_k && combine > 0.0 && fit_slots > 0 &&
      double(most) + cost.piece <= fit_peak + combine) {
    const double cut_peak = fit_peak;
    cut_allowed = false;
    if (deal(cut_peak + combine, false)) {
      // Whole requests: each a piece, the longest at least in its own chunk. (least_fit tries
      // lo + 1 first and bisects down to half a tile: from half a tile below the bound, the
      // bound itself is tried.)
      const double whole_share = (double(tiles) + cost.piece * double(parts)) / chunks;
      T = std::min(least_fit(std::max(whole_share, double(most) + cost.piece) - 0.5), cut_peak + combine);
    } else {
      cut_allowed = true;
    }
  }
  stats.max_segments = 0;
  if (!deal(T, true)) throw std::logic_error("dcpmla: the schedule's final deal did not fit");
  for (int j = k + 1; j <= chunks; ++j) chunk_work[j] = count;
  split_slot[splits] = slots;
  PlanHeader& h = plan.mutable_header();
  h.work_count = count;
  h.chunks = chunks;
  h.split_requests = splits;
}

void Planner::plan(const BatchDesc& batch, Plan& plan) const {
  const auto& c = config_;
  if (plan.work_capacity_ != work_capacity_ || plan.table_capacity_ != table_capacity_ ||
      plan.chunk_capacity_ != c.num_workers || plan.limits_.max_batch != c.limits.max_batch ||
      plan.limits_.max_qlen != c.limits.max_qlen)
    fail("plan", "a plan of other capacities", "a plan made by this planner's make_plan()");
  if (plan.arena_.base == nullptr) Plan::fail_moved_from();
  const int64_t max_block = validate(batch, plan);
  // From here on the batch is read from the plan's copy only.
  const auto [lens, qlens, table_start, tables] = plan.batch_copy();

  const int b_count = int(batch.seq_lens.size());
  const Layout& layout = c.layout;

  PlanStats stats;
  stats.max_block = max_block;
  for (int b = 0; b < b_count; ++b) {
    const int64_t len = lens[b];
    if (len == 0) continue;
    const int64_t largest = layout.local_length_of(len, 0);
    stats.min_local_len = stats.active_requests == 0 ? largest : std::min(stats.min_local_len, largest);
    stats.max_local_len = std::max(stats.max_local_len, largest);
    stats.total_local_len += largest;
    ++stats.active_requests;
  }

  PlanHeader& h = plan.mutable_header();
  h.batch = b_count;
  h.qlen = batch.qlen;
  h.page = page_;
  h.mode = int32_t(batch.mode);

  // Rows: what each query row attends on this rank, packed request by request. two_stage's
  // sharded stage sees the committed prefix [0, L - qlen) on every row; its causal block is
  // stage B. A request's longest row sets its tokens (kept in the split list's place until
  // the schedule replaces them).
  int32_t* rows = plan.at(plan.off_rows_);
  int32_t* q_start = plan.at(plan.off_q_start_);
  int32_t* longest = plan.at(plan.off_split_request_);
  int32_t stride = 0, total_rows = 0, widest = 0, widest_active = 0;
  for (int b = 0; b < b_count; ++b) {
    const int64_t len = lens[b];
    const int qb = qlens[b];
    int64_t most = 0;
    for (int t = 0; t < qb; ++t) {
      const int64_t n = c.route == Route::two_stage ? layout.local_length(len == 0 ? 0 : len - qb)
                                                    : layout.local_length(detail::row_window_unchecked(batch.mode, len, qb, t));
      rows[total_rows + t] = int32_t(n);
      most = std::max(most, n);
    }
    q_start[b] = total_rows;
    total_rows += qb;
    widest = std::max(widest, qb);
    if (most > 0) widest_active = std::max(widest_active, qb);
    longest[b] = int32_t(most);
    stride = std::max(stride, int32_t(ceil_div(most, page_)));
  }
  q_start[b_count] = total_rows;
  h.rows = total_rows;
  h.widest_qlen = widest;
  h.table_stride = stride;

  // Sub-page table, rows of this step's widest request: local index i lives in block
  // table[i / bs], so sub-page k of a request is table[k / per_block] * per_block + k % per_block.
  const int per_block = c.block_size / page_;
  int32_t* subpages = plan.at(plan.off_subpages_);
  for (int b = 0; b < b_count; ++b) {
    const int32_t* table = tables + table_start[b];
    int32_t* dst = subpages + int64_t(b) * stride;
    const int32_t n = int32_t(ceil_div(longest[b], page_));
    if (per_block == 1) {
      std::copy_n(table, n, dst);
    } else {
      for (int32_t k = 0; k < n; ++k) dst[k] = table[k / per_block] * per_block + k % per_block;
    }
  }

  // Chunks follow the requests with work: a padding request's rows (the kernels' row groups
  // count them, so that they get their zeros) never take parallelism away (seed 002).
  schedule(longest, b_count, chunks_of(int64_t(widest_active) * c.heads), plan, stats);
  // The route follows from the schedule: split_k when it cut a request.
  h.route = int32_t(c.route != Route::automatic ? c.route : h.split_requests > 0 ? Route::split_k : Route::one_stage);
  plan.stats_ = stats;
}

}  // namespace dcpmla
