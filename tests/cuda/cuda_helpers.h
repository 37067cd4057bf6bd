// Shared pieces of the GPU tests: device buffers, the skip when no GPU is present, and
// the comparison of a CUDA result with the CPU kernel's (same plan, same cache bytes).
#pragma once

#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "dcpmla/cuda.h"
#include "dcpmla/numeric.h"

namespace dcpmla::testing {

#define DCPMLA_REQUIRE_GPU()                                          \
  do {                                                                \
    if (!::dcpmla::cuda_device_available()) GTEST_SKIP() << "no CUDA device"; \
  } while (0)

inline void cuda_ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw CudaError(std::string(what) + ": " + cudaGetErrorString(e));
}

template <class T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t n) : n_(n) { cuda_ok(cudaMalloc(&ptr_, std::max<size_t>(n, 1) * sizeof(T)), "cudaMalloc(test)"); }
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) { upload(host); }
  ~DeviceBuffer() { cudaFree(ptr_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  T* get() const { return ptr_; }
  size_t size() const { return n_; }
  void upload(const std::vector<T>& host) {
    cuda_ok(cudaMemcpy(ptr_, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice), "upload");
  }
  std::vector<T> download() const {
    std::vector<T> host(n_);
    cuda_ok(cudaMemcpy(host.data(), ptr_, n_ * sizeof(T), cudaMemcpyDeviceToHost), "download");
    return host;
  }
  // Fill with a byte pattern (0xff: NaN in bf16 and f32) so that an unwritten output shows.
  // Synchronous: the graph and kernels under test run on non-blocking streams, which do not
  // wait for the legacy default stream this memset runs on.
  void poison() {
    cuda_ok(cudaMemset(ptr_, 0xff, n_ * sizeof(T)), "cudaMemset(poison)");
    cuda_ok(cudaDeviceSynchronize(), "cudaDeviceSynchronize(poison)");
  }

 private:
  T* ptr_ = nullptr;
  size_t n_ = 0;
};

inline std::vector<bf16> random_bf16(size_t n, uint64_t seed, float stddev = 1.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.0f, stddev);
  std::vector<bf16> v(n);
  for (auto& x : v) x = float_to_bf16(dist(rng));
  return v;
}

struct Comparison {
  double max_rel_l2 = 0, max_lse_err = 0;
  int64_t nan_count = 0, bad_rows = 0, nonzero_empty = 0;
  std::string worst;  // where the worst row is, for the failure message
};

// Row-by-row (rows of width R): relative L2 of out, absolute lse error (-inf == -inf is 0),
// NaN outputs, and rows whose lse is -inf but whose out is not exactly zero.
inline Comparison compare_rows(const std::vector<bf16>& out, const std::vector<float>& lse,
                               const std::vector<bf16>& ref_out, const std::vector<float>& ref_lse, int R,
                               int qlen, int heads, double bound = 1e-2) {
  Comparison c;
  const int64_t rows = int64_t(ref_lse.size());
  double worst = -1;
  for (int64_t r = 0; r < rows; ++r) {
    double num = 0, den = 0;
    bool nan = std::isnan(lse[size_t(r)]), zero = true;
    for (int j = 0; j < R; ++j) {
      const double a = bf16_to_float(out[size_t(r * R + j)]), b = bf16_to_float(ref_out[size_t(r * R + j)]);
      if (std::isnan(a)) nan = true;
      if (a != 0.0) zero = false;
      num += (a - b) * (a - b);
      den += b * b;
    }
    const double rel = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
    const float la = lse[size_t(r)], lb = ref_lse[size_t(r)];
    double lerr = 0;
    if (std::isinf(la) || std::isinf(lb))
      lerr = (la == lb) ? 0.0 : std::numeric_limits<double>::infinity();
    else
      lerr = std::fabs(double(la) - double(lb));
    if (nan) ++c.nan_count;
    if (std::isinf(lb) && lb < 0 && !zero) ++c.nonzero_empty;
    if (nan || rel > bound || lerr > bound) ++c.bad_rows;
    c.max_rel_l2 = std::max(c.max_rel_l2, nan ? std::numeric_limits<double>::infinity() : rel);
    c.max_lse_err = std::max(c.max_lse_err, nan ? std::numeric_limits<double>::infinity() : lerr);
    const double score = nan ? 1e300 : std::max(rel, lerr);
    if (score > worst) {
      worst = score;
      const int64_t h = r % heads, t = (r / heads) % qlen, b = r / (int64_t(heads) * qlen);
      c.worst = "row (b " + std::to_string(b) + ", t " + std::to_string(t) + ", h " + std::to_string(h) +
                "): rel_l2 " + std::to_string(rel) + ", lse " + std::to_string(la) + " vs " + std::to_string(lb);
    }
  }
  return c;
}

}  // namespace dcpmla::testing
