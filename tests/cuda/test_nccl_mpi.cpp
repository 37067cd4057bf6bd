// The mpirun start-up of the NCCL communicator (one process per GPU, the unique id shared
// with MPI_Bcast). With a GPU per process every collective must give the exact answer; with
// fewer GPUs on a node than processes (CI has none) every rank must fail with the same clear
// error and no rank may hang. Prints "nccl mpi: all ranks ok" on rank 0 when all is well.
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "dcpmla/comm_mpi.h"
#include "dcpmla/cuda.h"
#include "dcpmla/comm_nccl.h"
#include "dcpmla/error.h"

using namespace dcpmla;

namespace {

// Every collective over world_size ranks with rank-dependent data; true when exact.
bool exercise(NcclCommunicator& comm, std::string& why) {
  const int n = comm.world_size(), r = comm.rank();
  const size_t count = 5;
  std::vector<int32_t> send(count * size_t(n)), recv(count * size_t(n));
  for (size_t i = 0; i < send.size(); ++i) send[i] = int32_t(1000 * r + int(i));
  int32_t *ds = nullptr, *dr = nullptr;
  cudaMalloc(&ds, send.size() * 4);
  cudaMalloc(&dr, recv.size() * 4);
  cudaMemcpy(ds, send.data(), send.size() * 4, cudaMemcpyHostToDevice);
  bool ok = true;
  // all_gather of the first `count` values: rank p's block holds 1000 p + i.
  comm.all_gather(ds, dr, count, DataType::i32);
  comm.synchronize();
  cudaMemcpy(recv.data(), dr, recv.size() * 4, cudaMemcpyDeviceToHost);
  for (int p = 0; p < n; ++p)
    for (size_t i = 0; i < count; ++i) ok &= recv[size_t(p) * count + i] == int32_t(1000 * p + int(i));
  if (!ok) why = "all_gather";
  // reduce_scatter: chunk r summed over ranks = sum_p (1000 p) + r count + i.
  comm.reduce_scatter_sum(ds, dr, count, DataType::i32);
  comm.synchronize();
  cudaMemcpy(recv.data(), dr, count * 4, cudaMemcpyDeviceToHost);
  for (size_t i = 0; i < count; ++i)
    ok &= recv[i] == int32_t(1000 * n * (n - 1) / 2 + n * (r * int(count) + int(i)));
  if (!ok && why.empty()) why = "reduce_scatter";
  // all_to_all: block p of the result is rank p's block r = 1000 p + r count + i.
  comm.all_to_all(ds, dr, count, DataType::i32);
  comm.synchronize();
  cudaMemcpy(recv.data(), dr, recv.size() * 4, cudaMemcpyDeviceToHost);
  for (int p = 0; p < n; ++p)
    for (size_t i = 0; i < count; ++i) ok &= recv[size_t(p) * count + i] == int32_t(1000 * p + r * int(count) + int(i));
  if (!ok && why.empty()) why = "all_to_all";
  comm.barrier();
  cudaFree(ds);
  cudaFree(dr);
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  MpiSession mpi(&argc, &argv);
  auto host = make_mpi_communicator();
  const int n = host->world_size(), rank = host->rank();
  int32_t ok = 0;
  std::string what;
  try {
    NcclOptions o;
    o.timeout = std::chrono::seconds(60);
    auto comm = make_nccl_communicator_mpi(o);
    std::string why;
    ok = exercise(*comm, why) ? 1 : 0;
    what = ok ? "collectives exact over NCCL" : "wrong result in " + why;
  } catch (const Error& e) {
    // The refusal is right exactly when this node has fewer GPUs than processes.
    what = e.what();
    const bool expected = cuda_device_count() < n && what.find("one GPU per rank") != std::string::npos;
    ok = expected ? 1 : 0;
    if (expected) what = "refused as expected: " + what;
  } catch (const std::exception& e) {
    what = e.what();
  }
  std::printf("rank %d: %s: %s\n", rank, ok ? "ok" : "FAILED", what.c_str());
  std::vector<int32_t> all(static_cast<size_t>(n));
  host->all_gather(&ok, all.data(), 1, DataType::i32);
  int good = 0;
  for (int32_t v : all) good += v;
  if (rank == 0) std::printf(good == n ? "nccl mpi: all ranks ok (%d)\n" : "nccl mpi: FAILED (%d of %d ok)\n", good, n);
  return good == n ? 0 : 1;
}
