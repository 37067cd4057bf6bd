// Ranks as threads of one process: the barrier they meet at and the way they are run. The
// in-process host group (comm.cpp) and the device group (cuda/comm_device.cpp) share both.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

#include "dcpmla/error.h"

namespace dcpmla {

// Meets generation by generation. abort() releases every waiter; with a timeout, a wait
// that outlasts it aborts the group, since a peer that never arrives would otherwise hold
// the others forever.
class RankBarrier {
 public:
  enum class Outcome { passed, aborted, timed_out };

  // timeout = 0: wait as long as it takes (a failing rank still aborts the group).
  explicit RankBarrier(int world, std::chrono::milliseconds timeout = std::chrono::milliseconds::zero())
      : world_(world), timeout_(timeout) {}

  Outcome arrive_and_wait() {
    std::unique_lock lock(mutex_);
    if (aborted_) return Outcome::aborted;
    const uint64_t gen = generation_;
    if (++arrived_ == world_) {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
      return Outcome::passed;
    }
    const auto released = [&] { return generation_ != gen || aborted_; };
    if (timeout_.count() == 0) {
      cv_.wait(lock, released);
    } else if (!cv_.wait_for(lock, timeout_, released)) {
      aborted_ = true;
      cv_.notify_all();
      return Outcome::timed_out;
    }
    // A generation that completed has passed, even if a rank aborted right after leaving it
    // (a rank that finished its last collective and then failed must not fail this one).
    return generation_ != gen ? Outcome::passed : Outcome::aborted;
  }

  // The end of a read phase that every rank entered together (arrive_and_wait passed): no rank
  // can fail inside it, and one released early would free a buffer its peers still copy from.
  // So neither abort() nor the timeout releases this wait; an abort holds for the next one.
  void arrive_and_wait_all() {
    std::unique_lock lock(mutex_);
    const uint64_t gen = generation_;
    if (++arrived_ == world_) {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
      return;
    }
    cv_.wait(lock, [&] { return generation_ != gen; });
  }

  void abort() {
    std::lock_guard lock(mutex_);
    aborted_ = true;
    cv_.notify_all();
  }

 private:
  const int world_;
  const std::chrono::milliseconds timeout_;
  std::mutex mutex_;
  std::condition_variable cv_;
  uint64_t generation_ = 0;
  int arrived_ = 0;
  bool aborted_ = false;
};

// One live communicator per rank of a group: a second one for a rank would take a peer's place
// at the barrier, and the collective would read that peer's stale buffers.
class RankClaims {
 public:
  explicit RankClaims(int world) : taken_(std::make_unique<std::atomic<bool>[]>(size_t(world))) {}
  void claim(int rank) {
    if (taken_[size_t(rank)].exchange(true))
      fail("rank", rank, "a rank of this group with no live communicator (one communicator per rank at a time)");
  }
  void release(int rank) { taken_[size_t(rank)].store(false); }

 private:
  std::unique_ptr<std::atomic<bool>[]> taken_;
};

// Runs body(rank) on `world` threads. The first exception is kept and abort() is called at
// once, so the other ranks leave their collectives instead of waiting for the failed one;
// returned (not rethrown) so that the caller can release what the ranks used first. A thread
// that cannot be started (a process or memory limit) is such a failure too: the ranks already
// started are aborted and joined (a joinable std::thread destroyed by the unwinding would
// terminate the process).
inline std::exception_ptr run_rank_threads(int world, const std::function<void(int)>& body,
                                           const std::function<void()>& abort) {
  std::mutex mutex;
  std::exception_ptr first;
  const auto keep_first = [&](std::exception_ptr e) {
    std::lock_guard lock(mutex);
    if (!first) first = std::move(e);
  };
  std::vector<std::thread> threads;
  threads.reserve(size_t(world));
  for (int r = 0; r < world; ++r) {
    try {
      threads.emplace_back([&, r] {
        try {
          body(r);
        } catch (...) {
          keep_first(std::current_exception());
          abort();
        }
      });
    } catch (const std::system_error& e) {
      keep_first(std::make_exception_ptr(make_error(
          "world_size", world,
          fmt::format("ranks that can each start a thread here (starting rank {}'s failed: {})", r, e.what()))));
      abort();
      break;
    }
  }
  for (auto& t : threads) t.join();
  return first;
}

}  // namespace dcpmla
