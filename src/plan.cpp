#include "dcpmla/plan.h"

#include <algorithm>
#include <array>
#include <stdexcept>

#include "dcpmla/cache.h"
#include "dcpmla/error.h"

namespace dcpmla {
namespace {

constexpr uint32_t bit(Mode m) { return 1u << int(m); }
constexpr uint32_t bit(KvDtype d) { return 1u << int(d); }
constexpr uint32_t kAllModes = bit(Mode::decode) | bit(Mode::verify) | bit(Mode::draft);
constexpr uint32_t kAllDtypes = bit(KvDtype::bf16) | bit(KvDtype::fp8_e4m3) | bit(KvDtype::fp8_e5m2);
constexpr int kCpuMaxHeads = 4096, kCudaMaxHeads = 128;

// two_stage is verify-only: its stage B is the causal verify block.
constexpr std::array<Capability, 6> kCapabilities{{
    {Backend::cpu, Route::one_stage, kAllModes, kAllDtypes, 1, kCpuMaxHeads},
    {Backend::cpu, Route::two_stage, bit(Mode::verify), kAllDtypes, 1, kCpuMaxHeads},
    {Backend::cpu, Route::split_k, kAllModes, kAllDtypes, 1, kCpuMaxHeads},
    {Backend::cuda, Route::one_stage, kAllModes, kAllDtypes, 1, kCudaMaxHeads},
    {Backend::cuda, Route::two_stage, bit(Mode::verify), kAllDtypes, 1, kCudaMaxHeads},
    {Backend::cuda, Route::split_k, kAllModes, kAllDtypes, 1, kCudaMaxHeads},
}};

int max_heads(Backend backend) {
  int most = 0;
  for (const Capability& c : kCapabilities)
    if (c.backend == backend) most = std::max(most, c.max_heads);
  return most;
}

constexpr int64_t kMaxArenaInts = int64_t(1) << 30;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

constexpr size_t kHeaderInts = sizeof(PlanHeader) / sizeof(int32_t);
constexpr size_t kWorkInts = sizeof(WorkItem) / sizeof(int32_t);

struct ArenaOffsets {
  size_t rows, request_work, work, subpages, total;
};
ArenaOffsets arena_offsets(const PlanLimits& limits, int64_t table_capacity, int work_capacity) {
  ArenaOffsets o;
  o.rows = kHeaderInts;
  o.request_work = o.rows + size_t(limits.max_batch) * size_t(limits.max_qlen);
  o.work = o.request_work + size_t(limits.max_batch) + 1;
  o.subpages = o.work + size_t(work_capacity) * kWorkInts;
  o.total = o.subpages + size_t(limits.max_batch) * size_t(table_capacity);
  return o;
}

}  // namespace

std::span<const Capability> capability_table() { return kCapabilities; }

bool is_supported(Backend backend, Route route, Mode mode, KvDtype dtype, int heads) {
  return std::any_of(kCapabilities.begin(), kCapabilities.end(), [&](const Capability& c) {
    return c.backend == backend && c.route == route && (c.modes & bit(mode)) &&
           (c.dtypes & bit(dtype)) && heads >= c.min_heads && heads <= c.max_heads;
  });
}

size_t Plan::ints(const PlanLimits& limits, int64_t table_capacity, int work_capacity) {
  return arena_offsets(limits, table_capacity, work_capacity).total;
}

Plan::Plan(const PlanLimits& limits, int64_t table_capacity, int work_capacity, int32_t* storage)
    : limits_(limits), table_capacity_(table_capacity), work_capacity_(work_capacity) {
  const ArenaOffsets o = arena_offsets(limits, table_capacity, work_capacity);
  off_rows_ = o.rows;
  off_request_work_ = o.request_work;
  off_work_ = o.work;
  off_subpages_ = o.subpages;
  size_ = o.total;
  if (storage == nullptr) {
    owned_.assign(size_, 0);
    base_ = owned_.data();
  } else {
    base_ = storage;
    std::fill(base_, base_ + size_, 0);
  }
  mutable_header().route = int32_t(Route::one_stage);
}

size_t Plan::used_ints() const {
  const PlanHeader& h = header();
  return off_subpages_ + size_t(h.batch) * size_t(h.table_stride);
}

PlanView Plan::view_at(const int32_t* base) const {
  return PlanView{reinterpret_cast<const PlanHeader*>(base),
                  base + off_rows_,
                  base + off_subpages_,
                  reinterpret_cast<const WorkItem*>(base + off_work_),
                  base + off_request_work_,
                  int32_t(table_capacity_),
                  limits_.max_batch,
                  limits_.max_qlen,
                  work_capacity_};
}

Planner::Planner(const PlannerConfig& config) : config_(config) {
  const auto& c = config_;
  c.layout.validate_with_block_size(c.block_size);
  require(c.dims.kv_lora_rank >= 1, "kv_lora_rank", c.dims.kv_lora_rank, ">= 1");
  require(c.dims.rope_dim >= 1, "rope_dim", c.dims.rope_dim, ">= 1 (kv_lora_rank < D)");
  // D = R + P is an int everywhere downstream (found by fuzz_planner).
  require(c.dims.rope_dim <= INT32_MAX - c.dims.kv_lora_rank, "rope_dim", c.dims.rope_dim,
          fmt::format("<= {} so that D = kv_lora_rank + rope_dim fits int32", INT32_MAX - c.dims.kv_lora_rank));
  require(c.limits.max_batch >= 1, "limits.max_batch", c.limits.max_batch, ">= 1");
  require(c.limits.max_qlen >= 1 && c.limits.max_qlen <= kMaxQlen, "limits.max_qlen", c.limits.max_qlen,
          fmt::format("in [1, {}]", kMaxQlen));
  // Row lengths are int32 in the plan (and seq_lens are int32), so a longer limit means nothing
  // and would overflow the table arithmetic (found by fuzz_planner).
  require(c.limits.max_local_kv_len >= 1 && c.limits.max_local_kv_len <= INT32_MAX, "limits.max_local_kv_len",
          c.limits.max_local_kv_len, fmt::format("in [1, {}]", INT32_MAX));
  require(c.num_workers >= 1, "num_workers", c.num_workers, ">= 1");
  require(c.min_segment_tokens >= 1, "min_segment_tokens", c.min_segment_tokens, ">= 1");
  // Heads beyond what any route serves are the heads' fault, not the route's.
  require(c.heads >= 1 && c.heads <= max_heads(c.backend), "heads", c.heads,
          fmt::format("in [1, {}] on the {} backend", max_heads(c.backend), to_string(c.backend)));
  require(c.kv_dtype == KvDtype::bf16 || c.kv_dtype == KvDtype::fp8_e4m3 || c.kv_dtype == KvDtype::fp8_e5m2,
          "kv_dtype", int(c.kv_dtype), "bf16, fp8_e4m3 or fp8_e5m2");
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
  // In int64: max_batch + num_workers overflows int for absurd values (found by fuzz_planner);
  // the arena limit keeps the capacity far inside int once it passes.
  const int64_t work_capacity = int64_t(c.limits.max_batch) + c.num_workers;
  const int64_t ints = int64_t(c.limits.max_batch) * (c.limits.max_qlen + table_capacity_ + 1) +
                       work_capacity * int64_t(kWorkInts);
  require(ints < kMaxArenaInts, "limits", fmt::format("{} plan ints", ints),
          fmt::format("< {} (lower max_batch, max_local_kv_len or num_workers)", kMaxArenaInts));
  work_capacity_ = int(work_capacity);
}

Plan Planner::make_plan(int32_t* storage) const { return Plan(config_.limits, table_capacity_, work_capacity_, storage); }

// Every check branches first and formats only when it fails: this runs every step over
// every table entry.
int64_t Planner::validate(const BatchDesc& batch) const {
  const auto& c = config_;
  const int64_t b_count = int64_t(batch.seq_lens.size());
  if (b_count < 1 || b_count > c.limits.max_batch)
    fail("batch", b_count, fmt::format("1..limits.max_batch ({})", c.limits.max_batch));
  if (batch.mode != Mode::decode && batch.mode != Mode::verify && batch.mode != Mode::draft)
    fail("mode", int(batch.mode), "decode, verify or draft");
  if (batch.qlen < 1 || batch.qlen > c.limits.max_qlen)
    fail("qlen", batch.qlen, fmt::format("1..limits.max_qlen ({})", c.limits.max_qlen));
  if (batch.mode == Mode::decode && batch.qlen != 1) fail("qlen", batch.qlen, "1 in decode mode");
  if (c.route != Route::automatic && !is_supported(c.backend, c.route, batch.mode, c.kv_dtype, c.heads))
    fail("route", to_string(c.route), fmt::format("a route that serves mode {} (two_stage is verify-only)",
                                                  to_string(batch.mode)));
  if (batch.table_width < 0) fail("table_width", batch.table_width, ">= 0");
  if (int64_t(batch.block_tables.size()) != b_count * batch.table_width)
    fail("block_tables", fmt::format("{} entries", batch.block_tables.size()),
         fmt::format("batch ({}) x table_width ({})", b_count, batch.table_width));
  // Sub-page ids (block * block_size / page + k) are int32 in the plan.
  const int64_t per_block = c.block_size / page_;
  const int64_t block_limit = INT32_MAX / per_block;
  int64_t max_block = -1;
  for (int b = 0; b < int(b_count); ++b) {
    const int64_t len = batch.seq_lens[size_t(b)];
    validate_seq_len(batch.mode, len, batch.qlen, b);
    // Rank 0 holds the largest share; checking it makes every rank of the group agree.
    const int64_t largest = c.layout.local_length_of(len, 0);
    if (largest > c.limits.max_local_kv_len)
      fail(fmt::format("seq_lens[{}]", b), len,
           fmt::format("a length whose largest rank share ({}) fits limits.max_local_kv_len ({})", largest,
                       c.limits.max_local_kv_len));
    const int64_t entries = ceil_div(largest, c.block_size);
    if (entries > batch.table_width)
      fail("table_width", batch.table_width, fmt::format(">= {} entries for seq_lens[{}] = {}", entries, b, len));
    const int32_t* row = batch.block_tables.data() + size_t(b) * size_t(batch.table_width);
    int32_t lo = 0, hi = -1;
    for (int64_t j = 0; j < entries; ++j) {
      lo = std::min(lo, row[j]);
      hi = std::max(hi, row[j]);
    }
    if (lo < 0 || hi >= block_limit) {
      const int64_t j = std::find_if(row, row + entries, [&](int32_t v) { return v < 0 || v >= block_limit; }) - row;
      fail(fmt::format("block_tables[{}][{}]", b, j), row[j],
           fmt::format("a block id in [0, {}) (sub-page ids must fit int32)", block_limit));
    }
    max_block = std::max<int64_t>(max_block, hi);
  }
  return max_block;
}

Route Planner::choose_route(const PlanStats& stats, int qlen) const {
  if (config_.route != Route::automatic) return config_.route;
  // one_stage takes as long as its longest request (one unit per request and head group);
  // split_k spreads all tokens evenly over the workers and adds a merge. Split only when
  // the longest request is well above that even share (idle workers or a ragged batch)
  // and long enough to give each segment real work. Padding is not in the stats.
  if (stats.active_requests == 0 || stats.max_local_len < 2 * int64_t(config_.min_segment_tokens))
    return Route::one_stage;
  const double head_groups = double(ceil_div(int64_t(qlen) * config_.heads, kRowsPerUnit));
  const double even_share = double(stats.total_local_len) * head_groups / config_.num_workers;
  return double(stats.max_local_len) > 1.25 * even_share ? Route::split_k : Route::one_stage;
}

void Planner::plan(const BatchDesc& batch, Plan& plan) const {
  const auto& c = config_;
  if (plan.work_capacity_ != work_capacity_ || plan.table_capacity_ != table_capacity_ ||
      plan.limits_.max_batch != c.limits.max_batch || plan.limits_.max_qlen != c.limits.max_qlen)
    fail("plan", "a plan of other capacities", "a plan made by this planner's make_plan()");
  const int64_t max_block = validate(batch);

  const int b_count = int(batch.seq_lens.size());
  const int qlen = batch.qlen;
  const Layout& layout = c.layout;

  PlanStats stats;
  stats.max_block = max_block;
  for (int b = 0; b < b_count; ++b) {
    const int64_t len = batch.seq_lens[size_t(b)];
    if (len == 0) continue;
    const int64_t largest = layout.local_length_of(len, 0);
    stats.min_local_len = stats.active_requests == 0 ? largest : std::min(stats.min_local_len, largest);
    stats.max_local_len = std::max(stats.max_local_len, largest);
    stats.total_local_len += largest;
    ++stats.active_requests;
  }
  const Route route = choose_route(stats, qlen);

  PlanHeader& h = plan.mutable_header();
  h.route = int32_t(route);
  h.batch = b_count;
  h.qlen = qlen;
  h.page = page_;
  h.mode = int32_t(batch.mode);

  // Rows: what each row attends on this rank. two_stage's sharded stage sees the committed
  // prefix [0, L - qlen) on every row; its causal block is stage B. The longest row of a
  // request sets its tiles; they are kept in request_work until the work list replaces them.
  int32_t* rows = plan.at(plan.off_rows_);
  int32_t* tiles = plan.at(plan.off_request_work_);
  int32_t stride = 0;
  for (int b = 0; b < b_count; ++b) {
    const int64_t len = batch.seq_lens[size_t(b)];
    int64_t longest = 0;
    for (int t = 0; t < qlen; ++t) {
      const int64_t n = route == Route::two_stage ? layout.local_length(len == 0 ? 0 : len - qlen)
                                                  : layout.local_length(row_window(batch.mode, len, qlen, t));
      rows[b * qlen + t] = int32_t(n);
      longest = std::max(longest, n);
    }
    tiles[b] = int32_t(ceil_div(longest, page_));
    stride = std::max(stride, tiles[b]);
  }
  h.table_stride = stride;

  // Sub-page table, rows of this step's widest request: local index i lives in block
  // table[i / bs], so sub-page k of a request is table[k / per_block] * per_block + k % per_block.
  const int per_block = c.block_size / page_;
  int32_t* subpages = plan.at(plan.off_subpages_);
  for (int b = 0; b < b_count; ++b) {
    const int32_t* table = batch.block_tables.data() + size_t(b) * size_t(batch.table_width);
    int32_t* dst = subpages + int64_t(b) * stride;
    if (per_block == 1) {
      std::copy_n(table, tiles[b], dst);
    } else {
      for (int32_t k = 0; k < tiles[b]; ++k) dst[k] = table[k / per_block] * per_block + k % per_block;
    }
  }

  // Work: one item per request, or split_k's segments of whole tiles. Segments target an
  // even share of this rank's tiles over the workers (per head group), so a ragged batch
  // gives its long requests more segments.
  auto* work = reinterpret_cast<WorkItem*>(plan.at(plan.off_work_));
  int32_t* request_work = tiles;  // overwritten in order: entry b is read before it is replaced
  int count = 0;
  if (route == Route::split_k) {
    const int64_t head_groups = ceil_div(int64_t(qlen) * c.heads, kRowsPerUnit);
    const int64_t items_wanted = std::max<int64_t>(1, c.num_workers / head_groups);
    int64_t total_tiles = 0;
    for (int b = 0; b < b_count; ++b) total_tiles += tiles[b];
    const int64_t target = std::max(ceil_div(total_tiles, items_wanted), ceil_div(c.min_segment_tokens, page_));
    for (int b = 0; b < b_count; ++b) {
      const int64_t n = tiles[b];
      request_work[b] = count;
      if (n == 0) continue;
      const int64_t segments = ceil_div(n, target);
      const int64_t per_segment = ceil_div(n, segments);
      for (int64_t begin = 0; begin < n; begin += per_segment) {
        if (count >= work_capacity_) throw std::logic_error("dcpmla: split_k work exceeds its capacity");
        work[count++] = WorkItem{b, int32_t(begin), int32_t(std::min(n, begin + per_segment)), 0};
      }
      stats.max_segments = std::max(stats.max_segments, count - request_work[b]);
    }
  } else {
    for (int b = 0; b < b_count; ++b) {
      const int32_t n = tiles[b];
      request_work[b] = count;
      work[count++] = WorkItem{b, 0, n, 0};
    }
    stats.max_segments = 1;
  }
  request_work[b_count] = count;
  h.work_count = count;
  plan.stats_ = stats;
}

}  // namespace dcpmla
