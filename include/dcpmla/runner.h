// The data's way through one rank, and the whole DCP path in one call:
// shard -> page -> write -> plan -> per-rank attention -> cross-rank merge.
#pragma once

#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "dcpmla/attention.h"
#include "dcpmla/cache.h"
#include "dcpmla/comm.h"
#include "dcpmla/engine.h"
#include "dcpmla/plan.h"

namespace dcpmla {

// How the merged result is laid out across ranks (SPEC §2).
enum class MergeForm : int32_t {
  all_heads,      // every rank keeps all H heads (all-gather of partials, local combine)
  scatter_heads,  // each rank keeps H/N heads (all-gather of lse, correction, reduce-scatter)
};
inline constexpr std::array<EnumName, 2> kMergeFormNames{
    {{int32_t(MergeForm::all_heads), "all_heads"}, {int32_t(MergeForm::scatter_heads), "scatter_heads"}}};
constexpr std::span<const EnumName> enum_names(MergeForm) { return kMergeFormNames; }
inline MergeForm parse_merge_form(std::string_view s) { return parse_enum<MergeForm>("merge", s); }
inline std::string_view to_string(MergeForm f) { return enum_name(f); }

// Merges this rank's partial (o, lse over all H heads of `rows` query rows) with the
// other ranks'. all_heads: out/lse hold [rows, H, R] / [rows, H]. scatter_heads: they
// hold this rank's heads [rows, H/N, R] / [rows, H/N] (H % N == 0 required). out and out_lse
// may not share memory with o and lse. Every rank must pass the same form, rows, heads and
// width: it checks nothing across ranks (that would cost a collective per merge). In-process
// and device groups refuse calls that differ in collective, count or dtype; MPI may hang or
// merge wrong rows, so agree first (check_ranks_agree, as mla_attention_on_rank does).
void merge_across_ranks(Communicator& comm, MergeForm form, const bf16* o, const float* lse,
                        int64_t rows, int heads, int width, bf16* out, float* out_lse);

// One rank of the conformance path, whatever the backend: it owns this rank's cache (as an
// engine would) and drives the engine API over it, with host buffers in and out, so the
// same driver serves the CPU backend and the CUDA one.
class RankEngine {
 public:
  virtual ~RankEngine() = default;
  // Fill the cache with NaN, so that a read past a length shows.
  virtual void poison() = 0;
  // Write path: latents [n, D] of global positions[n] of requests[n]; tokens this
  // rank does not own get the PAD slot and are skipped.
  virtual void write(std::span<const bf16> latents, std::span<const int64_t> positions,
                     std::span<const int32_t> requests, const BatchDesc& batch) = 0;
  virtual void plan(const BatchDesc& batch) = 0;
  virtual const Plan& current_plan() const = 0;
  // Attention over this rank's shard with the current plan: q [rows, H, D] ->
  // out [rows, H, R], lse [rows, H] (natural log), host memory; rows as the plan packs them.
  virtual void attend(const bf16* q, bf16* out, float* lse) = 0;
};

// Makes one rank's engine: the Attention's configuration and the cache it owns.
using RankEngineFactory = std::function<std::unique_ptr<RankEngine>(const AttentionConfig&, const CacheConfig&)>;

// Rank-local slots of the driver's tokens (positions[n] of requests[n], SPEC §3); kPadSlot where
// this rank does not own a position. The host slot mapping, kept for the driver and the tests.
// Throws on an invalid layout or block_size, num_blocks < 1, block_tables not batch x
// table_width, a bad request index, or a position whose table entry is missing or out of range.
std::vector<int64_t> slots_of(std::span<const int64_t> positions, std::span<const int32_t> requests,
                              const BatchDesc& batch, int block_size, int64_t num_blocks, const Layout& layout);

// The CPU rank: a PagedCache and an Attention.
std::unique_ptr<RankEngine> make_cpu_rank(const AttentionConfig& config, const CacheConfig& cache);

// A rank engine's cache against its configuration (dtype, block size, D), checked when the
// engine is built (make_cpu_rank, the CUDA backend's rank engine): fail fast, before a write.
void require_rank_cache(const AttentionConfig& config, const CacheConfig& cache);

struct AttentionOptions {
  Mode mode = Mode::verify;
  int world_size = 1;
  int interleave = 1;
  int block_size = 64;
  KvDtype kv_dtype = KvDtype::bf16;
  float kv_scale = 1.0f;
  std::optional<float> softmax_scale;  // none: D^-0.5
  int kv_lora_rank = 512;
  Route route = Route::automatic;
  MergeForm merge = MergeForm::all_heads;
  Backend backend = Backend::cpu;
  int min_segment_tokens = 256;  // floor of a cut request's pieces (PlannerConfig)
  // Per-request query rows (BatchDesc::qlens), each in [0, qlen]; empty: qlen each. With
  // them q, out and lse hold sum(qlens) rows packed by request instead of batch x qlen.
  std::vector<int32_t> qlens;
  uint64_t seed = 0;  // draws the block tables (a random permutation, not identity)
  bool poison = true; // fill the caches with NaN before writing
};

struct AttentionResult {
  std::vector<float> out;  // [rows, H, R] as the bf16 output holds it (rows: B x qlen or sum(qlens))
  std::vector<float> lse;  // [rows, H] natural log
  std::vector<Route> routes;  // the route each rank's planner took (the schedule is each rank's own)
  std::vector<int> max_segments;  // per rank, the most pieces its plan cut one request into (1: none cut, 0: no rows)
};

// One rank's part of the conformance path, with whatever communicator links the ranks
// (in-process threads, MPI processes): this rank writes only the tokens it owns, attends
// its shard and merges with the others. Every rank returns the whole merged result
// (with scatter_heads the kept heads are all-gathered at the end). comm.world_size()
// must equal options.world_size. A rank that refuses its inputs or fails to set up says so in
// the first collective (refuse_together), where every rank raises: MPI has no abort that a
// peer would see. Ranks whose inputs or options differ (anything the partials depend on) are
// refused on every rank by check_ranks_agree. A rank that throws later calls comm.abort(),
// so that in-process peers raise instead of waiting for it.
// `engines` makes each rank's engine; empty = make_cpu_rank (options.backend must
// then be cpu). The CUDA backend passes its own (dcpmla::cuda::rank_engine_factory).
AttentionResult mla_attention_on_rank(std::span<const float> q, std::span<const float> kv,
                                      std::span<const int32_t> seq_lens, int batch, int qlen,
                                      int heads, int64_t max_len, int dim,
                                      const AttentionOptions& options, Communicator& comm,
                                      const RankEngineFactory& engines = {});

// Ranks agree on a batch before their first collective: each contributes the values it
// planned with; a mismatch raises dcpmla::Error on every rank (never a hang or a wrong merge).
void check_ranks_agree(Communicator& comm, std::span<const int32_t> signature, std::string_view what);

// Before the first collective that a refusal on one rank would leave its peers waiting in
// (NCCL's until its timeout): each rank passes the error it raised while validating or
// setting up (null when none), one flag per rank is exchanged, and if any rank refused every
// rank throws: the refusing rank its own error, the others an Error naming the refusing ranks.
void refuse_together(Communicator& comm, std::exception_ptr refused, std::string_view what);

// Most host memory the in-process entry point may ask for in all: the inputs' copies, every
// rank's merge buffers (which grow as world_size^2: each rank gathers every rank's partial)
// and, with the CPU engines, every rank's cache shard and kernel workspace live in this one
// process. A problem needing more is refused before anything is allocated (block_size 65536
// with 64 short requests on 8 ranks would be 39 GB of blocks). The same bound as one object's
// (kMaxHostBytes, cache.h): one process, one budget.
inline constexpr int64_t kMaxInProcessBytes = kMaxHostBytes;

// The conformance entry point (SPEC §5): options.world_size ranks as threads of this
// process, each driving its engine (CPU by default). Refuses more than kMaxInProcessRanks
// ranks or kMaxInProcessBytes of host memory, before anything is allocated.
AttentionResult mla_attention(std::span<const float> q, std::span<const float> kv,
                              std::span<const int32_t> seq_lens, int batch, int qlen, int heads,
                              int64_t max_len, int dim, const AttentionOptions& options,
                              const RankEngineFactory& engines = {});

// What mla_attention refuses before it allocates, from the sizes of q and kv (in values; their
// contents unread): the arguments, seq_lens and qlens, the rank limit, and kMaxInProcessBytes
// with `caller_bytes` more: what the caller holds for the call beside the library's own (the
// Python layer's contiguous copy of a strided q or kv), so that a call too big with that copy
// is refused before the copy is made.
void check_mla_attention(uint64_t q_size, uint64_t kv_size, std::span<const int32_t> seq_lens, int batch,
                         int qlen, int heads, int64_t max_len, int dim, const AttentionOptions& options,
                         const RankEngineFactory& engines = {}, double caller_bytes = 0);

}  // namespace dcpmla
