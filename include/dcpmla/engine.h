// The engine API (SPEC §6): what a serving engine calls every step. The engine owns its KV
// caches (one per layer, from its own allocator) and hands this layer's to each run; the
// library owns one plan per step and a workspace. Per step: plan(batch) once; per layer:
// write_kv (cache.h) and run. The result of run is this rank's partial (o, lse); the
// cross-rank merge is merge.h's combine_partials (or the engine's own DCP collectives).
// This is the CPU backend on host memory; dcpmla::cuda::Attention (cuda.h) is the same on
// device memory and streams.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "dcpmla/attention.h"
#include "dcpmla/cache.h"
#include "dcpmla/layout.h"
#include "dcpmla/plan.h"

namespace dcpmla {

// Parallel units the CPU backend's plans spread work over (the planner's num_workers): the
// H200's SM count, so that a CPU plan is the plan a GPU of that size runs (tests compare them).
inline constexpr int kCpuWorkers = 132;
// Query rows per unit of the CPU plans' schedule (PlannerConfig::rows_per_unit): the GPU's
// 64-row kernels'.
inline constexpr int kCpuRowsPerUnit = 64;

// Fixed for an Attention's life (one per model and rank); checked at construction.
struct AttentionConfig {
  int heads = 16;                      // query heads this rank computes (all the group's under DCP)
  KvDtype kv_dtype = KvDtype::bf16;
  int block_size = 64;
  Layout layout;                       // world_size, rank, interleave
  PlanLimits limits;                   // capture limits: every plan's batch must fit them
  std::optional<float> softmax_scale;  // none: D^-0.5; else a positive normal float <= 65536
  LatentDims dims;
  Route route = Route::automatic;      // forced for testing; automatic = the planner's policy
  int num_workers = 0;                 // parallel units a plan spreads over; 0: the backend's
  int min_segment_tokens = 256;        // floor of a cut request's pieces (PlannerConfig)
  // The schedule's cost model (tuning: results do not depend on it); none: the calibration
  // for the backend kernel's rows per CTA, the cache's dtype and the widest step's row
  // groups (calibrated_schedule_cost).
  std::optional<ScheduleCost> schedule_cost;
};

// The one place an AttentionConfig becomes a planner configuration; workers = the backend's
// parallel units where config.num_workers is 0; rows_per_unit = its kernel's rows per CTA.
PlannerConfig planner_config(const AttentionConfig& config, Backend backend, int workers, int rows_per_unit);

// The softmax scale a configuration asks for: D^-0.5 by default; throws unless a positive
// normal float <= kMaxSoftmaxScale.
float softmax_scale_of(const AttentionConfig& config);

// The cache layout a configuration reads (its kv_dtype, block_size and D): a cache of another
// dtype, block size or D is refused naming the field (validate_run, every run; a RankEngine that
// owns its cache, once, when it is built).
void require_cache_layout(KvDtype kv_dtype, int block_size, int dim, KvDtype cache_dtype, int cache_block_size,
                          int cache_dim);

// Checks a run's cache and scale against the planner and the current plan, before anything
// runs: dtype, block size, D, and a cache that holds every block the plan's tables name.
void validate_run(const PlannerConfig& config, const Plan& plan, const KvCache& cache, const KvScale& scale);

// Refuses a run whose outputs (out, lse) share memory with its inputs (q, the cache, a device
// kv_scale) or with each other (require_disjoint), over the plan's `rows` query rows. (A graph
// replays later plans on the captured buffers: the caller sizes them for the rows it replays,
// which this call cannot see.) [workspace, + workspace_bytes): memory the run writes besides
// them (the CUDA engine's, which the caller may have passed), kept apart from all of them too.
void require_run_disjoint(const PlannerConfig& config, int64_t rows, const void* q, const KvCache& cache,
                          const KvScale& scale, const void* out, const void* lse, const void* workspace = nullptr,
                          int64_t workspace_bytes = 0);

class Attention {
 public:
  explicit Attention(const AttentionConfig& config);

  const Planner& planner() const { return planner_; }
  const Plan& current_plan() const { return plan_; }
  float softmax_scale() const { return softmax_scale_; }

  // Validates and plans the step's batch; no allocation, no formatting unless it throws. (The
  // CPU backend's split-K workspace, split_workspace_floats of the capacities, is taken at
  // construction unless the route is one_stage, which never cuts a request.)
  void plan(const BatchDesc& batch);

  // This rank's partial over `cache` (this layer's) with the current plan:
  // q [rows, H, D] bf16 -> out [rows, H, R] bf16, lse [rows, H] natural log (-inf where the rank
  // holds no key of the row's window); rows = B x qlen, or sum(qlens), packed by request.
  // The CPU kernels take per-call scratch of their own, but cut requests' partials go to this
  // object's split-K workspace: calls on one Attention must not overlap (one object per
  // thread, or serialise them). Host pointers aligned to whole values (2 bytes for q, out and a
  // bf16 cache, 4 for lse), not to the CUDA backend's 16.
  void run(const bf16* q, const KvCache& cache, const KvScale& scale, bf16* out, float* lse);

  // The parameters run() computes with (tests).
  AttentionParams params(const bf16* q, const KvCache& cache, const KvScale& scale, bf16* out, float* lse);

 private:
  Planner planner_;
  Plan plan_;
  float softmax_scale_;
  bool planned_ = false;
  std::unique_ptr<float[]> workspace_;  // split-K partials (null when the route is one_stage: no plan cuts)
};

}  // namespace dcpmla
