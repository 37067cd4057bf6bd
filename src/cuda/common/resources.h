// RAII owners of CUDA resources: one type per kind, each released in one place (its
// destructor). Errors at creation throw dcpmla::CudaError naming the resource.
#pragma once

#include <cstddef>
#include <utility>

#include <cuda_runtime_api.h>

#include "common/params.h"

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

// A handle made by a CUDA call that writes it (cudaMalloc, cudaStreamCreate, ...), checked.
template <class T, class Make>
T made(Make make, const char* what) {
  T h{};
  check(make(&h), what);
  return h;
}

// `bytes` of device memory (cudaMalloc: 256-byte aligned).
class DeviceBuffer : public Owned<void*, FreeDevice> {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(size_t bytes, const char* what)
      : Owned(made<void*>([&](void** p) { return cudaMalloc(p, bytes == 0 ? 1 : bytes); }, what)), bytes_(bytes) {}
  template <class T>
  T* as() const { return static_cast<T*>(get()); }
  size_t bytes() const { return bytes_; }

 private:
  size_t bytes_ = 0;
};

// `bytes` of page-locked host memory, so that copies from it run asynchronously
// (cudaHostAllocMapped: also addressable from the device).
class PinnedBuffer : public Owned<void*, FreePinned> {
 public:
  PinnedBuffer() = default;
  PinnedBuffer(size_t bytes, const char* what, unsigned flags = cudaHostAllocDefault)
      : Owned(made<void*>([&](void** p) { return cudaHostAlloc(p, bytes == 0 ? 1 : bytes, flags); }, what)) {}
  template <class T>
  T* as() const { return static_cast<T*>(get()); }
};

// A non-blocking stream (it does not wait for the legacy default stream).
class Stream : public Owned<cudaStream_t, DestroyStream> {
 public:
  Stream() = default;
  explicit Stream(const char* what)
      : Owned(made<cudaStream_t>([](cudaStream_t* s) { return cudaStreamCreateWithFlags(s, cudaStreamNonBlocking); },
                                 what)) {}
};

// An event, for ordering only unless flags ask for timing (cudaEventDefault).
class Event : public Owned<cudaEvent_t, DestroyEvent> {
 public:
  Event() = default;
  explicit Event(const char* what, unsigned flags = cudaEventDisableTiming)
      : Owned(made<cudaEvent_t>([&](cudaEvent_t* e) { return cudaEventCreateWithFlags(e, flags); }, what)) {}
};

// The device the calling thread works on, and the device queries the host code shares
// (common/device.cpp). device_count() is 0 where no usable device (or driver) is found.
int current_device();
int device_sms(int device);
int device_count();
// Refuses a device ordinal outside [0, device_count()) with a dcpmla::Error naming `device`
// (instead of CUDA's "invalid device ordinal" at the first call on it). `also` completes the
// expectation ("or < 0 for the current device"), empty where no other value is meant.
void require_device(int device, const char* also = "");
// Refuses a call made while another device is current: its kernels and copies would go to that
// device, against this object's plan and workspace (`owner` names the object). A host query,
// no synchronisation: per step and per layer.
void require_current_device(int device, const char* owner);
// Refuses a stream of another device (cudaStreamGetDevice, a host query): work queued on it would
// run against another device's memory, or its copies be taken while the event beside them fails.
void require_stream_device(cudaStream_t stream, int device, const char* owner);
// Refuses plan() while `stream` captures a CUDA graph: the graph would record the upload of
// that plan's staging copy, and a replay would compute it instead of the latest plan.
void require_not_capturing(cudaStream_t stream);
// Refuses a cache whose base is not 16-byte aligned: the kernels read and write it 16 bytes at a
// time (a misaligned access faults), while KvCache::validate asks only whole values (the CPU's).
void require_cache_aligned(const void* kv);

}  // namespace dcpmla::cuda_detail
