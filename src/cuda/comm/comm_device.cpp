// DeviceGroup: DCP ranks as threads on one GPU, collectives as device copies ordered by a
// device-side barrier, so that each rank's CUDA graph replays on its own (see comm_device.h).
#include "dcpmla/comm_device.h"

#include <algorithm>
#include <array>

#include <cstring>
#include <functional>
#include <vector>

#include <cuda_runtime.h>

#include "dcp/dcp_kernels.h"
#include "dcpmla/cuda.h"
#include "dcpmla/error.h"
#include "common/params.h"
#include "common/resources.h"
#include "../../rank_threads.h"

namespace dcpmla {

using cuda_detail::check;

// ---- HostStagedCommunicator --------------------------------------------------------------

HostStagedCommunicator::HostStagedCommunicator(DeviceCommunicator& device, size_t capacity_bytes) : dev_(device) {
  reserve(capacity_bytes);
}
HostStagedCommunicator::~HostStagedCommunicator() = default;
int HostStagedCommunicator::rank() const { return dev_.rank(); }
int HostStagedCommunicator::world_size() const { return dev_.world_size(); }

void HostStagedCommunicator::reserve(size_t bytes) {
  if (buf_ && bytes <= buf_->bytes()) return;
  buf_.reset();
  buf_ = std::make_unique<cuda_detail::DeviceBuffer>(bytes, "cudaMalloc(host-staged scratch)");
}

void HostStagedCommunicator::staged(const void* send, size_t in_bytes, void* recv, size_t out_bytes,
                                    const std::function<void(const void*, void*)>& op) {
  reserve(in_bytes + out_bytes);
  char* s = buf_->as<char>();
  check(cudaMemcpyAsync(s, send, in_bytes, cudaMemcpyHostToDevice, dev_.stream()), "cudaMemcpyAsync(staged send)");
  op(s, s + in_bytes);
  check(cudaMemcpyAsync(recv, s + in_bytes, out_bytes, cudaMemcpyDeviceToHost, dev_.stream()),
        "cudaMemcpyAsync(staged recv)");
  dev_.synchronize();
}

void HostStagedCommunicator::all_gather(const void* send, void* recv, size_t count, DataType t) {
  check_collective_args("all_gather", send, recv, count, t, world_size());
  const size_t in = count * size_of(t);
  staged(send, in, recv, in * size_t(world_size()), [&](const void* s, void* r) { dev_.all_gather(s, r, count, t); });
}

void HostStagedCommunicator::reduce_scatter_sum(const void* send, void* recv, size_t count, DataType t) {
  check_collective_args("reduce_scatter_sum", send, recv, count, t, world_size());
  const size_t out = count * size_of(t);
  staged(send, out * size_t(world_size()), recv, out,
         [&](const void* s, void* r) { dev_.reduce_scatter_sum(s, r, count, t); });
}

void HostStagedCommunicator::all_to_all(const void* send, void* recv, size_t count, DataType t) {
  check_collective_args("all_to_all", send, recv, count, t, world_size());
  const size_t bytes = count * size_of(t) * size_t(world_size());
  staged(send, bytes, recv, bytes, [&](const void* s, void* r) { dev_.all_to_all(s, r, count, t); });
}

void HostStagedCommunicator::barrier() { dev_.barrier(); }

// ---- DeviceGroup ---------------------------------------------------------------------------

struct DeviceGroup::State {
  State(int n, int dev, std::chrono::milliseconds t)
      : world(n), device(dev), timeout(t), calls(size_t(n)), rendezvous(n, t), claims(n) {}

  // Host barrier with abort and timeout: only used while enqueueing, to exchange addresses.
  // Either failure also raises the device-side abort flag, so no device barrier waits on.
  void host_barrier(int rank) {
    const RankBarrier::Outcome outcome = rendezvous.arrive_and_wait();
    if (outcome == RankBarrier::Outcome::passed) return;
    if (abort_host) abort_host[0] = 1;
    if (outcome == RankBarrier::Outcome::timed_out)
      throw CudaError(fmt::format("dcpmla: device-group collective (rank {}): peers did not arrive within {} ms; "
                                  "the group was aborted",
                                  rank, timeout.count()));
    throw Error(fmt::format("dcpmla: device-group collective (rank {}) aborted: another rank failed", rank));
  }

  void abort() {
    rendezvous.abort();
    if (abort_host) abort_host[0] = 1;
  }

  const int world, device;
  const std::chrono::milliseconds timeout;
  std::vector<detail::PublishedCall> calls;  // each rank's call of the collective being enqueued
  RankBarrier rendezvous;
  RankClaims claims;
  cuda_detail::DeviceBuffer flags;       // device unsigned long long [world]
  cuda_detail::PinnedBuffer abort_buffer;  // mapped
  volatile int* abort_host = nullptr;   // mapped pinned [2]: abort, status, in abort_buffer
  int* abort_dev = nullptr;
};

namespace {

class DeviceGroupComm final : public DeviceCommunicator {
 public:
  DeviceGroupComm(std::shared_ptr<DeviceGroup::State> s, int rank, cudaStream_t stream)
      : s_(std::move(s)), rank_(rank), stream_(stream) {
    s_->claims.claim(rank_);  // a refused claim constructs nothing, so releases nothing
  }
  ~DeviceGroupComm() override { s_->claims.release(rank_); }

  int rank() const override { return rank_; }
  int world_size() const override { return s_->world; }
  cudaStream_t stream() const override { return stream_; }
  int device() const override { return s_->device; }

  void all_gather(const void* send, void* recv, size_t count, DataType t) override {
    check_collective_args_or_abort(*this, "all_gather", send, recv, count, t);
    gather_from_peers(Collective::all_gather, send, recv, count, t, false);
  }

  void reduce_scatter_sum(const void* send, void* recv, size_t count, DataType t) override {
    check_collective_args_or_abort(*this, "reduce_scatter_sum", send, recv, count, t);
    const auto peers = publish(Collective::reduce_scatter_sum, send, count, t);
    cuda_detail::ReduceParams p{};
    for (int k = 0; k < s_->world; ++k) p.src[k] = peers[size_t(k)].send;
    p.dst = recv;
    p.offset = int64_t(rank_) * int64_t(count);
    p.count = int64_t(count);
    p.n = s_->world;
    p.dtype = int(t);
    device_barrier();
    cuda_detail::launch_group_reduce(p, stream_);
    device_barrier();
  }

  void all_to_all(const void* send, void* recv, size_t count, DataType t) override {
    check_collective_args_or_abort(*this, "all_to_all", send, recv, count, t);
    gather_from_peers(Collective::all_to_all, send, recv, count, t, true);
  }

  void barrier() override {
    publish(Collective::barrier, nullptr, 0, DataType::f32);
    device_barrier();
    synchronize();
  }

  void synchronize() override {
    // The device barrier gives up by itself after the timeout, so this wait ends.
    const cudaError_t e = cudaStreamSynchronize(stream_);
    if (e != cudaSuccess) check(e, "cudaStreamSynchronize(device group)");
    const int status = s_->abort_host[1];
    if (status == 1)
      throw CudaError(fmt::format("dcpmla: device-group collective (rank {}): a peer did not arrive within {} ms; "
                                  "the group was aborted",
                                  rank_, s_->timeout.count()));
    if (status != 0 || s_->abort_host[0])
      throw CudaError(fmt::format("dcpmla: device-group collective (rank {}) aborted: another rank failed", rank_));
  }

  void abort() override { s_->abort(); }

 private:
  using Collective = detail::Collective;

  // Every rank's send address for this collective (host barrier twice: all published,
  // then all read, so the slots can be reused by the next collective). When the ranks'
  // calls differ (collective, count or dtype), every rank raises the same error after the
  // second barrier and nothing is enqueued. The copy is a fixed array (no allocation: the
  // DCP step calls this per layer).
  using Calls = std::array<detail::PublishedCall, kMaxDeviceGroupRanks>;
  Calls publish(Collective op, const void* send, size_t count, DataType t) {
    s_->calls[size_t(rank_)] = {send, count, t, op};
    s_->host_barrier(rank_);
    Calls calls;
    std::copy(s_->calls.begin(), s_->calls.end(), calls.begin());
    // Every rank passed the first: none may leave before all have read (an abort released one,
    // which then rewrote its slot under a peer's copy); an abort holds for the next collective.
    s_->rendezvous.arrive_and_wait_all();
    const int bad = detail::disagreeing_rank(calls.data(), s_->world);
    if (bad >= 0) [[unlikely]]
      detail::fail_disagreement(calls[0], calls[size_t(bad)], bad);
    return calls;
  }

  // recv block p = count elements from peer p's send buffer: its start (all_gather) or its
  // block for this rank (all_to_all), between device barriers (every peer's data is ready,
  // and no peer reuses its buffer before every rank has read it).
  void gather_from_peers(Collective op, const void* send, void* recv, size_t count, DataType t, bool own_block) {
    const size_t bytes = count * size_of(t);
    const auto peers = publish(op, send, count, t);
    cuda_detail::GatherParams g{};
    for (int p = 0; p < s_->world; ++p) {
      g.src[p] = static_cast<const char*>(peers[size_t(p)].send) + (own_block ? size_t(rank_) * bytes : 0);
      g.dst[p] = static_cast<char*>(recv) + size_t(p) * bytes;
    }
    g.bytes = int64_t(bytes);
    g.n = s_->world;
    device_barrier();
    cuda_detail::launch_gather(g, stream_);
    device_barrier();
  }

  void device_barrier() {
    cuda_detail::BarrierParams p{};
    p.flags = s_->flags.as<unsigned long long>();
    p.abort = s_->abort_dev;
    p.status = s_->abort_dev + 1;
    p.me = rank_;
    p.n = s_->world;
    p.timeout_ns = static_cast<unsigned long long>(s_->timeout.count()) * 1000000ull;
    cuda_detail::launch_group_barrier(p, stream_);
  }

  std::shared_ptr<DeviceGroup::State> s_;
  int rank_;
  cudaStream_t stream_;
};

}  // namespace

DeviceGroup::DeviceGroup(int world_size, int device, std::chrono::milliseconds timeout) {
  require(world_size >= 1 && world_size <= kMaxDeviceGroupRanks, "world_size", world_size,
          fmt::format("in [1, {}] for a device group (ranks simulated on one GPU)", kMaxDeviceGroupRanks));
  require_timeout(timeout);
  cuda_detail::require_device(device);
  state_ = std::make_shared<State>(world_size, device, timeout);
  check(cudaSetDevice(device), "cudaSetDevice(device group)");
  state_->flags = cuda_detail::DeviceBuffer(sizeof(unsigned long long) * size_t(world_size), "cudaMalloc(group flags)");
  check(cudaMemset(state_->flags.get(), 0, sizeof(unsigned long long) * size_t(world_size)), "cudaMemset(group flags)");
  // The memset runs on the legacy stream, which the ranks' non-blocking streams do not wait
  // for: finish it here. And load the kernels now (see preload_dcp_kernels).
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize(device group setup)");
  cuda_detail::preload_dcp_kernels();
  state_->abort_buffer = cuda_detail::PinnedBuffer(2 * sizeof(int), "cudaHostAlloc(group abort flag)", cudaHostAllocMapped);
  int* host = state_->abort_buffer.as<int>();
  host[0] = host[1] = 0;
  state_->abort_host = host;
  check(cudaHostGetDevicePointer(reinterpret_cast<void**>(&state_->abort_dev), host, 0),
        "cudaHostGetDevicePointer(group abort flag)");
}

DeviceGroup::~DeviceGroup() = default;
int DeviceGroup::world_size() const { return state_->world; }
void DeviceGroup::abort() { state_->abort(); }

std::unique_ptr<DeviceCommunicator> DeviceGroup::communicator(int rank, cudaStream_t stream) {
  require(rank >= 0 && rank < state_->world, "rank", rank,
          fmt::format("0 <= rank < world_size ({})", state_->world));
  return std::make_unique<DeviceGroupComm>(state_, rank, stream);
}

void run_device_ranks(int world_size, int device, const std::function<void(int, DeviceCommunicator&)>& fn,
                      std::chrono::milliseconds timeout) {
  DeviceGroup group(world_size, device, timeout);
  std::vector<cuda_detail::Stream> streams(static_cast<size_t>(world_size));
  const std::exception_ptr failed = run_rank_threads(
      world_size,
      [&](int r) {
        check(cudaSetDevice(device), "cudaSetDevice(rank thread)");
        streams[size_t(r)] = cuda_detail::Stream("cudaStreamCreate(rank)");
        auto comm = group.communicator(r, streams[size_t(r)].get());
        fn(r, *comm);
      },
      [&] { group.abort(); });
  // After the abort (if any): the device barrier kernels leave once it is raised.
  for (const cuda_detail::Stream& stream : streams)
    if (stream.get()) cudaStreamSynchronize(stream.get());
  if (failed) std::rethrow_exception(failed);
}

}  // namespace dcpmla
