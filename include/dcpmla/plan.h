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

// Fixed for the planner's life (one per model and rank); checked at construction.
struct PlannerConfig {
  Backend backend = Backend::cpu;
  Mode mode = Mode::verify;
  KvDtype kv_dtype = KvDtype::bf16;
  int heads = 16;
  LatentDims dims;
  Layout layout;
  int block_size = 64;
  int64_t num_blocks = 0;  // blocks in this rank's cache (table entries must be below it)
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
  int32_t route;       // Route (never automatic)
  int32_t batch;       // requests in this step (padding included)
  int32_t qlen;
  int32_t work_count;  // items in `work`
  int32_t page;        // sub-page tokens
  int32_t reserved[3];
};

// Plain view of a plan's buffers (host or device copy): what crosses into kernels.
struct PlanView {
  const PlanHeader* header;
  const int32_t* row_local_len;  // [batch, qlen] tokens each row attends on this rank
  const int32_t* subpage_table;  // [batch, table_stride] sub-page ids into the cache
  const WorkItem* work;          // [work_count] grouped by request, in request order
  const int32_t* request_work;   // [batch + 1] offsets into work
  int32_t table_stride;          // capacity: sub-pages per request
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
};

class Plan {
 public:
  Plan(const PlanLimits& limits, int64_t table_stride, int work_capacity);

  const PlanHeader& header() const { return *reinterpret_cast<const PlanHeader*>(arena_.data()); }
  Route route() const { return Route(header().route); }
  const PlanStats& stats() const { return stats_; }

  // The whole plan is one int32 arena at a stable address; a device backend copies it
  // verbatim and rebuilds the view over its copy.
  std::span<const int32_t> arena() const { return arena_; }
  PlanView view() const { return view_at(arena_.data()); }
  PlanView view_at(const int32_t* base) const;

  int32_t row_local_len(int b, int t) const { return view().row_local_len[b * header().qlen + t]; }
  std::span<const WorkItem> work() const { return {view().work, size_t(header().work_count)}; }

 private:
  friend class Planner;
  PlanHeader& mutable_header() { return *reinterpret_cast<PlanHeader*>(arena_.data()); }
  int32_t* at(size_t offset) { return arena_.data() + offset; }

  PlanLimits limits_;
  int64_t table_stride_;
  int work_capacity_;
  size_t off_rows_, off_subpages_, off_work_, off_request_work_;
  std::vector<int32_t> arena_;
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
  int64_t table_stride() const { return table_stride_; }
  int work_capacity() const { return work_capacity_; }

  // A plan with buffers for the capture limits (allocate once, re-plan into it).
  Plan make_plan() const;
  // Validates the batch (before touching `plan`) and writes the plan.
  void plan(const BatchDesc& batch, Plan& plan) const;

  // The auto policy, exposed so that docs, tests and the bench can show its choice.
  Route choose_route(const PlanStats& stats, int qlen) const;

 private:
  void validate(const BatchDesc& batch) const;

  PlannerConfig config_;
  int page_;
  int64_t table_stride_;
  int work_capacity_;
};

// Rows of (query row, head) one work unit of the kernels covers; the policy counts
// units = requests x ceil(qlen * heads / kRowsPerUnit).
inline constexpr int kRowsPerUnit = 64;

}  // namespace dcpmla
