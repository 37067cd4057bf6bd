// The planner (SPEC §4): the one place that inspects lengths and picks routes.
// One plan per batch and rank, written into fixed-capacity buffers (sized by the
// capture limits) so that a CUDA graph captured once replays after every re-plan.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "dcpmla/layout.h"
#include "dcpmla/types.h"

namespace dcpmla {

// The longest rank-local KV a plan may describe: 2^30 tokens. The kernels count a request's
// tokens in int32 and step past its end by up to a tile; a limit of INT32_MAX let that step
// wrap at 2^31 - 63 tokens (a hang or a wrong answer), and nothing real is that long.
inline constexpr int64_t kMaxLocalKvLen = int64_t(1) << 30;

// Capture limits: the largest batch any plan of this planner may describe.
struct PlanLimits {
  int max_batch = 128;
  int max_qlen = 8;
  int64_t max_local_kv_len = 1 << 17;  // longest rank-local KV of any row
};

// Granularity of the schedule's cuts (local tokens): the kernels' tile. A piece may start
// anywhere (kernels look up every token's sub-page), but a cut inside a tile would read it twice.
inline constexpr int kCutTokens = 64;

// The schedule's cost model, in tiles of kCutTokens tokens: a piece costs its tiles plus
// `piece` (loading Q, filling the pipeline, the epilogue); a piece of a cut request also
// `cut` (its partial write and share of the combine). Under the automatic route a batch of
// at most one request per chunk is not cut when its longest request is within `slack` of the
// even share, so that a uniform batch is not cut to win a few percent; nor is any batch whose
// best deal of whole requests loads its fullest chunk at most the combine's cost more than the
// cut deal's. The combine is a cost of the step, not of a chunk: `combine` for its launch and
// wait, plus `combine_piece` for each cut piece per chunk (the partials the attention grid
// writes and the combine reads back, M rows each), so a cut that saves a tile or two of a small
// step, or a few tiles of a step with many cut pieces, is not made. The defaults are the 16-row
// bf16 kernel's calibration; calibrated_schedule_cost gives each unit size and cache dtype its
// own (H200 and H100: bench/NOTES.md).
struct ScheduleCost {
  double piece = 1.0;
  double cut = 0.5;
  double slack = 0.05;
  double combine = 3.0;
  double combine_piece = 2.5;
};
// The most any ScheduleCost field may be (the planner refuses more, and NaN).
inline constexpr double kMaxScheduleCost = 1e6;

// The H200 calibration for units of rows_per_unit query rows of a kv_dtype cache, the widest
// step the planner is sized for (max_qlen x heads) making row_groups groups: a piece costs 1
// tile at 16 bf16 rows, 4 at 16 fp8 rows, 2 at 32 or more, 3 at 32 or more in exactly two
// groups (Q, the pipeline's restart and the epilogue grow with the rows, the tile time less;
// fp8 halves the tile time; the two groups of a chunk share their tiles' reads through L2),
// and 5 at 64 or more fp8 rows at any group count (that kernel's producer starts each unit
// with a DRAM round trip for its first tile and issues its Q after unpacking that tile: the
// traced CTAs fit about five of its tiles a piece). Measured, not modelled: the
// eleventh session's grid of the serving batches and its check on the uniform shapes, where 3
// lost 1-2 % at four groups and more; the twenty-second session's grids of the fp8 serving
// batches, where 5 beat 2-3 by 2-10 % at 64 rows and 4 beat 2 by 2-4 % at 16 (bench/NOTES.md).
// The combine costs 3 tiles plus 2.5 per cut piece per chunk on every kernel (ScheduleCost's
// defaults): on the H100 a step with half a cut piece a chunk ran whole faster where the cut
// saved up to about 4 tiles, one with one and a half up to 6.5-7.5 (verify128_q2, 1.9 pieces
// a chunk: 260 against 256 tiles, 427.5 against 437.1 us); fitted over 75 steps timed cut and
// whole, and checked on 60 fresh steps on the H200 (bench/NOTES.md, sessions 56-58).
ScheduleCost calibrated_schedule_cost(int rows_per_unit, KvDtype kv_dtype, int row_groups);

// The row groups of a step of `rows` query rows (qlen x heads) on units of rows_per_unit
// rows: ceil(rows / rows_per_unit), at least 1 (also for sizes a planner would refuse), at
// most INT_MAX.
int row_groups_of(int64_t rows, int rows_per_unit);

// Fixed for the planner's life (one per model and rank); checked at construction. The
// caches are the engine's: their size is checked against each plan when a run takes one.
struct PlannerConfig {
  Backend backend = Backend::cpu;
  KvDtype kv_dtype = KvDtype::bf16;
  int heads = 16;
  LatentDims dims;
  Layout layout;
  int block_size = 64;
  Route route = Route::automatic;  // a forced route, or automatic (the documented policy)
  PlanLimits limits;
  int num_workers = 132;  // resident CTAs (or threads) the schedule fills, one chunk each
  // Query rows (qlen x heads, flattened) one unit of the backend's kernel covers: a step's
  // rows make ceil(rows / rows_per_unit) row groups, and each group gets num_workers /
  // groups chunks of the same token schedule (so the groups of a chunk read the same KV
  // at the same time, from L2).
  int rows_per_unit = 64;
  // A request shorter than twice this many local tokens is never cut, and a split-K piece
  // covers at least this many (each piece costs a partial write and a share of the combine),
  // or the step's even share of 64-token tiles over the chunks when that is less (at least a
  // tile: a short step still fills the chunks); tests lower it to exercise many pieces on
  // short rows.
  int min_segment_tokens = 256;
  ScheduleCost cost;
};

// One step's batch as the engine describes it (host memory).
struct BatchDesc {
  std::span<const int32_t> seq_lens;      // [B] L_b incl. the query block; 0 = padding
  int qlen = 1;                           // rows per request; with qlens, the largest allowed
  std::span<const int32_t> block_tables;  // B rows of table_width entries, shared by all ranks
  int table_width = 0;
  Mode mode = Mode::verify;               // the step's windows (SPEC §1)
  // Per-request query rows (qo_indptr style), each in [0, qlen]; empty: qlen for every
  // request. Query rows are packed in request order: q [sum qlens, H, D], out and lse alike.
  // Request b's row t sees the window of SPEC §1 with its own qlens[b].
  std::span<const int32_t> qlens = {};
  // Ints from one request's table row to the next (>= table_width); 0: table_width, packed
  // rows. A slice of a wider table (an engine's persistent one, [:B, :W]) is read in place:
  // block_tables then spans (B - 1) x table_stride + table_width ints.
  int64_t table_stride = 0;

  int64_t table_pitch() const { return table_stride != 0 ? table_stride : table_width; }
  // Whether block_tables has the rows' shape (validate_table_shape names what is wrong).
  bool tables_fit() const {
    if (table_width < 0 || (table_stride != 0 && table_stride < table_width)) return false;
    // Overflow-checked: a hostile stride must not wrap the span's size into a match.
    int64_t span = 0;
    if (!seq_lens.empty() && (__builtin_mul_overflow(int64_t(seq_lens.size()) - 1, table_pitch(), &span) ||
                              __builtin_add_overflow(span, int64_t(table_width), &span)))
      return false;
    return block_tables.size() == uint64_t(span);
  }
  // Request b's row (b < B and the shape checked: validate_table_shape).
  std::span<const int32_t> table_of(size_t b) const {
    return block_tables.subspan(b * size_t(table_pitch()), size_t(table_width));
  }
};

// The tables' shape against the batch (table_width >= 0, table_stride 0 or >= table_width,
// block_tables exactly the B rows' span), so that every table_of() is in bounds: the planner's
// rule, also the write path's.
void validate_table_shape(const BatchDesc& batch);

// A contiguous run of rank-local tokens [tok_begin, tok_end) of one request (a piece of a
// chunk). slot < 0: the request is whole here and the piece writes out and lse; else the
// request is cut and the piece writes split-K partials into `slot`. A request's pieces cover
// [0, its longest row's local length) exactly, so the backends read no token past that end
// (it may be unmapped or poisoned) without clipping at the row lengths themselves.
struct WorkItem {
  int32_t request;
  int32_t tok_begin;
  int32_t tok_end;  // tok_begin == tok_end for a request with no local token
  int32_t slot;
};

// Scalars of a plan; kernels read them from plan memory, never from launch
// arguments, so a replayed graph sees the current batch.
struct PlanHeader {
  int32_t route;           // Route (never automatic): split_k when a request is cut
  int32_t batch;           // requests in this step (padding included)
  int32_t qlen;            // the step's largest query block: partial rows are qlen x heads apart
  int32_t work_count;      // items in `work`
  int32_t page;            // sub-page tokens
  int32_t table_stride;    // sub-pages per request row of subpage_table in this plan
  int32_t mode;            // Mode
  int32_t chunks;          // K: chunks of the schedule, each run by one CTA per row group
  int32_t rows;            // query rows of the step (sum of the requests' qlen)
  int32_t split_requests;  // requests cut into pieces (their rows are combined)
  int32_t widest_qlen;     // the largest request's query rows (sets the row groups)
};

// Plain view of a plan's buffers (host or device copy): what crosses into kernels.
struct PlanView {
  const PlanHeader* header;
  const int32_t* row_local_len;  // [rows] tokens each query row attends on this rank
  const int32_t* q_start;        // [batch + 1] request b's query rows are [q_start[b], q_start[b+1])
  const int32_t* subpage_table;  // [batch, header->table_stride] sub-page ids into the cache
  const WorkItem* work;          // [work_count] chunk by chunk; a request's pieces are adjacent
  const int32_t* chunk_work;     // [chunks + 1] chunk k runs work[chunk_work[k], chunk_work[k+1])
  const int32_t* split_request;  // [split_requests] the cut requests, in request order
  const int32_t* split_slot;     // [split_requests + 1] cut request i's partials are slots
                                 // [split_slot[i], split_slot[i+1])
  int32_t table_capacity;        // capacity: sub-pages per request
  int32_t max_batch;             // capacity
  int32_t max_qlen;              // capacity
  int32_t work_capacity;         // capacity (also of partial slots)
  int32_t chunk_capacity;        // capacity
};

// Statistics the planner computed, for tests, logs and the bench (padding excluded).
struct PlanStats {
  int active_requests = 0;
  // Local lengths of the active requests as rank 0 holds them (the largest share): the same on
  // every rank, so that the ranks' planners agree.
  int64_t min_local_len = 0;
  int64_t max_local_len = 0;
  int64_t total_local_len = 0;
  int max_segments = 0;  // most pieces of one request (1: no request is cut; 0: no active request)
  int64_t max_block = -1;  // largest block id the tables name (-1: none); the cache must hold it
};

class Plan {
 public:
  // storage: null for an owned arena, else `ints` int32s the caller keeps alive at a stable
  // address (pinned staging memory, say), so the planner writes straight into it. The
  // capacities are checked (each >= 1, the arena within the planner's limit).
  Plan(const PlanLimits& limits, int64_t table_capacity, int work_capacity, int chunk_capacity,
       int32_t* storage = nullptr);
  static size_t ints(const PlanLimits& limits, int64_t table_capacity, int work_capacity, int chunk_capacity);
  Plan(const Plan&) = delete;  // the view points into the arena
  Plan& operator=(const Plan&) = delete;
  // A vector's move keeps its buffer, so the arena stays where it was; the moved-from plan
  // holds none (ArenaRef) instead of pointing into the new owner's. It may then only be
  // assigned to or destroyed: a planner refuses it, and its accessors (header, view, and what
  // reads them) throw dcpmla::Error, as does run() on an engine Attention moved from.
  Plan(Plan&&) = default;
  // Not defaulted: a defaulted one moved onto itself would free the arena and keep pointing at
  // it (a vector moved onto itself empties). A self-move leaves the plan as it was.
  Plan& operator=(Plan&& o) noexcept {
    if (this != &o) {
      std::destroy_at(this);
      std::construct_at(this, std::move(o));
    }
    return *this;
  }

  const PlanHeader& header() const { return *reinterpret_cast<const PlanHeader*>(held_arena()); }
  Route route() const { return Route(header().route); }
  const PlanStats& stats() const { return stats_; }

  // The whole plan is one int32 arena at a stable address; a device backend copies its
  // used prefix (used_ints()) verbatim and rebuilds the view over its copy.
  std::span<const int32_t> arena() const { return {arena_.base, arena_.size}; }
  // Ints of the arena this plan uses: everything up to its own sub-page rows (the last part).
  size_t used_ints() const;
  PlanView view() const { return view_at(held_arena()); }
  PlanView view_at(const int32_t* base) const;

  // Inspection (checked: b in [0, batch), t in [0, qlen_of(b))).
  int32_t row_local_len(int b, int t) const;
  int qlen_of(int b) const;
  std::span<const WorkItem> work() const { return {view().work, size_t(header().work_count)}; }

 private:
  friend class Planner;
  // The arena's base; a moved-from plan has none (refused by name).
  const int32_t* held_arena() const {
    if (arena_.base == nullptr) fail_moved_from();
    return arena_.base;
  }
  [[noreturn]] static void fail_moved_from();
  PlanHeader& mutable_header() { return *reinterpret_cast<PlanHeader*>(arena_.base); }
  int32_t* at(size_t offset) { return arena_.base + offset; }

  PlanLimits limits_;
  int64_t table_capacity_;
  int work_capacity_, chunk_capacity_;
  size_t off_rows_, off_q_start_, off_chunk_work_, off_work_, off_split_request_, off_split_slot_, off_subpages_;
  std::vector<int32_t> owned_;  // empty when the caller provides the storage
  // The batch as the planner read it (host memory beside the arena; batch_copy() lays it out).
  // The planner reads the caller's arrays once, into here, checks the copy and builds the plan
  // from it: a caller thread that writes the arrays meanwhile (Python: another thread in a call
  // that released the GIL) cannot make the plan disagree with its checks (the ninth audit: a
  // block id or length changed between the check and a second read made run() read past the
  // cache and plan() write past the arena).
  std::vector<int32_t> batch_copy_;
  struct BatchCopy {
    int32_t* lens;         // [max_batch] seq_lens
    int32_t* qlens;        // [max_batch] each request's query rows
    int32_t* table_start;  // [max_batch + 1] where each request's entries start in `tables`
    int32_t* tables;       // the used table entries of every request, packed (table_capacity_ each at most)
  };
  BatchCopy batch_copy() {
    int32_t* lens = batch_copy_.data();
    const int n = limits_.max_batch;
    return {lens, lens + n, lens + 2 * n, lens + 3 * n + 1};
  }
  // The arena's address and size; a move leaves the source without one.
  struct ArenaRef {
    int32_t* base = nullptr;
    size_t size = 0;
    ArenaRef() = default;
    ArenaRef(int32_t* b, size_t n) : base(b), size(n) {}
    ArenaRef(ArenaRef&& o) noexcept : base(std::exchange(o.base, nullptr)), size(std::exchange(o.size, 0)) {}
    ArenaRef& operator=(ArenaRef&& o) noexcept {
      base = std::exchange(o.base, nullptr);
      size = std::exchange(o.size, 0);
      return *this;
    }
  };
  ArenaRef arena_;
  PlanStats stats_;
};
static_assert(std::is_nothrow_move_constructible_v<Plan>, "Plan's move assignment rebuilds in place");

// Which route serves which mode, dtype and head count on which backend.
struct Capability {
  Backend backend;
  Route route;
  uint32_t modes;   // bit per Mode
  uint32_t dtypes;  // bit per KvDtype
  int min_heads;
  int max_heads;
};
std::span<const Capability> capability_table();
// The most heads any route serves on `backend` (the table's; CUDA: one kernel launch's), and
// the check of a head count against it (dcpmla::Error naming `field` otherwise).
int max_heads(Backend backend);
void require_heads(std::string_view field, int heads, Backend backend);
bool is_supported(Backend backend, Route route, Mode mode, KvDtype dtype, int heads);

class Planner {
 public:
  // Throws dcpmla::Error on a bad or unsupported configuration (fail fast).
  explicit Planner(const PlannerConfig& config);

  const PlannerConfig& config() const { return config_; }
  int page() const { return page_; }
  int64_t table_capacity() const { return table_capacity_; }
  int work_capacity() const { return work_capacity_; }
  // Whether its plans may cut a request into pieces (every route but one_stage): then the
  // backend needs the split-K workspace and the combine.
  bool may_cut() const { return config_.route != Route::one_stage; }

  // A plan with buffers for the capture limits (allocate once, re-plan into it); with
  // storage, in the caller's plan_ints() int32s.
  Plan make_plan(int32_t* storage = nullptr) const;
  size_t plan_ints() const {
    return Plan::ints(config_.limits, table_capacity_, work_capacity_, config_.num_workers);
  }
  // Host bytes one plan holds (its arena, owned or the caller's, and its copy of the batch):
  // what an engine counts against its host budget before make_plan() allocates.
  size_t plan_host_bytes() const;
  // Validates the batch and writes the plan. The batch is read once, into the plan's copy of
  // it (beside its arena), and checked there before the plan itself is touched: a refused batch
  // leaves the plan as it was. Host work in O(batch + table entries); no allocation, and no
  // formatting unless it throws.
  void plan(const BatchDesc& batch, Plan& plan) const;

 private:
  // Chunks of a step whose widest request (with tokens) has `max_rows` query rows: the workers
  // over its ceil(max_rows / rows_per_unit) row groups.
  int chunks_of(int64_t max_rows) const;
  // Copies the batch into the plan's copy of it and checks that; returns the largest block
  // id its tables name (-1: none).
  int64_t validate(const BatchDesc& batch, Plan& plan) const;
  // Deals the requests' tokens (longest[b]: request b's longest row) into the plan's
  // chunks: its work list, chunk offsets, partial slots and cut requests.
  void schedule(const int32_t* longest, int batch, int chunks, Plan& plan, PlanStats& stats) const;

  PlannerConfig config_;
  int page_;
  int64_t table_capacity_;
  int work_capacity_;
};

}  // namespace dcpmla
