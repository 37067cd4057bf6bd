// The DCP step on GPUs (dcp.h): head all-gather, per-rank attention, the cross-rank merge in
// two forms, two_stage's balanced stage B; everything enqueued on the communicator's stream.
#include "dcpmla/dcp.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>

#include <cuda_runtime.h>

#include "attention/config.h"
#include "attention/variants.h"
#include "dcp/dcp_kernels.h"
#include "dcpmla/error.h"
#include "dcpmla/layout.h"
#include "dcpmla/runner.h"
#include "common/resources.h"
#include "common/params.h"

namespace dcpmla {

using cuda_detail::check;

namespace {

using cuda_detail::kDim;
using cuda_detail::kRank;

int64_t align_up(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

int32_t lo32(int64_t v) { return int32_t(uint32_t(uint64_t(v))); }
int32_t hi32(int64_t v) { return int32_t(uint32_t(uint64_t(v) >> 32)); }

uint32_t fnv1a(std::span<const int32_t> values, uint32_t h = 2166136261u) {
  for (int32_t v : values) h = (h ^ uint32_t(v)) * 16777619u;
  return h;
}

// The staged communicator's scratch: the agreement exchanges gather at most 64 int32 per rank.
size_t host_scratch_bytes(int world) { return size_t(64) * 4 * (size_t(world) + 1); }  // world + 1 overflowed at INT_MAX

}  // namespace

DcpTraffic dcp_traffic(int world_size, int64_t rows, int heads_local, int rank_dim, DataType reduce_dtype) {
  require(world_size >= 1, "world_size", world_size, ">= 1");
  require(rows >= 0, "rows", rows, ">= 0");
  require(heads_local >= 1, "heads_local", heads_local, ">= 1");
  require(rank_dim >= 0, "rank_dim", rank_dim, ">= 0");
  require(reduce_dtype == DataType::bf16 || reduce_dtype == DataType::f32, "reduce_dtype", int(reduce_dtype),
          "bf16 (1) or f32 (0)");
  // The largest product below (N x rows x Hl x the most bytes a cell moves) must fit int64:
  // rows 2^40 at 4096 heads wrapped to negative byte counts.
  const int64_t widest = std::max<int64_t>({int64_t(kDim) * 2, int64_t(world_size) * 4, int64_t(rank_dim) * 4 + 4});
  if (!checked_product({int64_t(world_size), rows, heads_local, widest}))
    fail("rows", rows, fmt::format("a row count whose traffic (world_size {} x rows x heads_local {} x bytes) fits int64",
                                   world_size, heads_local));
  const int64_t others = world_size - 1, cells = rows * heads_local;
  DcpTraffic t;
  t.q_all_gather = others * cells * kDim * 2;
  t.lse_all_gather = others * cells * world_size * 4;  // each rank's lse covers all H heads
  t.reduce_scatter = others * cells * rank_dim * int64_t(size_of(reduce_dtype));
  t.all_to_all = others * (cells * rank_dim * 2 + cells * 4);
  return t;
}

int dcp_ranks_per_group(int world_size, int heads_local) {
  require(world_size >= 1, "world_size", world_size, ">= 1");
  require_heads("heads_local", heads_local, Backend::cuda);
  int best = 1;
  for (int d = 1; d <= world_size; ++d)
    if (world_size % d == 0 && int64_t(d) * heads_local <= max_heads(Backend::cuda)) best = d;
  return best;
}

// The step's device memory and pinned staging (slots and lengths, two copies so that
// planning step k + 1 never waits for step k's upload).
struct DcpStep::Buffers {
  cuda_detail::DeviceBuffer device;
  cuda_detail::PinnedBuffer slots_host[2], lens_host[2];
  cuda_detail::Event staged[2];
};

DcpStep::DcpStep(const DcpConfig& config, DeviceCommunicator& comm)
    : config_(config), comm_(comm), world_(comm.world_size()), rank_(comm.rank()) {
  // A rank that refuses its configuration (or fails to set up) still takes part in one status
  // exchange, so that its peers raise at once instead of waiting in the agreement's collective
  // (over NCCL, for its timeout). The exchange needs this rank's staged communicator and the
  // communicator's kernels loaded (warm_up's reason), whatever point set-up reached.
  std::exception_ptr refused;
  try {
    build(config);
  } catch (...) {
    refused = std::current_exception();
    try {
      check(cudaSetDevice(comm_.device()), "cudaSetDevice(DcpStep)");
      check(cudaDeviceSynchronize(), "cudaDeviceSynchronize(DcpStep refusal)");
      cuda_detail::preload_dcp_kernels();
      if (!host_) host_ = std::make_unique<HostStagedCommunicator>(comm_, host_scratch_bytes(world_));
    } catch (...) {
      // No exchange without a usable device: this rank's own refusal is the error to raise, not
      // the CUDA error of the exchange's set-up (which hid a bad field on a machine without one).
      std::rethrow_exception(refused);
    }
  }
  refuse_together(*host_, refused, "DcpStep configuration");
  agree_on_config();
}

void DcpStep::build(const DcpConfig& config) {
  require(config.world_size == 0 || config.world_size == world_, "world_size", config.world_size,
          fmt::format("the communicator's size ({}) (or 0 to take it)", world_));
  require_heads("heads_local", config.heads_local, Backend::cuda);
  require(config.reduce_dtype == DataType::bf16 || config.reduce_dtype == DataType::f32, "reduce_dtype",
          int(config.reduce_dtype), "bf16 or f32");
  require_known("merge", config.merge);
  // Checked before anything is allocated (set_tuning below checks it again, once it can apply it).
  cuda_detail::validate_tuning(config.tuning);
  config_.world_size = world_;
  hl_ = config.heads_local;
  rg_ = dcp_ranks_per_group(world_, hl_);
  hg_ = rg_ * hl_;
  groups_ = world_ / rg_;

  AttentionConfig ac;
  ac.heads = hg_;
  ac.kv_dtype = config.kv_dtype;
  ac.block_size = config.block_size;
  ac.layout = Layout{world_, rank_, config.interleave};
  ac.limits = config.limits;
  ac.softmax_scale = config.softmax_scale;
  ac.route = config.route;
  ac.min_segment_tokens = config.min_segment_tokens;
  check(cudaSetDevice(comm_.device()), "cudaSetDevice(DcpStep)");
  rows_ = int64_t(config.limits.max_batch) * config.limits.max_qlen;
  // The buffers below take less than all_cells x (2 D + world) x 8 bytes together: past 2^62
  // their int64 sizes could wrap, and no device holds that anyway.
  if (double(rows_) * world_ * hl_ * (2.0 * kDim + world_) * 8.0 > 0x1p62)
    fail("limits", fmt::format("max_batch {} x max_qlen {} x heads_local {} on {} ranks", config.limits.max_batch,
                               config.limits.max_qlen, hl_, world_),
         "step buffers that fit the device (lower limits.max_batch or limits.max_qlen)");

  // One device allocation carved into the step's buffers (256-byte aligned pieces).
  const int64_t cells = rows_ * hl_, all_cells = rows_ * int64_t(world_) * hl_;
  const int64_t wire = int64_t(size_of(config.reduce_dtype));
  chunk_lse_offset_ = align_up(cells * kRank * 2, 16);
  chunk_bytes_ = align_up(chunk_lse_offset_ + cells * 4, 256);
  const bool rs = config.merge == DcpMerge::reduce_scatter;
  const int64_t sizes[] = {
      all_cells * kDim * 2,                                    // q_gathered
      rg_ > 1 ? all_cells * kDim * 2 : 0,                      // q_grp
      all_cells * kRank * 2,                                   // o_grp
      all_cells * 4,                                           // lse_grp
      rs ? all_cells * world_ * 4 : 0,                         // lse_all
      rs ? all_cells * kRank * wire : 0,                       // rs_send
      rs && config.reduce_dtype == DataType::f32 ? cells * kRank * 4 : 0,  // rs_recv
      rs ? 0 : chunk_bytes_ * world_,                          // a2a_send
      rs ? 0 : chunk_bytes_ * world_,                          // a2a_recv
      cells * kRank * 2,                                       // ob
      cells * 4,                                               // lb
      rows_ * 8,                                               // slots
      int64_t(config.limits.max_batch) * 4,                    // lens
  };
  int64_t total = 0;
  for (int64_t s : sizes) total += align_up(s, 256);
  // Refused by name before anything is allocated, beside the attention's workspace (which the
  // attention's own check counts alone): at 128 local heads on 2 ranks, max_batch 4096 and
  // max_qlen 64 ask about 290 GB of step buffers.
  size_t free_bytes = 0, device_bytes = 0;
  check(cudaMemGetInfo(&free_bytes, &device_bytes), "cudaMemGetInfo(DcpStep)");
  const double need = double(total) + double(cuda::Attention::workspace_bytes(ac, comm_.device()));
  if (need > double(device_bytes))
    fail("limits", fmt::format("max_batch {} x max_qlen {} x heads_local {} on {} ranks: {} of step buffers and "
                               "attention workspace", config.limits.max_batch, config.limits.max_qlen, hl_, world_,
                               bytes_text(need)),
         fmt::format("<= the device's {} (lower limits.max_batch or limits.max_qlen)", bytes_text(double(device_bytes))));
  attention_ = std::make_unique<cuda::Attention>(ac, comm_.device());
  attention_->set_tuning(config.tuning);
  softmax_scale_ = attention_->softmax_scale();
  carve(total, sizes);
  host_ = std::make_unique<HostStagedCommunicator>(comm_, host_scratch_bytes(world_));
  warm_up();
}

void DcpStep::carve(int64_t total, const int64_t* sizes) {
  buffers_ = std::make_unique<Buffers>();
  Buffers& b = *buffers_;
  b.device = cuda_detail::DeviceBuffer(size_t(total), "cudaMalloc(DcpStep buffers)");
  for (int k = 0; k < 2; ++k) {
    b.slots_host[k] = cuda_detail::PinnedBuffer(size_t(rows_) * 8, "cudaMallocHost(slot staging)");
    b.lens_host[k] = cuda_detail::PinnedBuffer(size_t(config_.limits.max_batch) * 4, "cudaMallocHost(length staging)");
    b.staged[k] = cuda_detail::Event("cudaEventCreate(DcpStep staging)");
  }
  // Zeroed once: rows past a batch hold zeros (or an earlier batch's values), never junk.
  check(cudaMemsetAsync(b.device.get(), 0, size_t(total), comm_.stream()), "cudaMemsetAsync(DcpStep buffers)");
  uint8_t* at = b.device.as<uint8_t>();
  void* parts[13];
  for (int k = 0; k < 13; ++k) {
    parts[k] = sizes[k] ? at : nullptr;
    at += align_up(sizes[k], 256);
  }
  q_gathered_ = static_cast<bf16*>(parts[0]);
  q_grp_ = rg_ > 1 ? static_cast<bf16*>(parts[1]) : q_gathered_;
  o_grp_ = static_cast<bf16*>(parts[2]);
  lse_grp_ = static_cast<float*>(parts[3]);
  lse_all_ = static_cast<float*>(parts[4]);
  rs_send_ = parts[5];
  rs_recv_ = static_cast<float*>(parts[6]);
  a2a_send_ = static_cast<uint8_t*>(parts[7]);
  a2a_recv_ = static_cast<uint8_t*>(parts[8]);
  ob_ = static_cast<bf16*>(parts[9]);
  lb_ = static_cast<float*>(parts[10]);
  slots_dev_ = static_cast<int64_t*>(parts[11]);
  lens_dev_ = static_cast<int32_t*>(parts[12]);
}

void DcpStep::warm_up() {
  // Before any collective: (1) setup work ran on the legacy stream, which a non-blocking
  // stream does not wait for; (2) with CUDA's lazy module loading the first launch of a
  // kernel may wait for the device to go idle, which never happens while a peer's barrier
  // kernel spins for this rank. So finish all setup work and launch every kernel run() uses
  // once, on empty work, now (no peer waits on this rank yet).
  cudaStream_t stream = comm_.stream();
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize(DcpStep setup)");
  cuda_detail::preload_dcp_kernels();
  check(cudaMemsetAsync(slots_dev_, 0xff, size_t(rows_) * 8, stream), "cudaMemsetAsync(slots)");  // all PAD
  // A scratch "cache" of one block over the stage-B buffer: the write kernel skips every PAD
  // slot and the zeroed plan has no work, so nothing is read or written (the latents are
  // another buffer: a write refuses a cache that overlaps them).
  const KvCache scratch{ob_, 1, 1, kDim, config_.kv_dtype};
  cuda::write_kv(scratch, q_grp_, slots_dev_, 1, KvScale{}, stream);
  cuda::attention(attention_->params(q_grp_, scratch, KvScale{}, o_grp_, lse_grp_), stream, attention_->num_sms(),
                  true, attention_->tuning());
  cuda::merge_state(ob_, lb_, ob_, lb_, ob_, lb_, 1, kRank, stream);  // scratch row
  check(cudaStreamSynchronize(stream), "cudaStreamSynchronize(DcpStep warm-up)");
}

void DcpStep::agree_on_config() {
  // Ranks built differently would merge garbage or wait on each other: refuse on every rank.
  // Once, at construction (a synchronised exchange).
  const DcpConfig& config = config_;
  const PlanLimits& l = config.limits;
  const int32_t signature[] = {world_, hl_, config.interleave, config.block_size, int32_t(config.kv_dtype),
                               int32_t(config.route), l.max_batch, l.max_qlen, lo32(l.max_local_kv_len),
                               hi32(l.max_local_kv_len), int32_t(config.merge), int32_t(config.reduce_dtype),
                               config.min_segment_tokens, int32_t(std::bit_cast<uint32_t>(softmax_scale_)),
                               // plan() exchanges the batch only with check_agreement: ranks built
                               // with different values would pair different collectives.
                               int32_t(config.check_agreement)};
  check_ranks_agree(*host_, signature,
                    "DcpConfig (world_size, heads_local, interleave, block_size, kv_dtype, route, limits, merge, "
                    "reduce_dtype, min_segment_tokens, softmax_scale, check_agreement)");
}

DcpStep::~DcpStep() {
  // Work in flight may still use the buffers.
  cudaStreamSynchronize(comm_.stream());
}

void DcpStep::plan(const BatchDesc& batch) {
  // Before the agreement's exchange, so that a refusal leaves the peers no collective to wait in.
  cuda_detail::require_not_capturing(comm_.stream());
  cuda_detail::require_current_device(comm_.device(), "DcpStep");
  // The step's gathers and stage B move query blocks of one shape.
  if (!batch.qlens.empty())
    fail("qlens", fmt::format("{} entries", batch.qlens.size()), "none: the DCP step takes uniform query blocks");
  const int B = int(batch.seq_lens.size());
  if (config_.check_agreement) {
    // Same shape, lengths and tables everywhere; then every rank's planner sees the same
    // batch and accepts or refuses it alike (its checks use rank 0's share).
    // The tables' rows only: the gaps of a strided table (another slice's columns) may differ.
    // A malformed shape hashes whole (the planner names it once the ranks agree).
    uint32_t tables_hash = fnv1a({});
    if (!batch.tables_fit())
      tables_hash = fnv1a(batch.block_tables);
    else
      for (int b = 0; b < B; ++b) tables_hash = fnv1a(batch.table_of(size_t(b)), tables_hash);
    const int32_t signature[] = {B, batch.qlen, batch.table_width, int32_t(batch.mode), int32_t(fnv1a(batch.seq_lens)),
                                 int32_t(tables_hash)};
    check_ranks_agree(*host_, signature, "batch (B, qlen, table_width, mode, seq_lens hash, block_tables hash)");
  }

  // The write path stores each request's last qlen positions, L - qlen .. L - 1: a live request
  // needs L >= qlen. The planner accepts 0 < L < qlen in draft mode, so this is checked here,
  // before the plan is replaced: a refused batch leaves the previous plan, slots and lengths.
  // (Negative lengths are the planner's to refuse. Plain comparisons; formatted on failure.)
  const int qlen = batch.qlen;
  for (int b = 0; b < B; ++b) {
    const int32_t L = batch.seq_lens[size_t(b)];
    if (L > 0 && L < qlen)
      fail(fmt::format("seq_lens[{}]", b), L,
           fmt::format(">= qlen ({}) or 0 (padding): the DCP step writes each request's last qlen positions", qlen));
  }

  // The staging copy for the new tokens' slots and lengths: its upload (two plans back) has
  // finished once this returns (waited for before the plan is replaced).
  Buffers& bufs = *buffers_;
  const int k = next_staging_;
  check(cudaEventSynchronize(bufs.staged[k].get()), "cudaEventSynchronize(DcpStep staging)");

  cudaStream_t stream = comm_.stream();
  attention_->plan(batch, stream);  // validates the batch first
  route_ = attention_->current_plan().route();

  // The new tokens' slots: the host mapping, O(batch x qlen), into that staging copy.
  const auto& c = attention_->planner().config();
  auto* slots = bufs.slots_host[k].as<int64_t>();
  auto* lens = bufs.lens_host[k].as<int32_t>();
  std::fill(slots, slots + rows_, kPadSlot);
  std::fill(lens, lens + config_.limits.max_batch, 0);
  // Block ids were checked by the planner; the cache's size is checked against them at run().
  const int64_t num_blocks = attention_->current_plan().stats().max_block + 1;
  for (int b = 0; b < B; ++b) {
    const int32_t L = batch.seq_lens[size_t(b)];
    lens[b] = L;
    if (L == 0) continue;
    const auto table = batch.table_of(size_t(b));
    for (int t = 0; t < qlen; ++t)
      // The planner validated the layout and block size: the per-token form checks only p and the table.
      slots[int64_t(b) * qlen + t] =
          detail::slot_of_validated(int64_t(L) - qlen + t, table, c.block_size, num_blocks, c.layout, b);
  }
  check(cudaMemcpyAsync(slots_dev_, slots, size_t(rows_) * 8, cudaMemcpyHostToDevice, stream),
        "cudaMemcpyAsync(slots)");
  check(cudaMemcpyAsync(lens_dev_, lens, size_t(config_.limits.max_batch) * 4, cudaMemcpyHostToDevice, stream),
        "cudaMemcpyAsync(seq_lens)");
  check(cudaEventRecord(bufs.staged[k].get(), stream), "cudaEventRecord(DcpStep staging)");
  next_staging_ = 1 - k;
  planned_ = true;
}

void DcpStep::run(const bf16* q_local, const bf16* new_latents, const KvCache& cache, const KvScale& scale,
                  bf16* out, float* lse) {
  require(planned_, "plan", "none", "a plan: call plan(batch) before run()");
  cuda_detail::require_current_device(comm_.device(), "DcpStep");
  require(q_local != nullptr && out != nullptr && lse != nullptr, "q_local/out/lse", "null", "device pointers");
  require(new_latents != nullptr || route_ != Route::two_stage, "new_latents", "null",
          "the verify block's latents (two_stage's stage B reads them)");
  // write_kv reads the latents 16 bytes at a time (checked here too, to name the caller's
  // argument); the step's own kernels read and write the rest element by element.
  require_aligned(new_latents, 16, "new_latents",
                  "16-byte aligned device memory (the write reads latents 16 bytes at a time)");
  require_aligned(q_local, 2, "q_local", "2-byte aligned device memory (bf16)");
  require_aligned(out, 2, "out", "2-byte aligned device memory (bf16)");
  require_aligned(lse, 4, "lse", "4-byte aligned device memory (float32)");
  // Checked here as well as by the write and the attention run: with no new_latents there is no
  // write, and the run comes after the step's first collectives, where a throw leaves the
  // peers waiting in the next one until their timeout.
  require_aligned(scale.device, 4, "kv_scale", "a 4-byte aligned device float (the device scale)");
  cuda_detail::require_cache_aligned(cache.data);
  validate_run(attention_->planner().config(), attention_->current_plan(), cache, scale);
  const int64_t cells = rows_ * hl_;  // the caller's buffers hold row_capacity() rows
  require_disjoint({{"out", out, cells * kRank * 2}, {"lse", lse, cells * 4}},
                   {{"q_local", q_local, cells * kDim * 2},
                    {"new_latents", new_latents, new_latents != nullptr ? rows_ * kDim * 2 : 0},
                    {"kv_cache", cache.data, cache.num_slots() * cache.row_bytes()},
                    {"kv_scale", scale.device, scale.device != nullptr ? 4 : 0}});
  // The write changes the cache before q_local is gathered.
  if (new_latents != nullptr)
    require_disjoint({{"kv_cache", cache.data, cache.num_slots() * cache.row_bytes()}},
                     {{"q_local", q_local, cells * kDim * 2}});
  cudaStream_t stream = comm_.stream();
  if (new_latents) cuda::write_kv(cache, new_latents, slots_dev_, rows_, scale, stream);

  // q over heads: [N][rows][Hl][D] -> [G][rows][Hg][D] (one 2-D copy per rank; none when
  // every group is one rank, where the layouts coincide).
  comm_.all_gather(q_local, q_gathered_, size_t(rows_ * hl_ * kDim), DataType::bf16);
  for (int first = 0; rg_ > 1 && first < world_; first += cuda_detail::kMaxPeers) {
    cuda_detail::Copy2dParams c{};
    c.n = std::min(world_ - first, cuda_detail::kMaxPeers);
    for (int k = 0; k < c.n; ++k) {
      const int p = first + k;
      c.dst[k] = q_grp_ + (int64_t(p / rg_) * rows_ * hg_ + int64_t(p % rg_) * hl_) * kDim;
      c.src[k] = q_gathered_ + int64_t(p) * rows_ * hl_ * kDim;
    }
    c.rows = rows_;
    c.width = int64_t(hl_) * kDim * 2;
    c.spitch = c.width;
    c.dpitch = int64_t(hg_) * kDim * 2;
    cuda_detail::launch_copy_2d(c, stream);
  }
  for (int g = 0; g < groups_; ++g)
    attention_->run(q_grp_ + int64_t(g) * rows_ * hg_ * kDim, cache, scale, o_grp_ + int64_t(g) * rows_ * hg_ * kRank,
                    lse_grp_ + int64_t(g) * rows_ * hg_, stream);

  enqueue_merge(out, lse);

  if (route_ == Route::two_stage) {
    // Balanced two_stage: the prefix is merged across ranks; each rank now attends the
    // verify block for the heads it keeps and merges it in.
    cuda_detail::BlockParams b{};
    b.plan_header = reinterpret_cast<const int32_t*>(attention_->params(nullptr, cache, scale, nullptr, nullptr).plan.header);
    b.q = q_local;
    b.block = new_latents;
    b.seq_lens = lens_dev_;
    b.dtype = config_.kv_dtype;
    b.kv_scale = scale.value;
    b.kv_scale_dev = scale.device;
    b.softmax_scale = softmax_scale_;
    b.heads = hl_;
    b.dim = kDim;
    b.width = kRank;
    b.row_capacity = rows_;
    b.out = ob_;
    b.lse = lb_;
    cuda_detail::launch_block_attention(b, stream);
    cuda::merge_state(out, lse, ob_, lb_, out, lse, rows_ * hl_, kRank, stream);
  }
}

void DcpStep::enqueue_merge(bf16* out, float* lse) {
  cudaStream_t stream = comm_.stream();
  const cuda_detail::HeadGroups g{world_, rank_, rg_, hl_, hg_, rows_};
  const int64_t cells = rows_ * hl_;
  if (config_.merge == DcpMerge::reduce_scatter) {
    comm_.all_gather(lse_grp_, lse_all_, size_t(int64_t(groups_) * rows_ * hg_), DataType::f32);
    const bool f32 = config_.reduce_dtype == DataType::f32;
    cuda_detail::launch_correct(cuda_detail::CorrectParams{g, lse_all_, o_grp_, rs_send_, f32, lse, kRank}, stream);
    if (f32) {
      comm_.reduce_scatter_sum(rs_send_, rs_recv_, size_t(cells * kRank), DataType::f32);
      cuda_detail::launch_to_bf16(rs_recv_, out, cells * kRank, stream);
    } else {
      comm_.reduce_scatter_sum(rs_send_, out, size_t(cells * kRank), DataType::bf16);
    }
    return;
  }
  cuda_detail::launch_pack(
      cuda_detail::PackParams{g, o_grp_, lse_grp_, a2a_send_, chunk_bytes_, chunk_lse_offset_, kRank}, stream);
  comm_.all_to_all(a2a_send_, a2a_recv_, size_t(chunk_bytes_ / 2), DataType::bf16);
  cuda_detail::launch_merge(
      cuda_detail::MergeParams{reinterpret_cast<const bf16*>(a2a_recv_),
                               reinterpret_cast<const float*>(a2a_recv_ + chunk_lse_offset_), chunk_bytes_ / 2,
                               chunk_bytes_ / 4, world_, cells, kRank, out, lse},
      stream);
}

}  // namespace dcpmla
