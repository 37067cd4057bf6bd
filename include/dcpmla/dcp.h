// The DCP step on GPUs (issue 4): one rank of an N-rank group over a device communicator
// (NCCL, or the DeviceGroup that simulates the ranks on one GPU).
//
// Each rank holds H_local query heads (the TP layout) and 1/N of every request's KV.
// One step, all on comm.stream():
//   1. KV write: the step's new tokens (the last qlen positions of each request) go to the
//      slots this rank owns; the others get PAD and are skipped.
//   2. all-gather of q over heads: every rank then holds all H = N x H_local heads.
//   3. attention over the local shard with this rank's plan (cuda::Attention) over the layer's cache. One
//      launch serves at most max_heads(Backend::cuda) heads (4096), so more heads run as G
//      groups of Hg heads (Hg = the largest multiple of H_local within it that gives whole
//      groups of ranks; G = 1 whenever H fits).
//   4. merge, in one of two forms; either way rank k keeps its own heads [k Hl, (k+1) Hl):
//      reduce_scatter: all-gather of lse, scale o_r by exp(lse_r - lse), reduce-scatter
//                      over heads (bf16 on the wire by default, or f32);
//      all_to_all:     all-to-all of (o bf16, lse f32) per destination, local combine.
//   5. two_stage (verify): the merged prefix (stage A) is merged with stage B, the dense
//      causal attention of the verify block for this rank's heads (balanced form, SPEC §4).
// plan() is host work (validation, planning; with check_agreement, a small synchronised
// exchange so that all ranks agree on the batch); run() only enqueues: no allocation and no
// host sync, so a CUDA graph captured around run() replays after every re-plan.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "dcpmla/comm_device.h"
#include "dcpmla/cuda.h"
#include "dcpmla/plan.h"

namespace dcpmla {

enum class DcpMerge : int32_t { reduce_scatter, all_to_all };
inline constexpr std::array<EnumName, 2> kDcpMergeNames{
    {{int32_t(DcpMerge::reduce_scatter), "reduce_scatter"}, {int32_t(DcpMerge::all_to_all), "all_to_all"}}};
constexpr std::span<const EnumName> enum_names(DcpMerge) { return kDcpMergeNames; }
inline DcpMerge parse_dcp_merge(std::string_view s) { return parse_enum<DcpMerge>("merge", s); }
inline std::string_view to_string(DcpMerge m) { return enum_name(m); }

struct DcpConfig {
  int world_size = 0;  // 0: the communicator's; otherwise it must equal it
  KvDtype kv_dtype = KvDtype::bf16;
  std::optional<float> softmax_scale;  // none: D^-0.5
  int heads_local = 16;        // H_local, 1..max_heads(Backend::cuda)
  int interleave = 1;
  int block_size = 64;
  Route route = Route::automatic;
  PlanLimits limits;           // capture limits: rows = max_batch x max_qlen
  int min_segment_tokens = 256;  // floor of a cut request's pieces (PlannerConfig)
  DcpMerge merge = DcpMerge::reduce_scatter;
  DataType reduce_dtype = DataType::bf16;  // reduce_scatter's wire type: bf16 or f32
  cuda::AttentionTuning tuning;
  // Debug: plan() checks that every rank was handed the same batch (a synchronised exchange
  // over the communicator). Off on the serving path, where the engine's scheduler is the one
  // source of the batch; on in the tests.
  bool check_agreement = false;
};

// Bytes one rank sends per step in each collective, counting what must leave the rank
// ((N - 1) shares of each exchange, as ring and point-to-point algorithms move it).
struct DcpTraffic {
  int64_t q_all_gather = 0;
  int64_t lse_all_gather = 0;  // reduce_scatter form
  int64_t reduce_scatter = 0;  // reduce_scatter form
  int64_t all_to_all = 0;      // all_to_all form
  int64_t merge_total(DcpMerge m) const {
    return m == DcpMerge::reduce_scatter ? lse_all_gather + reduce_scatter : all_to_all;
  }
};
DcpTraffic dcp_traffic(int world_size, int64_t rows, int heads_local, int rank_dim, DataType reduce_dtype);

// Ranks whose heads share one attention launch: the largest divisor d of world_size with
// d x heads_local <= max_heads(Backend::cuda) (one launch's head limit). Launches = world_size / d.
int dcp_ranks_per_group(int world_size, int heads_local);

class DcpStep {
 public:
  // Validates the configuration (dcpmla::Error; the tuning too) and allocates every buffer;
  // then all ranks check that they were built alike, check_agreement included (a
  // synchronised exchange over comm).
  DcpStep(const DcpConfig& config, DeviceCommunicator& comm);
  ~DcpStep();
  DcpStep(const DcpStep&) = delete;
  DcpStep& operator=(const DcpStep&) = delete;

  cuda::Attention& attention() { return *attention_; }
  const DcpConfig& config() const { return config_; }
  int world_size() const { return world_; }
  int rank() const { return rank_; }
  int heads_total() const { return world_ * config_.heads_local; }
  int group_heads() const { return hg_; }  // heads per attention launch
  int groups() const { return groups_; }
  int64_t row_capacity() const { return rows_; }  // max_batch x max_qlen

  // Host, once per step (for every layer) and never inside a capture: the planner plans, and
  // the plan, the new tokens' slots and the lengths are uploaded (stream-ordered, from
  // double-buffered pinned staging) to buffers at stable addresses. With check_agreement,
  // all ranks first agree on the batch (the same shape, lengths and tables everywhere, else
  // dcpmla::Error on every rank). Every live request needs seq_lens[b] >= qlen (its last qlen
  // positions are the written tokens; draft mode included); a refused batch leaves the
  // previous plan, slots and lengths in place.
  void plan(const BatchDesc& batch);

  // Enqueues one layer of the step on the communicator's stream, over that layer's
  // engine-owned cache (this rank's shard) and scale. Device pointers, rows laid out as
  // [B, qlen] of the current batch in the first B x qlen of row_capacity() rows:
  //   q_local     [rows, H_local, D]  this rank's query heads
  //   new_latents [rows, D]           latents of positions L_b - qlen + t (the new tokens;
  //                                   also two_stage's stage B block); nullptr skips the write
  //                                   (only when the cache already holds them and the route
  //                                   is not two_stage)
  //   out         [rows, H_local, R]  merged output of this rank's heads
  //   lse         [rows, H_local]     natural log
  // Rows past the batch hold unspecified values. new_latents 16-byte aligned (write_kv reads
  // it 16 bytes at a time), q_local and out 2, lse 4 (dcpmla::Error otherwise).
  void run(const bf16* q_local, const bf16* new_latents, const KvCache& cache, const KvScale& scale, bf16* out,
           float* lse);

 private:
  void enqueue_merge(bf16* out, float* lse);
  void build(const DcpConfig& config);  // everything but the exchanges with the peers
  void carve(int64_t total, const int64_t* sizes);
  void warm_up();
  void agree_on_config();

  DcpConfig config_;
  DeviceCommunicator& comm_;
  int world_, rank_, hl_, hg_, rg_, groups_;
  int64_t rows_;
  float softmax_scale_;
  std::unique_ptr<cuda::Attention> attention_;
  std::unique_ptr<HostStagedCommunicator> host_;  // agreement checks (persistent scratch)
  bool planned_ = false;
  Route route_ = Route::automatic;
  // Device buffers (one allocation, carved) and pinned staging, owned by RAII types.
  struct Buffers;
  std::unique_ptr<Buffers> buffers_;
  bf16* q_gathered_ = nullptr;  // [N][rows][Hl][D]
  bf16* q_grp_ = nullptr;       // [G][rows][Hg][D] (aliases q_gathered_ when rg == 1)
  bf16* o_grp_ = nullptr;       // [G][rows][Hg][R]
  float* lse_grp_ = nullptr;    // [G][rows][Hg]
  float* lse_all_ = nullptr;    // [N][G rows Hg]
  void* rs_send_ = nullptr;     // [N][rows][Hl][R] bf16 or f32
  float* rs_recv_ = nullptr;    // [rows][Hl][R] f32 (f32 wire only)
  uint8_t* a2a_send_ = nullptr; // [N][chunk]
  uint8_t* a2a_recv_ = nullptr;
  int64_t chunk_bytes_ = 0, chunk_lse_offset_ = 0;
  bf16* ob_ = nullptr;          // stage B [rows][Hl][R]
  float* lb_ = nullptr;
  int64_t* slots_dev_ = nullptr;    // [rows]
  int32_t* lens_dev_ = nullptr;     // [max_batch]
  int next_staging_ = 0;
};

}  // namespace dcpmla
