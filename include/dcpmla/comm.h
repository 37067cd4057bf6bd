// Collectives between the ranks of a DCP group. The in-process implementation runs
// ranks as threads; NCCL and MPI implementations plug in behind the same interface.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>

namespace dcpmla {

enum class DataType : int32_t { f32, bf16, i32 };
size_t size_of(DataType t);

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  // recv[world_size * count] = every rank's send[count], in rank order.
  virtual void all_gather(const void* send, void* recv, size_t count, DataType t) = 0;
  // recv[count] = sum over ranks of their send[rank * count .. (rank + 1) * count).
  virtual void reduce_scatter_sum(const void* send, void* recv, size_t count, DataType t) = 0;
  // recv[p * count ..] = rank p's send[rank * count ..], for every peer p.
  virtual void all_to_all(const void* send, void* recv, size_t count, DataType t) = 0;
  virtual void barrier() = 0;
};

// Most in-process ranks a group may have. In-process ranks are threads, each with its own
// cache shard; a DCP group is a handful of ranks, so a larger count is a mistake, refused
// before any thread starts (world_size = 10**6 must not try to spawn a million threads).
inline constexpr int kMaxInProcessRanks = 256;

// Ranks as threads of one process over host memory. A rank that fails aborts the group:
// the others leave their collective with an error instead of waiting forever.
class InProcessGroup {
 public:
  explicit InProcessGroup(int world_size);
  ~InProcessGroup();
  int world_size() const;
  std::unique_ptr<Communicator> communicator(int rank);
  void abort();

  struct State;

 private:
  std::shared_ptr<State> state_;
};

// Runs fn(rank, comm) on world_size threads over one InProcessGroup and rethrows the
// first rank's exception (others are aborted rather than left waiting).
void run_ranks(int world_size, const std::function<void(int, Communicator&)>& fn);

}  // namespace dcpmla
