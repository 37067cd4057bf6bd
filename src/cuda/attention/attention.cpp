// Host side of the CUDA backend: validation (before any launch), variant choice, and the
// engine API's cuda::Attention (its plan copies, the plan upload and the workspace). Kernels live in the .cu files beside this.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include <cuda_runtime.h>  // the typed cudaMalloc overloads

#include "dcpmla/cuda.h"
#include "dcpmla/error.h"
#include "dcpmla/layout.h"
#include "attention/config.h"
#include "attention/variants.h"
#include "common/resources.h"
#include "common/params.h"

namespace dcpmla {

namespace {

using namespace cuda_detail;

// The most SMs attention() takes (far past any GPU): the grids it sizes from them stay in int.
constexpr int kMaxSms = 1 << 16;

// What the kernels read and write in vectors (a misaligned address faults and kills the
// context): q and the cache 16 bytes at a time (cp.async, TMA), out up to 8 (the combine's
// stores; 16 required, as the Python layer does), lse and a device kv_scale 4. Plain
// comparisons: run() passes here every layer.
void require_io_aligned(const void* q, const void* kv, const void* out, const float* lse, const float* kv_scale_dev) {
  require_aligned(q, 16, "q", "16-byte aligned device memory (the kernels read q 16 bytes at a time)");
  require_cache_aligned(kv);
  require_aligned(out, 16, "out", "16-byte aligned device memory (the kernels write out in vectors)");
  require_aligned(lse, 4, "lse", "4-byte aligned device memory (float32)");
  require_aligned(kv_scale_dev, 4, "kv_scale", "a 4-byte aligned device float (the device scale)");
}

// The library's choice where the tuning leaves it open, from the H200 sweep (bench
// --sweep, bench/results): 64-token tiles win at 64 rows per CTA (-12% to -19%) and at 16
// rows (-10% bf16, -21% fp8 at context 4096). Two CTAs per SM win at 16 rows only when
// the plan has at least two units per SM (-4% at 4096, -13% at 32768) and lose when it has
// one (+17% at context 1024), so they stay opt-in.
int default_tile_tokens(int /*rows*/, bool /*fp8*/) { return 64; }
int default_ctas_per_sm(int /*rows*/, bool /*fp8*/) { return 1; }

}  // namespace

void cuda_detail::validate_tuning(const cuda::AttentionTuning& t) {
  require(t.tile_tokens == 0 || t.tile_tokens == 32 || t.tile_tokens == 64, "tuning.tile_tokens", t.tile_tokens,
          "0 (auto), 32 or 64");
  require(t.ctas_per_sm >= 0 && t.ctas_per_sm <= 2, "tuning.ctas_per_sm", t.ctas_per_sm, "0 (auto), 1 or 2");
  require(t.kernel >= 0 && t.kernel <= 4, "tuning.kernel", t.kernel,
          "0 (auto), 1 (mma.sync), 2 (wgmma), 3 (fp8 swap) or 4 (bf16 swap)");
}

namespace {

// The compiled variant (variants.cpp's table) that runs a configuration.
const KernelVariant& compiled(const cuda::AttentionVariant& v, KvDtype dtype) {
  return find_variant(Kernel(v.kernel), v.rows_per_cta, v.tile_tokens, v.ctas_per_sm, dtype);
}

// The launches of a validated call: the attention kernel on a fixed grid from the capacities
// (graph-safe: ctas_per_sm CTAs per SM, each running its (row group, chunk) slots of the
// schedule), then the combine of the cut requests unless no plan can cut one.
void launch(const AttentionParams& p, cudaStream_t stream, int num_sms, bool merge, const KernelVariant& k) {
  const int64_t groups = (int64_t(p.plan.max_qlen) * p.heads + k.rows_per_cta - 1) / k.rows_per_cta;
  k.launch(p, int(std::min<int64_t>(int64_t(p.plan.chunk_capacity) * groups, int64_t(num_sms) * k.ctas_per_sm)),
           stream);
  if (merge) {
    // Cut requests' rows: at most max_batch x max_qlen x heads.
    launch_split_merge(p, int64_t(p.plan.max_batch) * p.plan.max_qlen * p.heads, num_sms, stream);
  }
}

void validate_attention(const AttentionParams& p) {
  require(p.q != nullptr, "q", "null", "a device pointer");
  require(p.kv != nullptr, "kv", "null", "a device pointer");
  require(p.out != nullptr, "out", "null", "a device pointer");
  require(p.lse != nullptr, "lse", "null", "a device pointer");
  require(p.part_o != nullptr && p.part_m != nullptr && p.part_l != nullptr, "part_o/part_m/part_l", "null",
          "device pointers to a split-K workspace (split_workspace_floats floats)");
  validate_attention_params(p);
  require_heads("heads", p.heads, Backend::cuda);
  require(p.dim == kDim, "dim", p.dim, "576 (kv_lora_rank 512 + rope_dim 64) on the CUDA backend");
  require(p.rank_dim == kRank, "rank_dim", p.rank_dim, "512 on the CUDA backend");
  // The split-K partials: o is stored and read 16 bytes at a time, m and l as floats.
  require_aligned(p.part_o, 16, "part_o", "16-byte aligned device memory (partials move 16 bytes at a time)");
  require_aligned(p.part_m, 4, "part_m", "4-byte aligned device memory (float32)");
  require_aligned(p.part_l, 4, "part_l", "4-byte aligned device memory (float32)");
  require_io_aligned(p.q, p.kv, p.out, p.lse, p.kv_scale_dev);
  require_aligned(p.trace, 8, "trace", "8-byte aligned device memory (uint64 stamps)");
}

}  // namespace


namespace cuda {

int attention_rows_per_cta(int max_qlen, int heads) {
  const int64_t rows = int64_t(max_qlen) * heads;
  return rows <= 16 ? 16 : rows <= 32 ? 32 : 64;
}

AttentionVariant attention_variant(int max_qlen, int heads, KvDtype dtype, const AttentionTuning& tuning) {
  // Public: its arguments reach the variant table (a bit per dtype) and the row arithmetic.
  require_known("kv_dtype", dtype);
  if (max_qlen < 1 || max_qlen > kMaxQlen) fail("max_qlen", max_qlen, fmt::format("in [1, {}]", kMaxQlen));
  require_heads("heads", heads, Backend::cuda);
  validate_tuning(tuning);
  const bool fp8 = dtype != KvDtype::bf16;
  AttentionVariant v{};
  v.rows_per_cta = attention_rows_per_cta(max_qlen, heads);
  const bool mma_only_knobs = tuning.tile_tokens == 32 || tuning.ctas_per_sm == 2;
  // The swap kernels read one kind of cache each (fp8 swap: fp8, bf16 swap: bf16); asked for
  // with the other kind, the default serves.
  const bool other_cache =
      (tuning.kernel == int(Kernel::fp8_swap) && !fp8) || (tuning.kernel == int(Kernel::bf16_swap) && fp8);
  Kernel kernel = Kernel(other_cache ? 0 : tuning.kernel);
  if (int(kernel) == 0) kernel = mma_only_knobs ? Kernel::mma : default_kernel(v.rows_per_cta, fp8);
  v.kernel = int(kernel);
  if (kernel == Kernel::mma) {
    v.tile_tokens = tuning.tile_tokens ? tuning.tile_tokens : default_tile_tokens(v.rows_per_cta, fp8);
    v.ctas_per_sm = tuning.ctas_per_sm ? tuning.ctas_per_sm : default_ctas_per_sm(v.rows_per_cta, fp8);
    // Two CTAs per SM exist for 32-token tiles of 16 rows only (their shared memory and
    // registers halve); elsewhere the knob falls back to one.
    if (v.rows_per_cta != 16 || v.tile_tokens != 32) v.ctas_per_sm = 1;
  } else {
    // Fixed row counts whatever qlen x heads is: the wgmma kernel pads fewer rows to 64
    // inside the CTA, the swap kernels take more rows in more groups of 32.
    v.rows_per_cta = kernel == Kernel::wgmma ? 64 : std::min(v.rows_per_cta, 32);
    v.tile_tokens = 64;
    v.ctas_per_sm = 1;
  }
  v.smem_bytes = compiled(v, dtype).smem_bytes();
  return v;
}

void attention(const AttentionParams& p, cudaStream_t stream, int num_sms, bool merge, const AttentionTuning& tuning) {
  validate_attention(p);
  if (num_sms < 0 || num_sms > kMaxSms) fail("num_sms", num_sms, fmt::format("in [0, {}] (0 asks the device)", kMaxSms));
  if (num_sms == 0) num_sms = device_sms(current_device());
  launch(p, stream, num_sms, merge, compiled(attention_variant(p.plan.max_qlen, p.heads, p.kv_dtype, tuning), p.kv_dtype));
}

}  // namespace cuda

namespace cuda {

struct Attention::Impl {
  Impl(const AttentionConfig& config, int device_in, void* external, size_t external_bytes)
      : device(device_in < 0 ? current_device() : device_in),
        sms(device_sms(device)),
        planner(checked_config(config, device)),
        softmax_scale(softmax_scale_of(config)),
        workspace_need(checked_workspace(planner, external, external_bytes)),
        staging(2 * planner.plan_ints() * sizeof(int32_t), "cudaMallocHost(plan staging)"),
        plans{planner.make_plan(staging.as<int32_t>()), planner.make_plan(staging.as<int32_t>() + planner.plan_ints())},
        staged{Event("cudaEventCreate(plan staging)"), Event("cudaEventCreate(plan staging)")} {
    void* base = external;
    if (external == nullptr) {
      owned = DeviceBuffer(workspace_need, "cudaMalloc(attention workspace)");
      base = owned.get();
    }
    plan_dev = static_cast<int32_t*>(base);
    split = reinterpret_cast<float*>(static_cast<char*>(base) + plan_region(planner));
    // A zeroed device plan: a launch before the first plan() sees work_count = 0 and does
    // nothing. Finished before the constructor returns: later work runs on the caller's
    // non-blocking streams, which do not wait for the legacy default stream.
    check(cudaMemset(plan_dev, 0, plan_region(planner)), "cudaMemset(plan)");
    check(cudaDeviceSynchronize(), "cudaDeviceSynchronize(attention setup)");
  }

  // device < 0: checks only (one worker), without touching the device.
  static PlannerConfig checked_config(const AttentionConfig& c, int device) {
    require(c.dims.kv_lora_rank == kRank && c.dims.rope_dim == kDim - kRank, "dims",
            fmt::format("kv_lora_rank {}, rope_dim {}", c.dims.kv_lora_rank, c.dims.rope_dim),
            "kv_lora_rank 512, rope_dim 64 on the CUDA backend");
    (void)softmax_scale_of(c);
    // The schedule's row groups follow the default variant's rows per CTA. A configuration
    // no variant serves gets a placeholder here: the Planner built from it refuses it, naming
    // limits.max_qlen, heads or kv_dtype (every caller builds one).
    const bool servable = c.limits.max_qlen >= 1 && c.limits.max_qlen <= kMaxQlen && c.heads >= 1 &&
                          c.heads <= max_heads(Backend::cuda) && is_known(c.kv_dtype);
    return planner_config(c, Backend::cuda, device < 0 ? 1 : device_sms(device),
                          servable ? attention_variant(c.limits.max_qlen, c.heads, c.kv_dtype).rows_per_cta : 16);
  }
  // The workspace's size; the caller's (external) is checked here, before anything is
  // allocated. (Null with bytes > 0 was refused by the constructor: null means our own.)
  static size_t checked_workspace(const Planner& p, const void* external, size_t bytes) {
    const size_t need = layout_bytes(p);
    if (external == nullptr) {
      // Refused by name before cudaMalloc, as the CPU engine refuses its workspace: at 4096
      // heads the split-K partials of max_qlen 64 are hundreds of GB.
      size_t free_bytes = 0, total_bytes = 0;
      check(cudaMemGetInfo(&free_bytes, &total_bytes), "cudaMemGetInfo(attention workspace)");
      require(need <= total_bytes, "split-K workspace", bytes_text(double(need)),
              fmt::format("<= the device's {} (lower heads, limits.max_batch or limits.max_qlen, or route one_stage)",
                          bytes_text(double(total_bytes))));
      return need;
    }
    require(bytes >= need, "workspace bytes", bytes, fmt::format(">= {} (workspace_bytes)", need));
    require_aligned(external, 256, "workspace", "256-byte aligned device memory");
    return need;
  }
  // The device plan (256-byte aligned), then the split-K partials.
  static size_t plan_region(const Planner& p) { return (p.plan_ints() * sizeof(int32_t) + 255) / 256 * 256; }
  // A planner that never cuts (route one_stage) writes no partial and launches no combine:
  // no split-K workspace (part_o/m/l then point at the region's end and are never read or
  // written), as on the CPU backend.
  static size_t layout_bytes(const Planner& p) {
    return plan_region(p) + size_t(split_workspace_floats(p)) * sizeof(float);
  }

  int device, sms;
  Planner planner;
  float softmax_scale;
  size_t workspace_need;  // checked before the allocations below (checked_workspace)
  PinnedBuffer staging;
  Plan plans[2];
  Event staged[2];
  int current = 1;  // plans[current] is the last plan; the next goes to the other copy
  bool planned = false;
  AttentionTuning tuning;
  const KernelVariant* kernel = nullptr;  // the tuning's variant (set_tuning), what run() launches
  DeviceBuffer owned;
  int32_t* plan_dev = nullptr;
  float* split = nullptr;
  // The fewest blocks of any cache a run() captured into a CUDA graph used (max: none): a
  // replay reads that cache with whatever plan is current, so plan() refuses tables past it.
  int64_t captured_blocks = std::numeric_limits<int64_t>::max();
  // The fewest query rows of a run() captured into a graph (max: none): a replay writes the
  // current plan's rows into that run's buffers (plan(..., fit_captured_rows)).
  int64_t captured_rows = std::numeric_limits<int64_t>::max();
};

Attention::Attention(const AttentionConfig& config, int device) : Attention(config, nullptr, 0, device) {}

Attention::Attention(const AttentionConfig& config, void* workspace, size_t bytes, int device) {
  // The configuration is checked before any CUDA call (fail fast, also without a GPU).
  (void)Planner(Impl::checked_config(config, -1));
  if (workspace == nullptr && bytes > 0)
    fail("workspace", "null",
         fmt::format("a device pointer to the {} bytes given (or null with bytes 0: the library allocates its own)",
                     bytes));
  if (device >= 0) require_device(device, " (or < 0 for the current device)");
  // Built on its device; the caller's current device is given back.
  const cuda::DeviceScope scope(device >= 0 ? device : current_device());
  impl_ = std::make_unique<Impl>(config, device, workspace, bytes);
  set_tuning(AttentionTuning{});
}

Attention::~Attention() {
  // Work in flight may still read the plan and the workspace (on this object's device). A
  // destructor reports nothing, and leaves no error behind for a later check.
  if (!impl_) return;
  try {
    const cuda::DeviceScope scope(impl_->device);
    (void)cudaDeviceSynchronize();
  } catch (const std::exception&) {
    // CudaError, or dcpmla::Error from DeviceScope's device query where the runtime is being
    // torn down (no device left): a destructor that threw would end the process.
  }
  (void)cudaGetLastError();
}

size_t Attention::workspace_bytes(const AttentionConfig& config, int device) {
  (void)Planner(Impl::checked_config(config, -1));
  if (device >= 0) require_device(device, " (or < 0 for the current device)");
  return Impl::layout_bytes(Planner(Impl::checked_config(config, device < 0 ? current_device() : device)));
}

const Planner& Attention::planner() const { return impl_->planner; }
const Plan& Attention::current_plan() const { return impl_->plans[impl_->current]; }
float Attention::softmax_scale() const { return impl_->softmax_scale; }
int Attention::device() const { return impl_->device; }
int Attention::num_sms() const { return impl_->sms; }
const AttentionTuning& Attention::tuning() const { return impl_->tuning; }

void Attention::plan(const BatchDesc& batch, cudaStream_t stream, bool fit_captured_rows) {
  Impl& m = *impl_;
  require_not_capturing(stream);
  require_current_device(m.device, "Attention");
  require_stream_device(stream, m.device, "Attention");
  const int k = 1 - m.current;
  // The copy two plans back read this staging copy; in practice it finished long ago.
  check(cudaEventSynchronize(m.staged[k].get()), "cudaEventSynchronize(plan staging)");
  m.planner.plan(batch, m.plans[k]);  // validates first; throws before anything is written
  // A graph captured over a cache replays with this plan: its tables must stay inside that
  // cache (run() checks the cache only when it runs, i.e. at capture). plans[k] is not the
  // current plan yet, so a refusal here leaves the previous plan in place.
  const int64_t max_block = m.plans[k].stats().max_block;
  if (max_block >= m.captured_blocks)
    fail("block_tables", fmt::format("block id {}", max_block),
         fmt::format("< {}: a graph captured over a cache of {} blocks would read past it (capture again over a "
                     "larger cache, with a new Attention)",
                     m.captured_blocks, m.captured_blocks));
  if (fit_captured_rows && m.plans[k].header().rows > m.captured_rows)
    fail("batch", fmt::format("{} query rows", m.plans[k].header().rows),
         fmt::format("at most {} (the rows of a run() captured into a CUDA graph, whose replays write this plan's "
                     "rows into its buffers; capture with the largest batch to replay)",
                     m.captured_rows));
  try {
    check(cudaMemcpyAsync(m.plan_dev, m.plans[k].arena().data(), m.plans[k].used_ints() * sizeof(int32_t),
                          cudaMemcpyHostToDevice, stream),
          "cudaMemcpyAsync(plan upload)");
    check(cudaEventRecord(m.staged[k].get(), stream), "cudaEventRecord(plan staging)");
  } catch (...) {
    // The device copy may now hold this plan while the host's current one is the previous: run()
    // checks its buffers against the host's, so it refuses until a plan() succeeds.
    m.planned = false;
    throw;
  }
  m.current = k;
  m.planned = true;
}

AttentionParams Attention::params(const bf16* q, const KvCache& cache, const KvScale& scale, bf16* out,
                                  float* lse) const {
  const Impl& m = *impl_;
  return attention_params(m.planner.config(), q, static_cast<const uint8_t*>(cache.data), scale, m.softmax_scale,
                          current_plan().view_at(m.plan_dev), m.split, out, lse);
}

void Attention::run(const bf16* q, const KvCache& cache, const KvScale& scale, bf16* out, float* lse,
                    cudaStream_t stream) {
  Impl& m = *impl_;
  if (!m.planned) fail("plan", "none", "a plan: call plan(batch, stream) before run()");
  require_current_device(m.device, "Attention");
  validate_run(m.planner.config(), current_plan(), cache, scale);
  // A host query of the stream's state, legal during capture; no synchronisation.
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (const cudaError_t e = cudaStreamIsCapturing(stream, &capture); e != cudaSuccess) {
    (void)cudaGetLastError();  // not left behind for a later launch check to report
    check(e, "cudaStreamIsCapturing(run stream)");
  }
  const bool capturing = capture == cudaStreamCaptureStatusActive;
  // A step of no query rows (every qlen 0) may come with empty, null buffers: nothing runs, as
  // on the CPU backend. Not inside a capture: the graph replays later plans, which have rows,
  // on the buffers it captured.
  if (q == nullptr || out == nullptr || lse == nullptr) {
    if (current_plan().header().rows > 0 || capturing)
      fail("q/out/lse", "null", "device pointers (null only for a step of no query rows, outside a graph capture)");
    return;
  }
  // The rest of the parameters are the configuration's, checked when it was built.
  require_io_aligned(q, cache.data, out, lse, scale.device);
  require_run_disjoint(m.planner.config(), current_plan().header().rows, q, cache, scale, out, lse, m.plan_dev,
                       int64_t(m.workspace_need));
  // Inside a capture, remember the cache and the rows: later plans must fit them (plan()).
  if (capturing) {
    m.captured_blocks = std::min(m.captured_blocks, cache.num_blocks);
    m.captured_rows = std::min(m.captured_rows, int64_t(current_plan().header().rows));
  }
  // The combine reads the cut requests from the device plan. Captured, it is launched wherever
  // this planner may cut (the graph replays later plans); run eagerly, only when this plan cut
  // a request: with none its grid would only wait for the attention grid and exit, a second
  // kernel boundary in every call (the header is the host copy of the plan on the device).
  const bool merge = capturing ? m.planner.may_cut() : current_plan().header().split_requests > 0;
  launch(params(q, cache, scale, out, lse), stream, m.sms, merge, *m.kernel);
}

void Attention::set_tuning(const AttentionTuning& tuning) {
  require_current_device(impl_->device, "Attention");  // the opt-in below is per device
  const auto& c = impl_->planner.config();
  const KernelVariant& k = compiled(attention_variant(c.limits.max_qlen, c.heads, c.kv_dtype, tuning), c.kv_dtype);
  k.launch(params(nullptr, KvCache{}, KvScale{}, nullptr, nullptr), 0, nullptr);  // its shared memory, once
  impl_->tuning = tuning;
  impl_->kernel = &k;
}

}  // namespace cuda

}  // namespace dcpmla
