// The CPU backend's parallel loop (src/cpu/parallel.h): every index once, and an exception
// thrown inside reaches the caller instead of ending the process.
#include "cpu/parallel.h"

#include <gtest/gtest.h>

#include <atomic>
#include <new>
#include <stdexcept>
#include <vector>

namespace dcpmla::detail {
namespace {

const Schedule kSchedules[] = {Schedule::even, Schedule::dynamic};

TEST(ParallelFor, RunsEveryIndexOnce) {
  for (Schedule schedule : kSchedules) {
    std::vector<std::atomic<int>> seen(1000);
    parallel_for(int64_t(seen.size()), schedule, [&](int64_t i) { ++seen[size_t(i)]; });
    for (const auto& n : seen) EXPECT_EQ(n.load(), 1);
    parallel_for(0, schedule, [](int64_t) { FAIL() << "a body ran for n = 0"; });
  }
}

// An exception may not leave an OpenMP region: before this loop an allocation that failed in
// the CPU kernels' scratch ended the process in std::terminate (the twelfth audit). Now the
// first one thrown is rethrown, type kept, and the indices not yet begun are skipped.
TEST(ParallelFor, RethrowsTheFirstExceptionOnTheCaller) {
  for (Schedule schedule : kSchedules) {
    std::atomic<int64_t> ran{0};
    EXPECT_THROW(parallel_for(100000, schedule,
                              [&](int64_t i) {
                                ++ran;
                                if (i % 1000 == 7) throw std::bad_alloc();
                              }),
                 std::bad_alloc);
    EXPECT_LT(ran.load(), 100000);
    EXPECT_THROW(parallel_for(3, schedule, [](int64_t) { throw std::runtime_error("body"); }), std::runtime_error);
  }
  EXPECT_GE(parallel_threads(), 1);
}

}  // namespace
}  // namespace dcpmla::detail
