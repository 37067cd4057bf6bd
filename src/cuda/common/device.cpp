// The CUDA check and the device queries the host code shares (common/params.h, resources.h).
#include <string>

#include <cuda_runtime.h>

#include "dcpmla/cuda.h"
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

}  // namespace cuda_detail

bool cuda_device_available() { return cuda_detail::device_count() > 0; }

}  // namespace dcpmla
