// Collectives between the ranks of a DCP group. The in-process implementation runs
// ranks as threads; NCCL and MPI implementations plug in behind the same interface.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>

namespace dcpmla {

enum class DataType : int32_t { f32, bf16, i32 };
// True for f32, bf16 and i32: a DataType cast from any other integer is none of them.
constexpr bool is_known(DataType t) { return t == DataType::f32 || t == DataType::bf16 || t == DataType::i32; }
// Bytes of one element; an unknown DataType raises dcpmla::Error naming its value.
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
  // Tells the peers that this rank failed, so that their pending and later collectives raise
  // instead of waiting for it. In-process and device groups abort; the default does nothing
  // (under MPI the abort path ends the job: MpiSession::abort).
  virtual void abort() {}
};

// The most elements a collective may move per rank: count x 4 bytes (the largest element)
// x world_size must fit size_t.
inline size_t max_collective_count(int world_size) { return (SIZE_MAX / 4) / size_t(world_size > 0 ? world_size : 1); }
// The checks every communicator makes at the entry of each collective, before it touches a
// buffer or waits for a peer: `t` is a known DataType, `send` and `recv` are not null when
// count > 0 and aligned to whole elements (the reductions read and write them as elements, on
// the host and on the device, where a misaligned one faults), and count <= max_collective_count.
// Plain comparisons: the message (field, value, expectation and the collective's name) is built
// only on failure.
inline bool collective_args_ok(const void* send, const void* recv, size_t count, DataType t, int world_size) {
  return is_known(t) && (count == 0 || (send != nullptr && recv != nullptr)) &&
         (reinterpret_cast<uintptr_t>(send) | reinterpret_cast<uintptr_t>(recv)) % size_of(t) == 0 &&
         count <= max_collective_count(world_size);
}
// Raises dcpmla::Error for the first check that fails (op: the collective's name).
[[noreturn]] void fail_collective_args(const char* op, const void* send, const void* recv, size_t count, DataType t,
                                       int world_size);
inline void check_collective_args(const char* op, const void* send, const void* recv, size_t count, DataType t,
                                  int world_size) {
  if (!collective_args_ok(send, recv, count, t, world_size)) [[unlikely]]
    fail_collective_args(op, send, recv, count, t, world_size);
}
// The same for the groups whose ranks meet at a barrier (in-process, device): a rank that
// refuses its arguments never joins the collective, so it aborts the group first and its
// peers raise at once instead of waiting for the timeout.
inline void check_collective_args_or_abort(Communicator& self, const char* op, const void* send, const void* recv,
                                           size_t count, DataType t) {
  if (!collective_args_ok(send, recv, count, t, self.world_size())) [[unlikely]] {
    self.abort();
    fail_collective_args(op, send, recv, count, t, self.world_size());
  }
}

namespace detail {
// Groups whose ranks meet at a host barrier (the in-process group, the device group) publish
// each call, so that every rank can see that all of them called the same collective with the
// same count and type before anyone reads a peer's buffer.
enum class Collective : int32_t { all_gather, reduce_scatter_sum, all_to_all, barrier };
const char* name_of(Collective c);
struct PublishedCall {
  const void* send = nullptr;
  size_t count = 0;
  DataType dtype = DataType::f32;
  Collective op = Collective::barrier;
};
// The first rank whose call differs from rank 0's (collective, count or dtype), or -1.
inline int disagreeing_rank(const PublishedCall* calls, int world) {
  for (int p = 1; p < world; ++p)
    if (calls[p].op != calls[0].op || calls[p].count != calls[0].count || calls[p].dtype != calls[0].dtype) return p;
  return -1;
}
// Raises dcpmla::Error naming the field that differs, rank `p`'s value and rank 0's; every
// rank, seeing the same calls, raises the same message.
[[noreturn]] void fail_disagreement(const PublishedCall& rank0, const PublishedCall& other, int p);
}  // namespace detail

// Most in-process ranks a group may have. In-process ranks are threads, each with its own
// cache shard; a DCP group is a handful of ranks, so a larger count is a mistake, refused
// before any thread starts (world_size = 10**6 must not try to spawn a million threads).
inline constexpr int kMaxInProcessRanks = 256;
// world_size in [1, kMaxInProcessRanks] (dcpmla::Error naming world_size otherwise).
void require_in_process_world(int world_size);

// Longest an in-process collective waits for its peers by default. It bounds a wait on a
// rank that failed without saying so or never calls the collective; it must exceed the
// longest computation between two collectives (a large CPU attention step takes minutes).
inline constexpr std::chrono::milliseconds kDefaultCollectiveTimeout = std::chrono::minutes(10);
// Longest timeout any communicator takes: a year. Waits convert it to nanoseconds on the steady
// clock, which a timeout of about 292 years overflows (milliseconds::max() then timed out at
// once); a caller who wants no practical bound passes this.
inline constexpr std::chrono::milliseconds kMaxCollectiveTimeout = std::chrono::hours(24 * 365);
// Every communicator's check of its timeout: in (0, kMaxCollectiveTimeout].
void require_timeout(std::chrono::milliseconds timeout);

// Ranks as threads of one process over host memory, whoever drives them (run_ranks or the
// caller's own threads). A rank that fails aborts the group, and the others' collectives
// raise dcpmla::Error instead of waiting forever: a rank fails when its communicator's
// abort() is called (the library's entry points do this when they throw), when its
// communicator is destroyed by an exception unwinding past it, or when a collective waits
// longer than `timeout` for it.
class InProcessGroup {
 public:
  explicit InProcessGroup(int world_size, std::chrono::milliseconds timeout = kDefaultCollectiveTimeout);
  ~InProcessGroup();
  int world_size() const;
  std::unique_ptr<Communicator> communicator(int rank);
  void abort();
  // The rank whose failure aborted the group first, or -1.
  int failed_rank() const;

  struct State;

 private:
  std::shared_ptr<State> state_;
};

// Runs fn(rank, comm) on world_size threads over one InProcessGroup and rethrows the
// first rank's exception (others are aborted rather than left waiting).
void run_ranks(int world_size, const std::function<void(int, Communicator&)>& fn);

}  // namespace dcpmla
