// The CUDA RankEngine: the conformance driver's per-rank steps (poison, write, plan,
// attend) on the GPU, with host buffers in and out.
#include <cuda_runtime.h>

#include <memory>

#include "dcpmla/cuda.h"
#include "dcpmla/error.h"
#include "params.h"

namespace dcpmla::cuda {
namespace {

using cuda_detail::check;

// A device buffer that grows on demand (contents are not kept across growth).
template <class T>
class Scratch {
 public:
  ~Scratch() { cudaFree(ptr_); }
  T* get(size_t n) {
    if (n > n_) {
      cudaFree(ptr_);
      ptr_ = nullptr;
      n_ = 0;
      check(cudaMalloc(&ptr_, std::max<size_t>(n, 1) * sizeof(T)), "cudaMalloc(engine scratch)");
      n_ = n;
    }
    return ptr_;
  }

 private:
  T* ptr_ = nullptr;
  size_t n_ = 0;
};

PlannerConfig on_cuda(PlannerConfig c) {
  c.backend = Backend::cuda;
  return c;
}

class CudaRankEngine final : public RankEngine {
 public:
  CudaRankEngine(const PlannerConfig& config, float kv_scale, float softmax_scale, int device)
      : runner_(on_cuda(config), kv_scale, softmax_scale, device) {
    check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate(engine)");
  }
  ~CudaRankEngine() override {
    if (stream_) {
      cudaStreamSynchronize(stream_);
      cudaStreamDestroy(stream_);
    }
  }

  // 0xff bytes are NaN in bf16, e4m3 and e5m2 alike.
  void poison() override {
    check(cudaMemsetAsync(runner_.cache(), 0xff, size_t(runner_.cache_config().bytes()), stream_),
          "cudaMemsetAsync(cache poison)");
    check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize(poison)");
  }

  void write(std::span<const bf16> latents, std::span<const int64_t> positions, std::span<const int32_t> requests,
             const BatchDesc& batch) override {
    const int dim = runner_.cache_config().dim;
    require(latents.size() == positions.size() * size_t(dim), "latents", latents.size(),
            fmt::format("positions ({}) x dim ({}) values", positions.size(), dim));
    if (positions.empty()) return;
    bf16* dev = latents_.get(latents.size());
    check(cudaMemcpyAsync(dev, latents.data(), latents.size_bytes(), cudaMemcpyHostToDevice, stream_),
          "cudaMemcpyAsync(latents)");
    runner_.write(dev, positions, requests, batch, stream_);
    check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize(write)");
  }

  void plan(const BatchDesc& batch) override { runner_.plan(batch, stream_); }
  const Plan& current_plan() const override { return runner_.current_plan(); }

  void attend(const bf16* q, bf16* out, float* lse) override {
    const auto& c = runner_.planner().config();
    const PlanHeader& h = runner_.current_plan().header();
    const size_t rows = size_t(h.batch) * size_t(h.qlen) * size_t(c.heads);
    const size_t D = size_t(c.dims.dim()), R = size_t(c.dims.kv_lora_rank);
    bf16* dq = q_.get(rows * D);
    bf16* dout = out_.get(rows * R);
    float* dlse = lse_.get(rows);
    check(cudaMemcpyAsync(dq, q, rows * D * sizeof(bf16), cudaMemcpyHostToDevice, stream_), "cudaMemcpyAsync(q)");
    runner_.attend(dq, dout, dlse, stream_);
    check(cudaMemcpyAsync(out, dout, rows * R * sizeof(bf16), cudaMemcpyDeviceToHost, stream_),
          "cudaMemcpyAsync(out)");
    check(cudaMemcpyAsync(lse, dlse, rows * sizeof(float), cudaMemcpyDeviceToHost, stream_), "cudaMemcpyAsync(lse)");
    check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize(attend)");
  }

 private:
  CudaRankRunner runner_;
  cudaStream_t stream_ = nullptr;
  Scratch<bf16> latents_, q_, out_;
  Scratch<float> lse_;
};

}  // namespace

RankEngineFactory rank_engine_factory(int device) {
  return [device](const PlannerConfig& config, float kv_scale, float softmax_scale) -> std::unique_ptr<RankEngine> {
    return std::make_unique<CudaRankEngine>(config, kv_scale, softmax_scale, device);
  };
}

}  // namespace dcpmla::cuda
