// The CUDA check and the device queries the host code shares (common/params.h, resources.h).
#include <string>

#include <cuda_runtime.h>

#include "dcpmla/cuda.h"
#include "dcpmla/error.h"
#include "common/resources.h"

namespace dcpmla {

namespace cuda_detail {

void check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return;
  // A failed call also records its error as the thread's last one: cleared here, so that the
  // next launch check (ours, or the framework's after the caller caught this) does not report
  // it again as its own. A sticky error (a dead context) stays whatever this does.
  (void)cudaGetLastError();
  throw CudaError(std::string("dcpmla: CUDA call ") + what + " failed: " + cudaGetErrorName(e) + " (" +
                    cudaGetErrorString(e) + ")");
}

int current_device() {
  int device = 0;
  const cudaError_t e = cudaGetDevice(&device);
  // No usable GPU: named as an explicit device is (require_device), not as a failed call.
  if (e != cudaSuccess && device_count() == 0) {
    (void)cudaGetLastError();
    fail("device", "the current device",
         fmt::format("a CUDA device (this machine has no usable GPU: {})", cudaGetErrorName(e)));
  }
  check(e, "cudaGetDevice");
  return device;
}

int device_sms(int device) {
  int sms = 0;
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device),
        "cudaDeviceGetAttribute(multiprocessor count)");
  return sms;
}

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky "no device" error
    return 0;
  }
  return n;
}

void require_device(int device, const char* also) {
  const int count = device_count();
  if (device < 0 || device >= count)
    fail("device", device, fmt::format("a CUDA device in [0, {}) (this machine has {} GPU(s)){}", count, count, also));
}

void require_current_device(int device, const char* owner) {
  const int current = current_device();
  if (current != device)
    fail("current device", current,
         fmt::format("{} (the {}'s device: make it current, cudaSetDevice, before calling it)", device, owner));
}

void require_stream_device(cudaStream_t stream, int device, const char* owner) {
  int of = -1;
  check(cudaStreamGetDevice(stream, &of), "cudaStreamGetDevice");
  if (of != device)
    fail("stream", fmt::format("a stream of device {}", of),
         fmt::format("a stream of device {} (the {}'s)", device, owner));
}

void require_not_capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  check(cudaStreamIsCapturing(stream, &capture), "cudaStreamIsCapturing(plan stream)");
  if (capture != cudaStreamCaptureStatusNone)
    fail("plan", "called while its stream captures a CUDA graph",
         "plan() outside the capture: a replay computes the batch of the last plan()");
}

void require_cache_aligned(const void* kv) {
  require_aligned(kv, 16, "kv_cache",
                  "16-byte aligned device memory (the kernels read and write the cache 16 bytes at a time)");
}

}  // namespace cuda_detail

namespace cuda {

// Only a switch checks the ordinal (a bad one is an input error naming `device`, not CUDA's
// "invalid device ordinal"): staying on the current device costs nothing per call.
DeviceScope::DeviceScope(int device) : previous_(cuda_detail::current_device()), device_(device) {
  if (previous_ == device_) return;
  cuda_detail::require_device(device_);
  cuda_detail::check(cudaSetDevice(device_), "cudaSetDevice");
}
DeviceScope::~DeviceScope() {
  if (previous_ != device_) (void)cudaSetDevice(previous_);
}

}  // namespace cuda

bool cuda_device_available() { return cuda_detail::device_count() > 0; }

int cuda_device_count() { return cuda_detail::device_count(); }

}  // namespace dcpmla
