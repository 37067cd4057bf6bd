// The CUDA backend (sm_90a): the same plan, the same parameters, device pointers.
// Every entry point validates like the CPU path before any launch (input errors throw
// dcpmla::Error); a CUDA runtime or launch failure throws dcpmla::CudaError naming the call.
// Kernels run asynchronously on the caller's stream and never synchronise with the host,
// so attend() can be captured in a CUDA graph and replayed after every re-plan.
#pragma once

#include <cstdint>
#include <span>
#include <stdexcept>

#include <cuda_runtime_api.h>

#include "dcpmla/attention.h"
#include "dcpmla/cache.h"
#include "dcpmla/plan.h"
#include "dcpmla/runner.h"

namespace dcpmla {

// A CUDA runtime error or a failed launch; what() names the call ("cudaMalloc(cache): ...").
class CudaError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// True when a CUDA device is present and usable (tests skip otherwise).
bool cuda_device_available();

namespace cuda {

// Kernel variant knobs; 0 leaves the choice to the library. Results do not depend on
// them (every variant is tested); they exist for tuning and for the tests.
struct AttentionTuning {
  int tile_tokens = 0;  // 32 or 64 KV tokens per pipeline stage
  int ctas_per_sm = 0;  // 1, or 2 (applies to 16-row CTAs, i.e. qlen x heads <= 16; else 1)
  // 1: the mma.sync kernel (16/32/64-row CTAs, the reference variant); 2: the wgmma kernel
  // (64-row CTAs on warpgroup MMA); 3: the fp8 swap kernel (16-row CTAs on native fp8
  // warpgroup MMA, fp8 caches only: with a bf16 cache 3 acts as 0). tile_tokens and
  // ctas_per_sm apply to the mma.sync kernel only. 0 picks the measured default per shape
  // (wgmma at 64 rows, fp8 swap for fp8 at 16 rows, else mma.sync), unless the knobs above
  // ask for a variant only the mma.sync kernel has (32-token tiles, 2 CTAs per SM).
  int kernel = 0;
};

// Attention over a plan whose view and buffers all live on the device (AttentionParams
// as for attention_cpu, with device pointers; p.plan from Plan::view_at(device arena)).
// Launches a fixed grid sized by the plan's capacities (graph-safe), then the split-K
// merge, which exits at once unless the device plan's route is split_k (merge = false
// skips it: only for plans that can never be split_k). D = 576, R = 512, heads 1..128,
// any kv dtype. num_sms = 0 asks the device.
void attention(const AttentionParams& p, cudaStream_t stream, int num_sms = 0, bool merge = true,
               const AttentionTuning& tuning = {});

// Rows of query (qlen x heads, flattened) one CTA of the attention kernel serves for a
// plan of these capacities (16, 32 or 64).
int attention_rows_per_cta(int max_qlen, int heads);

// The variant attention() runs for these capacities, dtype and tuning (for logs and the bench).
struct AttentionVariant {
  int rows_per_cta, tile_tokens, ctas_per_sm, smem_bytes;
  int kernel;  // 1 mma.sync, 2 wgmma, 3 fp8 swap (AttentionTuning::kernel)
};
AttentionVariant attention_variant(int max_qlen, int heads, KvDtype dtype, const AttentionTuning& tuning = {});

// KV write (SPEC §3): latents bf16 [n, dim] -> cache slots[n]; kPadSlot (-1) is skipped,
// and so is any slot outside [0, cache.num_slots()) (never an out-of-bounds write; the
// runner validates slots on the host first). fp8: stored = rne(sat(x / scale)).
void write_kv(const bf16* latents, const int64_t* slots, int64_t n, const CacheConfig& cache,
              uint8_t* cache_data, cudaStream_t stream);

// merge_state / combine_partials of merge.h on device pointers (natural-log lse).
void merge_state(const bf16* o_a, const float* lse_a, const bf16* o_b, const float* lse_b, bf16* o,
                 float* lse, int64_t rows, int width, cudaStream_t stream);
void combine_partials(const bf16* o_parts, const float* lse_parts, int n, bf16* o, float* lse,
                      int64_t rows, int width, cudaStream_t stream);

// Engines for the conformance path: mla_attention(..., cuda::rank_engine_factory()) runs
// every rank's write, plan and attention on this device (host buffers in and out; each
// call synchronises its own stream). The cross-rank merge and two_stage's stage B stay
// on the host, as the driver does them for every backend.
RankEngineFactory rank_engine_factory(int device = 0);

}  // namespace cuda

// One rank on the GPU, mirroring RankRunner: a device cache, the plan's arena copied to a
// device buffer at a stable address, and a preallocated split-K workspace.
class CudaRankRunner {
 public:
  // config.backend must be cuda (the planner then checks what the CUDA kernels serve).
  CudaRankRunner(const PlannerConfig& config, float kv_scale, float softmax_scale, int device = 0);
  ~CudaRankRunner();
  CudaRankRunner(const CudaRankRunner&) = delete;
  CudaRankRunner& operator=(const CudaRankRunner&) = delete;

  const Planner& planner() const { return planner_; }
  const Plan& current_plan() const { return plan_; }  // the host copy of the last plan
  const CacheConfig& cache_config() const { return cache_config_; }
  uint8_t* cache() const { return cache_; }           // device [num_blocks, block_size, D]
  const int32_t* device_plan() const { return plan_dev_; }

  // Copies a host image of the cache (e.g. a PagedCache's bytes) to the device.
  void upload_cache(std::span<const uint8_t> bytes, cudaStream_t stream);
  // Write path: latents (device, bf16 [n, D]) of global positions[n] of requests[n] (host);
  // slots are computed and checked on the host like RankRunner::write, then written by
  // the KV write kernel. Tokens this rank does not own get the PAD slot.
  void write(const bf16* latents, std::span<const int64_t> positions, std::span<const int32_t> requests,
             const BatchDesc& batch, cudaStream_t stream);

  // Planner::plan (validates the batch), then an asynchronous copy of the plan to its
  // device buffer from pinned memory, ordered before later work on `stream`.
  void plan(const BatchDesc& batch, cudaStream_t stream);

  // Attention with the current device plan: q [B, qlen, H, D], out [B, qlen, H, R],
  // lse [B, qlen, H] natural log (device pointers). No allocation, no host sync.
  void attend(const bf16* q, bf16* out, float* lse, cudaStream_t stream);

  // The parameters attend() launches with (device pointers); tests and the bench swap kv.
  AttentionParams params(const bf16* q, bf16* out, float* lse) const;
  int num_sms() const { return num_sms_; }

  // Kernel variant for later attend() calls (validated; opts the variant into its shared
  // memory at once, so a graph may be captured right after).
  void set_tuning(const cuda::AttentionTuning& tuning);
  const cuda::AttentionTuning& tuning() const { return tuning_; }

 private:
  Planner planner_;
  CacheConfig cache_config_;
  Plan plan_;
  float kv_scale_;
  float softmax_scale_;
  int device_;
  int num_sms_ = 0;
  bool planned_ = false;
  cuda::AttentionTuning tuning_;
  uint8_t* cache_ = nullptr;
  int32_t* plan_dev_ = nullptr;
  float* workspace_ = nullptr;
  int64_t workspace_floats_ = 0;
  // Two pinned staging copies of the arena: a re-plan waits only for the upload two plans back.
  int32_t* staging_[2] = {nullptr, nullptr};
  cudaEvent_t staged_[2] = {nullptr, nullptr};
  int next_staging_ = 0;
  // Slot staging for write(), grown on demand.
  int64_t* slots_host_ = nullptr;
  int64_t* slots_dev_ = nullptr;
  int64_t slots_capacity_ = 0;
};

}  // namespace dcpmla
