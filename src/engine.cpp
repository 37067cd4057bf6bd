#include "dcpmla/engine.h"

#include <cmath>
#include <limits>

#include "dcpmla/error.h"
#include "cpu/parallel.h"

namespace dcpmla {

PlannerConfig planner_config(const AttentionConfig& c, Backend backend, int workers, int rows_per_unit) {
  PlannerConfig p;
  p.backend = backend;
  p.kv_dtype = c.kv_dtype;
  p.heads = c.heads;
  p.dims = c.dims;
  p.layout = c.layout;
  p.block_size = c.block_size;
  p.route = c.route;
  p.limits = c.limits;
  require(c.num_workers >= 0, "num_workers", c.num_workers, "0 (the backend's) or a count >= 1");
  // Refused here, before the engines allocate their plan arenas (softmax_scale_of takes it).
  if (c.softmax_scale) require_softmax_scale(*c.softmax_scale);
  p.num_workers = c.num_workers > 0 ? c.num_workers : workers;
  p.rows_per_unit = rows_per_unit;
  p.min_segment_tokens = c.min_segment_tokens;
  // The row groups of the capacity's widest step (max_qlen x heads), as the kernel variant is
  // fixed by the capacity too (the planner checks the sizes; a config it will refuse gets
  // some calibration).
  const int row_groups = row_groups_of(int64_t(c.limits.max_qlen) * c.heads, rows_per_unit);
  p.cost = c.schedule_cost.value_or(calibrated_schedule_cost(rows_per_unit, c.kv_dtype, row_groups));
  return p;
}

float softmax_scale_of(const AttentionConfig& c) {
  c.dims.validate();
  if (c.softmax_scale) {
    require_softmax_scale(*c.softmax_scale);
    return *c.softmax_scale;
  }
  return 1.0f / std::sqrt(float(c.dims.dim()));
}

void require_cache_layout(KvDtype kv_dtype, int block_size, int dim, KvDtype cache_dtype, int cache_block_size,
                          int cache_dim) {
  if (cache_dtype != kv_dtype)
    fail("kv_cache dtype", to_string(cache_dtype), fmt::format("{} (the Attention's kv_dtype)", to_string(kv_dtype)));
  if (cache_block_size != block_size)
    fail("kv_cache block_size", cache_block_size, fmt::format("{} (the Attention's block_size)", block_size));
  if (cache_dim != dim) fail("kv_cache dim", cache_dim, fmt::format("D = {}", dim));
}

void validate_run(const PlannerConfig& c, const Plan& plan, const KvCache& cache, const KvScale& scale) {
  cache.validate();
  require_cache_layout(c.kv_dtype, c.block_size, c.dims.dim(), cache.dtype, cache.block_size, cache.dim);
  if (plan.stats().max_block >= cache.num_blocks)
    fail("kv_cache num_blocks", cache.num_blocks,
         fmt::format("> {} (the largest block id of the planned tables)", plan.stats().max_block));
  scale.validate(cache.dtype);
  if (scale.device != nullptr && c.backend != Backend::cuda)
    fail("kv_scale", "a device pointer", "a host float on the cpu backend");
}

void require_run_disjoint(const PlannerConfig& c, int64_t rows, const void* q, const KvCache& cache,
                          const KvScale& scale, const void* out, const void* lse, const void* workspace,
                          int64_t workspace_bytes) {
  // q's byte count bounds the others' (R < D, and D >= 2).
  const std::optional<int64_t> q_bytes = checked_product({rows, c.heads, c.dims.dim(), 2});
  if (!q_bytes) fail("q", fmt::format("{} rows x {} heads x D {}", rows, c.heads, c.dims.dim()), "bytes that fit int64");
  const int64_t cells = rows * c.heads;
  require_disjoint({{"out", out, cells * c.dims.kv_lora_rank * 2},
                    {"lse", lse, cells * 4},
                    {"workspace", workspace, workspace_bytes}},
                   {{"q", q, *q_bytes},
                    {"kv_cache", cache.data, cache.num_slots() * cache.row_bytes()},
                    {"kv_scale", scale.device, scale.device != nullptr ? 4 : 0}});
}

namespace {

// The planner, once its engine's host memory (one plan, the split-K workspace and the kernel's
// scratch on every thread) is known to fit the host budget: refused with its size before any
// of it is allocated.
Planner within_host_budget(Planner planner) {
  const int threads = detail::parallel_threads();
  const double bytes = double(planner.plan_host_bytes()) + double(split_workspace_floats(planner)) * sizeof(float) +
                       double(cpu_attention_scratch_bytes(planner.config().dims)) * threads;
  require(bytes <= double(kMaxHostBytes), "host memory (plan, split-K workspace and the threads' scratch)",
          fmt::format("{} for {} threads", bytes_text(bytes), threads),
          fmt::format("<= {} (lower heads, kv_lora_rank, rope_dim, limits.max_batch, limits.max_qlen or "
                      "limits.max_local_kv_len, or route one_stage)",
                      bytes_text(double(kMaxHostBytes))));
  return planner;
}

}  // namespace

Attention::Attention(const AttentionConfig& config)
    : planner_(within_host_budget(Planner(planner_config(config, Backend::cpu, kCpuWorkers, kCpuRowsPerUnit)))),
      plan_(planner_.make_plan()),
      softmax_scale_(softmax_scale_of(config)) {
  // The split-K workspace of the capacities, taken here (plan() allocates nothing) unless no
  // plan cuts a request. Not zero-filled: the kernels write every partial before the merge
  // reads it, so the pages are committed only when a step cuts.
  if (const int64_t floats = split_workspace_floats(planner_); floats > 0)
    workspace_ = std::make_unique_for_overwrite<float[]>(size_t(floats));
}

void Attention::plan(const BatchDesc& batch) {
  planner_.plan(batch, plan_);  // validates first: a refused batch keeps the previous plan
  planned_ = true;
}

AttentionParams Attention::params(const bf16* q, const KvCache& cache, const KvScale& scale, bf16* out, float* lse) {
  return attention_params(planner_.config(), q, static_cast<const uint8_t*>(cache.data), scale, softmax_scale_,
                          plan_.view(), workspace_.get(), out, lse);
}

void Attention::run(const bf16* q, const KvCache& cache, const KvScale& scale, bf16* out, float* lse) {
  if (!planned_) fail("plan", "none", "a plan: call plan(batch) before run()");
  validate_run(planner_.config(), plan_, cache, scale);
  // A step of no query rows (every qlen 0) reads and writes nothing: its buffers may be null.
  if (plan_.header().rows > 0 && (q == nullptr || out == nullptr || lse == nullptr))
    fail("q/out/lse", "null", "host pointers");
  require_run_disjoint(planner_.config(), plan_.header().rows, q, cache, scale, out, lse);
  attention_cpu(params(q, cache, scale, out, lse));
}

}  // namespace dcpmla
