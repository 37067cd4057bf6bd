#include "dcpmla/comm.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <numeric>
#include <stdexcept>
#include <string>
#include <thread>

#include "dcpmla/error.h"
#include "dcpmla/numeric.h"
#include "dcpmla/runner.h"
#include "test_helpers.h"
#include "../../src/rank_threads.h"

namespace dcpmla {

TEST(Comm, CollectivesMoveTheRightData) {
  for (int n = 1; n <= 5; ++n) {
    const size_t count = 3;
    run_ranks(n, [&](int r, Communicator& comm) {
      ASSERT_EQ(comm.rank(), r);
      ASSERT_EQ(comm.world_size(), n);
      std::vector<float> send(count * size_t(n));
      for (size_t i = 0; i < send.size(); ++i) send[i] = float(100 * r + int(i));
      std::vector<float> gathered(count * size_t(n));
      comm.all_gather(send.data(), gathered.data(), count, DataType::f32);
      for (int p = 0; p < n; ++p)
        for (size_t i = 0; i < count; ++i) ASSERT_EQ(gathered[size_t(p) * count + i], float(100 * p + int(i)));
      std::vector<float> reduced(count);
      comm.reduce_scatter_sum(send.data(), reduced.data(), count, DataType::f32);
      for (size_t i = 0; i < count; ++i) {
        float want = 0;
        for (int p = 0; p < n; ++p) want += float(100 * p + int(size_t(r) * count + i));
        ASSERT_EQ(reduced[i], want);
      }
      std::vector<float> swapped(count * size_t(n));
      comm.all_to_all(send.data(), swapped.data(), count, DataType::f32);
      for (int p = 0; p < n; ++p)
        for (size_t i = 0; i < count; ++i)
          ASSERT_EQ(swapped[size_t(p) * count + i], float(100 * p + int(size_t(r) * count + i)));
      std::vector<bf16> hs(size_t(n), float_to_bf16(1.5f)), hr(1);
      comm.reduce_scatter_sum(hs.data(), hr.data(), 1, DataType::bf16);
      ASSERT_EQ(bf16_to_float(hr[0]), 1.5f * float(n));
      comm.barrier();
    });
  }
}

TEST(Comm, AFailingRankAbortsTheOthersInsteadOfHanging) {
  std::atomic<int> aborted{0};
  const auto start = std::chrono::steady_clock::now();
  try {
    run_ranks(4, [&](int r, Communicator& comm) {
      if (r == 2) throw Error("dcpmla: field 'seq_lens[0]' = -1: expected >= 0");
      try {
        comm.barrier();
      } catch (const Error&) {
        ++aborted;
        throw;
      }
    });
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("seq_lens[0]"), std::string::npos) << "the root cause is reported";
  }
  EXPECT_EQ(aborted.load(), 3);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
}

// The caller's own threads drive the group (no run_ranks): rank 1 is handed lengths it
// refuses and throws; rank 0, already in a collective, must raise instead of waiting forever.
TEST(Comm, ARankThatThrowsAbortsAGroupDrivenByUserThreads) {
  const int qlen = 1, heads = 2, dim = 576;
  const int64_t max_len = 8;
  const auto q = testing::random_normal(size_t(qlen) * heads * dim, 1);
  const auto kv = testing::random_normal(size_t(max_len) * dim, 2);
  const std::vector<int32_t> good{8}, bad{-1};
  AttentionOptions o;
  o.world_size = 2;
  o.mode = Mode::decode;
  InProcessGroup group(2);
  std::string errors[2];
  const auto start = std::chrono::steady_clock::now();
  auto rank = [&](int r) {
    auto comm = group.communicator(r);  // outlives the exception: the library must abort
    try {
      mla_attention_on_rank(q, kv, r == 1 ? bad : good, 1, qlen, heads, max_len, dim, o, *comm);
    } catch (const Error& e) {
      errors[r] = e.what();
    }
  };
  std::thread t0(rank, 0), t1(rank, 1);
  t0.join();
  t1.join();
  EXPECT_NE(errors[1].find("'seq_lens[0]' = -1"), std::string::npos) << errors[1];
  EXPECT_NE(errors[0].find("aborted: rank 1 failed"), std::string::npos) << errors[0];
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
}

// User code (not the library) throws while it holds the communicator: unwinding past it
// aborts the group.
TEST(Comm, UnwindingPastACommunicatorAbortsTheGroup) {
  InProcessGroup group(3);
  std::atomic<int> aborted{0};
  auto waiter = [&](int r) {
    auto comm = group.communicator(r);
    float x = 1.0f, all[3];
    try {
      comm->all_gather(&x, all, 1, DataType::f32);
    } catch (const Error& e) {
      aborted += std::string(e.what()).find("rank 2 failed") != std::string::npos;
    }
  };
  std::thread t0(waiter, 0), t1(waiter, 1);
  std::thread t2([&] {
    try {
      auto comm = group.communicator(2);
      throw std::runtime_error("the caller's own failure");
    } catch (const std::runtime_error&) {
    }
  });
  t0.join();
  t1.join();
  t2.join();
  EXPECT_EQ(aborted.load(), 2);
}

// A rank that never arrives (and never fails) is bounded by the group's timeout.
TEST(Comm, WaitsAreBoundedByTheGroupTimeout) {
  InProcessGroup group(2, std::chrono::milliseconds(100));
  auto silent = group.communicator(1);
  auto comm = group.communicator(0);
  const auto start = std::chrono::steady_clock::now();
  try {
    comm->barrier();
    FAIL() << "the barrier passed without rank 1";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("did not arrive within 100 ms"), std::string::npos) << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  EXPECT_THROW(silent->barrier(), Error) << "the group stays aborted";
  EXPECT_GT(kDefaultCollectiveTimeout.count(), 0) << "the default is a bound too";
  EXPECT_THROW(InProcessGroup(2, std::chrono::milliseconds(0)), Error);
}

// A rank that fails right after the last collective both ranks completed must not fail
// the peer's completed collective (the peer may not have woken up yet).
TEST(Comm, ACompletedGenerationPassesEvenIfARankAbortsRightAfter) {
  int aborted = 0;
  for (int i = 0; i < 200; ++i) {
    RankBarrier barrier(2);
    RankBarrier::Outcome first{};
    std::thread waiter([&] { first = barrier.arrive_and_wait(); });
    std::thread last([&] {
      barrier.arrive_and_wait();
      barrier.abort();
    });
    waiter.join();
    last.join();
    aborted += first != RankBarrier::Outcome::passed;
  }
  EXPECT_EQ(aborted, 0);
}

TEST(Comm, RankBarrierTimesOutAndAbortsTheGroup) {
  // One of two ranks never comes: the waiter gives up after the timeout and the group stays
  // aborted, so a late rank does not wait either.
  RankBarrier barrier(2, std::chrono::milliseconds(50));
  const auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(barrier.arrive_and_wait(), RankBarrier::Outcome::timed_out);
  EXPECT_GE(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(50));
  EXPECT_EQ(barrier.arrive_and_wait(), RankBarrier::Outcome::aborted);
  // Without a timeout, generations pass as long as every rank arrives.
  RankBarrier open(3);
  std::atomic<int> passed{0};
  const auto failed = run_rank_threads(
      3,
      [&](int) {
        for (int i = 0; i < 100; ++i) passed += open.arrive_and_wait() == RankBarrier::Outcome::passed;
      },
      [&] { open.abort(); });
  EXPECT_FALSE(failed);
  EXPECT_EQ(passed.load(), 300);
}

TEST(Comm, RefusesBadRanks) {
  EXPECT_THROW(InProcessGroup(0), Error);
  EXPECT_THROW(InProcessGroup(kMaxInProcessRanks + 1), Error);
  bool ran = false;
  EXPECT_THROW(run_ranks(1000000, [&](int, Communicator&) { ran = true; }), Error);
  EXPECT_FALSE(ran) << "no rank may start when the group is refused";
  InProcessGroup group(2);
  EXPECT_THROW(group.communicator(2), Error);
  EXPECT_THROW(group.communicator(-1), Error);
}

}  // namespace dcpmla
