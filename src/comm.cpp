#include "dcpmla/comm.h"

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <mutex>
#include <omp.h>
#include <thread>
#include <vector>

#include "dcpmla/error.h"
#include "dcpmla/numeric.h"

namespace dcpmla {

size_t size_of(DataType t) { return t == DataType::bf16 ? 2 : 4; }

// Ranks meet at a generation barrier; each collective publishes its send buffer, lets every
// rank read what it needs, and meets again before anyone reuses a buffer.
struct InProcessGroup::State {
  explicit State(int n) : world(n), sends(size_t(n), nullptr) {}

  void barrier() {
    std::unique_lock lock(mutex);
    if (aborted) throw Error("dcpmla: in-process collective aborted: another rank failed");
    const uint64_t gen = generation;
    if (++arrived == world) {
      arrived = 0;
      ++generation;
      cv.notify_all();
      return;
    }
    cv.wait(lock, [&] { return generation != gen || aborted; });
    if (aborted) throw Error("dcpmla: in-process collective aborted: another rank failed");
  }

  void abort() {
    std::lock_guard lock(mutex);
    aborted = true;
    cv.notify_all();
  }

  const int world;
  std::vector<const void*> sends;
  std::mutex mutex;
  std::condition_variable cv;
  uint64_t generation = 0;
  int arrived = 0;
  bool aborted = false;
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
      : state_(std::move(state)), rank_(rank) {}

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

  void barrier() override { state_->barrier(); }

 private:
  template <class Read>
  void exchange(const void* send, Read read) {
    state_->sends[size_t(rank_)] = send;
    state_->barrier();
    for (int p = 0; p < state_->world; ++p) read(p, state_->sends[size_t(p)]);
    state_->barrier();
  }

  std::shared_ptr<InProcessGroup::State> state_;
  int rank_;
};

}  // namespace

InProcessGroup::InProcessGroup(int world_size) {
  require(world_size >= 1 && world_size <= kMaxInProcessRanks, "world_size", world_size,
          fmt::format("in [1, {}] for in-process ranks (threads)", kMaxInProcessRanks));
  state_ = std::make_shared<State>(world_size);
}
InProcessGroup::~InProcessGroup() = default;
int InProcessGroup::world_size() const { return state_->world; }
void InProcessGroup::abort() { state_->abort(); }

std::unique_ptr<Communicator> InProcessGroup::communicator(int rank) {
  require(rank >= 0 && rank < state_->world, "rank", rank,
          fmt::format("0 <= rank < world_size ({})", state_->world));
  return std::make_unique<InProcessComm>(state_, rank);
}

void run_ranks(int world_size, const std::function<void(int, Communicator&)>& fn) {
  InProcessGroup group(world_size);
  std::mutex mutex;
  std::exception_ptr first;
  std::vector<std::thread> threads;
  for (int r = 0; r < world_size; ++r)
    threads.emplace_back([&, r] {
      // Ranks share the cores: each rank's kernels get its share, so threads do not
      // oversubscribe the machine and spin against each other.
      omp_set_num_threads(std::max(1, omp_get_max_threads() / world_size));
      try {
        auto comm = group.communicator(r);
        fn(r, *comm);
      } catch (...) {
        {
          std::lock_guard lock(mutex);
          if (!first) first = std::current_exception();
        }
        group.abort();
      }
    });
  for (auto& t : threads) t.join();
  if (first) std::rethrow_exception(first);
}

}  // namespace dcpmla
