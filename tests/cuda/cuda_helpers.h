// Shared pieces of the GPU tests: device buffers, the skip when no GPU is present, and
// the comparison of a CUDA result with the CPU kernel's (same plan, same cache bytes).
#pragma once

#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <algorithm>
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

  // One row of width R against what it should be (want(j): value j; want_lse, -inf for an
  // empty window): relative L2 of out (absolute where want is all zero), absolute lse error
  // (-inf == -inf is 0), NaN, and an empty row that is not exactly zero. where() names the row
  // for the message, called only for a new worst.
  template <class Want, class Where>
  void add(const bf16* got, float got_lse, Want want, double want_lse, int R, double bound, Where where) {
    double num = 0, den = 0;
    bool nan = std::isnan(got_lse), zero = true;
    for (int j = 0; j < R; ++j) {
      const double a = bf16_to_float(got[j]), b = want(j);
      nan = nan || std::isnan(a);
      zero = zero && a == 0.0;
      num += (a - b) * (a - b);
      den += b * b;
    }
    const double rel = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
    const double lerr = std::isinf(got_lse) || std::isinf(want_lse)
                            ? (double(got_lse) == want_lse ? 0.0 : std::numeric_limits<double>::infinity())
                            : std::fabs(double(got_lse) - want_lse);
    nan_count += nan;
    nonzero_empty += std::isinf(want_lse) && want_lse < 0 && !zero;
    bad_rows += nan || rel > bound || lerr > bound;
    max_rel_l2 = std::max(max_rel_l2, nan ? std::numeric_limits<double>::infinity() : rel);
    max_lse_err = std::max(max_lse_err, nan ? std::numeric_limits<double>::infinity() : lerr);
    const double score = nan ? 1e300 : std::max(rel, lerr);
    if (score > worst_score_) {
      worst_score_ = score;
      worst = where() + ": rel_l2 " + std::to_string(rel) + ", lse " + std::to_string(got_lse) + " vs " +
              std::to_string(want_lse);
    }
  }

 private:
  double worst_score_ = -1;
};

// Packed output row `cell` (query row cell / heads, head cell % heads) named for a failure
// message: its request b and that request's query row t, from the requests' query rows (qlens;
// empty: qlen each, packed request by request either way).
inline std::string row_name(int64_t cell, int heads, int qlen, const std::vector<int32_t>& qlens = {}) {
  int64_t t = cell / heads, b = 0;
  if (qlens.empty()) {
    b = t / qlen;
    t -= b * qlen;
  } else {
    for (; b < int64_t(qlens.size()) && t >= qlens[size_t(b)]; ++b) t -= qlens[size_t(b)];
  }
  return "row (b " + std::to_string(b) + ", t " + std::to_string(t) + ", h " + std::to_string(cell % heads) + ")";
}

// Row-by-row (rows of width R) against the CPU kernel's answer.
inline Comparison compare_rows(const std::vector<bf16>& out, const std::vector<float>& lse,
                               const std::vector<bf16>& ref_out, const std::vector<float>& ref_lse, int R,
                               int qlen, int heads, double bound = 1e-2, const std::vector<int32_t>& qlens = {}) {
  Comparison c;
  for (int64_t r = 0; r < int64_t(ref_lse.size()); ++r)
    c.add(out.data() + r * R, lse[size_t(r)], [&](int j) { return bf16_to_float(ref_out[size_t(r * R + j)]); },
          ref_lse[size_t(r)], R, bound, [&] { return row_name(r, heads, qlen, qlens); });
  return c;
}

}  // namespace dcpmla::testing
