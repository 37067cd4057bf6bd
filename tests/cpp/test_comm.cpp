#include "dcpmla/comm.h"

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <functional>
#include <iterator>
#include <latch>
#include <numeric>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

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
  // Rank 1 refused before the first collective: rank 0 learns it there (refuse_together), as
  // it must under MPI, whose ranks cannot abort each other.
  EXPECT_NE(errors[0].find("refused by rank 1"), std::string::npos) << errors[0];
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

// A rank thread that cannot start (a process or memory limit) ended the process: the unwinding
// destroyed the joinable threads already started (std::terminate; the sixtieth session's
// audit). Now the started ranks are aborted and joined, and the failure names world_size.
// Run in a child process whose address space leaves room for a few thread stacks only; its
// exit code says what happened (0: some ranks started, then the failure was reported).
[[noreturn]] void start_ranks_in_a_small_address_space() {
  long pages = 0;
  if (FILE* f = std::fopen("/proc/self/statm", "r")) {
    if (std::fscanf(f, "%ld", &pages) != 1) pages = 0;
    std::fclose(f);
  }
  const rlim_t room = rlim_t(pages) * rlim_t(sysconf(_SC_PAGESIZE)) + (rlim_t(64) << 20);
  const rlimit limit{room, room};
  if (pages == 0 || setrlimit(RLIMIT_AS, &limit) != 0) std::_Exit(2);
  RankBarrier barrier(256);
  std::atomic<int> ran{0};
  const auto failed = run_rank_threads(
      256,
      [&](int) {
        ++ran;
        barrier.arrive_and_wait();
      },
      [&] { barrier.abort(); });
  const std::string message = testing::error_of([&] {
    if (failed) std::rethrow_exception(failed);
  });
  std::_Exit(ran > 0 && ran < 256 && message.find("'world_size' = 256") != std::string::npos ? 0 : 3);
}

TEST(CommDeathTest, RankThreadsThatCannotStartAreAReportedFailure) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "an address-space limit and ASan's shadow memory do not mix";
#endif
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(start_ranks_in_a_small_address_space(), ::testing::ExitedWithCode(0), "");
}

namespace {

using testing::error_of;

// Runs fn(rank, comm) on the caller's threads over one group and returns each rank's error.
std::vector<std::string> errors_on_ranks(InProcessGroup& group, const std::function<void(int, Communicator&)>& fn) {
  std::vector<std::string> errors(size_t(group.world_size()));
  std::vector<std::thread> threads;
  for (int r = 0; r < group.world_size(); ++r)
    threads.emplace_back([&, r] {
      auto comm = group.communicator(r);
      errors[size_t(r)] = error_of([&] { fn(r, *comm); });
    });
  for (auto& t : threads) t.join();
  return errors;
}

bool has(const std::string& text, const std::string& needle) { return text.find(needle) != std::string::npos; }

}  // namespace

// An unknown DataType used to be treated as a 4-byte type (i32 in sums); it is refused by
// every collective, naming its value, and the peers raise at once instead of waiting.
TEST(Comm, RefusesAnUnknownDataType) {
  const auto bad = DataType(7);
  EXPECT_TRUE(has(error_of([&] { (void)size_of(bad); }), "'dtype' = 7")) << error_of([&] { (void)size_of(bad); });
  EXPECT_EQ(size_of(DataType::bf16), 2u);
  EXPECT_EQ(size_of(DataType::i32), 4u);
  std::vector<int32_t> send(8, 1), recv(8, 0);
  using Call = std::function<void(Communicator&)>;
  const std::vector<std::pair<std::string, Call>> calls{
      {"all_gather", [&](Communicator& c) { c.all_gather(send.data(), recv.data(), 2, bad); }},
      {"reduce_scatter_sum", [&](Communicator& c) { c.reduce_scatter_sum(send.data(), recv.data(), 2, bad); }},
      {"all_to_all", [&](Communicator& c) { c.all_to_all(send.data(), recv.data(), 2, bad); }},
      {"all_gather", [&](Communicator& c) { c.all_gather(send.data(), recv.data(), 2, DataType(-1)); }}};
  // The caller's threads, not run_ranks (which aborts the group for any rank that throws): only
  // the refusing rank's own abort releases its peer's barrier before the group's 30 s timeout.
  for (const auto& [op, call] : calls) {
    InProcessGroup group(2, std::chrono::seconds(30));
    const auto start = std::chrono::steady_clock::now();
    const auto errors = errors_on_ranks(group, [&](int r, Communicator& comm) {
      if (r == 0) call(comm);
      else comm.barrier();
    });
    EXPECT_TRUE(has(errors[0], "field 'dtype' = ") && has(errors[0], "f32 (0), bf16 (1) or i32 (2) (in " + op + ")"))
        << errors[0];
    EXPECT_TRUE(has(errors[1], "abort")) << "rank 1: " << errors[1];
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  }
  EXPECT_TRUE(has(error_of([&] {
                    run_ranks(1, [&](int, Communicator& c) { c.reduce_scatter_sum(send.data(), recv.data(), 2, bad); });
                  }),
                  "'dtype' = 7"));
  EXPECT_EQ(recv, std::vector<int32_t>(8, 0)) << "nothing was written";
}

TEST(Comm, RefusesNullBuffersAndCountsThatOverflow) {
  std::vector<float> buf(8, 1.0f);
  float* none = nullptr;
  const auto odd_bytes = [](float* p, int bytes) { return static_cast<void*>(reinterpret_cast<char*>(p) + bytes); };
  using Call = std::function<void(Communicator&)>;
  const std::vector<std::pair<std::string, Call>> calls{
      {"'send' = null", [&](Communicator& c) { c.all_gather(none, buf.data(), 1, DataType::f32); }},
      {"'recv' = null", [&](Communicator& c) { c.all_gather(buf.data(), none, 1, DataType::f32); }},
      {"'send' = null", [&](Communicator& c) { c.reduce_scatter_sum(none, buf.data(), 1, DataType::f32); }},
      {"'recv' = null", [&](Communicator& c) { c.reduce_scatter_sum(buf.data(), none, 1, DataType::bf16); }},
      {"'send' = null", [&](Communicator& c) { c.all_to_all(none, buf.data(), 1, DataType::i32); }},
      {"'recv' = null", [&](Communicator& c) { c.all_to_all(buf.data(), none, 1, DataType::i32); }},
      // count x bytes x ranks wraps size_t: a short copy (or a huge one) instead of an error
      {"'count' = 9223372036854775807",
       [&](Communicator& c) { c.all_gather(buf.data(), buf.data() + 4, size_t(INT64_MAX), DataType::f32); }},
      {"'count' = 4611686018427387904",
       [&](Communicator& c) { c.all_to_all(buf.data(), buf.data() + 4, size_t(1) << 62, DataType::bf16); }},
      // Elements split across their alignment: the reductions read and write them whole.
      {"'send' = address",
       [&](Communicator& c) { c.reduce_scatter_sum(odd_bytes(buf.data(), 2), buf.data() + 4, 1, DataType::f32); }},
      {"'recv' = address",
       [&](Communicator& c) { c.all_gather(buf.data(), odd_bytes(buf.data() + 4, 1), 1, DataType::bf16); }}};
  for (const auto& [needle, call] : calls) {
    const std::string e = error_of([&] { run_ranks(2, [&](int, Communicator& comm) { call(comm); }); });
    EXPECT_TRUE(has(e, needle)) << needle << " vs " << e;
  }
  // count = 0 moves nothing: null buffers are fine.
  run_ranks(3, [&](int, Communicator& c) {
    c.all_gather(nullptr, nullptr, 0, DataType::f32);
    c.reduce_scatter_sum(nullptr, nullptr, 0, DataType::i32);
    c.all_to_all(nullptr, nullptr, 0, DataType::bf16);
  });
}

// A refusal on one rank before the first collective: every rank raises after one exchange
// (the refusing rank its own error), and the group is not aborted.
TEST(Comm, OneRankRefusingMakesEveryRankRefuse) {
  InProcessGroup group(3, std::chrono::seconds(5));
  const auto errors = errors_on_ranks(group, [](int r, Communicator& c) {
    std::exception_ptr refused;
    if (r == 1) refused = std::make_exception_ptr(Error("dcpmla: field 'heads' = 0: expected >= 1"));
    refuse_together(c, refused, "the test's set-up");
  });
  EXPECT_EQ(errors[1], "dcpmla: field 'heads' = 0: expected >= 1");
  for (int r : {0, 2})
    EXPECT_TRUE(has(errors[size_t(r)], "the test's set-up: refused by rank 1")) << errors[size_t(r)];
  // Nobody refused: nobody raises.
  for (const std::string& e : errors_on_ranks(group, [](int, Communicator& c) { refuse_together(c, nullptr, "x"); }))
    EXPECT_EQ(e, "");
}

// A rank that refused its own input keeps its own error even when the exchange that tells
// its peers fails (a peer that never comes, or one that already aborted the group): the
// collective's error named no field, after the group's whole timeout.
TEST(Comm, ARefusingRankKeepsItsOwnErrorWhenTheExchangeFails) {
  const auto refusal = std::make_exception_ptr(Error("dcpmla: field 'seq_lens[0]' = -1: expected >= 0"));
  InProcessGroup silent(2, std::chrono::milliseconds(200));
  const auto peer = silent.communicator(1);  // never calls
  const auto comm = silent.communicator(0);
  EXPECT_EQ(testing::error_of([&] { refuse_together(*comm, refusal, "set-up"); }),
            "dcpmla: field 'seq_lens[0]' = -1: expected >= 0");
  InProcessGroup aborted(2);
  aborted.abort();
  const auto first = aborted.communicator(0);
  EXPECT_EQ(testing::error_of([&] { refuse_together(*first, refusal, "set-up"); }),
            "dcpmla: field 'seq_lens[0]' = -1: expected >= 0");
  EXPECT_TRUE(has(testing::error_of([&] { refuse_together(*first, nullptr, "set-up"); }), "aborted"))
      << "a rank with nothing to refuse reports the collective's error";
}

// Ranks that disagree on the collective, its count or its dtype used to read past a peer's
// buffer; every rank now raises the same error naming the field, and the group stays usable.
TEST(Comm, RanksThatDisagreeOnACollectiveAllRaise) {
  InProcessGroup group(3, std::chrono::seconds(5));
  std::vector<float> send(64, 1.0f), recv(64, 0.0f);
  auto check_all = [&](const std::vector<std::string>& errors, const std::string& needle) {
    for (size_t r = 0; r < errors.size(); ++r) {
      EXPECT_TRUE(has(errors[r], needle)) << "rank " << r << ": " << errors[r];
      EXPECT_EQ(errors[r], errors[0]) << "the same message on every rank";
    }
  };
  check_all(errors_on_ranks(group,
                            [&](int r, Communicator& c) {
                              auto s = send, v = recv;
                              c.all_gather(s.data(), v.data(), r == 2 ? 5 : 3, DataType::f32);
                            }),
            "field 'count' = 5 (rank 2, all_gather): expected the same on every rank (rank 0: 3)");
  check_all(errors_on_ranks(group,
                            [&](int r, Communicator& c) {
                              auto s = send, v = recv;
                              c.reduce_scatter_sum(s.data(), v.data(), 4, r == 1 ? DataType::bf16 : DataType::f32);
                            }),
            "field 'dtype' = 1 (rank 1, reduce_scatter_sum): expected the same on every rank (rank 0: 0)");
  check_all(errors_on_ranks(group,
                            [&](int r, Communicator& c) {
                              auto s = send, v = recv;
                              if (r == 1) c.barrier();
                              else c.all_to_all(s.data(), v.data(), 2, DataType::f32);
                            }),
            "field 'collective' = barrier (rank 1): expected the same collective on every rank (rank 0 called "
            "all_to_all)");
  // The group was not aborted: the ranks go on.
  const auto after = errors_on_ranks(group, [&](int r, Communicator& c) {
    const int32_t mine = r;
    int32_t all[3] = {-1, -1, -1};
    c.all_gather(&mine, all, 1, DataType::i32);
    if (all[0] != 0 || all[1] != 1 || all[2] != 2) throw Error("wrong all_gather after a refused one");
  });
  for (const std::string& e : after) EXPECT_EQ(e, "");
  EXPECT_EQ(group.failed_rank(), -1);
}

// The i32 reduce-scatter used to sum through float, exact only up to 2**24; MPI and the
// device group sum exactly.
TEST(Comm, Int32ReduceScatterIsExact) {
  const int n = 3;
  const size_t count = 4;
  const int32_t values[count] = {(1 << 24) + 1, 1 << 30, -((1 << 24) + 3), 123456789};
  run_ranks(n, [&](int r, Communicator& comm) {
    std::vector<int32_t> send(count * n), recv(count, 0);
    for (int p = 0; p < n; ++p)
      for (size_t i = 0; i < count; ++i) send[size_t(p) * count + i] = i == 1 && r > 0 ? 1 : values[i] + r;
    comm.reduce_scatter_sum(send.data(), recv.data(), count, DataType::i32);
    for (size_t i = 0; i < count; ++i) {
      const int64_t want = i == 1 ? int64_t(values[1]) + 2 : int64_t(values[i]) * n + 0 + 1 + 2;
      EXPECT_EQ(recv[i], want) << "rank " << r << " element " << i;
    }
  });
}

// milliseconds::max() overflowed the steady clock's nanoseconds in every wait, which then timed
// out at once; timeouts are bounded by a year.
TEST(Comm, TimeoutsAreBoundedByAYear) {
  testing::expect_error([] { InProcessGroup g(2, std::chrono::milliseconds::max()); }, "'timeout' = ");
  testing::expect_error([] { InProcessGroup g(2, kMaxCollectiveTimeout + std::chrono::milliseconds(1)); },
                        "at most a year");
  testing::expect_error([] { InProcessGroup g(2, std::chrono::milliseconds(0)); }, "'timeout' = 0 ms");
  // The longest allowed: two ranks meet at a barrier without a spurious timeout.
  InProcessGroup group(2, kMaxCollectiveTimeout);
  std::vector<std::unique_ptr<Communicator>> comms;
  for (int r = 0; r < 2; ++r) comms.push_back(group.communicator(r));
  std::thread peer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    comms[1]->barrier();
  });
  EXPECT_NO_THROW(comms[0]->barrier());
  peer.join();
}

// Ranks whose options differ in what their partials depend on used to be merged into a wrong
// answer (interleave: out off by 0.9; qlens {1, 3} against {3, 1}: by 1.3). Each is refused on
// every rank before any partial is exchanged.
TEST(Comm, RanksThatDisagreeOnTheirOptionsAreRefused) {
  const int heads = 2, dim = 576, qlen = 3;
  const int64_t max_len = 40;
  const auto q = testing::random_normal(size_t(2) * qlen * heads * dim, 1);
  const auto kv = testing::random_normal(size_t(2) * max_len * dim, 2);
  const std::vector<int32_t> lens{40, 33};
  AttentionOptions base;
  base.world_size = 2;
  base.mode = Mode::draft;
  base.block_size = 16;
  const std::vector<std::pair<std::string, std::function<void(AttentionOptions&)>>> changes{
      {"interleave", [](AttentionOptions& o) { o.interleave = 2; }},
      {"mode", [](AttentionOptions& o) { o.mode = Mode::verify; }},
      {"softmax_scale", [](AttentionOptions& o) { o.softmax_scale = 0.01f; }},
      {"kv_dtype", [](AttentionOptions& o) {
         o.kv_dtype = KvDtype::fp8_e4m3;
         o.kv_scale = 0.05f;
       }},
      {"qlens", [](AttentionOptions& o) { o.qlens = {3, 1}; }}};
  for (const auto& [what, change] : changes) {
    InProcessGroup group(2, std::chrono::seconds(20));
    const auto errors = errors_on_ranks(group, [&](int r, Communicator& comm) {
      AttentionOptions o = base;
      if (what == "qlens") o.qlens = {1, 3};  // 4 rows on both ranks
      if (r == 1) change(o);
      const auto rows = o.qlens.empty() ? size_t(2 * qlen) : size_t(4);
      const std::span<const float> mine(q.data(), rows * heads * dim);
      (void)mla_attention_on_rank(mine, kv, lens, 2, qlen, heads, max_len, dim, o, comm);
    });
    for (const std::string& e : errors) EXPECT_TRUE(has(e, "expected the same on every rank")) << what << ": " << e;
  }
  // The same options in another spelling agree: qlens of qlen each are no qlens.
  InProcessGroup group(2, std::chrono::seconds(20));
  const auto errors = errors_on_ranks(group, [&](int r, Communicator& comm) {
    AttentionOptions o = base;
    if (r == 1) o.qlens = {qlen, qlen};
    (void)mla_attention_on_rank(q, kv, lens, 2, qlen, heads, max_len, dim, o, comm);
  });
  EXPECT_EQ(errors[0] + errors[1], "");
}

// Ranks handed other values of q, or of a token below its request's length, merged them into an
// answer of neither (the seventieth session's audit: lse 4.00 where rank 0's inputs give 2.94 and
// rank 1's 3.80). Refused on every rank; a token past its length is never read and may differ.
TEST(Comm, RanksThatDisagreeOnTheirValuesAreRefused) {
  const int heads = 2, dim = 576, qlen = 1, batch = 2;
  const int64_t max_len = 40;
  const auto q = testing::random_normal(size_t(batch) * qlen * heads * dim, 1);
  const auto kv = testing::random_normal(size_t(batch) * max_len * dim, 2);
  const std::vector<int32_t> lens{40, 33};
  AttentionOptions o;
  o.world_size = 2;
  o.mode = Mode::decode;
  o.block_size = 16;
  // Rank 1's copy changed at one value: q's last, the last token of request 1 (position 32), or
  // past request 1's length (position 33, never read).
  const size_t last_token = (size_t(1) * max_len + 32) * dim + dim - 1, past = (size_t(1) * max_len + 33) * dim;
  for (const auto& [what, in_q, at, refused] :
       {std::tuple{"q", true, q.size() - 1, true}, std::tuple{"kv below a length", false, last_token, true},
        std::tuple{"kv past a length", false, past, false}}) {
    InProcessGroup group(2, std::chrono::seconds(20));
    const auto errors = errors_on_ranks(group, [&](int r, Communicator& comm) {
      std::vector<float> my_q = q, my_kv = kv;
      if (r == 1) (in_q ? my_q : my_kv)[at] += 1.0f;
      (void)mla_attention_on_rank(my_q, my_kv, lens, batch, qlen, heads, max_len, dim, o, comm);
    });
    for (const std::string& e : errors)
      EXPECT_EQ(has(e, "expected the same on every rank"), refused) << what << ": '" << e << "'";
  }
}

// A second live communicator for a rank took its peer's place at the barrier, and the
// collective read that peer's freed buffer from an earlier call (heap-use-after-free).
TEST(Comm, ARankHasOneLiveCommunicator) {
  InProcessGroup group(2);
  {
    auto first = group.communicator(0);
    testing::expect_error([&] { (void)group.communicator(0); }, "'rank' = 0");
    auto other = group.communicator(1);  // another rank is free
  }
  EXPECT_NO_THROW((void)group.communicator(0)) << "released with its communicator";
}

// An abort (or a peer's timeout) while the ranks copy each other's buffers released a rank at
// the exchange's second barrier: it returned, its caller freed its send buffer, and a slower
// peer went on copying from it (a crash here: each send buffer is unmapped the moment its
// collective returns). The read phase now ends for all ranks together: a collective raises on
// every rank (aborted before the ranks met) or completes on every rank with the right data.
TEST(Comm, AnAbortNeverSplitsACollective) {
  const size_t count = size_t(8) << 20, bytes = count * sizeof(float);  // 32 MiB a rank
  int completed = 0;
  const int delays_us[] = {0, 500, 1000, 2000, 4000, 6000, 9000, 13000, 20000};
  for (int delay_us : delays_us) {
    InProcessGroup group(2);
    std::latch ready(3);  // the delay counts from the ranks' calls
    std::string errors[2];
    bool right[2] = {false, false};
    std::vector<std::thread> ranks;
    for (int r = 0; r < 2; ++r)
      ranks.emplace_back([&, r] {
        auto comm = group.communicator(r);
        void* mapped = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        ASSERT_NE(mapped, MAP_FAILED);
        auto* send = static_cast<float*>(mapped);
        std::fill(send, send + count, float(r + 1));
        // Rank 0 gathers into pages never touched (a fault each: the slower reader), rank 1 into touched ones.
        void* recv_mapped = mmap(nullptr, 2 * bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        ASSERT_NE(recv_mapped, MAP_FAILED);
        std::span<float> recv(static_cast<float*>(recv_mapped), 2 * count);
        if (r == 1) std::fill(recv.begin(), recv.end(), 0.0f);
        ready.arrive_and_wait();
        errors[r] = testing::error_of([&] { comm->all_gather(send, recv.data(), count, DataType::f32); });
        munmap(mapped, bytes);  // a peer still reading it would fault
        right[r] = recv[count - 1] == 1.0f && recv[2 * count - 1] == 2.0f;
        munmap(recv_mapped, 2 * bytes);
      });
    ready.arrive_and_wait();
    std::this_thread::sleep_for(std::chrono::microseconds(delay_us));
    group.abort();
    for (auto& t : ranks) t.join();
    EXPECT_EQ(errors[0].empty(), errors[1].empty()) << "delay " << delay_us << " us: " << errors[0] << errors[1];
    if (errors[0].empty() && errors[1].empty()) {
      ++completed;
      EXPECT_TRUE(right[0] && right[1]) << "delay " << delay_us << " us";
    }
  }
  std::printf("collectives completed despite a later abort: %d of %zu\n", completed, std::size(delays_us));
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
