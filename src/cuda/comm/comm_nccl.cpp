// NCCL communicator (comm_nccl.h): non-blocking communicators whose every wait is bounded,
// and the two ways to start a group (threads of one process, or mpirun processes).
#include "dcpmla/comm_nccl.h"

#include <nccl.h>

#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <thread>

#include <cuda_runtime.h>

#include "dcpmla/cuda.h"
#include "dcpmla/error.h"
#include "common/resources.h"

#ifdef DCPMLA_NCCL_WITH_MPI
#include <mpi.h>
#endif

static_assert(sizeof(ncclUniqueId) == sizeof(dcpmla::NcclId), "NcclId must hold an ncclUniqueId");

namespace dcpmla {
namespace {

using Clock = std::chrono::steady_clock;
using cuda_detail::check;
using cuda_detail::device_count;

[[noreturn]] void nccl_fail(ncclResult_t r, const char* call, ncclComm_t comm, int rank) {
  const char* last = comm ? ncclGetLastError(comm) : nullptr;
  throw CudaError(fmt::format("dcpmla: NCCL call {} failed on rank {}: {}{}{}", call, rank, ncclGetErrorString(r),
                              last && *last ? ": " : "", last ? last : ""));
}

// Only for a DataType that check_collective_args accepted.
ncclDataType_t nccl_type(DataType t) {
  switch (t) {
    case DataType::f32: return ncclFloat32;
    case DataType::bf16: return ncclBfloat16;
    case DataType::i32: return ncclInt32;
  }
  return ncclFloat32;
}

// NVLink multicast (NVLS) stays off unless the user set the variable (see the header).
void keep_nvls_off() { setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0); }


}  // namespace

struct NcclCommunicator::Impl {
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;  // the caller's, or owned_stream
  cuda_detail::Stream owned_stream;
  int rank = 0, world = 1, device = 0;
  NcclOptions options;
  bool is_aborted = false;
  cuda_detail::DeviceBuffer scratch;  // int32 [world + 1] for barrier()

  ~Impl() {
    if (comm && !is_aborted) {
      cudaSetDevice(device);
      // Flush pending work; a dead peer makes the (bounded) wait fail and we abort instead.
      bool clean = false;
      try {
        const ncclResult_t r = ncclCommFinalize(comm);
        if (r == ncclSuccess || r == ncclInProgress) {
          wait_state("ncclCommFinalize");
          clean = true;
        }
      } catch (const std::exception&) {
      }
      if (clean) ncclCommDestroy(comm);
      else do_abort();
    }
    if (owned_stream.get()) cudaStreamSynchronize(owned_stream.get());
  }

  void do_abort() {
    if (comm && !is_aborted) {
      cudaSetDevice(device);
      ncclCommAbort(comm);
      is_aborted = true;
    }
  }

  void require_usable(const char* call) const {
    if (is_aborted)
      throw CudaError(fmt::format("dcpmla: NCCL call {} on rank {}: the communicator was aborted "
                                  "(a peer failed or timed out earlier); make a new one",
                                  call, rank));
  }

  // Non-blocking NCCL: wait until the communicator leaves ncclInProgress, at most the timeout.
  void wait_state(const char* call) {
    const auto deadline = Clock::now() + options.timeout;
    for (;;) {
      ncclResult_t state = ncclSuccess;
      const ncclResult_t r = ncclCommGetAsyncError(comm, &state);
      if (r != ncclSuccess) {
        do_abort();
        nccl_fail(r, "ncclCommGetAsyncError", nullptr, rank);
      }
      if (state == ncclSuccess) return;
      if (state != ncclInProgress) {
        const std::string last = ncclGetLastError(comm) ? ncclGetLastError(comm) : "";
        do_abort();
        throw CudaError(fmt::format("dcpmla: NCCL call {} failed on rank {}: {}{}{}; communicator aborted", call, rank,
                                    ncclGetErrorString(state), last.empty() ? "" : ": ", last));
      }
      if (Clock::now() > deadline) {
        do_abort();
        throw CudaError(fmt::format("dcpmla: NCCL call {} on rank {} did not complete within {} ms (a peer failed or "
                                    "never joined); communicator aborted",
                                    call, rank, options.timeout.count()));
      }
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }

  // The result of an NCCL call in non-blocking mode: ncclInProgress means "poll".
  void result(ncclResult_t r, const char* call) {
    if (r == ncclSuccess || r == ncclInProgress) {
      if (!options.blocking) wait_state(call);
      return;
    }
    const std::string last = comm && ncclGetLastError(comm) ? ncclGetLastError(comm) : "";
    do_abort();
    throw CudaError(fmt::format("dcpmla: NCCL call {} failed on rank {}: {}{}{}", call, rank, ncclGetErrorString(r),
                                last.empty() ? "" : ": ", last));
  }

  void set_device() const { check(cudaSetDevice(device), "cudaSetDevice(NCCL rank)"); }
};

NcclCommunicator::NcclCommunicator(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
NcclCommunicator::~NcclCommunicator() = default;
int NcclCommunicator::rank() const { return impl_->rank; }
int NcclCommunicator::world_size() const { return impl_->world; }
cudaStream_t NcclCommunicator::stream() const { return impl_->stream; }
int NcclCommunicator::device() const { return impl_->device; }
bool NcclCommunicator::aborted() const { return impl_->is_aborted; }
void NcclCommunicator::abort() { impl_->do_abort(); }

void NcclCommunicator::all_gather(const void* send, void* recv, size_t count, DataType t) {
  check_collective_args("all_gather", send, recv, count, t, impl_->world);
  impl_->require_usable("ncclAllGather");
  impl_->set_device();
  impl_->result(ncclAllGather(send, recv, count, nccl_type(t), impl_->comm, impl_->stream), "ncclAllGather");
}

void NcclCommunicator::reduce_scatter_sum(const void* send, void* recv, size_t count, DataType t) {
  check_collective_args("reduce_scatter_sum", send, recv, count, t, impl_->world);
  impl_->require_usable("ncclReduceScatter");
  impl_->set_device();
  impl_->result(ncclReduceScatter(send, recv, count, nccl_type(t), ncclSum, impl_->comm, impl_->stream),
                "ncclReduceScatter");
}

void NcclCommunicator::all_to_all(const void* send, void* recv, size_t count, DataType t) {
  check_collective_args("all_to_all", send, recv, count, t, impl_->world);
  impl_->require_usable("ncclSend/ncclRecv (all_to_all)");
  impl_->set_device();
  const size_t bytes = count * size_of(t);
  // Grouped point-to-point (every NCCL 2.x has it; ncclAlltoAll is new in 2.28).
  impl_->result(ncclGroupStart(), "ncclGroupStart");
  ncclResult_t bad = ncclSuccess;
  const char* bad_call = "";
  for (int p = 0; p < impl_->world && bad == ncclSuccess; ++p) {
    const ncclResult_t s = ncclSend(static_cast<const char*>(send) + size_t(p) * bytes, count, nccl_type(t), p,
                                    impl_->comm, impl_->stream);
    if (s != ncclSuccess && s != ncclInProgress) bad = s, bad_call = "ncclSend";
    const ncclResult_t r =
        ncclRecv(static_cast<char*>(recv) + size_t(p) * bytes, count, nccl_type(t), p, impl_->comm, impl_->stream);
    if (bad == ncclSuccess && r != ncclSuccess && r != ncclInProgress) bad = r, bad_call = "ncclRecv";
  }
  if (bad != ncclSuccess) {
    ncclGroupEnd();
    impl_->result(bad, bad_call);
  }
  impl_->result(ncclGroupEnd(), "ncclGroupEnd (all_to_all)");
}

void NcclCommunicator::barrier() {
  // A one-word all-gather, then the bounded wait.
  impl_->require_usable("barrier");
  all_gather(impl_->scratch.as<int32_t>(), impl_->scratch.as<int32_t>() + 1, 1, DataType::i32);
  synchronize();
}

void NcclCommunicator::synchronize() {
  impl_->require_usable("synchronize");
  const auto deadline = Clock::now() + impl_->options.timeout;
  for (;;) {
    const cudaError_t q = cudaStreamQuery(impl_->stream);
    if (q == cudaSuccess) return;
    if (q != cudaErrorNotReady) check(q, "cudaStreamQuery(NCCL stream)");
    ncclResult_t state = ncclSuccess;
    ncclCommGetAsyncError(impl_->comm, &state);
    if (state != ncclSuccess && state != ncclInProgress) {
      impl_->do_abort();
      throw CudaError(fmt::format("dcpmla: NCCL collective failed on rank {}: {}; communicator aborted", impl_->rank,
                                  ncclGetErrorString(state)));
    }
    if (Clock::now() > deadline) {
      impl_->do_abort();
      throw CudaError(fmt::format("dcpmla: NCCL collectives on rank {} did not finish within {} ms (a peer failed or "
                                  "stopped calling them); communicator aborted",
                                  impl_->rank, impl_->options.timeout.count()));
    }
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

NcclId nccl_unique_id() {
  keep_nvls_off();
  ncclUniqueId id;
  const ncclResult_t r = ncclGetUniqueId(&id);
  if (r != ncclSuccess) nccl_fail(r, "ncclGetUniqueId", nullptr, 0);
  NcclId out;
  std::memcpy(out.data(), &id, sizeof(id));
  return out;
}

int nccl_version() {
  int v = 0;
  ncclGetVersion(&v);
  return v;
}

std::unique_ptr<NcclCommunicator> make_nccl_communicator(const NcclId& id, int world_size, int rank, int device,
                                                         cudaStream_t stream, const NcclOptions& options) {
  require(world_size >= 1, "world_size", world_size, ">= 1");
  require(rank >= 0 && rank < world_size, "rank", rank, fmt::format("0 <= rank < world_size ({})", world_size));
  require_timeout(options.timeout);
  cuda_detail::require_device(device);
  keep_nvls_off();
  auto impl = std::make_unique<NcclCommunicator::Impl>();
  impl->rank = rank;
  impl->world = world_size;
  impl->device = device;
  impl->options = options;
  impl->set_device();
  if (stream) {
    impl->stream = stream;
  } else {
    impl->owned_stream = cuda_detail::Stream("cudaStreamCreate(NCCL rank)");
    impl->stream = impl->owned_stream.get();
  }
  // A count a rank and one more (in size_t: world_size + 1 overflowed int at INT_MAX).
  const size_t scratch_bytes = sizeof(int32_t) * (size_t(world_size) + 1);
  impl->scratch = cuda_detail::DeviceBuffer(scratch_bytes, "cudaMalloc(NCCL barrier)");
  check(cudaMemset(impl->scratch.get(), 0, scratch_bytes), "cudaMemset(NCCL barrier)");
  ncclUniqueId nid;
  std::memcpy(&nid, id.data(), sizeof(nid));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = options.blocking ? 1 : 0;
  const ncclResult_t r = ncclCommInitRankConfig(&impl->comm, world_size, nid, rank, &config);
  if (r != ncclSuccess && r != ncclInProgress) {
    if (impl->comm) impl->do_abort();
    impl->comm = nullptr;
    nccl_fail(r, "ncclCommInitRankConfig", nullptr, rank);
  }
  if (!options.blocking) impl->wait_state("ncclCommInitRankConfig");
  return std::make_unique<NcclCommunicator>(std::move(impl));
}

std::vector<std::unique_ptr<NcclCommunicator>> make_nccl_communicators(int world_size, const NcclOptions& options) {
  require(world_size >= 1, "world_size", world_size, ">= 1");
  const int gpus = device_count();
  require(gpus >= world_size, "world_size", world_size,
          fmt::format("at most the GPUs of this node ({}): one GPU per rank when one process drives every GPU", gpus));
  const NcclId id = nccl_unique_id();
  std::vector<std::unique_ptr<NcclCommunicator>> comms(static_cast<size_t>(world_size));
  std::mutex mutex;
  std::exception_ptr first;
  std::vector<std::thread> threads;
  for (int r = 0; r < world_size; ++r)
    threads.emplace_back([&, r] {
      try {
        comms[size_t(r)] = make_nccl_communicator(id, world_size, r, r, nullptr, options);
      } catch (...) {
        std::lock_guard lock(mutex);
        if (!first) first = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  if (first) {
    for (auto& c : comms)
      if (c) c->abort();
    std::rethrow_exception(first);
  }
  return comms;
}

#ifdef DCPMLA_NCCL_WITH_MPI

namespace {
void mpi_check(int rc, const char* call) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  throw Error(fmt::format("dcpmla: {} failed: {}", call, std::string(text, size_t(len))));
}
}  // namespace

bool nccl_has_mpi() { return true; }

std::unique_ptr<NcclCommunicator> make_nccl_communicator_mpi(const NcclOptions& options) {
  int ready = 0;
  mpi_check(MPI_Initialized(&ready), "MPI_Initialized");
  if (!ready) throw Error("dcpmla: make_nccl_communicator_mpi: MPI is not initialised (create an MpiSession first)");
  int rank = 0, size = 1, local_rank = 0, local_size = 1;
  mpi_check(MPI_Comm_rank(MPI_COMM_WORLD, &rank), "MPI_Comm_rank");
  mpi_check(MPI_Comm_size(MPI_COMM_WORLD, &size), "MPI_Comm_size");
  MPI_Comm node = MPI_COMM_NULL;
  mpi_check(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node),
            "MPI_Comm_split_type");
  MPI_Comm_rank(node, &local_rank);
  MPI_Comm_size(node, &local_size);
  MPI_Comm_free(&node);
  // Every rank learns the worst node before any NCCL call, so all fail alike.
  const int gpus = device_count();
  const int mine[2] = {local_size - gpus, gpus};
  int worst[2] = {0, 0};
  mpi_check(MPI_Allreduce(&mine[0], &worst[0], 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD), "MPI_Allreduce(GPU check)");
  mpi_check(MPI_Allreduce(&mine[1], &worst[1], 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD), "MPI_Allreduce(GPU check)");
  if (worst[0] > 0)
    throw Error(fmt::format("dcpmla: field 'MPI ranks per node' = {} more than GPUs on a node: expected one GPU per "
                            "rank (this node: {} rank(s), {} GPU(s); fewest GPUs on any node: {})",
                            worst[0], local_size, gpus, worst[1]));
  // Rank 0 makes the id; a failure there is broadcast too, so nobody waits for it.
  struct {
    int32_t ok;
    char id[128];
  } msg{};
  if (rank == 0) {
    try {
      const NcclId id = nccl_unique_id();
      std::memcpy(msg.id, id.data(), id.size());
      msg.ok = 1;
    } catch (const std::exception&) {
      msg.ok = 0;
    }
  }
  mpi_check(MPI_Bcast(&msg, int(sizeof(msg)), MPI_BYTE, 0, MPI_COMM_WORLD), "MPI_Bcast(NCCL unique id)");
  if (!msg.ok) throw CudaError("dcpmla: ncclGetUniqueId failed on rank 0; no NCCL communicator was made");
  NcclId id;
  std::memcpy(id.data(), msg.id, id.size());
  return make_nccl_communicator(id, size, rank, local_rank, nullptr, options);
}

#else

bool nccl_has_mpi() { return false; }

std::unique_ptr<NcclCommunicator> make_nccl_communicator_mpi(const NcclOptions&) {
  throw Error("dcpmla: make_nccl_communicator_mpi: this dcpmla was built without MPI (DCPMLA_MPI); "
              "start the NCCL group with make_nccl_communicators (one process, a thread per GPU)");
}

#endif

}  // namespace dcpmla
