// RAII owners of CUDA resources: one type per kind, each released in one place (its
// destructor). Errors at creation throw dcpmla::CudaError naming the resource.
#pragma once

#include <cstddef>
#include <utility>

#include <cuda_runtime_api.h>

#include "../params.h"

namespace dcpmla::cuda_detail {

template <class T, class Release>
class Owned {
 public:
  Owned() = default;
  explicit Owned(T h) : h_(h) {}
  ~Owned() { reset(); }
  Owned(Owned&& o) noexcept : h_(std::exchange(o.h_, T{})) {}
  Owned& operator=(Owned&& o) noexcept {
    if (this != &o) {
      reset();
      h_ = std::exchange(o.h_, T{});
    }
    return *this;
  }
  Owned(const Owned&) = delete;
  Owned& operator=(const Owned&) = delete;
  T get() const { return h_; }
  void reset() {
    if (h_) Release{}(h_);
    h_ = T{};
  }

 private:
  T h_{};
};

struct FreeDevice { void operator()(void* p) const { cudaFree(p); } };
struct FreePinned { void operator()(void* p) const { cudaFreeHost(p); } };
struct DestroyStream { void operator()(cudaStream_t s) const { cudaStreamDestroy(s); } };
struct DestroyEvent { void operator()(cudaEvent_t e) const { cudaEventDestroy(e); } };

// `bytes` of device memory (cudaMalloc: 256-byte aligned).
class DeviceBuffer : public Owned<void*, FreeDevice> {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(size_t bytes, const char* what) : Owned(allocate(bytes, what)), bytes_(bytes) {}
  template <class T>
  T* as() const { return static_cast<T*>(get()); }
  size_t bytes() const { return bytes_; }

 private:
  static void* allocate(size_t bytes, const char* what) {
    void* p = nullptr;
    check(cudaMalloc(&p, bytes == 0 ? 1 : bytes), what);
    return p;
  }
  size_t bytes_ = 0;
};

// `bytes` of page-locked host memory, so that copies from it run asynchronously.
class PinnedBuffer : public Owned<void*, FreePinned> {
 public:
  PinnedBuffer() = default;
  PinnedBuffer(size_t bytes, const char* what) : Owned(allocate(bytes, what)) {}
  template <class T>
  T* as() const { return static_cast<T*>(get()); }

 private:
  static void* allocate(size_t bytes, const char* what) {
    void* p = nullptr;
    check(cudaMallocHost(&p, bytes == 0 ? 1 : bytes), what);
    return p;
  }
};

// A non-blocking stream (it does not wait for the legacy default stream).
class Stream : public Owned<cudaStream_t, DestroyStream> {
 public:
  explicit Stream(const char* what) : Owned(create(what)) {}

 private:
  static cudaStream_t create(const char* what) {
    cudaStream_t s = nullptr;
    check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), what);
    return s;
  }
};

// An event for ordering only (no timing).
class Event : public Owned<cudaEvent_t, DestroyEvent> {
 public:
  Event() = default;
  explicit Event(const char* what) : Owned(create(what)) {}

 private:
  static cudaEvent_t create(const char* what) {
    cudaEvent_t e = nullptr;
    check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), what);
    return e;
  }
};

// The device the calling thread works on, and the one-call helpers the host code shares.
int current_device();
int device_sms(int device);

}  // namespace dcpmla::cuda_detail
