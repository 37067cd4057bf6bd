// CUDA graph capture and replay (SPEC §4): capture attend() once, re-plan a different
// batch (other lengths, another qlen, fewer requests padded with L = 0, another route),
// replay the same graph and compare with the CPU kernel on that batch.
#include <gtest/gtest.h>

#include "scenario.h"

namespace dcpmla::testing {
namespace {

struct GraphCase {
  Scenario s;                    // shared configuration (lens unused)
  std::vector<int32_t> lens1, lens2;
  int qlen1, qlen2;
};

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
  size_t next = 0;
  // Two batches over disjoint blocks of one cache.
  const BatchData d1 = make_batch(s, gc.lens1, gc.qlen1, ids, next, int32_t(num_blocks - 1), s.seed);
  const BatchData d2 = make_batch(s, gc.lens2, gc.qlen2, ids, next, int32_t(num_blocks - 1), s.seed + 99);

  PlannerConfig config = make_config(s, num_blocks, max_batch, max_local);
  const float sm_scale = default_softmax_scale();
  RankRunner cpu(config, s.kv_scale, sm_scale);
  cpu.cache().poison();
  cpu.write(d1.latents, d1.positions, d1.requests, d1.desc());
  cpu.write(d2.latents, d2.positions, d2.requests, d2.desc());

  config.backend = Backend::cuda;
  CudaRankRunner gpu(config, s.kv_scale, sm_scale);
  gpu.set_tuning(test_tuning());
  const size_t cache_bytes = size_t(cpu.cache().config().bytes());
  cudaStream_t stream;
  cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  gpu.upload_cache(std::span<const uint8_t>(cpu.cache().data(), cache_bytes), stream);

  const size_t qcap = size_t(max_batch) * s.max_qlen * s.heads;
  DeviceBuffer<bf16> q(qcap * 576), out(qcap * 512);
  DeviceBuffer<float> lse(qcap);

  auto reference = [&](const BatchData& d, std::vector<bf16>& ro, std::vector<float>& rl) {
    cpu.plan(d.desc());
    const size_t rows = d.lens.size() * size_t(d.qlen) * s.heads;
    ro.assign(rows * 512, bf16{});
    rl.assign(rows, 0.0f);
    cpu.attend(d.q.data(), ro.data(), rl.data());
    return cpu.current_plan().route();
  };
  auto check = [&](const BatchData& d, const char* which) {
    std::vector<bf16> ro;
    std::vector<float> rl;
    const Route route = reference(d, ro, rl);
    const size_t rows = rl.size();
    std::vector<bf16> o = out.download();
    std::vector<float> l = lse.download();
    o.resize(rows * 512);
    l.resize(rows);
    const Comparison c = compare_rows(o, l, ro, rl, 512, d.qlen, s.heads);
    EXPECT_EQ(c.bad_rows, 0) << which << " (route " << to_string(route) << "): max rel_l2 " << c.max_rel_l2
                             << ", lse err " << c.max_lse_err << " | worst " << c.worst;
    EXPECT_EQ(c.nonzero_empty, 0) << which;
    return route;
  };

  // Plan batch 1, capture, replay.
  gpu.plan(d1.desc(), stream);
  cuda_ok(cudaMemcpyAsync(q.get(), d1.q.data(), d1.q.size() * sizeof(bf16), cudaMemcpyHostToDevice, stream), "q1");
  cuda_ok(cudaStreamSynchronize(stream), "sync");
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  cuda_ok(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture");
  gpu.attend(q.get(), out.get(), lse.get(), stream);
  cuda_ok(cudaStreamEndCapture(stream, &graph), "cudaStreamEndCapture");
  cuda_ok(cudaGraphInstantiate(&exec, graph, 0), "cudaGraphInstantiate");
  out.poison();
  lse.poison();
  cuda_ok(cudaGraphLaunch(exec, stream), "cudaGraphLaunch 1");
  cuda_ok(cudaStreamSynchronize(stream), "replay 1");
  const Route r1 = check(d1, "replay of batch 1");

  // Re-plan batch 2 (fewer live requests, padding, other qlen), replay the same graph.
  gpu.plan(d2.desc(), stream);
  cuda_ok(cudaMemcpyAsync(q.get(), d2.q.data(), d2.q.size() * sizeof(bf16), cudaMemcpyHostToDevice, stream), "q2");
  out.poison();
  lse.poison();
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

}  // namespace
}  // namespace dcpmla::testing
