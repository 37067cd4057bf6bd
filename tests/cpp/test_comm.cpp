#include "dcpmla/comm.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <numeric>

#include "dcpmla/error.h"
#include "dcpmla/numeric.h"
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
