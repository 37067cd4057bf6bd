// A kernel an engine might launch behind dcpmla's last kernel, for the launch-order test of
// the combine (test_cuda_graph.cpp; dependent_copy.cu).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

namespace dcpmla::testing {

// Enqueues on `stream`, as a programmatic dependent launch (it may start beside the stream's
// previous kernel), a kernel that waits for that kernel (griddepcontrol.wait) and then copies
// `bytes` (a multiple of 16, 16-byte aligned) from src to dst. Also under stream capture.
void enqueue_dependent_copy(const void* src, void* dst, size_t bytes, cudaStream_t stream);

}  // namespace dcpmla::testing
