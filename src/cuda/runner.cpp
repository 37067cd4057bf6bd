// Host side of the CUDA backend: validation (before any launch), variant choice, the
// CudaRankRunner's buffers and the plan upload. Kernels live in the .cu files beside this.
#include <algorithm>
#include <cmath>
#include <cstring>

#include <cuda_runtime.h>  // the typed cudaMalloc overloads

#include "dcpmla/cuda.h"
#include "dcpmla/error.h"
#include "dcpmla/layout.h"
#include "attention/variants.h"
#include "params.h"

namespace dcpmla {
namespace {

using cuda_detail::check;

constexpr int kCudaDim = 576, kCudaRank = 512, kCudaMaxHeads = 128;

int device_sms() {
  int device = 0, sms = 0;
  check(cudaGetDevice(&device), "cudaGetDevice");
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device),
        "cudaDeviceGetAttribute(multiprocessor count)");
  return sms;
}

void require_dtype(KvDtype d) {
  require(d == KvDtype::bf16 || d == KvDtype::fp8_e4m3 || d == KvDtype::fp8_e5m2, "kv_dtype", int(d),
          "bf16, fp8_e4m3 or fp8_e5m2");
}

// The library's choice where the tuning leaves it open, from the H200 sweep (bench
// --sweep, bench/results): 64-token tiles win at 64 rows per CTA (-12% to -19%) and at 16
// rows (-10% bf16, -21% fp8 at context 4096). Two CTAs per SM win at 16 rows only when
// the plan has at least two units per SM (-4% at 4096, -13% at 32768) and lose when it has
// one (+17% at context 1024), so they stay opt-in.
int default_tile_tokens(int /*rows*/, bool /*fp8*/) { return 64; }
int default_ctas_per_sm(int /*rows*/, bool /*fp8*/) { return 1; }

void validate_tuning(const cuda::AttentionTuning& t) {
  require(t.tile_tokens == 0 || t.tile_tokens == 32 || t.tile_tokens == 64, "tuning.tile_tokens", t.tile_tokens,
          "0 (auto), 32 or 64");
  require(t.ctas_per_sm >= 0 && t.ctas_per_sm <= 2, "tuning.ctas_per_sm", t.ctas_per_sm, "0 (auto), 1 or 2");
  require(t.kernel >= 0 && t.kernel <= 3, "tuning.kernel", t.kernel,
          "0 (auto), 1 (mma.sync), 2 (wgmma) or 3 (fp8 swap)");
}

// The one place a runtime configuration becomes a compiled variant. grid = 0 only opts
// the variant into its shared memory.
void launch_attention(const AttentionParams& p, int grid, cudaStream_t stream, const cuda::AttentionVariant& v,
                      bool fp8) {
  if (v.kernel == cuda_detail::kKernelWgmma)
    return fp8 ? cuda_detail::launch_attention_wgmma<true>(p, grid, stream)
               : cuda_detail::launch_attention_wgmma<false>(p, grid, stream);
  if (v.kernel == cuda_detail::kKernelFp8Swap)
    return p.kv_dtype == KvDtype::fp8_e5m2 ? cuda_detail::launch_attention_fp8_swap<true>(p, grid, stream)
                                           : cuda_detail::launch_attention_fp8_swap<false>(p, grid, stream);
#define DCPMLA_CASE(ROWS, NT, CPS, FP8)                                                         \
  if (v.rows_per_cta == ROWS && v.tile_tokens == NT && v.ctas_per_sm == CPS && fp8 == FP8)     \
    return cuda_detail::launch_attention_variant<ROWS / 16, NT, CPS, FP8>(p, grid, stream)
  DCPMLA_CASE(16, 32, 1, false);
  DCPMLA_CASE(16, 32, 1, true);
  DCPMLA_CASE(16, 64, 1, false);
  DCPMLA_CASE(16, 64, 1, true);
  DCPMLA_CASE(16, 32, 2, false);
  DCPMLA_CASE(16, 32, 2, true);
  DCPMLA_CASE(32, 32, 1, false);
  DCPMLA_CASE(32, 32, 1, true);
  DCPMLA_CASE(32, 64, 1, false);
  DCPMLA_CASE(32, 64, 1, true);
  DCPMLA_CASE(64, 32, 1, false);
  DCPMLA_CASE(64, 32, 1, true);
  DCPMLA_CASE(64, 64, 1, false);
  DCPMLA_CASE(64, 64, 1, true);
#undef DCPMLA_CASE
  throw std::logic_error("dcpmla: no compiled attention variant for this configuration");
}

void validate_attention(const AttentionParams& p) {
  require(p.q != nullptr, "q", "null", "a device pointer");
  require(p.kv != nullptr, "kv", "null", "a device pointer");
  require(p.out != nullptr, "out", "null", "a device pointer");
  require(p.lse != nullptr, "lse", "null", "a device pointer");
  require(p.part_o != nullptr && p.part_m != nullptr && p.part_l != nullptr, "part_o/part_m/part_l", "null",
          "device pointers to a split-K workspace (split_workspace_floats floats)");
  require(p.plan.header != nullptr && p.plan.row_local_len != nullptr && p.plan.subpage_table != nullptr &&
              p.plan.work != nullptr && p.plan.request_work != nullptr,
          "plan", "a view with null buffers", "a view over a device copy of a plan (Plan::view_at)");
  require_dtype(p.kv_dtype);
  require(p.heads >= 1 && p.heads <= kCudaMaxHeads, "heads", p.heads, "1..128 on the CUDA backend");
  require(p.dim == kCudaDim, "dim", p.dim, "576 (kv_lora_rank 512 + rope_dim 64) on the CUDA backend");
  require(p.rank_dim == kCudaRank, "rank_dim", p.rank_dim, "512 on the CUDA backend");
  require_scale("softmax_scale", p.softmax_scale);
  if (p.kv_dtype == KvDtype::bf16)
    require(p.kv_scale == 1.0f, "kv_scale", p.kv_scale, "1.0 for a bf16 cache (the scale is for fp8)");
  else
    require_scale("kv_scale", p.kv_scale);
  require(p.plan.max_qlen >= 1 && p.plan.max_batch >= 1 && p.plan.work_capacity >= 1, "plan capacities",
          fmt::format("max_batch {}, max_qlen {}, work_capacity {}", p.plan.max_batch, p.plan.max_qlen,
                      p.plan.work_capacity),
          ">= 1 each");
}

}  // namespace

bool cuda_device_available() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky "no device" error
    return false;
  }
  return n > 0;
}

namespace cuda {

int attention_rows_per_cta(int max_qlen, int heads) {
  const int64_t rows = int64_t(max_qlen) * heads;
  return rows <= 16 ? 16 : rows <= 32 ? 32 : 64;
}

AttentionVariant attention_variant(int max_qlen, int heads, KvDtype dtype, const AttentionTuning& tuning) {
  validate_tuning(tuning);
  const bool fp8 = dtype != KvDtype::bf16;
  AttentionVariant v{};
  v.rows_per_cta = attention_rows_per_cta(max_qlen, heads);
  const bool mma_only_knobs = tuning.tile_tokens == 32 || tuning.ctas_per_sm == 2;
  // The fp8 swap kernel reads fp8 caches only; asked for with a bf16 cache, the default serves.
  int kernel = tuning.kernel == cuda_detail::kKernelFp8Swap && !fp8 ? 0 : tuning.kernel;
  if (kernel == 0) kernel = mma_only_knobs ? cuda_detail::kKernelMma : cuda_detail::default_kernel(v.rows_per_cta, fp8);
  if (kernel != cuda_detail::kKernelMma) {
    // Fixed row counts whatever qlen x heads is: the wgmma kernel pads fewer rows to 64
    // inside the CTA, the fp8 swap kernel takes more rows in more groups of 16.
    const bool swap = kernel == cuda_detail::kKernelFp8Swap;
    v.rows_per_cta = swap ? 16 : 64;
    v.tile_tokens = 64;
    v.ctas_per_sm = 1;
    v.smem_bytes = swap ? (dtype == KvDtype::fp8_e5m2 ? cuda_detail::attention_fp8_swap_smem_bytes<true>()
                                                      : cuda_detail::attention_fp8_swap_smem_bytes<false>())
                        : (fp8 ? cuda_detail::attention_wgmma_smem_bytes<true>()
                               : cuda_detail::attention_wgmma_smem_bytes<false>());
    v.kernel = kernel;
    return v;
  }
  v.kernel = cuda_detail::kKernelMma;
  v.tile_tokens = tuning.tile_tokens ? tuning.tile_tokens : default_tile_tokens(v.rows_per_cta, fp8);
  v.ctas_per_sm = tuning.ctas_per_sm ? tuning.ctas_per_sm : default_ctas_per_sm(v.rows_per_cta, fp8);
  // Two CTAs per SM exist for 32-token tiles of 16 rows only (their shared memory and
  // registers halve); elsewhere the knob falls back to one.
  if (v.rows_per_cta != 16 || v.tile_tokens != 32) v.ctas_per_sm = 1;
#define DCPMLA_SMEM(ROWS, NT, CPS)                                                                     \
  if (v.rows_per_cta == ROWS && v.tile_tokens == NT && v.ctas_per_sm == CPS)                          \
    v.smem_bytes = fp8 ? cuda_detail::attention_smem_bytes<ROWS / 16, NT, CPS, true>()                \
                       : cuda_detail::attention_smem_bytes<ROWS / 16, NT, CPS, false>();
  DCPMLA_SMEM(16, 32, 1)
  DCPMLA_SMEM(16, 64, 1)
  DCPMLA_SMEM(16, 32, 2)
  DCPMLA_SMEM(32, 32, 1)
  DCPMLA_SMEM(32, 64, 1)
  DCPMLA_SMEM(64, 32, 1)
  DCPMLA_SMEM(64, 64, 1)
#undef DCPMLA_SMEM
  return v;
}

void attention(const AttentionParams& p, cudaStream_t stream, int num_sms, bool merge, const AttentionTuning& tuning) {
  validate_attention(p);
  const AttentionVariant v = attention_variant(p.plan.max_qlen, p.heads, p.kv_dtype, tuning);
  if (num_sms <= 0) num_sms = device_sms();
  // Fixed grid from the capacities (graph-safe): ctas_per_sm CTAs per SM (the kernel
  // fills the shared memory), each looping over (work item, head group) units.
  const int64_t groups = (int64_t(p.plan.max_qlen) * p.heads + v.rows_per_cta - 1) / v.rows_per_cta;
  const int grid = int(std::min<int64_t>(int64_t(p.plan.work_capacity) * groups, int64_t(num_sms) * v.ctas_per_sm));
  launch_attention(p, grid, stream, v, p.kv_dtype != KvDtype::bf16);
  if (merge) {
    const int64_t rows_cap = int64_t(p.plan.max_batch) * p.plan.max_qlen * p.heads;
    cuda_detail::launch_split_merge(p, int(std::min<int64_t>((rows_cap + 7) / 8, int64_t(num_sms) * 8)), stream);
  }
}

void write_kv(const bf16* latents, const int64_t* slots, int64_t n, const CacheConfig& cache,
              uint8_t* cache_data, cudaStream_t stream) {
  cache.validate();
  require(n >= 0, "n", n, ">= 0");
  require(cache.dim % 8 == 0, "dim", cache.dim, "a multiple of 8 on the CUDA backend");
  if (n == 0) return;
  require(latents != nullptr && slots != nullptr && cache_data != nullptr, "latents/slots/cache", "null",
          "device pointers");
  cuda_detail::launch_write_kv(
      cuda_detail::WriteKvParams{latents, slots, n, cache.num_slots(), cache.dim, cache.dtype, cache.scale, cache_data},
      stream);
}

void merge_state(const bf16* o_a, const float* lse_a, const bf16* o_b, const float* lse_b, bf16* o,
                 float* lse, int64_t rows, int width, cudaStream_t stream) {
  require(rows >= 0, "rows", rows, ">= 0");
  require(width >= 1, "width", width, ">= 1");
  if (rows == 0) return;
  require(o_a && lse_a && o_b && lse_b && o && lse, "o/lse", "null", "device pointers");
  // Two partials as one stack: element distances between a and b (flat device addresses).
  const int64_t so = int64_t(reinterpret_cast<intptr_t>(o_b) - reinterpret_cast<intptr_t>(o_a)) / 2;
  const int64_t sl = int64_t(reinterpret_cast<intptr_t>(lse_b) - reinterpret_cast<intptr_t>(lse_a)) / 4;
  require((reinterpret_cast<intptr_t>(o_b) - reinterpret_cast<intptr_t>(o_a)) % 2 == 0 &&
              (reinterpret_cast<intptr_t>(lse_b) - reinterpret_cast<intptr_t>(lse_a)) % 4 == 0,
          "o_b/lse_b", "misaligned", "aligned to their element types");
  cuda_detail::launch_merge(cuda_detail::MergeParams{o_a, lse_a, so, sl, 2, rows, width, o, lse}, stream);
}

void combine_partials(const bf16* o_parts, const float* lse_parts, int n, bf16* o, float* lse,
                      int64_t rows, int width, cudaStream_t stream) {
  require(n >= 1, "n", n, ">= 1");
  require(rows >= 0, "rows", rows, ">= 0");
  require(width >= 1, "width", width, ">= 1");
  if (rows == 0) return;
  require(o_parts && lse_parts && o && lse, "o/lse", "null", "device pointers");
  cuda_detail::launch_merge(
      cuda_detail::MergeParams{o_parts, lse_parts, rows * width, rows, n, rows, width, o, lse}, stream);
}

}  // namespace cuda

namespace {

PlannerConfig checked_config(const PlannerConfig& c, float softmax_scale) {
  require(c.backend == Backend::cuda, "backend", to_string(c.backend),
          "cuda for CudaRankRunner (RankRunner serves cpu)");
  require(c.dims.kv_lora_rank == kCudaRank && c.dims.rope_dim == kCudaDim - kCudaRank, "dims",
          fmt::format("kv_lora_rank {}, rope_dim {}", c.dims.kv_lora_rank, c.dims.rope_dim),
          "kv_lora_rank 512, rope_dim 64 on the CUDA backend");
  require_scale("softmax_scale", softmax_scale);
  return c;
}

}  // namespace

CudaRankRunner::CudaRankRunner(const PlannerConfig& config, float kv_scale, float softmax_scale, int device)
    : planner_(checked_config(config, softmax_scale)),
      cache_config_{config.num_blocks, config.block_size, config.dims.dim(), config.kv_dtype, kv_scale},
      plan_(planner_.make_plan()),
      kv_scale_(kv_scale),
      softmax_scale_(softmax_scale),
      device_(device) {
  cache_config_.validate();
  auto release = [this] {
    cudaFree(cache_);
    cudaFree(plan_dev_);
    cudaFree(workspace_);
    for (int k = 0; k < 2; ++k) {
      cudaFreeHost(staging_[k]);
      if (staged_[k]) cudaEventDestroy(staged_[k]);
    }
  };
  try {
    check(cudaSetDevice(device), "cudaSetDevice");
    num_sms_ = device_sms();
    const size_t arena_bytes = plan_.arena().size() * sizeof(int32_t);
    check(cudaMalloc(&cache_, size_t(cache_config_.bytes())), "cudaMalloc(cache)");
    check(cudaMalloc(&plan_dev_, arena_bytes), "cudaMalloc(plan arena)");
    workspace_floats_ = split_workspace_floats(planner_.work_capacity(), config.limits.max_qlen, config.heads,
                                               config.dims.kv_lora_rank);
    check(cudaMalloc(&workspace_, size_t(workspace_floats_) * sizeof(float)), "cudaMalloc(split-K workspace)");
    for (int k = 0; k < 2; ++k) {
      check(cudaMallocHost(&staging_[k], arena_bytes), "cudaMallocHost(plan staging)");
      check(cudaEventCreateWithFlags(&staged_[k], cudaEventDisableTiming), "cudaEventCreate(plan staging)");
    }
    // Zeroed plan: a launch before the first plan() sees work_count = 0 and does nothing.
    // Finished before the constructor returns: later work runs on the caller's non-blocking
    // streams, which do not wait for the legacy default stream.
    check(cudaMemset(plan_dev_, 0, arena_bytes), "cudaMemset(plan arena)");
    check(cudaDeviceSynchronize(), "cudaDeviceSynchronize(runner setup)");
    // Opt the chosen kernel variant into its shared memory now, before any graph capture.
    set_tuning(tuning_);
  } catch (...) {
    release();
    throw;
  }
}

CudaRankRunner::~CudaRankRunner() {
  // Pending work that uses these buffers must finish before they go.
  cudaDeviceSynchronize();
  cudaFree(cache_);
  cudaFree(plan_dev_);
  cudaFree(workspace_);
  cudaFree(slots_dev_);
  cudaFreeHost(slots_host_);
  for (int k = 0; k < 2; ++k) {
    cudaFreeHost(staging_[k]);
    if (staged_[k]) cudaEventDestroy(staged_[k]);
  }
}

void CudaRankRunner::upload_cache(std::span<const uint8_t> bytes, cudaStream_t stream) {
  require(int64_t(bytes.size()) == cache_config_.bytes(), "cache bytes", bytes.size(),
          fmt::format("the cache's size ({} bytes)", cache_config_.bytes()));
  check(cudaMemcpyAsync(cache_, bytes.data(), bytes.size(), cudaMemcpyHostToDevice, stream),
        "cudaMemcpyAsync(cache upload)");
}

void CudaRankRunner::write(const bf16* latents, std::span<const int64_t> positions,
                           std::span<const int32_t> requests, const BatchDesc& batch, cudaStream_t stream) {
  const auto& c = planner_.config();
  require(requests.size() == positions.size(), "requests", requests.size(),
          fmt::format("one request index per position ({})", positions.size()));
  const int64_t n = int64_t(positions.size());
  if (n == 0) return;
  require(latents != nullptr, "latents", "null", "a device pointer");
  if (n > slots_capacity_) {
    check(cudaStreamSynchronize(stream), "cudaStreamSynchronize(before growing slot buffers)");
    cudaFree(slots_dev_);
    cudaFreeHost(slots_host_);
    slots_dev_ = nullptr;
    slots_host_ = nullptr;
    slots_capacity_ = 0;
    check(cudaMallocHost(&slots_host_, size_t(n) * sizeof(int64_t)), "cudaMallocHost(slots)");
    check(cudaMalloc(&slots_dev_, size_t(n) * sizeof(int64_t)), "cudaMalloc(slots)");
    slots_capacity_ = n;
  } else {
    // The previous write's copy may still read the pinned slots.
    check(cudaStreamSynchronize(stream), "cudaStreamSynchronize(slot staging reuse)");
  }
  for (int64_t k = 0; k < n; ++k) {
    const int32_t b = requests[size_t(k)];
    require(b >= 0 && size_t(b) < batch.seq_lens.size(), fmt::format("requests[{}]", k), b,
            fmt::format("a request in [0, {})", batch.seq_lens.size()));
    const auto table = batch.block_tables.subspan(size_t(b) * size_t(batch.table_width), size_t(batch.table_width));
    slots_host_[k] = slot_of(positions[size_t(k)], table, c.block_size, c.num_blocks, c.layout);
  }
  check(cudaMemcpyAsync(slots_dev_, slots_host_, size_t(n) * sizeof(int64_t), cudaMemcpyHostToDevice, stream),
        "cudaMemcpyAsync(slots)");
  cuda::write_kv(latents, slots_dev_, n, cache_config_, cache_, stream);
}

void CudaRankRunner::plan(const BatchDesc& batch, cudaStream_t stream) {
  const int k = next_staging_;
  // The upload two plans back used this staging copy; it has long finished in practice.
  check(cudaEventSynchronize(staged_[k]), "cudaEventSynchronize(plan staging)");
  planner_.plan(batch, plan_);  // validates first; throws before anything is written
  const PlanView view = plan_.view();
  const int32_t* base = plan_.arena().data();
  // Arena order: header, rows, request offsets, work, sub-page tables (last): copy the
  // prefix this batch uses.
  const size_t used = size_t(view.subpage_table - base) + size_t(view.header->batch) * size_t(view.table_stride);
  std::memcpy(staging_[k], base, used * sizeof(int32_t));
  check(cudaMemcpyAsync(plan_dev_, staging_[k], used * sizeof(int32_t), cudaMemcpyHostToDevice, stream),
        "cudaMemcpyAsync(plan upload)");
  check(cudaEventRecord(staged_[k], stream), "cudaEventRecord(plan staging)");
  next_staging_ = 1 - k;
  planned_ = true;
}

AttentionParams CudaRankRunner::params(const bf16* q, bf16* out, float* lse) const {
  return attention_params(planner_.config(), q, cache_, kv_scale_, softmax_scale_, plan_.view_at(plan_dev_),
                          workspace_, out, lse);
}

void CudaRankRunner::attend(const bf16* q, bf16* out, float* lse, cudaStream_t stream) {
  require(planned_, "plan", "none", "a plan: call plan(batch) before attend()");
  const Route forced = planner_.config().route;
  // The merge kernel reads the route from the device plan; skip it only when no plan of
  // this planner can be split_k.
  const bool may_split = forced == Route::automatic || forced == Route::split_k;
  cuda::attention(params(q, out, lse), stream, num_sms_, may_split, tuning_);
}

void CudaRankRunner::set_tuning(const cuda::AttentionTuning& tuning) {
  const auto& c = planner_.config();
  const cuda::AttentionVariant v = cuda::attention_variant(c.limits.max_qlen, c.heads, c.kv_dtype, tuning);
  launch_attention(params(nullptr, nullptr, nullptr), 0, nullptr, v, c.kv_dtype != KvDtype::bf16);
  tuning_ = tuning;
}

}  // namespace dcpmla
