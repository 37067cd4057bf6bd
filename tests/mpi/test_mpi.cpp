// Run under mpirun (one process per rank): the MPI communicator must give exactly the
// in-process result, and bad input must fail on every rank instead of hanging.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "dcpmla/comm_mpi.h"
#include "dcpmla/error.h"
#include "dcpmla/runner.h"
#include "../cpp/test_helpers.h"

using namespace dcpmla;

namespace {

int passed = 0, failed = 0;

void expect(bool ok, const std::string& what, int rank) {
  ok ? ++passed : ++failed;
  if (!ok) std::printf("rank %d FAILED: %s\n", rank, what.c_str());
}

}  // namespace

int main(int argc, char** argv) {
  MpiSession mpi(&argc, &argv);
  auto comm = make_mpi_communicator();
  const int n = comm->world_size(), rank = comm->rank();
  const std::vector<int32_t> lens{0, 1, 5, 37, 130};  // padding, shorter than the world, longer
  const int B = int(lens.size()), H = 2 * n;
  const int64_t L = 130;
  int index = 0;
  for (Mode mode : {Mode::decode, Mode::verify, Mode::draft})
    for (KvDtype dtype : {KvDtype::bf16, KvDtype::fp8_e4m3})
      for (MergeForm merge : {MergeForm::all_heads, MergeForm::scatter_heads})
        for (int il : {1, 2}) {
          ++index;
          const int qlen = mode == Mode::decode ? 1 : 3;
          std::vector<int32_t> l = lens;
          for (auto& x : l) x = x == 0 ? 0 : std::max(x, qlen);
          const auto q = dcpmla::testing::random_normal(size_t(B) * qlen * H * 576, 100 + uint64_t(index));
          const auto kv = dcpmla::testing::random_normal(size_t(B) * L * 576, 200 + uint64_t(index));
          AttentionOptions o;
          o.mode = mode;
          o.world_size = n;
          o.interleave = il;
          o.block_size = 16;
          o.kv_dtype = dtype;
          o.kv_scale = dtype == KvDtype::bf16 ? 1.0f : 0.05f;
          o.merge = merge;
          o.route = mode == Mode::verify && index % 2 ? Route::two_stage : Route::automatic;
          o.min_segment_tokens = 16;
          o.seed = uint64_t(index);
          const auto mine = mla_attention_on_rank(q, kv, l, B, qlen, H, L, 576, o, *comm);
          const auto threads = mla_attention(q, kv, l, B, qlen, H, L, 576, o);
          // all_heads merges in rank order on both sides: bit-exact. scatter_heads sums in
          // the order MPI's reduce-scatter picks: one bf16 rounding step apart at most.
          const float tol = merge == MergeForm::all_heads ? 0.0f : 1.0f / 128;
          bool same = mine.out.size() == threads.out.size() && mine.lse.size() == threads.lse.size();
          for (size_t i = 0; same && i < mine.out.size(); ++i)
            same = std::fabs(mine.out[i] - threads.out[i]) <= tol * std::fabs(threads.out[i]);
          for (size_t i = 0; same && i < mine.lse.size(); ++i)
            same = mine.lse[i] == threads.lse[i];
          expect(same, "MPI result == in-process result, case " + std::to_string(index), rank);
        }

  auto expect_error = [&](const std::function<void()>& fn, const std::string& needle, const std::string& what) {
    try {
      fn();
      expect(false, what + ": no error", rank);
    } catch (const Error& e) {
      expect(std::string(e.what()).find(needle) != std::string::npos, what + ": " + e.what(), rank);
    }
  };
  const auto q = dcpmla::testing::random_normal(size_t(1) * 1 * H * 576, 1);
  const auto kv = dcpmla::testing::random_normal(size_t(1) * 20 * 576, 2);
  AttentionOptions o;
  o.world_size = n + 1;
  const std::vector<int32_t> twenty{20};
  expect_error([&] { mla_attention_on_rank(q, kv, twenty, 1, 1, H, 20, 576, o, *comm); }, "world_size",
               "world size that does not match the communicator");
  o.world_size = n;
  const std::vector<int32_t> mine{rank == n - 1 ? 19 : 20};  // the last rank was handed another batch
  if (n > 1)
    expect_error([&] { mla_attention_on_rank(q, kv, mine, 1, 1, H, 20, 576, o, *comm); }, "expected the same on every rank",
                 "ranks that disagree on the batch");

  // A rank that refuses its own inputs before any collective: MPI has no abort its peers see, so
  // every rank must raise in the first collective (they waited in MPI_Allgather forever).
  const std::vector<int32_t> refused{rank == n - 1 ? 21 : 20};  // 21 > max_len on the last rank
  if (n > 1)
    expect_error([&] { mla_attention_on_rank(q, kv, refused, 1, 1, H, 20, 576, o, *comm); },
                 rank == n - 1 ? "'seq_lens[0]' = 21" : "refused by rank " + std::to_string(n - 1),
                 "a rank that refuses its inputs");
  // Ranks whose options differ in what the partials depend on (each used to merge wrong numbers,
  // or with other row counts to fail inside MPI naming no field).
  const auto differ = [&](const char* what, const std::function<void(AttentionOptions&)>& change) {
    AttentionOptions d = o;
    d.mode = Mode::draft;
    if (rank == n - 1) change(d);
    const auto q3 = dcpmla::testing::random_normal(size_t(1) * 3 * H * 576, 3);
    if (n > 1)
      expect_error([&] { mla_attention_on_rank(q3, kv, twenty, 1, 3, H, 20, 576, d, *comm); },
                   "expected the same on every rank", std::string("ranks that disagree on ") + what);
  };
  differ("interleave", [](AttentionOptions& d) { d.interleave = 2; });
  differ("mode", [](AttentionOptions& d) { d.mode = Mode::verify; });
  differ("softmax_scale", [](AttentionOptions& d) { d.softmax_scale = 0.01f; });
  differ("kv_dtype", [](AttentionOptions& d) { d.kv_dtype = KvDtype::fp8_e4m3; });
  {  // the same rows in all, other rows per request
    AttentionOptions d = o;
    d.mode = Mode::draft;
    d.qlens = rank == n - 1 ? std::vector<int32_t>{3, 1} : std::vector<int32_t>{1, 3};
    const auto q4 = dcpmla::testing::random_normal(size_t(4) * H * 576, 4);
    const auto kv2 = dcpmla::testing::random_normal(size_t(2) * 20 * 576, 5);
    const std::vector<int32_t> both{20, 20};
    if (n > 1)
      expect_error([&] { mla_attention_on_rank(q4, kv2, both, 2, 3, H, 20, 576, d, *comm); },
                   "expected the same on every rank", "ranks that disagree on qlens");
  }

  // Collective arguments, refused on every rank before any MPI call (every rank passes the
  // same ones, so none is left waiting). An unknown DataType used to travel as 16-bit words,
  // and a count past int was cast to int: 2**32 + 5 moved 5 elements.
  {
    std::vector<int32_t> s(size_t(4 * n), 1), r(size_t(4 * n), 0);
    const auto bad = DataType(7);
    expect_error([&] { comm->all_gather(s.data(), r.data(), 2, bad); }, "'dtype' = 7", "all_gather, unknown dtype");
    expect_error([&] { comm->reduce_scatter_sum(s.data(), r.data(), 2, bad); }, "'dtype' = 7",
                 "reduce_scatter_sum, unknown dtype");
    expect_error([&] { comm->all_to_all(s.data(), r.data(), 2, bad); }, "'dtype' = 7", "all_to_all, unknown dtype");
    const size_t huge = (size_t(1) << 32) + 5;
    expect_error([&] { comm->all_gather(s.data(), r.data(), huge, DataType::i32); }, "'count' = 4294967301",
                 "all_gather, count past int");
    expect_error([&] { comm->reduce_scatter_sum(s.data(), r.data(), huge, DataType::bf16); }, "'count' = 4294967301",
                 "reduce_scatter_sum, count past int");
    expect_error([&] { comm->all_to_all(s.data(), r.data(), huge, DataType::f32); }, "'count' = 4294967301",
                 "all_to_all, count past int");
    // count fits int but count x world_size does not (the gathered side)
    const size_t wide = size_t(INT32_MAX) / size_t(n) + 1;
    if (n > 1)
      expect_error([&] { comm->all_gather(s.data(), r.data(), wide, DataType::i32); }, "'count' = " + std::to_string(wide),
                   "all_gather, count x world_size past int");
    expect_error([&] { comm->all_gather(nullptr, r.data(), 1, DataType::i32); }, "'send' = null", "null send");
    expect_error([&] { comm->all_to_all(s.data(), nullptr, 1, DataType::i32); }, "'recv' = null", "null recv");
    // i32 sums exactly beyond 2**24: MPI always did; a cross-check of the in-process group's
    // int64 sum (tests/cpp/test_comm.cpp), which summed through float before
    for (auto& x : s) x = (1 << 24) + 1;
    comm->reduce_scatter_sum(s.data(), r.data(), 4, DataType::i32);
    bool exact = true;
    for (int i = 0; i < 4; ++i) exact = exact && r[size_t(i)] == int32_t(int64_t((1 << 24) + 1) * n);
    expect(exact, "exact i32 reduce-scatter beyond 2**24", rank);
  }

  // Every rank reports; the job fails if any rank failed.
  std::vector<int32_t> counts(size_t(2 * n));
  const int32_t local[2] = {passed, failed};
  comm->all_gather(local, counts.data(), 2, DataType::i32);
  int total_passed = 0, total_failed = 0;
  for (int r = 0; r < n; ++r) total_passed += counts[size_t(2 * r)], total_failed += counts[size_t(2 * r + 1)];
  if (rank == 0) std::printf("mpi np=%d: %d passed, %d failed\n", n, total_passed, total_failed);
  return total_failed == 0 ? 0 : 1;
}
