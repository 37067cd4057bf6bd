#include "dcpmla/comm.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <exception>
#include <omp.h>
#include <vector>

#include "dcpmla/error.h"
#include "dcpmla/numeric.h"
#include "rank_threads.h"

namespace dcpmla {

size_t size_of(DataType t) { return t == DataType::bf16 ? 2 : 4; }

// Ranks meet at a generation barrier; each collective publishes its send buffer, lets every
// rank read what it needs, and meets again before anyone reuses a buffer.
struct InProcessGroup::State {
  State(int n, std::chrono::milliseconds t) : world(n), timeout(t), sends(size_t(n), nullptr), rendezvous(n, t) {}

  void barrier(int rank) {
    switch (rendezvous.arrive_and_wait()) {
      case RankBarrier::Outcome::passed:
        return;
      case RankBarrier::Outcome::timed_out:
        throw Error(fmt::format("dcpmla: in-process collective (rank {}): the other ranks did not arrive within {} ms "
                                "(a rank failed without aborting the group, or never called this collective); "
                                "the group is aborted",
                                rank, timeout.count()));
      case RankBarrier::Outcome::aborted:
        break;
    }
    const int failed = failed_rank.load();
    throw Error(failed >= 0 ? fmt::format("dcpmla: in-process collective (rank {}) aborted: rank {} failed", rank, failed)
                            : fmt::format("dcpmla: in-process collective (rank {}) aborted", rank));
  }
  void abort(int rank) {
    int none = -1;
    failed_rank.compare_exchange_strong(none, rank);  // the first failure is the cause
    rendezvous.abort();
  }

  const int world;
  const std::chrono::milliseconds timeout;
  std::vector<const void*> sends;
  RankBarrier rendezvous;
  std::atomic<int> failed_rank{-1};  // -1: aborted by InProcessGroup::abort(), or not at all
};

namespace {

void add_into(float* acc, const void* src, size_t count, DataType t) {
  if (t == DataType::f32) {
    const auto* s = static_cast<const float*>(src);
    for (size_t i = 0; i < count; ++i) acc[i] += s[i];
  } else if (t == DataType::bf16) {
    const auto* s = static_cast<const bf16*>(src);
    for (size_t i = 0; i < count; ++i) acc[i] += bf16_to_float(s[i]);
  } else {
    const auto* s = static_cast<const int32_t*>(src);
    for (size_t i = 0; i < count; ++i) acc[i] += float(s[i]);
  }
}

void store_from(const float* acc, void* dst, size_t count, DataType t) {
  for (size_t i = 0; i < count; ++i) {
    if (t == DataType::f32) static_cast<float*>(dst)[i] = acc[i];
    else if (t == DataType::bf16) static_cast<bf16*>(dst)[i] = float_to_bf16(acc[i]);
    else static_cast<int32_t*>(dst)[i] = int32_t(acc[i]);
  }
}

class InProcessComm final : public Communicator {
 public:
  InProcessComm(std::shared_ptr<InProcessGroup::State> state, int rank)
      : state_(std::move(state)), rank_(rank), unwinding_at_birth_(std::uncaught_exceptions()) {}
  // Destroyed by an exception on its way out of the rank's code: that rank has failed, and
  // no peer may wait for it.
  ~InProcessComm() override {
    if (std::uncaught_exceptions() > unwinding_at_birth_) abort();
  }

  int rank() const override { return rank_; }
  int world_size() const override { return state_->world; }

  void all_gather(const void* send, void* recv, size_t count, DataType t) override {
    const size_t bytes = count * size_of(t);
    exchange(send, [&](int p, const void* src) {
      std::memcpy(static_cast<char*>(recv) + size_t(p) * bytes, src, bytes);
    });
  }

  void reduce_scatter_sum(const void* send, void* recv, size_t count, DataType t) override {
    std::vector<float> acc(count, 0.0f);
    const size_t offset = size_t(rank_) * count * size_of(t);
    exchange(send, [&](int, const void* src) { add_into(acc.data(), static_cast<const char*>(src) + offset, count, t); });
    store_from(acc.data(), recv, count, t);
  }

  void all_to_all(const void* send, void* recv, size_t count, DataType t) override {
    const size_t bytes = count * size_of(t);
    exchange(send, [&](int p, const void* src) {
      std::memcpy(static_cast<char*>(recv) + size_t(p) * bytes,
                  static_cast<const char*>(src) + size_t(rank_) * bytes, bytes);
    });
  }

  void barrier() override { state_->barrier(rank_); }
  void abort() override { state_->abort(rank_); }

 private:
  template <class Read>
  void exchange(const void* send, Read read) {
    state_->sends[size_t(rank_)] = send;
    state_->barrier(rank_);
    for (int p = 0; p < state_->world; ++p) read(p, state_->sends[size_t(p)]);
    state_->barrier(rank_);
  }

  std::shared_ptr<InProcessGroup::State> state_;
  int rank_;
  int unwinding_at_birth_;
};

}  // namespace

InProcessGroup::InProcessGroup(int world_size, std::chrono::milliseconds timeout) {
  require(world_size >= 1 && world_size <= kMaxInProcessRanks, "world_size", world_size,
          fmt::format("in [1, {}] for in-process ranks (threads)", kMaxInProcessRanks));
  require(timeout.count() > 0, "timeout", fmt::format("{} ms", timeout.count()), "> 0 (a bound on every wait)");
  state_ = std::make_shared<State>(world_size, timeout);
}
InProcessGroup::~InProcessGroup() = default;
int InProcessGroup::world_size() const { return state_->world; }
void InProcessGroup::abort() { state_->rendezvous.abort(); }
int InProcessGroup::failed_rank() const { return state_->failed_rank.load(); }

std::unique_ptr<Communicator> InProcessGroup::communicator(int rank) {
  require(rank >= 0 && rank < state_->world, "rank", rank,
          fmt::format("0 <= rank < world_size ({})", state_->world));
  return std::make_unique<InProcessComm>(state_, rank);
}

void run_ranks(int world_size, const std::function<void(int, Communicator&)>& fn) {
  InProcessGroup group(world_size);
  std::vector<std::exception_ptr> errors(static_cast<size_t>(world_size));
  const std::exception_ptr first = run_rank_threads(
      world_size,
      [&](int r) {
        // Ranks share the cores: each rank's kernels get its share, so threads do not
        // oversubscribe the machine and spin against each other.
        omp_set_num_threads(std::max(1, omp_get_max_threads() / world_size));
        try {
          auto comm = group.communicator(r);
          fn(r, *comm);
        } catch (...) {
          errors[size_t(r)] = std::current_exception();
          throw;
        }
      },
      [&] { group.abort(); });
  // The rank that aborted the group holds the cause; the others only report the abort, and
  // one of them may have been recorded first.
  const int cause = group.failed_rank();
  if (cause >= 0 && errors[size_t(cause)]) std::rethrow_exception(errors[size_t(cause)]);
  if (first) std::rethrow_exception(first);
}

}  // namespace dcpmla
