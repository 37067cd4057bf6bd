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

// two_stage is verify-only: its stage B is the causal verify block.
constexpr std::array<Capability, 6> kCapabilities{{
    {Backend::cpu, Route::one_stage, kAllModes, kAllDtypes, 1, 4096},
    {Backend::cpu, Route::two_stage, bit(Mode::verify), kAllDtypes, 1, 4096},
    {Backend::cpu, Route::split_k, kAllModes, kAllDtypes, 1, 4096},
    {Backend::cuda, Route::one_stage, kAllModes, kAllDtypes, 1, 128},
    {Backend::cuda, Route::two_stage, bit(Mode::verify), kAllDtypes, 1, 128},
    {Backend::cuda, Route::split_k, kAllModes, kAllDtypes, 1, 128},
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

}  // namespace

std::span<const Capability> capability_table() { return kCapabilities; }

bool is_supported(Backend backend, Route route, Mode mode, KvDtype dtype, int heads) {
  return std::any_of(kCapabilities.begin(), kCapabilities.end(), [&](const Capability& c) {
    return c.backend == backend && c.route == route && (c.modes & bit(mode)) &&
           (c.dtypes & bit(dtype)) && heads >= c.min_heads && heads <= c.max_heads;
  });
}

Plan::Plan(const PlanLimits& limits, int64_t table_stride, int work_capacity)
    : limits_(limits), table_stride_(table_stride), work_capacity_(work_capacity) {
  off_rows_ = kHeaderInts;
  off_request_work_ = off_rows_ + size_t(limits.max_batch) * size_t(limits.max_qlen);
  off_work_ = off_request_work_ + size_t(limits.max_batch) + 1;
  off_subpages_ = off_work_ + size_t(work_capacity) * kWorkInts;
  const size_t total = off_subpages_ + size_t(limits.max_batch) * size_t(table_stride);
  arena_.assign(total, 0);
  mutable_header().route = int32_t(Route::one_stage);
}

PlanView Plan::view_at(const int32_t* base) const {
  return PlanView{reinterpret_cast<const PlanHeader*>(base),
                  base + off_rows_,
                  base + off_subpages_,
                  reinterpret_cast<const WorkItem*>(base + off_work_),
                  base + off_request_work_,
                  int32_t(table_stride_),
                  limits_.max_batch,
                  limits_.max_qlen,
                  work_capacity_};
}

Planner::Planner(const PlannerConfig& config) : config_(config) {
  const auto& c = config_;
  c.layout.validate_with_block_size(c.block_size);
  require(c.num_blocks >= 1, "num_blocks", c.num_blocks, ">= 1");
  require(c.dims.kv_lora_rank >= 1, "kv_lora_rank", c.dims.kv_lora_rank, ">= 1");
  require(c.dims.rope_dim >= 1, "rope_dim", c.dims.rope_dim, ">= 1 (kv_lora_rank < D)");
  // D = R + P is an int everywhere downstream (found by fuzz_planner).
  require(c.dims.rope_dim <= INT32_MAX - c.dims.kv_lora_rank, "rope_dim", c.dims.rope_dim,
          fmt::format("<= {} so that D = kv_lora_rank + rope_dim fits int32", INT32_MAX - c.dims.kv_lora_rank));
  require(c.limits.max_batch >= 1, "limits.max_batch", c.limits.max_batch, ">= 1");
  require(c.limits.max_qlen >= 1 && c.limits.max_qlen <= kMaxQlen, "limits.max_qlen", c.limits.max_qlen,
          fmt::format("in [1, {}]", kMaxQlen));
  // Row lengths are int32 in the plan (and seq_lens are int32), so a longer limit means nothing
  // and would overflow the table-stride arithmetic (found by fuzz_planner).
  require(c.limits.max_local_kv_len >= 1 && c.limits.max_local_kv_len <= INT32_MAX, "limits.max_local_kv_len",
          c.limits.max_local_kv_len, fmt::format("in [1, {}]", INT32_MAX));
  require(c.num_workers >= 1, "num_workers", c.num_workers, ">= 1");
  require(c.min_segment_tokens >= 1, "min_segment_tokens", c.min_segment_tokens, ">= 1");
  // Heads beyond what any route serves are the heads' fault, not the route's.
  require(c.heads >= 1 && c.heads <= max_heads(c.backend), "heads", c.heads,
          fmt::format("in [1, {}] on the {} backend", max_heads(c.backend), to_string(c.backend)));
  // Auto may take one_stage or split_k; a forced route must itself be served.
  const Route checked = c.route == Route::automatic ? Route::one_stage : c.route;
  if (!is_supported(c.backend, checked, c.mode, c.kv_dtype, c.heads))
    throw Error(fmt::format(
        "dcpmla: field 'route' = {}: expected a route the {} backend serves for mode {}, kv_dtype {} "
        "and heads {} (see capability_table(): two_stage is verify-only; cuda serves 1..128 heads)",
        to_string(c.route), to_string(c.backend), to_string(c.mode), to_string(c.kv_dtype), c.heads));
  page_ = subpage_size(c.block_size);
  // Sub-page ids (block * block_size / page + k) are int32 in the plan.
  const int64_t per_block = c.block_size / page_;
  require(c.num_blocks <= INT32_MAX / per_block, "num_blocks", c.num_blocks,
          fmt::format("<= {} so that sub-page ids (num_blocks x block_size / page {}) fit int32",
                      INT32_MAX / per_block, page_));
  table_stride_ = ceil_div(c.limits.max_local_kv_len, page_);
  // In int64: max_batch + num_workers overflows int for absurd values (found by fuzz_planner);
  // the arena limit keeps the capacity far inside int once it passes.
  const int64_t work_capacity = int64_t(c.limits.max_batch) + c.num_workers;
  const int64_t ints = int64_t(c.limits.max_batch) * (c.limits.max_qlen + table_stride_ + 1) +
                       work_capacity * int64_t(kWorkInts);
  require(ints < kMaxArenaInts, "limits", fmt::format("{} plan ints", ints),
          fmt::format("< {} (lower max_batch, max_local_kv_len or num_workers)", kMaxArenaInts));
  work_capacity_ = int(work_capacity);
}

Plan Planner::make_plan() const { return Plan(config_.limits, table_stride_, work_capacity_); }

void Planner::validate(const BatchDesc& batch) const {
  const auto& c = config_;
  const int64_t b_count = int64_t(batch.seq_lens.size());
  require(b_count >= 1 && b_count <= c.limits.max_batch, "batch", b_count,
          fmt::format("1..limits.max_batch ({})", c.limits.max_batch));
  require(batch.qlen >= 1 && batch.qlen <= c.limits.max_qlen, "qlen", batch.qlen,
          fmt::format("1..limits.max_qlen ({})", c.limits.max_qlen));
  if (c.mode == Mode::decode) require(batch.qlen == 1, "qlen", batch.qlen, "1 in decode mode");
  require(batch.table_width >= 0, "table_width", batch.table_width, ">= 0");
  require(int64_t(batch.block_tables.size()) == b_count * batch.table_width, "block_tables",
          fmt::format("{} entries", batch.block_tables.size()),
          fmt::format("batch ({}) x table_width ({})", b_count, batch.table_width));
  for (int b = 0; b < int(b_count); ++b) {
    const int64_t len = batch.seq_lens[size_t(b)];
    validate_seq_len(c.mode, len, batch.qlen, b);
    // Rank 0 holds the largest share; checking it makes every rank of the group agree.
    const int64_t largest = c.layout.local_length_of(len, 0);
    require(largest <= c.limits.max_local_kv_len, fmt::format("seq_lens[{}]", b), len,
            fmt::format("a length whose largest rank share ({}) fits limits.max_local_kv_len ({})",
                        largest, c.limits.max_local_kv_len));
    const int64_t entries = ceil_div(largest, c.block_size);
    require(entries <= batch.table_width, "table_width", batch.table_width,
            fmt::format(">= {} entries for seq_lens[{}] = {}", entries, b, len));
    for (int64_t j = 0; j < entries; ++j) {
      const int32_t block = batch.block_tables[size_t(b) * size_t(batch.table_width) + size_t(j)];
      require(block >= 0 && block < c.num_blocks, fmt::format("block_tables[{}][{}]", b, j), block,
              fmt::format("a block id in [0, {})", c.num_blocks));
    }
  }
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
  require(plan.work_capacity_ == work_capacity_ && plan.table_stride_ == table_stride_ &&
              plan.limits_.max_batch == c.limits.max_batch && plan.limits_.max_qlen == c.limits.max_qlen,
          "plan", "a plan of other capacities", "a plan made by this planner's make_plan()");
  validate(batch);

  const int b_count = int(batch.seq_lens.size());
  const int qlen = batch.qlen;
  const Layout& layout = c.layout;

  PlanStats stats;
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
  if (route == Route::two_stage)
    require(c.mode == Mode::verify, "route", to_string(route), "verify mode");

  PlanHeader& h = plan.mutable_header();
  h.route = int32_t(route);
  h.batch = b_count;
  h.qlen = qlen;
  h.page = page_;

  // Rows: what each row attends on this rank. two_stage's sharded stage sees the committed
  // prefix [0, L - qlen) on every row; its causal block is stage B.
  int32_t* rows = plan.at(plan.off_rows_);
  std::vector<int64_t> tiles(size_t(b_count), 0);
  for (int b = 0; b < b_count; ++b) {
    const int64_t len = batch.seq_lens[size_t(b)];
    int64_t longest = 0;
    for (int t = 0; t < qlen; ++t) {
      const int64_t n = route == Route::two_stage ? layout.local_length(len == 0 ? 0 : len - qlen)
                                                  : layout.local_length(row_window(c.mode, len, qlen, t));
      rows[b * qlen + t] = int32_t(n);
      longest = std::max(longest, n);
    }
    tiles[size_t(b)] = ceil_div(longest, page_);
  }

  // Sub-page table: local index i lives in block table[i / bs], so sub-page k of a
  // request is table[k / per_block] * per_block + k % per_block.
  const int per_block = c.block_size / page_;
  int32_t* subpages = plan.at(plan.off_subpages_);
  for (int b = 0; b < b_count; ++b) {
    const int32_t* table = batch.block_tables.data() + size_t(b) * size_t(batch.table_width);
    int32_t* dst = subpages + int64_t(b) * table_stride_;
    for (int64_t k = 0; k < tiles[size_t(b)]; ++k)
      dst[k] = table[k / per_block] * per_block + int32_t(k % per_block);
  }

  // Work: one item per request, or split_k's segments of whole tiles. Segments target an
  // even share of this rank's tiles over the workers (per head group), so a ragged batch
  // gives its long requests more segments.
  auto* work = reinterpret_cast<WorkItem*>(plan.at(plan.off_work_));
  int32_t* request_work = plan.at(plan.off_request_work_);
  int count = 0;
  if (route == Route::split_k) {
    const int64_t head_groups = ceil_div(int64_t(qlen) * c.heads, kRowsPerUnit);
    const int64_t items_wanted = std::max<int64_t>(1, c.num_workers / head_groups);
    int64_t total_tiles = 0;
    for (int64_t t : tiles) total_tiles += t;
    const int64_t target = std::max(ceil_div(total_tiles, items_wanted), ceil_div(c.min_segment_tokens, page_));
    for (int b = 0; b < b_count; ++b) {
      request_work[b] = count;
      const int64_t n = tiles[size_t(b)];
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
      request_work[b] = count;
      work[count++] = WorkItem{b, 0, int32_t(tiles[size_t(b)]), 0};
    }
    stats.max_segments = 1;
  }
  request_work[b_count] = count;
  h.work_count = count;
  plan.stats_ = stats;
}

}  // namespace dcpmla
