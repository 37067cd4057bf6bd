// The CUDA rank of the conformance path: a device cache it owns (as an engine would), the
// device slot mapping and write path, and cuda::Attention, with host buffers in and out.
#include <cuda_runtime.h>

#include <memory>

#include "dcpmla/cuda.h"
#include "dcpmla/error.h"
#include "common/resources.h"
#include "common/params.h"

namespace dcpmla::cuda {
namespace {

using namespace cuda_detail;

// A device buffer that grows on demand (contents are not kept across growth).
class Scratch {
 public:
  template <class T>
  T* get(size_t n, const char* what) {
    if (n * sizeof(T) > buffer_.bytes()) buffer_ = DeviceBuffer(n * sizeof(T), what);
    return buffer_.as<T>();
  }

 private:
  DeviceBuffer buffer_;
};

class CudaRank final : public RankEngine {
 public:
  CudaRank(const AttentionConfig& config, const CacheConfig& cache, int device)
      // The device is checked (dcpmla::Error naming it) and set first: every allocation below
      // lands on it.
      : cache_config_((cache.validate(), require_rank_cache(config, cache), require_device(device),
                       check(cudaSetDevice(device), "cudaSetDevice(rank)"), cache)),
        cache_(size_t(cache.bytes()), "cudaMalloc(rank cache)"),
        stream_("cudaStreamCreate(rank)"),
        attention_(config, device) {}

  KvCache view() const {
    return KvCache{cache_.get(), cache_config_.num_blocks, cache_config_.block_size, cache_config_.dim,
                   cache_config_.dtype};
  }

  // 0xff bytes are NaN in bf16, e4m3 and e5m2 alike.
  void poison() override {
    check(cudaMemsetAsync(cache_.get(), 0xff, cache_.bytes(), stream_.get()), "cudaMemsetAsync(cache poison)");
    check(cudaStreamSynchronize(stream_.get()), "cudaStreamSynchronize(poison)");
  }

  // The device slot mapping from positions and the shared tables, then the device write.
  void write(std::span<const bf16> latents, std::span<const int64_t> positions, std::span<const int32_t> requests,
             const BatchDesc& batch) override {
    const int dim = cache_config_.dim;
    require(latents.size() == positions.size() * size_t(dim), "latents", latents.size(),
            fmt::format("positions ({}) x dim ({}) values", positions.size(), dim));
    require(requests.size() == positions.size(), "requests", requests.size(),
            fmt::format("one request index per position ({})", positions.size()));
    // The device slot mapping reads packed rows (the runner's tables are).
    validate_table_shape(batch);
    require(batch.table_pitch() == batch.table_width, "table_stride", batch.table_stride,
            fmt::format("0 or table_width ({}): packed rows", batch.table_width));
    const int64_t n = int64_t(positions.size());
    if (n == 0) return;
    cudaStream_t s = stream_.get();
    auto* d_latents = latents_.get<bf16>(latents.size(), "cudaMalloc(latents)");
    auto* d_pos = positions_.get<int64_t>(size_t(n), "cudaMalloc(positions)");
    auto* d_req = requests_.get<int32_t>(size_t(n), "cudaMalloc(requests)");
    auto* d_tables = tables_.get<int32_t>(batch.block_tables.size() + 1, "cudaMalloc(tables)");
    auto* d_slots = slots_.get<int64_t>(size_t(n), "cudaMalloc(slots)");
    auto* d_errors = errors_.get<int>(1, "cudaMalloc(errors)");
    check(cudaMemcpyAsync(d_latents, latents.data(), latents.size_bytes(), cudaMemcpyHostToDevice, s), "latents");
    check(cudaMemcpyAsync(d_pos, positions.data(), positions.size_bytes(), cudaMemcpyHostToDevice, s), "positions");
    check(cudaMemcpyAsync(d_req, requests.data(), requests.size_bytes(), cudaMemcpyHostToDevice, s), "requests");
    check(cudaMemcpyAsync(d_tables, batch.block_tables.data(), batch.block_tables.size_bytes(),
                          cudaMemcpyHostToDevice, s),
          "block tables");
    check(cudaMemsetAsync(d_errors, 0, sizeof(int), s), "cudaMemsetAsync(errors)");
    const PlannerConfig& c = attention_.planner().config();
    slot_mapping(d_pos, d_req, n, d_tables, int(batch.seq_lens.size()), batch.table_width, c.block_size,
                 cache_config_.num_blocks, c.layout, d_slots, s, d_errors);
    write_kv(view(), d_latents, d_slots, n, KvScale{cache_config_.scale}, s, d_errors);
    int errors = 0;
    check(cudaMemcpyAsync(&errors, d_errors, sizeof(int), cudaMemcpyDeviceToHost, s), "errors");
    check(cudaStreamSynchronize(s), "cudaStreamSynchronize(write)");
    require(errors == 0, "positions/block_tables", fmt::format("{} bad entries", errors),
            "positions inside the tables and block ids inside the cache");
  }

  void plan(const BatchDesc& batch) override { attention_.plan(batch, stream_.get()); }
  const Plan& current_plan() const override { return attention_.current_plan(); }

  void attend(const bf16* q, bf16* out, float* lse) override {
    const auto& c = attention_.planner().config();
    const PlanHeader& h = attention_.current_plan().header();
    const size_t rows = size_t(h.rows) * size_t(c.heads);
    const size_t D = size_t(c.dims.dim()), R = size_t(c.dims.kv_lora_rank);
    cudaStream_t s = stream_.get();
    auto* dq = q_.get<bf16>(rows * D, "cudaMalloc(q)");
    auto* dout = out_.get<bf16>(rows * R, "cudaMalloc(out)");
    auto* dlse = lse_.get<float>(rows, "cudaMalloc(lse)");
    check(cudaMemcpyAsync(dq, q, rows * D * sizeof(bf16), cudaMemcpyHostToDevice, s), "cudaMemcpyAsync(q)");
    attention_.run(dq, view(), KvScale{cache_config_.scale}, dout, dlse, s);
    check(cudaMemcpyAsync(out, dout, rows * R * sizeof(bf16), cudaMemcpyDeviceToHost, s), "cudaMemcpyAsync(out)");
    check(cudaMemcpyAsync(lse, dlse, rows * sizeof(float), cudaMemcpyDeviceToHost, s), "cudaMemcpyAsync(lse)");
    check(cudaStreamSynchronize(s), "cudaStreamSynchronize(attend)");
  }

 private:
  CacheConfig cache_config_;
  DeviceBuffer cache_;
  Stream stream_;
  Attention attention_;
  Scratch latents_, positions_, requests_, tables_, slots_, errors_, q_, out_, lse_;
};

}  // namespace

RankEngineFactory rank_engine_factory(int device) {
  return [device](const AttentionConfig& config, const CacheConfig& cache) -> std::unique_ptr<RankEngine> {
    return std::make_unique<CudaRank>(config, cache, device);
  };
}

}  // namespace dcpmla::cuda
