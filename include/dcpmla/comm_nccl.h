// Collectives over NCCL for device memory: one GPU per rank. Built when NCCL is found
// (CMake option DCPMLA_NCCL, target dcpmla::dcpmla_nccl); nccl.h stays out of this header.
//
// Two ways to start (README "DCP across GPUs"):
//  (a) one process per GPU under mpirun: make_nccl_communicator_mpi() shares the NCCL unique
//      id with MPI_Bcast (needs the MPI communicator library: DCPMLA_MPI); this is also how
//      a group spans several nodes.
//  (b) one process driving every GPU of a node: make_nccl_communicators(n), one thread per
//      GPU, each calling ncclCommInitRankConfig with one id from ncclGetUniqueId. Callers
//      with their own threads use nccl_unique_id() + make_nccl_communicator().
//
// Every communicator is non-blocking (NCCL's config.blocking = 0) unless asked otherwise:
// an NCCL call returns at once and the library polls ncclCommGetAsyncError, so init,
// enqueue and synchronize() wait at most `timeout`; past it the communicator is aborted
// (ncclCommAbort) and the call throws dcpmla::CudaError naming it. A rank that fails
// therefore never leaves the others waiting forever. NCCL_NVLS_ENABLE is set to 0 when the
// environment leaves it unset (NVLink multicast can take shared machines' GPUs down).
#pragma once

#include <array>
#include <chrono>
#include <memory>
#include <vector>

#include "dcpmla/comm_device.h"

namespace dcpmla {

struct NcclOptions {
  std::chrono::milliseconds timeout = std::chrono::seconds(300);  // init, enqueue, synchronize
  bool blocking = false;  // NCCL's blocking mode (then only synchronize() is bounded)
};

// ncclUniqueId's bytes (NCCL_UNIQUE_ID_BYTES = 128).
using NcclId = std::array<char, 128>;
NcclId nccl_unique_id();

// NCCL's version as major * 10000 + minor * 100 + patch (ncclGetVersion).
int nccl_version();

class NcclCommunicator final : public DeviceCommunicator {
 public:
  struct Impl;
  explicit NcclCommunicator(std::unique_ptr<Impl> impl);
  ~NcclCommunicator() override;  // ncclCommFinalize + ncclCommDestroy (or ncclCommAbort)

  int rank() const override;
  int world_size() const override;
  cudaStream_t stream() const override;
  int device() const override;
  // ncclAllGather / ncclReduceScatter (ncclSum; bf16 as ncclBfloat16) / grouped
  // ncclSend+ncclRecv, enqueued on stream(); no host synchronisation (graph-capturable).
  void all_gather(const void* send, void* recv, size_t count, DataType t) override;
  void reduce_scatter_sum(const void* send, void* recv, size_t count, DataType t) override;
  void all_to_all(const void* send, void* recv, size_t count, DataType t) override;
  void barrier() override;
  void synchronize() override;
  void abort() override;
  bool aborted() const;

 private:
  std::unique_ptr<Impl> impl_;
};

// One rank of a group whose id came from nccl_unique_id() on one rank (shared by the
// caller). stream = nullptr: the communicator creates (and owns) a non-blocking stream.
std::unique_ptr<NcclCommunicator> make_nccl_communicator(const NcclId& id, int world_size, int rank, int device,
                                                         cudaStream_t stream = nullptr, const NcclOptions& options = {});

// (b) One process, one thread per GPU: ranks 0..world_size-1 on devices 0..world_size-1.
// Fewer GPUs than world_size is refused (dcpmla::Error) before anything starts.
std::vector<std::unique_ptr<NcclCommunicator>> make_nccl_communicators(int world_size, const NcclOptions& options = {});

// (a) One process per GPU under mpirun (MPI already initialised, e.g. by MpiSession):
// rank and size of MPI_COMM_WORLD, device = the rank's index on its node. Every rank checks
// that its node has a GPU per local rank before any NCCL call and all ranks agree (an
// MPI_Allreduce), so a short node fails every rank with the same error. Throws
// dcpmla::Error when dcpmla was built without MPI.
std::unique_ptr<NcclCommunicator> make_nccl_communicator_mpi(const NcclOptions& options = {});

// True when make_nccl_communicator_mpi is available (built with MPI).
bool nccl_has_mpi();

}  // namespace dcpmla
