// CUDA graph capture and replay (SPEC §4, §6): capture run() of three layers (each with its
// own engine-owned cache and device kv_scale) once, re-plan a different batch (other
// lengths, another qlen, fewer requests padded with L = 0, another route), replay the same
// graph and compare every layer with the CPU engine on that batch.
#include <gtest/gtest.h>

#include <memory>
#include <random>

#include "scenario.h"

namespace dcpmla::testing {
namespace {

struct GraphCase {
  Scenario s;                    // shared configuration (lens unused)
  std::vector<int32_t> lens1, lens2;
  int qlen1, qlen2;
  std::vector<int32_t> qlens1 = {}, qlens2 = {};  // per-request query rows (empty: uniform)
};

constexpr int kLayers = 3;

void run_graph_case(const GraphCase& gc) {
  const Scenario& s = gc.s;
  const int max_batch = int(std::max(gc.lens1.size(), gc.lens2.size()));
  int64_t total = 0, max_local = 1;
  const Layout group{s.world, 0, s.interleave};
  for (const auto* lens : {&gc.lens1, &gc.lens2})
    for (int32_t L : *lens) {
      total += blocks_needed(s, L);
      max_local = std::max<int64_t>(max_local, group.local_length_of(L, 0));
    }
  const int64_t num_blocks = total + 1;
  std::vector<int32_t> ids(static_cast<size_t>(total));
  std::iota(ids.begin(), ids.end(), 0);
  std::mt19937_64 rng(s.seed);
  std::shuffle(ids.begin(), ids.end(), rng);
  // Two batches over disjoint blocks of every layer's cache; each layer has its own latents
  // (and its own scale), so a run that reads another layer's cache shows.
  std::vector<BatchData> d1, d2;
  std::vector<float> scales;
  for (int layer = 0; layer < kLayers; ++layer) {
    size_t next = 0;
    d1.push_back(
        make_batch(s, gc.lens1, gc.qlen1, ids, next, int32_t(num_blocks - 1), s.seed + 1000 * layer, gc.qlens1));
    d2.push_back(
        make_batch(s, gc.lens2, gc.qlen2, ids, next, int32_t(num_blocks - 1), s.seed + 1000 * layer + 99, gc.qlens2));
    scales.push_back(s.dtype == KvDtype::bf16 ? 1.0f : s.kv_scale * float(1 + layer));
  }

  const AttentionConfig config = make_config(s, max_batch, max_local);
  Attention cpu(config);
  std::vector<PagedCache> cpu_caches;
  std::vector<std::unique_ptr<DeviceCache>> gpu_caches;
  cudaStream_t stream;
  cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  for (int layer = 0; layer < kLayers; ++layer) {
    cpu_caches.emplace_back(CacheConfig{num_blocks, s.block_size, 576, s.dtype, scales[size_t(layer)]});
    cpu_caches.back().poison();
    gpu_caches.push_back(std::make_unique<DeviceCache>(num_blocks, s.block_size, s.dtype));
    for (const BatchData* d : {&d1[size_t(layer)], &d2[size_t(layer)]}) {
      cpu_caches.back().write(d->latents,
                              slots_of(d->positions, d->requests, d->desc(), s.block_size, num_blocks, config.layout));
      device_write(*d, config.layout, *gpu_caches.back(), scales[size_t(layer)], stream);
    }
  }

  cuda::Attention gpu(config);
  gpu.set_tuning(test_tuning());
  const size_t qcap = size_t(max_batch) * s.max_qlen * s.heads;
  DeviceBuffer<bf16> q(qcap * 576);
  std::vector<std::unique_ptr<DeviceBuffer<bf16>>> outs;
  std::vector<std::unique_ptr<DeviceBuffer<float>>> lses;
  // fp8 scales as device floats, read when the graph replays.
  DeviceBuffer<float> scale_dev(scales);
  for (int layer = 0; layer < kLayers; ++layer) {
    outs.push_back(std::make_unique<DeviceBuffer<bf16>>(qcap * 512));
    lses.push_back(std::make_unique<DeviceBuffer<float>>(qcap));
  }
  auto scale_of = [&](int layer) {
    return s.dtype == KvDtype::bf16 ? KvScale{} : KvScale{1.0f, scale_dev.get() + layer};
  };

  auto check = [&](const std::vector<BatchData>& d, const char* which) {
    cpu.plan(d[0].desc());
    const Route route = gpu.current_plan().route();
    for (int layer = 0; layer < kLayers; ++layer) {
      const BatchData& dl = d[size_t(layer)];
      const size_t rows = size_t(dl.rows()) * s.heads;
      std::vector<bf16> ro(rows * 512);
      std::vector<float> rl(rows);
      cpu.run(d[0].q.data(), cpu_caches[size_t(layer)].view(), KvScale{scales[size_t(layer)]}, ro.data(), rl.data());
      std::vector<bf16> o = outs[size_t(layer)]->download();
      std::vector<float> l = lses[size_t(layer)]->download();
      o.resize(rows * 512);
      l.resize(rows);
      const Comparison c = compare_rows(o, l, ro, rl, 512, dl.qlen, s.heads, 1e-2, dl.qlens);
      EXPECT_EQ(c.bad_rows, 0) << which << ", layer " << layer << " (route " << to_string(route)
                               << "): max rel_l2 " << c.max_rel_l2 << ", lse err " << c.max_lse_err << " | worst "
                               << c.worst;
      EXPECT_EQ(c.nonzero_empty, 0) << which << ", layer " << layer;
    }
    return route;
  };
  auto poison = [&] {
    for (int layer = 0; layer < kLayers; ++layer) {
      outs[size_t(layer)]->poison();
      lses[size_t(layer)]->poison();
    }
  };

  // Plan batch 1, capture every layer's run in global mode (any synchronisation or
  // allocation inside run() would invalidate the capture), replay.
  gpu.plan(d1[0].desc(), stream);
  cuda_ok(cudaMemcpyAsync(q.get(), d1[0].q.data(), d1[0].q.size() * sizeof(bf16), cudaMemcpyHostToDevice, stream),
          "q1");
  cuda_ok(cudaStreamSynchronize(stream), "sync");
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  cuda_ok(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), "cudaStreamBeginCapture");
  for (int layer = 0; layer < kLayers; ++layer)
    gpu.run(q.get(), gpu_caches[size_t(layer)]->view, scale_of(layer), outs[size_t(layer)]->get(),
            lses[size_t(layer)]->get(), stream);
  cuda_ok(cudaStreamEndCapture(stream, &graph), "cudaStreamEndCapture");
  cuda_ok(cudaGraphInstantiate(&exec, graph, 0), "cudaGraphInstantiate");
  poison();
  cuda_ok(cudaGraphLaunch(exec, stream), "cudaGraphLaunch 1");
  cuda_ok(cudaStreamSynchronize(stream), "replay 1");
  const Route r1 = check(d1, "replay of batch 1");

  // Re-plan batch 2 (fewer live requests, padding, other qlen), replay the same graph.
  gpu.plan(d2[0].desc(), stream);
  cuda_ok(cudaMemcpyAsync(q.get(), d2[0].q.data(), d2[0].q.size() * sizeof(bf16), cudaMemcpyHostToDevice, stream),
          "q2");
  poison();
  cuda_ok(cudaGraphLaunch(exec, stream), "cudaGraphLaunch 2");
  cuda_ok(cudaStreamSynchronize(stream), "replay 2");
  const Route r2 = check(d2, "replay of batch 2");
  ::testing::Test::RecordProperty("routes", std::string(to_string(r1)) + " -> " + std::string(to_string(r2)));

  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

TEST(CudaGraph, ReplayAfterReplanSplitToOneStage) {
  DCPMLA_REQUIRE_GPU();
  GraphCase gc;
  gc.s = Scenario{"graph", Mode::verify, KvDtype::bf16, 64, 16, 2, 1, 1, Route::automatic, 4, 4, {}};
  gc.s.seed = 42;
  // Batch 1: 8 long requests -> idle SMs -> split_k. Batch 2: 3 short live requests and
  // 5 padding ones at qlen 2 -> one_stage.
  gc.lens1 = {3000, 2900, 4100, 1200, 6000, 2222, 3333, 800};
  gc.qlen1 = 4;
  gc.lens2 = {300, 0, 17, 0, 0, 250, 0, 0};
  gc.qlen2 = 2;
  run_graph_case(gc);
}

TEST(CudaGraph, ReplayAfterReplanOneStageToSplitFp8) {
  DCPMLA_REQUIRE_GPU();
  GraphCase gc;
  gc.s = Scenario{"graph_fp8", Mode::verify, KvDtype::fp8_e4m3, 16, 128, 1, 0, 1, Route::automatic, 2, 2, {}};
  gc.s.kv_scale = 0.5f;
  gc.s.seed = 43;
  gc.lens1 = {100, 200, 300};
  gc.qlen1 = 2;
  gc.lens2 = {5000, 0, 0};
  gc.qlen2 = 1;
  run_graph_case(gc);
}

TEST(CudaGraph, ReplayAfterReplanDecode16Heads) {
  DCPMLA_REQUIRE_GPU();
  GraphCase gc;
  gc.s = Scenario{"graph_decode", Mode::decode, KvDtype::fp8_e5m2, 64, 16, 4, 2, 1, Route::automatic, 1, 1, {}};
  gc.s.kv_scale = 2.0f;
  gc.s.seed = 44;
  gc.lens1 = {9000, 4000, 7000, 123, 8000, 6000};
  gc.qlen1 = 1;
  gc.lens2 = {0, 50, 0, 0, 3, 0};
  gc.qlen2 = 1;
  run_graph_case(gc);
}

// The balanced schedule's edges (plan.h) on every default kernel: few chunks (3 to 7) put
// chunk edges on tile, request and padding boundaries, one chunk holds many short requests
// while a long one runs over every chunk (min_segment_tokens 64: cuts on every tile edge);
// per-request query lengths include requests without rows, padding rows and rows whose
// rank-local window is empty. The second batch moves every edge and is replayed from the
// graph captured on the first.
TEST(CudaGraph, ScheduleEdgesReplayedAfterEveryEdgeMoves) {
  DCPMLA_REQUIRE_GPU();
  struct Shape {
    Mode mode;
    KvDtype dtype;
    int heads, max_qlen, workers, world, interleave;
    Route route;
  };
  const Shape shapes[] = {
      {Mode::decode, KvDtype::bf16, 16, 1, 3, 1, 1, Route::automatic},        // mma, 16 rows
      {Mode::verify, KvDtype::bf16, 16, 4, 7, 2, 1, Route::automatic},        // wgmma
      {Mode::decode, KvDtype::fp8_e4m3, 16, 1, 5, 3, 2, Route::split_k},      // fp8 swap
      {Mode::verify, KvDtype::fp8_e5m2, 128, 2, 7, 1, 1, Route::automatic},   // wgmma fp8, two row groups
      {Mode::draft, KvDtype::bf16, 32, 1, 4, 4, 1, Route::one_stage},         // mma, 32 rows
      {Mode::verify, KvDtype::fp8_e4m3, 8, 4, 0, 2, 2, Route::automatic},     // mma fp8, 32 rows, all SMs
  };
  const std::vector<int32_t> lens1{70, 0, 64, 130, 5000, 1, 0, 129, 640, 63, 3000, 65};
  const std::vector<int32_t> lens2{2000, 17, 0, 6000, 128, 0, 0, 129, 1, 64, 700, 3};
  int index = 0;
  for (const Shape& sh : shapes) {
    GraphCase gc;
    Scenario& s = gc.s;
    s.name = "schedule_" + std::to_string(index);
    s.mode = sh.mode;
    s.dtype = sh.dtype;
    s.kv_scale = sh.dtype == KvDtype::bf16 ? 1.0f : 0.25f;
    s.heads = sh.heads;
    s.world = sh.world;
    s.rank = index % sh.world;
    s.interleave = sh.interleave;
    s.block_size = 16;
    s.route = sh.route;
    s.num_workers = sh.workers;
    s.min_segment_tokens = 64;
    s.seed = 5000 + uint64_t(index++);
    s.max_qlen = sh.max_qlen;
    std::mt19937_64 rng(s.seed);
    // Query rows per request: up to max_qlen, at most L in the causal modes (0 for padding is
    // allowed: such a request has no row at all).
    auto qlens_for = [&](const std::vector<int32_t>& lens) {
      std::vector<int32_t> q;
      for (int32_t L : lens) {
        const int most = s.mode == Mode::draft || L == 0 ? sh.max_qlen : std::min<int>(sh.max_qlen, L);
        q.push_back(int32_t(rng() % uint64_t(most + 1)));
      }
      q[4] = int32_t(std::min<int>(sh.max_qlen, lens1[4]));
      return q;
    };
    gc.lens1 = lens1;
    gc.lens2 = lens2;
    gc.qlen1 = gc.qlen2 = s.qlen = sh.max_qlen;
    gc.qlens1 = qlens_for(lens1);
    gc.qlens2 = qlens_for(lens2);
    SCOPED_TRACE(s.describe());
    run_graph_case(gc);
  }
}

// The engine path over the grid: every mode, dtype and route, N in {1, 2, 3, 4, 8} (a
// random rank of each), interleave 1 and 2, block sizes 1 to 256, 5 to 128 heads; three
// layers per step, each with its own cache, latents and scale, captured once and replayed
// after a re-plan that changes lengths, qlen and padding. Lengths include padding, a
// request of exactly qlen tokens and one shorter than N x interleave (ranks without a
// token of it).
TEST(CudaGraph, EnginePathOverTheGrid) {
  DCPMLA_REQUIRE_GPU();
  const Mode modes[] = {Mode::decode, Mode::verify, Mode::draft};
  const KvDtype dtypes[] = {KvDtype::bf16, KvDtype::fp8_e4m3, KvDtype::fp8_e5m2};
  const int worlds[] = {1, 2, 3, 4, 8}, blocks[] = {1, 16, 64, 256}, heads[] = {16, 128, 5};
  const Route verify_routes[] = {Route::automatic, Route::one_stage, Route::two_stage, Route::split_k};
  const Route other_routes[] = {Route::automatic, Route::one_stage, Route::split_k};
  for (int k = 0; k < 15; ++k) {
    GraphCase gc;
    Scenario& s = gc.s;
    s.name = "grid_" + std::to_string(k);
    s.mode = modes[k % 3];
    s.dtype = dtypes[(k / 3) % 3];
    s.kv_scale = s.dtype == KvDtype::bf16 ? 1.0f : s.dtype == KvDtype::fp8_e4m3 ? 0.05f : 2.0f;
    s.world = worlds[k % 5];
    s.rank = (k * 7 + 3) % s.world;
    s.block_size = blocks[k % 4];
    s.interleave = s.block_size % 2 == 0 ? 1 + k % 2 : 1;
    s.heads = heads[k % 3];
    s.route = s.mode == Mode::verify ? verify_routes[k % 4] : other_routes[k % 3];
    s.seed = 1000 + uint64_t(k);
    gc.qlen1 = s.mode == Mode::decode ? 1 : 1 + k % 4;
    gc.qlen2 = s.mode == Mode::decode ? 1 : 1 + (k + 2) % 4;
    s.qlen = gc.qlen1;
    s.max_qlen = std::max(gc.qlen1, gc.qlen2);
    std::mt19937_64 rng(s.seed);
    auto length = [&](int qlen) { return int32_t(qlen + rng() % 2000); };
    const int span = s.world * s.interleave;
    gc.lens1 = {length(gc.qlen1), 0, int32_t(gc.qlen1), length(gc.qlen1), int32_t(std::max(gc.qlen1, span - 1))};
    gc.lens2 = {0, length(gc.qlen2), int32_t(gc.qlen2), 0, 0, length(gc.qlen2)};
    SCOPED_TRACE(s.describe());
    run_graph_case(gc);
  }
}

}  // namespace
}  // namespace dcpmla::testing
