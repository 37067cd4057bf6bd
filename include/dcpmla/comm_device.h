// Collectives over DEVICE memory, enqueued on the communicator's CUDA stream with no host
// synchronisation, so a whole DCP step (communication included) can be captured in a CUDA
// graph. Two implementations: NCCL (comm_nccl.h, one GPU per rank) and DeviceGroup below
// (ranks as threads on one GPU, so the GPU DCP step is tested exactly on a single device).
#pragma once

#include <chrono>
#include <functional>
#include <memory>

#include <cuda_runtime_api.h>

#include "dcpmla/comm.h"

namespace dcpmla {

namespace cuda_detail {
class DeviceBuffer;  // src/cuda/common/resources.h
}

// Communicator whose send/recv pointers are device pointers. Every collective is enqueued
// on stream() and returns at once; ordering with the caller's kernels is stream order.
class DeviceCommunicator : public Communicator {
 public:
  virtual cudaStream_t stream() const = 0;
  virtual int device() const = 0;
  // Waits for everything enqueued on stream(). A peer that failed or never arrives ends the
  // wait within the communicator's timeout: the communicator is aborted and this throws
  // (dcpmla::CudaError naming the call), so no rank waits forever.
  virtual void synchronize() = 0;
  // Makes every pending and later collective of this rank fail instead of waiting.
  virtual void abort() = 0;
  // barrier(): a device collective followed by synchronize().
};

// The same collectives over HOST buffers, staged through device scratch and followed by
// synchronize(): for the few host-side exchanges a step needs (check_ranks_agree).
// Allocate it once and keep it: growing or freeing the scratch (cudaMalloc / cudaFree)
// may synchronise the whole device, which must not happen while peers' collectives wait.
class HostStagedCommunicator final : public Communicator {
 public:
  explicit HostStagedCommunicator(DeviceCommunicator& device, size_t capacity_bytes = 0);
  ~HostStagedCommunicator() override;
  int rank() const override;
  int world_size() const override;
  void all_gather(const void* send, void* recv, size_t count, DataType t) override;
  void reduce_scatter_sum(const void* send, void* recv, size_t count, DataType t) override;
  void all_to_all(const void* send, void* recv, size_t count, DataType t) override;
  void barrier() override;

 private:
  void reserve(size_t bytes);  // device scratch of at least `bytes`
  // Host send (in_bytes) to device scratch, op(device send, device recv), back to the host
  // recv (out_bytes), then wait for the stream.
  void staged(const void* send, size_t in_bytes, void* recv, size_t out_bytes,
              const std::function<void(const void*, void*)>& op);
  DeviceCommunicator& dev_;
  std::unique_ptr<cuda_detail::DeviceBuffer> buf_;  // device scratch, grown by reserve()
};

// Most ranks a DeviceGroup simulates on one GPU (the reduce-scatter kernel takes every
// peer's pointer by value).
inline constexpr int kMaxDeviceGroupRanks = 16;

// Ranks as threads of one process on ONE GPU, each with its own stream. A collective is a
// device-side barrier (a one-thread kernel that raises this rank's flag and waits for every
// peer's), a copy kernel reading the peers' buffers (reduce-scatter sums in float32) and a
// second barrier before anyone reuses a buffer. Flags live in device memory and count up
// across calls, so each rank's graph, captured on its own stream, replays correctly: no host
// barrier is needed at replay (host barriers only exchange the buffer addresses while
// enqueueing). A failed rank aborts the group: host waits throw, and device waits see the
// abort flag (mapped host memory) or their timeout and give up.
// Ranks spin on the device for each other, so their kernels must run concurrently: the group
// loads its kernels up front (CUDA's lazy loading may otherwise wait for an idle device), and
// more ranks than hardware queues (CUDA_DEVICE_MAX_CONNECTIONS, 8 by default) can serialise
// two ranks' streams; the barrier then times out with an error rather than hanging. Tests
// set CUDA_DEVICE_MAX_CONNECTIONS=32.
class DeviceGroup {
 public:
  explicit DeviceGroup(int world_size, int device = 0,
                       std::chrono::milliseconds timeout = std::chrono::seconds(60));
  ~DeviceGroup();
  DeviceGroup(const DeviceGroup&) = delete;
  DeviceGroup& operator=(const DeviceGroup&) = delete;
  int world_size() const;
  // The rank's communicator; it enqueues on `stream` (the caller keeps it alive).
  std::unique_ptr<DeviceCommunicator> communicator(int rank, cudaStream_t stream);
  void abort();

  struct State;

 private:
  std::shared_ptr<State> state_;
};

// Runs fn(rank, comm) on world_size threads over one DeviceGroup on `device`, each with
// its own non-blocking stream (comm.stream()), and rethrows the first rank's exception
// (the others are aborted rather than left waiting).
void run_device_ranks(int world_size, int device, const std::function<void(int, DeviceCommunicator&)>& fn,
                      std::chrono::milliseconds timeout = std::chrono::seconds(60));

}  // namespace dcpmla
