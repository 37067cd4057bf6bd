// Attention over one rank's shard, as a plan says (SPEC §1, §4). CPU kernels here;
// the CUDA kernels take the same parameter struct with device pointers.
#pragma once

#include <cstdint>

#include "dcpmla/cache.h"
#include "dcpmla/numeric.h"
#include "dcpmla/plan.h"
#include "dcpmla/types.h"

namespace dcpmla {

// Plain pointers and sizes; no ownership.
struct AttentionParams {
  const bf16* q;       // [batch, qlen, heads, D]
  const uint8_t* kv;   // [num_subpages, page, D] in kv_dtype (the paged cache)
  KvDtype kv_dtype;
  float kv_scale;      // read = stored * kv_scale
  const float* kv_scale_dev;  // CUDA: when set, the scale is read from here at run time
  float softmax_scale; // scores = softmax_scale * <q, k>
  int heads;
  int dim;             // D
  int rank_dim;        // R: the value is the first R values of a latent
  PlanView plan;
  bf16* out;           // [batch, qlen, heads, R]
  float* lse;          // [batch, qlen, heads], natural log; -inf for an empty window
  // split_k workspace: [work_capacity, max_qlen, heads, R] and [work_capacity, max_qlen, heads]
  float* part_o;
  float* part_m;       // base-2 running max of scores * log2(e)
  float* part_l;       // sum of 2^(s * log2(e) - m)
  // CUDA diagnostics (the bench's --trace), null in every call the library makes: when set,
  // kTraceEntries device uint64 that receive each CTA's start and end on the GPU's global
  // timer (ns): attention CTA b at [2 b, 2 b + 1], combine CTA c at [kTraceCombine + 2 c, + 1],
  // for b, c < kTraceCtas (a combine CTA with no row to merge stamps neither), and the SM
  // attention CTA b ran on at [kTraceSm + b], and its SM's cycle counter (clock64) at its
  // start and end at [kTraceCycles + 2 b, + 1] (over the ns: the clock it ran at). The wgmma and
  // swap kernels and the combine stamp (the mma.sync reference kernel does not: at 255
  // registers its 32-row form spilled); what a CTA does is unchanged, and unwritten entries
  // keep their value.
  uint64_t* trace = nullptr;
};
inline constexpr int kTraceCtas = 1024;
inline constexpr int kTraceCombine = 2 * kTraceCtas;
inline constexpr int kTraceSm = 4 * kTraceCtas;
inline constexpr int kTraceCycles = 5 * kTraceCtas;
inline constexpr int kTraceEntries = 7 * kTraceCtas;

// The checks of a parameter struct that every backend makes before its kernels run: a plan view
// with every buffer, a known kv_dtype, heads >= 1, 1 <= rank_dim < dim, the scales (kv_scale 1
// for bf16), plan capacities >= 1. It reads no pointer (they may be device memory): each backend
// checks its own pointers, and the CUDA one its sizes and alignment.
void validate_attention_params(const AttentionParams& p);

// Runs the plan's route over the sharded cache: one_stage and two_stage's stage A write
// (out, lse) directly; split_k writes partials and merges them. Rows with no local key
// get out = 0, lse = -inf. Validates p first (host pointers: q, kv, out and lse where the plan
// has rows, the split-K workspace where it cut a request; no device scale; whole-value
// alignment; out and lse apart from q, each other and the workspace; the cache's extent is not
// in p, so its overlap with them is the engine's check, Attention::run).
void attention_cpu(const AttentionParams& p);

// Host bytes attention_cpu allocates on each thread it runs on, whatever the batch (a task's
// scratch is bounded in heads and query positions). The CPU engine counts it for every OpenMP
// thread in its host budget, so a latent width too wide for the host is refused when the
// engine is built.
int64_t cpu_attention_scratch_bytes(const LatentDims& dims);

// Workspace floats split_k partials need for plans of these capacities
// (PlanView::work_capacity, PlanView::max_qlen). Throws dcpmla::Error when an argument is
// below 1 or the count does not fit int64 (absurd dims once wrapped it to 0 floats).
int64_t split_workspace_floats(int64_t work_capacity, int max_qlen, int heads, int rank_dim);
// The same for a planner's plans: 0 when it never cuts (route one_stage). What the engines take
// and the memory bounds count.
int64_t split_workspace_floats(const Planner& planner);

// The parameters of a plan's attention (host or device pointers alike), with the split-K
// workspace (split_workspace_floats floats) laid out as part_o, then part_m, then part_l.
AttentionParams attention_params(const PlannerConfig& config, const bf16* q, const uint8_t* kv,
                                 const KvScale& kv_scale, float softmax_scale, const PlanView& plan,
                                 float* workspace, bf16* out, float* lse);

// two_stage stage B: dense causal attention of each request's query block over its own
// block latents (identical on every rank). Heads [head_begin, head_begin + heads) of q.
struct BlockAttentionParams {
  const bf16* q;            // [batch, qlen, q_heads, D]
  const bf16* block_kv;     // [batch, qlen, D] the block's latents (as the model made them)
  const int32_t* seq_lens;  // [batch]; 0 = padding (rows get out = 0, lse = -inf)
  KvDtype kv_dtype;         // the block is read as the cache stores it (quantised alike)
  float kv_scale;
  float softmax_scale;
  int batch, qlen, q_heads, head_begin, heads, dim, rank_dim;
  bf16* out;  // [batch, qlen, heads, R]
  float* lse; // [batch, qlen, heads]
};
// Validates p first: sizes (1 <= rank_dim < dim, heads [head_begin, head_begin + heads) within
// q_heads), dtype and scales, the pointers where batch > 0, and every seq_lens entry 0 or >= qlen.
void block_attention_cpu(const BlockAttentionParams& p);

}  // namespace dcpmla
