// The CUDA backend (sm_90a): the same plan, the same parameters, device pointers.
// Every entry point validates like the CPU path before any launch (input errors throw
// dcpmla::Error); a CUDA runtime or launch failure throws dcpmla::CudaError naming the call.
// Kernels run asynchronously on the caller's stream and never synchronise with the host,
// so run() can be captured in a CUDA graph and replayed after every re-plan.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <stdexcept>

#include <cuda_runtime_api.h>

#include "dcpmla/attention.h"
#include "dcpmla/cache.h"
#include "dcpmla/engine.h"
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
// The usable CUDA devices: 0 without a GPU or driver (the runtime's error is cleared).
int cuda_device_count();

namespace cuda {

// Makes `device` current for a scope and gives the caller's back at its end (an ordinal outside
// the machine's GPUs is refused naming `device`; a failed switch throws CudaError). Attention,
// DcpStep and the free functions run on the current device and refuse another where they own
// device state; engines whose threads switch devices wrap calls in it.
class DeviceScope {
 public:
  explicit DeviceScope(int device);
  ~DeviceScope();
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int previous_ = 0, device_ = 0;
};

// Kernel variant knobs; 0 leaves the choice to the library. Results do not depend on
// them (every variant is tested); they exist for tuning and for the tests.
struct AttentionTuning {
  int tile_tokens = 0;  // 32 or 64 KV tokens per pipeline stage
  int ctas_per_sm = 0;  // 1, or 2 (applies to 16-row CTAs, i.e. qlen x heads <= 16; else 1)
  // 1: the mma.sync kernel (16/32/64-row CTAs, the reference variant); 2: the wgmma kernel
  // (64-row CTAs on warpgroup MMA); 3: the fp8 swap kernel (16- or 32-row CTAs on native fp8
  // warpgroup MMA, fp8 caches only: with a bf16 cache 3 acts as 0); 4: the bf16 swap kernel
  // (16- or 32-row CTAs on warpgroup MMA, bf16 caches only: with an fp8 cache 4 acts as 0).
  // tile_tokens and ctas_per_sm apply to the mma.sync kernel only. 0 picks the measured
  // default per shape (wgmma at 64 rows for every cache; below, fp8 swap for fp8; for bf16,
  // bf16 swap at 16 rows and wgmma padded to 64 at 32), unless the knobs above ask for a
  // variant only the mma.sync kernel has (32-token tiles, 2 CTAs per SM).
  int kernel = 0;
};

// Attention over a plan whose view and buffers all live on the device (AttentionParams
// as for attention_cpu, with device pointers; p.plan from Plan::view_at(device arena)).
// Launches a fixed grid sized by the plan's capacities (graph-safe), then the split-K
// merge, which exits at once unless the device plan cut a request (merge = false skips it:
// for a plan that cut none, header().split_requests = 0, as Attention::run does outside a
// graph capture, or plans that can never cut). D = 576, R = 512, heads 1..4096 (max_heads),
// any kv dtype. num_sms = 0 asks the device (at most 65536). Alignment (refused otherwise, since a misaligned
// vector access faults and kills the CUDA context): q, kv, out and part_o 16 bytes, lse,
// kv_scale_dev, part_m and part_l 4. A bf16 cache's rows the plan names must lie below 2^31
// (the 64-row kernel's TMA coordinates are int32): a planner configured for CUDA and bf16
// refuses tables past them; this function sees no host plan and cannot check it, nor size q,
// out and lse: keeping out and lse apart from the inputs, each other and the workspace is the
// caller's part here (cuda::Attention::run checks it). trace, when set, 8 bytes.
void attention(const AttentionParams& p, cudaStream_t stream, int num_sms = 0, bool merge = true,
               const AttentionTuning& tuning = {});

// Rows of query (qlen x heads, flattened) one CTA of the attention kernel serves for a
// plan of these capacities (16, 32 or 64).
int attention_rows_per_cta(int max_qlen, int heads);

// The variant attention() runs for these capacities, dtype and tuning (for logs and the bench).
// max_qlen in [1, kMaxQlen], heads 1..max_heads(Backend::cuda) and a known dtype, else dcpmla::Error.
struct AttentionVariant {
  int rows_per_cta, tile_tokens, ctas_per_sm, smem_bytes;
  int kernel;  // 1 mma.sync, 2 wgmma, 3 fp8 swap, 4 bf16 swap (AttentionTuning::kernel)
};
AttentionVariant attention_variant(int max_qlen, int heads, KvDtype dtype, const AttentionTuning& tuning = {});

// KV write (SPEC §3) on the device, capturable: latents bf16 [n, D] -> cache slots[n] (device
// int64, rank-local); kPadSlot (-1) is skipped. A slot outside [0, cache.num_slots()) is never
// written: it is skipped and, where `errors` is given, counted there (a device int, added to
// atomically), since a device mapping cannot be checked on the host without a sync.
// fp8: stored = rne(sat(x / scale)), with the scale read on the device when scale.device is set.
// Alignment: latents 16 bytes (read 16 at a time), slots 8, scale.device 4. Two tokens with
// one slot are written in parallel: the slot may keep any mix of their 16-byte groups.
void write_kv(const KvCache& cache, const bf16* latents, const int64_t* slots, int64_t n, const KvScale& scale,
              cudaStream_t stream, int* errors = nullptr);

// The DCP slot mapping on the device (SPEC §3), capturable: slots[k] for global position
// positions[k] of request requests[k], from the shared block tables [batch, table_width]
// (device int32): the rank-local slot where `layout` owns the position, else kPadSlot. A
// position past the table or a block id outside [0, num_blocks) gives kPadSlot and, where
// `errors` is given, counts there. (layout.h's slot_of is the host version.)
void slot_mapping(const int64_t* positions, const int32_t* requests, int64_t n, const int32_t* block_tables,
                  int batch, int table_width, int block_size, int64_t num_blocks, const Layout& layout,
                  int64_t* slots, cudaStream_t stream, int* errors = nullptr);

// merge_state / combine_partials of merge.h on device pointers (natural-log lse).
void merge_state(const bf16* o_a, const float* lse_a, const bf16* o_b, const float* lse_b, bf16* o,
                 float* lse, int64_t rows, int width, cudaStream_t stream);
void combine_partials(const bf16* o_parts, const float* lse_parts, int n, bf16* o, float* lse,
                      int64_t rows, int width, cudaStream_t stream);

// The engine API on the GPU (SPEC §6; engine.h is the CPU form): plan once per step, run once
// per layer with that layer's engine-owned cache. The library owns the plan (two pinned host
// copies and one device copy) and the split-K workspace, or takes the workspace from the
// caller (workspace_bytes, for engines that account every byte of GPU memory). route
// one_stage never cuts, so it has no split-K workspace (only the device plan); a split-K
// workspace larger than the device is refused by name before any allocation.
//  - plan(): host work; the planner writes into the pinned copy not in flight and an
//    asynchronous copy of the bytes the step uses goes to the device plan on `stream`, so
//    planning step k+1 overlaps step k's GPU work. It waits on the host only for the copy
//    two plans back. The run stream must be `stream` or ordered after it.
//  - run(): validation on host scalars, then launches; no allocation, no synchronisation, no
//    host read of device memory: capturable in a CUDA graph, and a replay after a new plan()
//    computes the new batch.
//  - No lock: calls on one object must not overlap (its plans and workspace are the object's);
//    use one per thread, or serialise them.
class Attention {
 public:
  // device < 0: the current device, else one in [0, device count) (dcpmla::Error otherwise).
  // Allocates the workspace.
  explicit Attention(const AttentionConfig& config, int device = -1);
  // The caller's workspace: `bytes` >= workspace_bytes(config) of device memory, 256-byte aligned,
  // kept alive as long as this object (checked before anything is allocated). A null workspace
  // with bytes 0 is the constructor above; null with bytes > 0 is refused.
  Attention(const AttentionConfig& config, void* workspace, size_t bytes, int device = -1);
  ~Attention();
  Attention(const Attention&) = delete;
  Attention& operator=(const Attention&) = delete;

  static size_t workspace_bytes(const AttentionConfig& config, int device = -1);

  const Planner& planner() const;
  const Plan& current_plan() const;  // the host copy of the last plan
  float softmax_scale() const;
  int device() const;
  int num_sms() const;

  // Once a run() was captured into a CUDA graph, plan() refuses tables naming a block id >= the
  // num_blocks of the smallest cache a captured run() used (field block_tables): a replay would
  // read past that cache. The bound holds for this object's lifetime (capture over a larger
  // cache with a new Attention); a refused batch leaves the previous plan current.
  // fit_captured_rows: also refuse a batch of more query rows than the fewest of a run() captured
  // so far (its replays write this plan's rows into that run's buffers): for callers whose
  // buffers are sized for the batch they captured (the Python engine), not for the limits.
  void plan(const BatchDesc& batch, cudaStream_t stream, bool fit_captured_rows = false);
  // q [B, qlen, H, D] -> out [B, qlen, H, R], lse [B, qlen, H] natural log (device pointers):
  // this rank's partial; rows whose rank-local window is empty give out 0, lse -inf.
  // q, out and the cache 16-byte aligned, lse and scale.device 4-byte aligned; out and lse share no byte
  // with q, the cache, scale.device or each other over the plan's rows (dcpmla::Error otherwise).
  // A captured graph replays later plans on these pointers: size them for the rows of every
  // plan replayed (the capture limits), or plan with fit_captured_rows. plan() and run() refuse
  // a call made while another device is current, and plan() one made while `stream` captures.
  // Inside a capture (cudaStreamIsCapturing on `stream`) it records the cache's num_blocks for
  // plan()'s check above. A step of no query rows (every qlen 0) may pass null q/out/lse
  // outside a capture: nothing runs. Launches the attention kernel, then the combine of cut
  // requests: captured, wherever the planner may cut; eagerly, only when the plan cut one.
  void run(const bf16* q, const KvCache& cache, const KvScale& scale, bf16* out, float* lse, cudaStream_t stream);

  // The parameters run() launches with (tests and the bench).
  AttentionParams params(const bf16* q, const KvCache& cache, const KvScale& scale, bf16* out, float* lse) const;
  // Kernel variant for later run() calls (validated; opts the variant into its shared memory
  // at once, so a graph may be captured right after).
  void set_tuning(const AttentionTuning& tuning);
  const AttentionTuning& tuning() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Ranks for the conformance path: mla_attention(..., cuda::rank_engine_factory()) runs every
// rank's write (device slot mapping + write_kv), plan and attention on this device with a
// device cache per rank (host buffers in and out; each call synchronises its own stream). The
// cross-rank merge and two_stage's stage B stay on the host, as the driver does them for
// every backend. device: one in [0, device count), checked (dcpmla::Error) when a rank is built.
RankEngineFactory rank_engine_factory(int device = 0);

}  // namespace cuda

}  // namespace dcpmla
