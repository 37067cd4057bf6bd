// The planner (SPEC §4): the one place that inspects lengths and picks routes.
// One plan per batch and rank, written into fixed-capacity buffers (sized by the
// capture limits) so that a CUDA graph captured once replays after every re-plan.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "dcpmla/layout.h"
#include "dcpmla/types.h"

namespace dcpmla {

// Capture limits: the largest batch any plan of this planner may describe.
struct PlanLimits {
  int max_batch = 128;
  int max_qlen = 8;
  int64_t max_local_kv_len = 1 << 17;  // longest rank-local KV of any row
};

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
  int num_workers = 132;  // parallel units a plan spreads work over (SMs, threads)
  // A split-K segment covers at least this many local tokens (each segment costs a
  // partial write and a merge); tests lower it to exercise many segments on short rows.
  int min_segment_tokens = 256;
};

// One step's batch as the engine describes it (host memory).
struct BatchDesc {
  std::span<const int32_t> seq_lens;      // [B] L_b incl. the query block; 0 = padding
  int qlen = 1;                           // rows per request
  std::span<const int32_t> block_tables;  // [B, table_width] shared by all ranks
  int table_width = 0;
  Mode mode = Mode::verify;               // the step's windows (SPEC §1)
};

// A contiguous run of tiles (of `page` local tokens) of one request.
struct WorkItem {
  int32_t request;
  int32_t tile_begin;
  int32_t tile_end;  // exclusive; tile_begin == tile_end for a padding request
  int32_t pad_ = 0;
};

// Scalars of a plan; kernels read them from plan memory, never from launch
// arguments, so a replayed graph sees the current batch.
struct PlanHeader {
  int32_t route;         // Route (never automatic)
  int32_t batch;         // requests in this step (padding included)
  int32_t qlen;
  int32_t work_count;    // items in `work`
  int32_t page;          // sub-page tokens
  int32_t table_stride;  // sub-pages per request row of subpage_table in this plan
  int32_t mode;          // Mode
  int32_t reserved;
};

// Plain view of a plan's buffers (host or device copy): what crosses into kernels.
struct PlanView {
  const PlanHeader* header;
  const int32_t* row_local_len;  // [batch, qlen] tokens each row attends on this rank
  const int32_t* subpage_table;  // [batch, header->table_stride] sub-page ids into the cache
  const WorkItem* work;          // [work_count] grouped by request, in request order
  const int32_t* request_work;   // [batch + 1] offsets into work
  int32_t table_capacity;        // capacity: sub-pages per request
  int32_t max_batch;             // capacity
  int32_t max_qlen;              // capacity
  int32_t work_capacity;         // capacity
};

// Statistics the planner computed, for tests, logs and the bench (padding excluded).
struct PlanStats {
  int active_requests = 0;
  int64_t min_local_len = 0;
  int64_t max_local_len = 0;
  int64_t total_local_len = 0;
  int max_segments = 0;  // largest number of work items of one request
  int64_t max_block = -1;  // largest block id the tables name (-1: none); the cache must hold it
};

class Plan {
 public:
  // storage: null for an owned arena, else `ints` int32s the caller keeps alive at a stable
  // address (pinned staging memory, say), so the planner writes straight into it.
  Plan(const PlanLimits& limits, int64_t table_capacity, int work_capacity, int32_t* storage = nullptr);
  static size_t ints(const PlanLimits& limits, int64_t table_capacity, int work_capacity);
  Plan(const Plan&) = delete;  // the view points into the arena
  Plan& operator=(const Plan&) = delete;
  Plan(Plan&&) = default;      // a vector's move keeps its buffer, so base_ stays valid
  Plan& operator=(Plan&&) = default;

  const PlanHeader& header() const { return *reinterpret_cast<const PlanHeader*>(base_); }
  Route route() const { return Route(header().route); }
  const PlanStats& stats() const { return stats_; }

  // The whole plan is one int32 arena at a stable address; a device backend copies its
  // used prefix (used_ints()) verbatim and rebuilds the view over its copy.
  std::span<const int32_t> arena() const { return {base_, size_}; }
  // Ints of the arena this plan uses: everything up to its own sub-page rows (the last part).
  size_t used_ints() const;
  PlanView view() const { return view_at(base_); }
  PlanView view_at(const int32_t* base) const;

  int32_t row_local_len(int b, int t) const { return view().row_local_len[b * header().qlen + t]; }
  std::span<const WorkItem> work() const { return {view().work, size_t(header().work_count)}; }

 private:
  friend class Planner;
  PlanHeader& mutable_header() { return *reinterpret_cast<PlanHeader*>(base_); }
  int32_t* at(size_t offset) { return base_ + offset; }

  PlanLimits limits_;
  int64_t table_capacity_;
  int work_capacity_;
  size_t off_rows_, off_subpages_, off_work_, off_request_work_;
  std::vector<int32_t> owned_;  // empty when the caller provides the storage
  int32_t* base_;
  size_t size_;
  PlanStats stats_;
};

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
bool is_supported(Backend backend, Route route, Mode mode, KvDtype dtype, int heads);

class Planner {
 public:
  // Throws dcpmla::Error on a bad or unsupported configuration (fail fast).
  explicit Planner(const PlannerConfig& config);

  const PlannerConfig& config() const { return config_; }
  int page() const { return page_; }
  int64_t table_capacity() const { return table_capacity_; }
  int work_capacity() const { return work_capacity_; }

  // A plan with buffers for the capture limits (allocate once, re-plan into it); with
  // storage, in the caller's plan_ints() int32s.
  Plan make_plan(int32_t* storage = nullptr) const;
  size_t plan_ints() const { return Plan::ints(config_.limits, table_capacity_, work_capacity_); }
  // Validates the batch (before touching `plan`) and writes the plan. Host work in
  // O(batch + table entries); no allocation, and no formatting unless it throws.
  void plan(const BatchDesc& batch, Plan& plan) const;

  // The auto policy, exposed so that docs, tests and the bench can show its choice.
  Route choose_route(const PlanStats& stats, int qlen) const;

 private:
  // Checks the batch; returns the largest block id its tables name (-1: none).
  int64_t validate(const BatchDesc& batch) const;

  PlannerConfig config_;
  int page_;
  int64_t table_capacity_;
  int work_capacity_;
};

// Rows of (query row, head) one work unit of the kernels covers; the policy counts
// units = requests x ceil(qlen * heads / kRowsPerUnit).
inline constexpr int kRowsPerUnit = 64;

}  // namespace dcpmla
