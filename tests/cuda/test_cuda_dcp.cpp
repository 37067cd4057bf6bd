// The GPU DCP step (dcp.h) with N = 2, 4, 8 ranks simulated on one GPU (DeviceGroup): it
// must equal DCP1 (the CPU path on one rank, and the GPU step on one rank)
// for every mode and dtype, both merge forms, interleave 1 and > 1, the two_stage route,
// and after a CUDA graph replay that follows a re-plan. Requests shorter than N and ranks
// holding no token of a row must give exact results (no NaN, -inf only for padding); a NaN
// latent reaches the same rows as on the CPU path, also where its rank is a row's only
// non-empty one. Bad input fails on every rank, never hangs.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "dcp_harness.h"
#include "dcpmla/error.h"

namespace dcpmla::testing {
namespace {

// Lengths with padding (0), requests shorter than every N tested (1, 2, 3: most ranks hold
// no token of their rows), one that ends mid-run of an interleave, and longer ones.
std::vector<int32_t> lens_for(int qlen) {
  std::vector<int32_t> lens{0, 1, 2, 3, 37, 300, 523};
  for (auto& L : lens) L = L == 0 ? 0 : std::max<int32_t>(L, qlen);
  return lens;
}

struct Grid {
  int world;
  DcpMerge merge;
};

class DcpStepGrid : public ::testing::TestWithParam<Grid> {};

// Every mode x dtype x interleave for one (N, merge form). Head counts vary with the dtype
// so that odd head counts and more than 128 gathered heads in one launch (N x Hl = 256) run
// too; DcpStep.GroupsOfLaunchesBeyondTheHeadLimit runs the launches in groups.
TEST_P(DcpStepGrid, EqualsDcp1AndCpuReference) {
  DCPMLA_REQUIRE_GPU();
  const Grid grid = GetParam();
  uint64_t seed = 100 * uint64_t(grid.world) + uint64_t(grid.merge);
  for (Mode mode : {Mode::decode, Mode::verify, Mode::draft})
    for (KvDtype dtype : {KvDtype::bf16, KvDtype::fp8_e4m3, KvDtype::fp8_e5m2})
      for (int interleave : {1, 4}) {
        DcpCase c;
        c.name = "grid";
        c.world = grid.world;
        c.merge = grid.merge;
        c.mode = mode;
        c.dtype = dtype;
        c.kv_scale = dtype == KvDtype::bf16 ? 1.0f : dtype == KvDtype::fp8_e4m3 ? 0.05f : 2.0f;
        c.interleave = interleave;
        c.block_size = interleave == 1 ? 16 : 64;
        c.heads_local = dtype == KvDtype::bf16 ? 8 : dtype == KvDtype::fp8_e4m3 ? 32 : 3;
        c.qlen = mode == Mode::decode ? 1 : mode == Mode::verify ? 4 : 3;
        // Routes: verify alternates two_stage (balanced) and auto; decode forces split_k
        // at interleave 1; draft forces one_stage at interleave 4.
        if (mode == Mode::verify) c.route = interleave == 1 ? Route::two_stage : Route::automatic;
        if (mode == Mode::decode && interleave == 1) c.route = Route::split_k;
        if (mode == Mode::draft && interleave == 4) c.route = Route::one_stage;
        c.reduce = interleave == 1 ? DataType::bf16 : DataType::f32;
        c.lens = lens_for(c.qlen);
        c.seed = ++seed;
        SCOPED_TRACE(c.describe());
        const GlobalBatch g = make_global(c.lens, c.qlen, c.world * c.heads_local, c.seed);
        const Result ref = cpu_reference(g, c);
        const Result got = run_gpu(c, g);
        EXPECT_EQ(got.cache_mismatch, 0) << "the step's KV write must equal the CPU write path";
        if (c.route != Route::automatic) {
          EXPECT_EQ(got.route, c.route);
        }
        expect_close(got, ref, g, "N ranks vs CPU DCP1");
        DcpCase one = c;
        one.world = 1;
        one.heads_local = g.H;
        const Result dcp1 = run_gpu(one, g);
        expect_close(got, dcp1, g, "N ranks vs GPU DCP1");
      }
}

INSTANTIATE_TEST_SUITE_P(Worlds, DcpStepGrid,
                         ::testing::Values(Grid{2, DcpMerge::reduce_scatter}, Grid{2, DcpMerge::all_to_all},
                                           Grid{4, DcpMerge::reduce_scatter}, Grid{4, DcpMerge::all_to_all},
                                           Grid{8, DcpMerge::reduce_scatter}, Grid{8, DcpMerge::all_to_all}),
                         [](const auto& info) {
                           return "N" + std::to_string(info.param.world) + "_" +
                                  std::string(to_string(info.param.merge));
                         });

// Only short requests: with N = 8 most ranks hold no token of any row; and a request of
// length 1 in verify with qlen 1 (the window is the block itself).
TEST(DcpStep, ShortRequestsAndEmptyRanksAreExact) {
  DCPMLA_REQUIRE_GPU();
  for (DcpMerge merge : {DcpMerge::reduce_scatter, DcpMerge::all_to_all})
    for (Route route : {Route::one_stage, Route::two_stage}) {
      DcpCase c;
      c.name = "short";
      c.world = 8;
      c.merge = merge;
      c.route = route;
      c.qlen = route == Route::two_stage ? 2 : 1;
      c.lens = {1 + (c.qlen - 1), 2, 0, 7, 3};
      c.heads_local = 4;
      c.interleave = 2;
      c.seed = 77 + uint64_t(merge);
      SCOPED_TRACE(c.describe());
      const GlobalBatch g = make_global(c.lens, c.qlen, c.world * c.heads_local, c.seed);
      const Result ref = cpu_reference(g, c);
      const Result got = run_gpu(c, g);
      expect_close(got, ref, g, "short requests");
      // Padding rows: exactly zero with lse = -inf.
      for (int t = 0; t < c.qlen; ++t)
        for (int h = 0; h < g.H; ++h) {
          const size_t row = (size_t(2) * c.qlen + size_t(t)) * g.H + size_t(h);
          EXPECT_TRUE(std::isinf(got.lse[row]) && got.lse[row] < 0);
          for (int j = 0; j < kR; ++j) ASSERT_EQ(got.out[row * kR + j].bits, 0);
        }
    }
}

// NaN containment across ranks (docs/design.md): a NaN latent reaches exactly the rows whose
// window holds it, after the merge as on the CPU path, and no other row. Request 1 (length 1)
// lives on rank 0 alone, so its other ranks' partials are empty (lse -inf) beside one NaN
// partial: a merge whose maximum skipped the NaN (fmaxf) would find only empty partials and
// write the row as padding (0, -inf). Request 5 (length 300) holds its NaN on one rank among
// finite partials. Both merge forms (reduce_scatter's correction kernel, all_to_all's merge).
TEST(DcpStep, NanReachesTheSameRowsAsOnTheCpu) {
  DCPMLA_REQUIRE_GPU();
  for (DcpMerge merge : {DcpMerge::reduce_scatter, DcpMerge::all_to_all})
    for (Route route : {Route::one_stage, Route::split_k}) {
      const bool split = route == Route::split_k;
      const DcpCase c{.name = "nan", .world = 4, .mode = Mode::decode, .route = route, .merge = merge,
                      .reduce = merge == DcpMerge::reduce_scatter && split ? DataType::f32 : DataType::bf16,
                      .heads_local = 4, .qlen = 1, .lens = lens_for(1), .seed = 91 + 2 * uint64_t(merge) + split};
      SCOPED_TRACE(c.describe());
      GlobalBatch g = make_global(c.lens, c.qlen, c.world * c.heads_local, c.seed);
      for (const auto& [b, pos] : {std::pair{1, 0}, std::pair{5, 100}}) {
        const size_t at = (size_t(b) * size_t(g.Lmax) + size_t(pos)) * kD + 7;
        g.kv16[at] = float_to_bf16(std::numeric_limits<float>::quiet_NaN());
        g.kvf[at] = bf16_to_float(g.kv16[at]);
      }
      Result ref = cpu_reference(g, c);
      Result got = run_gpu(c, g);
      EXPECT_EQ(got.cache_mismatch, 0);
      // The NaN rows: the same on both paths, and only those of requests 1 and 5. Then they
      // are set aside (zero in both) and every other row must match as usual.
      int64_t nan_rows = 0, mismatched = 0, stray = 0;
      for (size_t row = 0; row < ref.lse.size(); ++row) {
        const bool ref_nan = std::isnan(ref.lse[row]);
        bool got_nan = std::isnan(got.lse[row]);
        for (int j = 0; j < kR; ++j) got_nan |= std::isnan(bf16_to_float(got.out[row * kR + size_t(j)]));
        const int b = int(row / (size_t(c.qlen) * size_t(g.H)));
        nan_rows += ref_nan;
        mismatched += ref_nan != got_nan;
        stray += ref_nan && b != 1 && b != 5;
        if (ref_nan) {
          ref.lse[row] = got.lse[row] = 0.0f;
          for (int j = 0; j < kR; ++j) ref.out[row * kR + size_t(j)] = got.out[row * kR + size_t(j)] = bf16{};
        }
      }
      EXPECT_EQ(nan_rows, int64_t(2) * c.qlen * g.H) << "every row of requests 1 and 5, no other";
      EXPECT_EQ(stray, 0);
      EXPECT_EQ(mismatched, 0) << "NaN rows differ from the CPU path's";
      expect_close(got, ref, g, "rows without NaN");
    }
}

// More gathered heads than one launch serves (4 x 1100 > max_heads, 4096): two groups of two
// ranks' heads (2200 each), one launch a group, both merge forms, against the CPU path.
TEST(DcpStep, GroupsOfLaunchesBeyondTheHeadLimit) {
  DCPMLA_REQUIRE_GPU();
  ASSERT_EQ(dcp_ranks_per_group(4, 1100), 2);
  for (DcpMerge merge : {DcpMerge::reduce_scatter, DcpMerge::all_to_all}) {
    const DcpCase c{.name = "groups", .world = 4, .mode = Mode::verify, .merge = merge, .heads_local = 1100, .qlen = 2,
                    .lens = {0, 3, 40, 200}, .seed = 77 + uint64_t(merge)};
    SCOPED_TRACE(c.describe());
    const GlobalBatch g = make_global(c.lens, c.qlen, c.world * c.heads_local, c.seed);
    expect_close(run_gpu(c, g), cpu_reference(g, c), g, "groups of launches vs CPU DCP1");
  }
}

// One rank (no peer to wait for, so compute-sanitizer can run it): every kernel of the
// step, both merge forms, two_stage's stage B, against the CPU path.
TEST(DcpStep, OneRankEveryKernel) {
  DCPMLA_REQUIRE_GPU();
  for (DcpMerge merge : {DcpMerge::reduce_scatter, DcpMerge::all_to_all}) {
    DcpCase c;
    c.name = "one_rank";
    c.world = 1;
    c.merge = merge;
    c.route = Route::two_stage;
    c.dtype = KvDtype::fp8_e4m3;
    c.kv_scale = 0.05f;
    c.qlen = 3;
    c.heads_local = 16;
    c.reduce = DataType::f32;
    c.lens = {3, 0, 100, 41};
    c.seed = 61 + uint64_t(merge);
    SCOPED_TRACE(c.describe());
    const GlobalBatch g = make_global(c.lens, c.qlen, c.heads_local, c.seed);
    const Result got = run_gpu(c, g);
    EXPECT_EQ(got.cache_mismatch, 0);
    expect_close(got, cpu_reference(g, c), g, "one rank");
  }
}

// A CUDA graph per rank, captured once around DcpStep::run on the rank's stream, replayed
// for batch 1, then after re-planning a different batch (fewer live requests, padding,
// another qlen, another route): the communication is inside each graph.
struct GraphCase {
  DcpCase c;
  std::vector<int32_t> lens1, lens2;
  int qlen1, qlen2;
};

void run_graph_case(const GraphCase& gc) {
  const DcpCase& c = gc.c;
  SCOPED_TRACE(c.describe());
  const int H = c.world * c.heads_local;
  const GlobalBatch g1 = make_global(gc.lens1, gc.qlen1, H, c.seed), g2 = make_global(gc.lens2, gc.qlen2, H, c.seed + 5);
  const Tables t = make_tables(c, {&g1, &g2});
  const int max_batch = std::max(g1.B, g2.B), max_qlen = std::max(gc.qlen1, gc.qlen2);
  Result got1, got2;
  for (Result* r : {&got1, &got2}) {
    const GlobalBatch& g = r == &got1 ? g1 : g2;
    r->out.assign(size_t(g.B) * g.qlen * H * kR, bf16{});
    r->lse.assign(size_t(g.B) * g.qlen * H, 0.0f);
  }
  std::mutex mutex;
  std::vector<std::string> routes(static_cast<size_t>(c.world));
  run_ranks_on_gpu(c.world, [&](int rank, DeviceCommunicator& comm) {
    cudaStream_t stream = comm.stream();
    // The serving configuration: no per-step agreement exchange (plan() is host work only).
    DcpConfig config = step_config(c, t, max_batch, max_qlen);
    config.check_agreement = false;
    DcpStep step(config, comm);
    DeviceCache cache(t.num_blocks, c.block_size, c.dtype, stream);
    const RankInputs in1 = rank_inputs(g1, rank, c.heads_local, step.row_capacity());
    const RankInputs in2 = rank_inputs(g2, rank, c.heads_local, step.row_capacity());
    const BatchDesc d1{g1.lens, g1.qlen, t.tables[0], t.widths[0], c.mode},
        d2{g2.lens, g2.qlen, t.tables[1], t.widths[1], c.mode};
    for (auto [in, d] : {std::pair{&in1, &d1}, std::pair{&in2, &d2}})
      device_write(in->prefix_positions, in->prefix_requests, in->prefix_latents, *d,
                   Layout{c.world, rank, c.interleave}, cache, c.kv_scale, stream);
    const size_t cap = size_t(step.row_capacity());
    DeviceBuffer<bf16> q(cap * c.heads_local * kD), lat(cap * kD), out(cap * c.heads_local * kR);
    DeviceBuffer<float> lse(cap * c.heads_local);

    step.plan(d1);
    upload_on(q, in1.q_local, stream);
    upload_on(lat, in1.new_latents, stream);
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    cuda_ok(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture");
    step.run(q.get(), lat.get(), cache.view, KvScale{c.kv_scale}, out.get(), lse.get());
    cuda_ok(cudaStreamEndCapture(stream, &graph), "cudaStreamEndCapture");
    cuda_ok(cudaGraphInstantiate(&exec, graph, 0), "cudaGraphInstantiate");
    std::string route = std::string(to_string(step.attention().current_plan().route()));

    auto replay = [&](const GlobalBatch& g, Result& res) {
      poison_on(out, stream);
      poison_on(lse, stream);
      cuda_ok(cudaGraphLaunch(exec, stream), "cudaGraphLaunch");
      comm.synchronize();
      const std::vector<bf16> o = out.download();
      const std::vector<float> l = lse.download();
      std::lock_guard lock(mutex);
      scatter_heads(res, g, rank, c.heads_local, o, l);
    };
    replay(g1, got1);
    step.plan(d2);
    upload_on(q, in2.q_local, stream);
    upload_on(lat, in2.new_latents, stream);
    replay(g2, got2);
    route += " -> " + std::string(to_string(step.attention().current_plan().route()));
    routes[size_t(rank)] = route;
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  });
  ::testing::Test::RecordProperty("routes", routes[0]);
  DcpCase c1 = c, c2 = c;
  c1.qlen = gc.qlen1;
  c2.qlen = gc.qlen2;
  expect_close(got1, cpu_reference(g1, c1), g1, "graph replay of batch 1 (" + routes[0] + ")");
  expect_close(got2, cpu_reference(g2, c2), g2, "graph replay after re-plan, batch 2 (" + routes[0] + ")");
}

TEST(DcpStepGraph, ReplayAfterReplanTwoStageReduceScatter) {
  DCPMLA_REQUIRE_GPU();
  GraphCase gc;
  gc.c.name = "graph_two_stage";
  gc.c.world = 4;
  gc.c.mode = Mode::verify;
  gc.c.route = Route::two_stage;
  gc.c.interleave = 2;
  gc.c.block_size = 16;
  gc.c.heads_local = 16;
  gc.c.merge = DcpMerge::reduce_scatter;
  gc.c.seed = 501;
  gc.lens1 = {900, 40, 4, 1200};  // 4 = qlen: an empty committed prefix
  gc.qlen1 = 4;
  gc.lens2 = {0, 77, 0, 2};
  gc.qlen2 = 2;
  run_graph_case(gc);
}

TEST(DcpStepGraph, ReplayAfterReplanSplitToOneStageAllToAllFp8) {
  DCPMLA_REQUIRE_GPU();
  GraphCase gc;
  gc.c.name = "graph_split";
  gc.c.world = 8;
  gc.c.mode = Mode::decode;
  gc.c.dtype = KvDtype::fp8_e4m3;
  gc.c.kv_scale = 0.05f;
  gc.c.interleave = 1;
  gc.c.block_size = 64;
  gc.c.heads_local = 32;  // 256 heads: two attention launches per rank
  gc.c.merge = DcpMerge::all_to_all;
  gc.c.seed = 502;
  gc.lens1 = {6000, 9000, 100, 4000, 5};
  gc.qlen1 = 1;
  gc.lens2 = {0, 300, 0, 0, 1};
  gc.qlen2 = 1;
  run_graph_case(gc);
}

TEST(DcpStepGraph, ReplayDraftReduceScatterF32) {
  DCPMLA_REQUIRE_GPU();
  GraphCase gc;
  gc.c.name = "graph_draft";
  gc.c.world = 2;
  gc.c.mode = Mode::draft;
  gc.c.dtype = KvDtype::fp8_e5m2;
  gc.c.kv_scale = 2.0f;
  gc.c.interleave = 1;
  gc.c.heads_local = 64;
  gc.c.merge = DcpMerge::reduce_scatter;
  gc.c.reduce = DataType::f32;
  gc.c.seed = 503;
  gc.lens1 = {50, 700, 3};
  gc.qlen1 = 3;
  gc.lens2 = {1000, 0, 4};
  gc.qlen2 = 2;
  run_graph_case(gc);
}

// ---- bad input: an error on every rank, never a hang ---------------------------------------

// Runs fn on every rank; returns each rank's error text ("" when it did not throw).
std::vector<std::string> errors_per_rank(int world, const std::function<void(int, DeviceCommunicator&)>& fn) {
  std::vector<std::string> errors(static_cast<size_t>(world));
  std::mutex mutex;
  run_ranks_on_gpu(world, [&](int rank, DeviceCommunicator& comm) {
    try {
      fn(rank, comm);
    } catch (const std::exception& e) {
      std::lock_guard lock(mutex);
      errors[size_t(rank)] = e.what();
    }
  });
  return errors;
}

DcpConfig small_config(int world) {
  DcpConfig cfg;
  cfg.world_size = world;
  cfg.heads_local = 4;
  cfg.block_size = 16;
  cfg.limits = PlanLimits{4, 2, 256};
  cfg.check_agreement = true;
  return cfg;
}

TEST(DcpStepBadInput, WorldSizeNotMatchingTheCommunicator) {
  DCPMLA_REQUIRE_GPU();
  const auto errors = errors_per_rank(2, [](int, DeviceCommunicator& comm) {
    DcpConfig cfg = small_config(3);
    DcpStep step(cfg, comm);
  });
  for (const auto& e : errors) EXPECT_NE(e.find("'world_size' = 3"), std::string::npos) << e;
}

// One rank refuses its configuration; the others must raise at once, naming it, rather than
// wait for it in the agreement's collective (over NCCL they waited for the timeout).
TEST(DcpStepBadInput, OneRankRefusingMakesEveryRankRefuse) {
  DCPMLA_REQUIRE_GPU();
  const auto start = std::chrono::steady_clock::now();
  const auto errors = errors_per_rank(3, [](int rank, DeviceCommunicator& comm) {
    DcpConfig cfg = small_config(3);
    if (rank == 1) cfg.heads_local = 0;
    DcpStep step(cfg, comm);
  });
  ASSERT_EQ(errors.size(), 3u);
  EXPECT_NE(errors[1].find("'heads_local' = 0"), std::string::npos) << errors[1];
  for (int r : {0, 2}) EXPECT_NE(errors[size_t(r)].find("refused by rank 1"), std::string::npos) << errors[size_t(r)];
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30));
}

// Step buffers past the device's memory were left to cudaMalloc (a CUDA error naming no field,
// after the attention's workspace was allocated): 128 local heads on 2 ranks at max_batch 4096
// and max_qlen 64 ask about 290 GB of step buffers beside a workspace of about 140 GB, past
// any H100's or H200's memory. Refused by name before any allocation.
TEST(DcpStepBadInput, StepBuffersPastTheDeviceAreRefusedByName) {
  DCPMLA_REQUIRE_GPU();
  const auto errors = errors_per_rank(2, [](int, DeviceCommunicator& comm) {
    DcpConfig cfg = small_config(2);
    cfg.heads_local = 128;
    cfg.limits = PlanLimits{4096, 64, 4096};
    DcpStep step(cfg, comm);
  });
  for (const auto& e : errors) {
    EXPECT_NE(e.find("field 'limits' = max_batch 4096 x max_qlen 64 x heads_local 128 on 2 ranks"), std::string::npos)
        << e;
    EXPECT_NE(e.find("expected <= the device's"), std::string::npos) << e;
  }
}

// A communicator over a device no machine has: every CUDA call for it fails, and no
// collective may run.
class UnusableDeviceComm final : public DeviceCommunicator {
 public:
  int rank() const override { return 0; }
  int world_size() const override { return 1; }
  void all_gather(const void*, void*, size_t, DataType) override { fail_collective(); }
  void reduce_scatter_sum(const void*, void*, size_t, DataType) override { fail_collective(); }
  void all_to_all(const void*, void*, size_t, DataType) override { fail_collective(); }
  void barrier() override { fail_collective(); }
  cudaStream_t stream() const override { return nullptr; }
  int device() const override { return 1 << 20; }
  void synchronize() override {}
  void abort() override {}

 private:
  [[noreturn]] static void fail_collective() { throw std::logic_error("a collective over an unusable device"); }
};

// A rank that refuses its configuration still joins one status exchange, which needs its
// device; where that device cannot be used, the refusal itself is raised, naming the field,
// not the CUDA error of the exchange's set-up. Needs no GPU: the device is unusable anywhere.
TEST(DcpStepBadInput, RefusalOverAnUnusableDeviceNamesTheField) {
  UnusableDeviceComm comm;
  DcpConfig cfg = small_config(1);
  cfg.heads_local = 0;
  try {
    DcpStep step(cfg, comm);
    ADD_FAILURE() << "accepted heads_local = 0";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'heads_local' = 0"), std::string::npos) << e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "raised something other than the refusal: " << e.what();
  }
}

TEST(DcpStepBadInput, RanksDisagreeOnTheConfiguration) {
  DCPMLA_REQUIRE_GPU();
  const auto errors = errors_per_rank(4, [](int rank, DeviceCommunicator& comm) {
    DcpConfig cfg = small_config(4);
    if (rank == 3) cfg.interleave = 2;
    DcpStep step(cfg, comm);
  });
  for (const auto& e : errors) EXPECT_NE(e.find("expected the same on every rank"), std::string::npos) << e;
}

TEST(DcpStepBadInput, RanksDisagreeOnThePlanShape) {
  DCPMLA_REQUIRE_GPU();
  const auto errors = errors_per_rank(4, [](int rank, DeviceCommunicator& comm) {
    DcpStep step(small_config(4), comm);
    const std::vector<int32_t> lens{rank == 1 ? 40 : 41, 8};
    const std::vector<int32_t> tables{0, 1, 2, 3};
    step.plan(BatchDesc{lens, 1, tables, 2});
  });
  for (const auto& e : errors) EXPECT_NE(e.find("expected the same on every rank"), std::string::npos) << e;
}

// The tables name block 999; each rank's 64-block cache is too small for them: every rank
// refuses the run before any launch or collective, naming the cache and the block.
TEST(DcpStepBadInput, CacheTooSmallForTheTablesRefusedAlikeOnEveryRank) {
  DCPMLA_REQUIRE_GPU();
  const auto errors = errors_per_rank(4, [](int, DeviceCommunicator& comm) {
    DcpStep step(small_config(4), comm);
    const std::vector<int32_t> lens{41, 8};
    const std::vector<int32_t> tables{999, 1, 2, 3};  // used entries
    step.plan(BatchDesc{lens, 1, tables, 2});
    DeviceCache cache(64, 16, KvDtype::bf16, comm.stream());
    DeviceBuffer<bf16> q(size_t(step.row_capacity()) * 4 * kD), out(size_t(step.row_capacity()) * 4 * kR);
    DeviceBuffer<float> lse(size_t(step.row_capacity()) * 4);
    step.run(q.get(), nullptr, cache.view, KvScale{}, out.get(), lse.get());
  });
  for (const auto& e : errors) {
    EXPECT_NE(e.find("num_blocks"), std::string::npos) << e;
    EXPECT_NE(e.find("999"), std::string::npos) << e;
  }
}

TEST(DcpStepBadInput, FailedRankAbortsTheOthers) {
  DCPMLA_REQUIRE_GPU();
  const auto start = std::chrono::steady_clock::now();
  try {
    run_ranks_on_gpu(4, [](int rank, DeviceCommunicator& comm) {
      DcpStep step(small_config(4), comm);
      if (rank == 2) throw Error("rank 2 failed on purpose");
      const std::vector<int32_t> lens{41, 8};
      const std::vector<int32_t> tables{0, 1, 2, 3};
      step.plan(BatchDesc{lens, 1, tables, 2});  // the others wait here for rank 2
    });
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("rank 2 failed on purpose"), std::string::npos) << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30));
}

// A peer that never reaches the device-side barrier: the waiting rank's barrier kernel gives
// up after the group's timeout, and every rank's synchronize() reports it.
TEST(DcpStepBadInput, DeviceBarrierTimesOut) {
  DCPMLA_REQUIRE_GPU();
  DeviceGroup group(2, 0, std::chrono::milliseconds(300));
  cudaStream_t s[2];
  for (auto& x : s) cuda_ok(cudaStreamCreateWithFlags(&x, cudaStreamNonBlocking), "cudaStreamCreate");
  auto c0 = group.communicator(0, s[0]);
  auto c1 = group.communicator(1, s[1]);
  // One live communicator per rank: a second would take the peer's place at the barrier.
  try {
    (void)group.communicator(0, s[1]);
    ADD_FAILURE() << "a second communicator for rank 0";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'rank' = 0"), std::string::npos) << e.what();
  }
  DeviceBuffer<float> a(4), b(8), x(4), y(8);
  // Rank 1's stream is held by a host callback for 2 s, so its barrier kernel starts late.
  std::atomic<bool> release{false};
  cuda_ok(cudaLaunchHostFunc(
              s[1], [](void* flag) {
                const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(2);
                while (!static_cast<std::atomic<bool>*>(flag)->load() && std::chrono::steady_clock::now() < until)
                  std::this_thread::sleep_for(std::chrono::milliseconds(10));
              },
              &release),
          "cudaLaunchHostFunc");
  std::string e0, e1;
  std::thread t1([&] {
    c1->all_gather(x.get(), y.get(), 4, DataType::f32);
    try {
      c1->synchronize();
    } catch (const std::exception& e) {
      e1 = e.what();
    }
  });
  c0->all_gather(a.get(), b.get(), 4, DataType::f32);
  try {
    c0->synchronize();
  } catch (const std::exception& e) {
    e0 = e.what();
  }
  release = true;
  t1.join();
  EXPECT_NE(e0.find("did not arrive"), std::string::npos) << e0;
  EXPECT_FALSE(e1.empty());
  for (auto& st : s) cudaStreamDestroy(st);
}

TEST(DcpStepBadInput, DeviceGroupChecksItsArguments) {
  EXPECT_THROW(DeviceGroup(0), Error);
  EXPECT_THROW(DeviceGroup(kMaxDeviceGroupRanks + 1), Error);
  const int n = cuda_device_count();
  try {
    DeviceGroup g(2, n);  // one past the last GPU (CI: there is none)
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'device'"), std::string::npos) << e.what();
  }
}

// The device group's reduction sums whole elements on the device: a misaligned buffer is refused
// by name (the group aborted first), where it would have faulted in the kernel.
TEST(DcpStepBadInput, DeviceGroupReduceRefusesMisalignedBuffers) {
  DCPMLA_REQUIRE_GPU();
  const auto errors = errors_per_rank(1, [](int, DeviceCommunicator& comm) {
    DeviceBuffer<float> send(8), recv(8);
    comm.reduce_scatter_sum(reinterpret_cast<const char*>(send.get()) + 2, recv.get(), 2, DataType::f32);
  });
  EXPECT_NE(errors[0].find("'send' = address"), std::string::npos) << errors[0];
  EXPECT_NE(errors[0].find("4-byte aligned"), std::string::npos) << errors[0];
}

// check_agreement decides whether plan() runs an exchange: ranks built with different values
// would pair different collectives, so it is part of the configuration the ranks agree on.
TEST(DcpStepBadInput, RanksDisagreeOnCheckAgreement) {
  DCPMLA_REQUIRE_GPU();
  const auto errors = errors_per_rank(2, [](int rank, DeviceCommunicator& comm) {
    DcpConfig cfg = small_config(2);
    cfg.check_agreement = rank == 0;
    DcpStep step(cfg, comm);
  });
  // check_agreement is the signature's last value: the two ranks' lists differ there (every
  // message lists the field names, so the name alone would not tell).
  for (const auto& e : errors) {
    EXPECT_NE(e.find("expected the same on every rank"), std::string::npos) << e;
    EXPECT_NE(e.find(", 1]"), std::string::npos) << e;
    EXPECT_NE(e.find(", 0]"), std::string::npos) << e;
  }
}

// A bad tuning is refused by the constructor (before it allocates anything).
TEST(DcpStepBadInput, BadTuningRefused) {
  DCPMLA_REQUIRE_GPU();
  const auto errors = errors_per_rank(1, [](int, DeviceCommunicator& comm) {
    DcpConfig cfg = small_config(1);
    cfg.tuning.kernel = 9;
    DcpStep step(cfg, comm);
  });
  EXPECT_NE(errors[0].find("'tuning.kernel' = 9"), std::string::npos) << errors[0];
}

// Draft mode lets the planner take 0 < L < qlen, but the step writes each request's last qlen
// positions: plan() refuses such a request, naming it, before the plan is replaced, so the
// previous plan (and its slots and lengths) stays and still runs.
TEST(DcpStepBadInput, DraftRequestShorterThanQlenRefusedBeforeReplan) {
  DCPMLA_REQUIRE_GPU();
  const auto errors = errors_per_rank(1, [](int, DeviceCommunicator& comm) {
    DcpStep step(small_config(1), comm);
    const std::vector<int32_t> tables{0, 1, 2, 3};
    const std::vector<int32_t> good{20, 8}, bad{20, 1};
    step.plan(BatchDesc{good, 2, tables, 2, Mode::draft});
    // Request 1's window (8 tokens, one rank) tells the two batches apart; their headers are equal.
    ASSERT_EQ(step.attention().current_plan().row_local_len(1, 0), 8);
    try {
      step.plan(BatchDesc{bad, 2, tables, 2, Mode::draft});
      ADD_FAILURE() << "accepted seq_lens[1] = 1 < qlen 2";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("'seq_lens[1]' = 1"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(">= qlen (2)"), std::string::npos) << e.what();
    }
    EXPECT_EQ(step.attention().current_plan().row_local_len(1, 0), 8) << "the refused batch replaced the plan";
    // The previous batch still runs (its slots and lengths are intact).
    DeviceCache cache(8, 16, KvDtype::bf16, comm.stream());
    const size_t cap = size_t(step.row_capacity());
    DeviceBuffer<bf16> q(cap * 4 * kD), lat(cap * kD), out(cap * 4 * kR);
    DeviceBuffer<float> lse(cap * 4);
    step.run(q.get(), lat.get(), cache.view, KvScale{}, out.get(), lse.get());
    comm.synchronize();
  });
  EXPECT_EQ(errors[0], "");
}

// Misaligned pointers to DcpStep::run are refused before anything is enqueued: the write reads
// new_latents 16 bytes at a time.
TEST(DcpStepBadInput, MisalignedPointersRefusedBeforeAnyLaunch) {
  DCPMLA_REQUIRE_GPU();
  const auto errors = errors_per_rank(1, [](int, DeviceCommunicator& comm) {
    DcpStep step(small_config(1), comm);
    const std::vector<int32_t> lens{20, 8}, tables{0, 1, 2, 3};
    step.plan(BatchDesc{lens, 1, tables, 2});
    DeviceCache cache(8, 16, KvDtype::bf16, comm.stream());
    const size_t cap = size_t(step.row_capacity());
    DeviceBuffer<bf16> q(cap * 4 * kD), lat(cap * kD + 8), out(cap * 4 * kR);
    DeviceBuffer<float> lse(cap * 4 + 1);
    auto expect_refused = [&](const std::function<void()>& fn, const char* part) {
      try {
        fn();
        ADD_FAILURE() << "accepted a misaligned " << part;
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
      }
    };
    expect_refused([&] { step.run(q.get(), lat.get() + 4, cache.view, KvScale{}, out.get(), lse.get()); },
                   "'new_latents' = address");
    expect_refused(
        [&] {
          step.run(q.get(), lat.get(), cache.view, KvScale{}, out.get(),
                   reinterpret_cast<float*>(reinterpret_cast<char*>(lse.get()) + 2));
        },
        "'lse' = address");
    // A cache of whole bf16 values 2 bytes past 16 (the CPU backend's need, not the kernels').
    KvCache shifted = cache.view;
    shifted.data = static_cast<uint8_t*>(shifted.data) + 2;
    shifted.num_blocks -= 1;  // inside the allocation
    expect_refused([&] { step.run(q.get(), lat.get(), shifted, KvScale{}, out.get(), lse.get()); },
                   "'kv_cache' = address");
    // An output over an input, and new tokens written over their own latents: refused by
    // the step and by its write, before anything is enqueued.
    expect_refused([&] { step.run(q.get(), lat.get(), cache.view, KvScale{}, q.get() + 64, lse.get()); },
                   "overlapping q_local");
    expect_refused(
        [&] {
          step.run(q.get(), static_cast<const bf16*>(cache.view.data), cache.view, KvScale{}, out.get(), lse.get());
        },
        "overlapping latents");
    comm.synchronize();
  });
  EXPECT_EQ(errors[0], "");
}

TEST(DcpTraffic, BytesPerRank) {
  const DcpTraffic t = dcp_traffic(4, 32, 16, 512, DataType::bf16);
  EXPECT_EQ(t.q_all_gather, 3 * 32 * 16 * 576 * 2);
  EXPECT_EQ(t.reduce_scatter, 3 * 32 * 16 * 512 * 2);
  EXPECT_EQ(t.lse_all_gather, 3 * 32 * 16 * 4 * 4);
  EXPECT_EQ(t.all_to_all, 3 * (32 * 16 * 512 * 2 + 32 * 16 * 4));
  // A row count whose bytes overflow int64 is refused, not wrapped to a negative count.
  EXPECT_THROW((void)dcp_traffic(8, int64_t(1) << 40, 4096, 512, DataType::bf16), Error);
  EXPECT_EQ(dcp_ranks_per_group(8, 16), 8);
  EXPECT_EQ(dcp_ranks_per_group(8, 32), 8);
  EXPECT_EQ(dcp_ranks_per_group(8, 3), 8);
  EXPECT_EQ(dcp_ranks_per_group(6, 32), 6);
  EXPECT_EQ(dcp_ranks_per_group(2, 128), 2);
  // Past one launch's max_heads (4096): whole ranks per group.
  EXPECT_EQ(dcp_ranks_per_group(8, 1024), 4);
  EXPECT_EQ(dcp_ranks_per_group(8, 4096), 1);
  EXPECT_EQ(dcp_ranks_per_group(6, 1000), 3);
  EXPECT_EQ(dcp_ranks_per_group(4, 1100), 2);
}

}  // namespace
}  // namespace dcpmla::testing
