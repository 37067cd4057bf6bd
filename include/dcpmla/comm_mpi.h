// Collectives over MPI for host memory: one process per rank, launched by mpirun.
// Built when MPI is found (CMake option DCPMLA_MPI); mpi.h stays out of this header.
#pragma once

#include <memory>

#include "dcpmla/comm.h"

namespace dcpmla {

// MPI_Init on construction, MPI_Finalize on destruction.
class MpiSession {
 public:
  MpiSession(int* argc, char*** argv);
  ~MpiSession();
  MpiSession(const MpiSession&) = delete;
  MpiSession& operator=(const MpiSession&) = delete;
  int rank() const { return rank_; }
  int world_size() const { return size_; }

  // True when this process was started by an MPI launcher (mpirun / mpiexec).
  static bool launched();
  // The abort path: ends every process of the job, so that no rank waits forever on
  // one that failed.
  [[noreturn]] static void abort(int code);

 private:
  int rank_ = 0, size_ = 1;
};

// A communicator over MPI_COMM_WORLD (errors become dcpmla::Error naming the call).
std::unique_ptr<Communicator> make_mpi_communicator();

}  // namespace dcpmla
