// The CUDA check and the device queries the host code shares (common/params.h, resources.h).
#include <string>

#include <cuda_runtime.h>

#include "dcpmla/cuda.h"
#include "dcpmla/error.h"
#include "common/resources.h"

namespace dcpmla {

namespace cuda_detail {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw CudaError(std::string("dcpmla: CUDA call ") + what + " failed: " + cudaGetErrorName(e) + " (" +
                    cudaGetErrorString(e) + ")");
}

int current_device() {
  int device = 0;
  check(cudaGetDevice(&device), "cudaGetDevice");
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

}  // namespace cuda_detail

bool cuda_device_available() { return cuda_detail::device_count() > 0; }

int cuda_device_count() { return cuda_detail::device_count(); }

}  // namespace dcpmla
