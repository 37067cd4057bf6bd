#include "dcpmla/comm.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <exception>
#include <omp.h>
#include <utility>
#include <vector>

#include "dcpmla/error.h"
#include "dcpmla/numeric.h"
#include "rank_threads.h"

namespace dcpmla {

namespace {

constexpr const char* kKnownTypes = "a DataType: f32 (0), bf16 (1) or i32 (2)";

}  // namespace

size_t size_of(DataType t) {
  switch (t) {
    case DataType::f32: return 4;
    case DataType::bf16: return 2;
    case DataType::i32: return 4;
  }
  fail("dtype", int32_t(t), kKnownTypes);
}

void fail_collective_args(const char* op, const void* send, const void* recv, size_t count, DataType t,
                          int world_size) {
  if (!is_known(t)) fail("dtype", int32_t(t), fmt::format("{} (in {})", kKnownTypes, op));
  if (count > 0 && send == nullptr)
    fail("send", "null", fmt::format("a buffer (in {}, count = {})", op, count));
  if (count > 0 && recv == nullptr)
    fail("recv", "null", fmt::format("a buffer (in {}, count = {})", op, count));
  for (const auto& [field, at] : {std::pair<const char*, const void*>{"send", send}, {"recv", recv}})
    require_aligned(at, size_of(t), field,
                    fmt::format("{}-byte aligned memory (whole elements, in {})", size_of(t), op));
  fail("count", count,
       fmt::format("at most {} (in {}: count x element bytes x world_size ({}) must fit size_t)",
                   max_collective_count(world_size), op, world_size));
}

namespace detail {

const char* name_of(Collective c) {
  switch (c) {
    case Collective::all_gather: return "all_gather";
    case Collective::reduce_scatter_sum: return "reduce_scatter_sum";
    case Collective::all_to_all: return "all_to_all";
    case Collective::barrier: return "barrier";
  }
  return "?";
}

void fail_disagreement(const PublishedCall& rank0, const PublishedCall& other, int p) {
  if (other.op != rank0.op)
    fail("collective", fmt::format("{} (rank {})", name_of(other.op), p),
         fmt::format("the same collective on every rank (rank 0 called {})", name_of(rank0.op)));
  if (other.count != rank0.count)
    fail("count", fmt::format("{} (rank {}, {})", other.count, p, name_of(other.op)),
         fmt::format("the same on every rank (rank 0: {})", rank0.count));
  fail("dtype", fmt::format("{} (rank {}, {})", int32_t(other.dtype), p, name_of(other.op)),
       fmt::format("the same on every rank (rank 0: {})", int32_t(rank0.dtype)));
}

}  // namespace detail

// Ranks meet at a generation barrier; each collective publishes its send buffer, lets every
// rank read what it needs, and meets again before anyone reuses a buffer.
struct InProcessGroup::State {
  State(int n, std::chrono::milliseconds t) : world(n), timeout(t), calls(size_t(n)), rendezvous(n, t), claims(n) {}

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
  std::vector<detail::PublishedCall> calls;  // each rank's call of the current collective
  RankBarrier rendezvous;
  RankClaims claims;
  std::atomic<int> failed_rank{-1};  // -1: aborted by InProcessGroup::abort(), or not at all
};

namespace {

using detail::Collective;

// f32 and bf16 sum in float (i32 sums in int64: reduce_scatter_sum).
void add_into(float* acc, const void* src, size_t count, DataType t) {
  if (t == DataType::f32) {
    const auto* s = static_cast<const float*>(src);
    for (size_t i = 0; i < count; ++i) acc[i] += s[i];
  } else {
    const auto* s = static_cast<const bf16*>(src);
    for (size_t i = 0; i < count; ++i) acc[i] += bf16_to_float(s[i]);
  }
}

void store_from(const float* acc, void* dst, size_t count, DataType t) {
  if (t == DataType::f32) {
    for (size_t i = 0; i < count; ++i) static_cast<float*>(dst)[i] = acc[i];
  } else {
    for (size_t i = 0; i < count; ++i) static_cast<bf16*>(dst)[i] = float_to_bf16(acc[i]);
  }
}

class InProcessComm final : public Communicator {
 public:
  InProcessComm(std::shared_ptr<InProcessGroup::State> state, int rank)
      : state_(std::move(state)), rank_(rank), unwinding_at_birth_(std::uncaught_exceptions()) {
    state_->claims.claim(rank_);  // a refused claim constructs nothing, so releases nothing
  }
  // Destroyed by an exception on its way out of the rank's code: that rank has failed, and
  // no peer may wait for it.
  ~InProcessComm() override {
    if (std::uncaught_exceptions() > unwinding_at_birth_) abort();
    state_->claims.release(rank_);
  }

  int rank() const override { return rank_; }
  int world_size() const override { return state_->world; }

  void all_gather(const void* send, void* recv, size_t count, DataType t) override {
    check_collective_args_or_abort(*this, "all_gather", send, recv, count, t);
    const size_t bytes = count * size_of(t);
    exchange(Collective::all_gather, send, count, t, [&](int p, const void* src) {
      std::memcpy(static_cast<char*>(recv) + size_t(p) * bytes, src, bytes);
    });
  }

  void reduce_scatter_sum(const void* send, void* recv, size_t count, DataType t) override {
    check_collective_args_or_abort(*this, "reduce_scatter_sum", send, recv, count, t);
    const size_t offset = size_t(rank_) * count * size_of(t);
    if (t == DataType::i32) {  // exactly in int64, wrapped to int32 like MPI's and the device group's sums
      std::vector<int64_t> acc(count, 0);
      exchange(Collective::reduce_scatter_sum, send, count, t, [&](int, const void* src) {
        const auto* s = reinterpret_cast<const int32_t*>(static_cast<const char*>(src) + offset);
        for (size_t i = 0; i < count; ++i) acc[i] += s[i];
      });
      for (size_t i = 0; i < count; ++i) static_cast<int32_t*>(recv)[i] = int32_t(uint32_t(uint64_t(acc[i])));
      return;
    }
    std::vector<float> acc(count, 0.0f);
    exchange(Collective::reduce_scatter_sum, send, count, t,
             [&](int, const void* src) { add_into(acc.data(), static_cast<const char*>(src) + offset, count, t); });
    store_from(acc.data(), recv, count, t);
  }

  void all_to_all(const void* send, void* recv, size_t count, DataType t) override {
    check_collective_args_or_abort(*this, "all_to_all", send, recv, count, t);
    const size_t bytes = count * size_of(t);
    exchange(Collective::all_to_all, send, count, t, [&](int p, const void* src) {
      std::memcpy(static_cast<char*>(recv) + size_t(p) * bytes,
                  static_cast<const char*>(src) + size_t(rank_) * bytes, bytes);
    });
  }

  // Published like a collective, so that a rank in barrier() and a peer in a collective
  // both raise instead of the peer reading a stale buffer.
  void barrier() override {
    exchange(Collective::barrier, nullptr, 0, DataType::f32, [](int, const void*) {});
  }
  void abort() override { state_->abort(rank_); }

 private:
  // Publishes this rank's call, then reads every rank's send buffer between two barriers
  // (all published; all read before anyone reuses a buffer). When the ranks' calls differ
  // (collective, count or dtype) nobody reads: every rank passes the second barrier and
  // raises the same error, and the group stays usable.
  template <class Read>
  void exchange(Collective op, const void* send, size_t count, DataType t, Read read) {
    auto& calls = state_->calls;
    calls[size_t(rank_)] = {send, count, t, op};
    state_->barrier(rank_);
    const int bad = detail::disagreeing_rank(calls.data(), state_->world);
    detail::PublishedCall first, other;
    if (bad < 0) {
      // count 0 reads nothing (and its buffers may be null: memcpy of null is undefined).
      for (int p = 0; p < state_->world && count > 0; ++p) read(p, calls[size_t(p)].send);
    } else {
      first = calls[0];
      other = calls[size_t(bad)];
    }
    state_->rendezvous.arrive_and_wait_all();  // every rank has passed the first: none may leave early
    if (bad >= 0) [[unlikely]]
      detail::fail_disagreement(first, other, bad);
  }

  std::shared_ptr<InProcessGroup::State> state_;
  int rank_;
  int unwinding_at_birth_;
};

}  // namespace

void require_timeout(std::chrono::milliseconds timeout) {
  if (timeout.count() <= 0 || timeout > kMaxCollectiveTimeout)
    fail("timeout", fmt::format("{} ms", timeout.count()),
         fmt::format("in (0, {}] ms (a bound on every wait, at most a year)", kMaxCollectiveTimeout.count()));
}

void require_in_process_world(int world_size) {
  if (world_size < 1 || world_size > kMaxInProcessRanks)
    fail("world_size", world_size, fmt::format("in [1, {}] for in-process ranks (threads)", kMaxInProcessRanks));
}

InProcessGroup::InProcessGroup(int world_size, std::chrono::milliseconds timeout) {
  require_in_process_world(world_size);
  require_timeout(timeout);
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
