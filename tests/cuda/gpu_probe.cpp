// Exit 0 when a CUDA device is usable, 77 when not: the skip code of the ctest runs that wrap a
// tool around a test binary (compute-sanitizer), which cannot skip themselves the way the GPU
// test cases do (GTEST_SKIP) on a machine without a GPU.
#include "dcpmla/cuda.h"

int main() { return dcpmla::cuda_device_available() ? 0 : 77; }
