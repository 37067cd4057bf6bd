#include "dcpmla/comm_mpi.h"

#include <mpi.h>

#include <climits>
#include <cstdlib>
#include <vector>

#include "dcpmla/error.h"
#include "dcpmla/numeric.h"

namespace dcpmla {
namespace {

void check(int rc, const char* call) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  throw Error(fmt::format("dcpmla: {} failed: {}", call, std::string(text, size_t(len))));
}

// Only for a DataType that check_collective_args accepted.
MPI_Datatype mpi_type(DataType t) {
  // bf16 travels as raw 16-bit words; sums over it are done in float (below).
  return t == DataType::f32 ? MPI_FLOAT : t == DataType::i32 ? MPI_INT32_T : MPI_UINT16_T;
}

[[noreturn]] void fail_count(const char* op, size_t count, int world, size_t max_count) {
  fail("count", count,
       fmt::format("at most {} in {} over MPI (MPI counts are int: count and count x world_size ({}) must fit "
                   "int32; split the transfer)",
                   max_count, op, world));
}

class MpiComm final : public Communicator {
 public:
  MpiComm() {
    check(MPI_Comm_dup(MPI_COMM_WORLD, &comm_), "MPI_Comm_dup");
    check(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
    check(MPI_Comm_rank(comm_, &rank_), "MPI_Comm_rank");
    check(MPI_Comm_size(comm_, &size_), "MPI_Comm_size");
    max_count_ = size_t(INT_MAX) / size_t(size_);
  }
  ~MpiComm() override { MPI_Comm_free(&comm_); }

  int rank() const override { return rank_; }
  int world_size() const override { return size_; }

  void all_gather(const void* send, void* recv, size_t count, DataType t) override {
    check_args("all_gather", send, recv, count, t);
    check(MPI_Allgather(send, int(count), mpi_type(t), recv, int(count), mpi_type(t), comm_), "MPI_Allgather");
  }

  void reduce_scatter_sum(const void* send, void* recv, size_t count, DataType t) override {
    check_args("reduce_scatter_sum", send, recv, count, t);
    if (t != DataType::bf16) {
      check(MPI_Reduce_scatter_block(send, recv, int(count), mpi_type(t), MPI_SUM, comm_),
            "MPI_Reduce_scatter_block");
      return;
    }
    // MPI has no bf16 sum: widen to float, reduce, round once.
    const auto* s = static_cast<const bf16*>(send);
    std::vector<float> wide(count * size_t(size_)), sum(count);
    for (size_t i = 0; i < wide.size(); ++i) wide[i] = bf16_to_float(s[i]);
    check(MPI_Reduce_scatter_block(wide.data(), sum.data(), int(count), MPI_FLOAT, MPI_SUM, comm_),
          "MPI_Reduce_scatter_block");
    auto* r = static_cast<bf16*>(recv);
    for (size_t i = 0; i < count; ++i) r[i] = float_to_bf16(sum[i]);
  }

  void all_to_all(const void* send, void* recv, size_t count, DataType t) override {
    check_args("all_to_all", send, recv, count, t);
    check(MPI_Alltoall(send, int(count), mpi_type(t), recv, int(count), mpi_type(t), comm_), "MPI_Alltoall");
  }

  void barrier() override { check(MPI_Barrier(comm_), "MPI_Barrier"); }

 private:
  // The shared entry checks, and the int counts MPI takes: every collective's gathered side
  // holds count x world_size elements, so that product must fit int too.
  void check_args(const char* op, const void* send, const void* recv, size_t count, DataType t) const {
    check_collective_args(op, send, recv, count, t, size_);
    if (count > max_count_) [[unlikely]]
      fail_count(op, count, size_, max_count_);
  }

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1;
  size_t max_count_ = 0;  // INT_MAX / size_
};

}  // namespace

MpiSession::MpiSession(int* argc, char*** argv) {
  int ready = 0;
  check(MPI_Initialized(&ready), "MPI_Initialized");
  if (!ready) check(MPI_Init(argc, argv), "MPI_Init");
  check(MPI_Comm_rank(MPI_COMM_WORLD, &rank_), "MPI_Comm_rank");
  check(MPI_Comm_size(MPI_COMM_WORLD, &size_), "MPI_Comm_size");
}

MpiSession::~MpiSession() {
  int done = 0;
  MPI_Finalized(&done);
  if (!done) MPI_Finalize();
}

bool MpiSession::launched() {
  // Open MPI, MPICH/Hydra and PMIx launchers each set one of these.
  return std::getenv("OMPI_COMM_WORLD_SIZE") || std::getenv("PMI_SIZE") || std::getenv("PMIX_RANK");
}

void MpiSession::abort(int code) {
  MPI_Abort(MPI_COMM_WORLD, code);
  std::exit(code);
}

std::unique_ptr<Communicator> make_mpi_communicator() { return std::make_unique<MpiComm>(); }

}  // namespace dcpmla
