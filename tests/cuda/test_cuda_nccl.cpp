// The NCCL communicator (comm_nccl.h) with the GPUs one machine has: a one-rank group made
// through the thread start-up and through an explicit id, every collective, the whole DCP
// step over NCCL (eager and as a CUDA graph) against the same step over the DeviceGroup,
// and the refusals and the timeout path. The mpirun start-up is tests/cuda/test_nccl_mpi.cpp.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>

#include "dcp_harness.h"
#include "dcpmla/comm_nccl.h"
#include "dcpmla/error.h"

namespace dcpmla::testing {
namespace {

// Runs without a GPU too (CI): asking one node for more ranks than it has GPUs.
TEST(Nccl, RefusesMoreRanksThanGpus) {
  const int n = cuda_device_count() + 1;
  try {
    make_nccl_communicators(n);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("at most the GPUs of this node"), std::string::npos) << e.what();
  }
}

TEST(Nccl, MpiStartupNeedsMpi) {
  // Built without MPI: a clear refusal; with MPI but outside mpirun: MPI is not initialised.
  EXPECT_THROW(make_nccl_communicator_mpi(), Error);
}

template <class T>
void expect_same(const DeviceBuffer<T>& a, const std::vector<T>& want, const char* what) {
  const std::vector<T> got = a.download();
  ASSERT_EQ(got.size(), want.size()) << what;
  EXPECT_EQ(0, std::memcmp(got.data(), want.data(), want.size() * sizeof(T))) << what;
}

void exercise_one_rank(NcclCommunicator& comm) {
  ASSERT_EQ(comm.world_size(), 1);
  ASSERT_EQ(comm.rank(), 0);
  const std::vector<float> f{1.5f, -2.0f, 3.25f, 0.0f};
  const std::vector<int32_t> i{7, -8, 9, 10};
  const std::vector<bf16> h = random_bf16(64, 3);
  DeviceBuffer<float> fs(f), fr(4);
  DeviceBuffer<int32_t> is(i), ir(4);
  DeviceBuffer<bf16> hs(h), hr(64);
  cuda_ok(cudaDeviceSynchronize(), "uploads");  // legacy-stream uploads before the NCCL stream reads
  comm.all_gather(fs.get(), fr.get(), 4, DataType::f32);
  comm.synchronize();
  expect_same(fr, f, "all_gather f32");
  comm.reduce_scatter_sum(is.get(), ir.get(), 4, DataType::i32);
  comm.synchronize();
  expect_same(ir, i, "reduce_scatter i32");
  comm.reduce_scatter_sum(hs.get(), hr.get(), 64, DataType::bf16);  // ncclBfloat16
  comm.synchronize();
  expect_same(hr, h, "reduce_scatter bf16");
  comm.reduce_scatter_sum(fs.get(), fr.get(), 4, DataType::f32);
  comm.all_to_all(hs.get(), hr.get(), 64, DataType::bf16);
  comm.synchronize();
  expect_same(fr, f, "reduce_scatter f32");
  expect_same(hr, h, "all_to_all bf16");
  comm.barrier();
}

TEST(Nccl, ThreadStartupOneRankCollectives) {
  DCPMLA_REQUIRE_GPU();
  auto comms = make_nccl_communicators(1);
  ASSERT_EQ(comms.size(), 1u);
  EXPECT_GE(nccl_version(), 21400);
  exercise_one_rank(*comms[0]);
}

TEST(Nccl, ExplicitIdOneRankOnCallersStream) {
  DCPMLA_REQUIRE_GPU();
  cudaStream_t stream;
  cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  {
    auto comm = make_nccl_communicator(nccl_unique_id(), 1, 0, 0, stream);
    EXPECT_EQ(comm->stream(), stream);
    exercise_one_rank(*comm);
  }
  cudaStreamDestroy(stream);
}

// The DCP step over a one-rank NCCL group equals the same step over the DeviceGroup, bit for
// bit, eagerly and as a CUDA graph replayed after a re-plan.
TEST(Nccl, DcpStepOverNcclEqualsDeviceGroup) {
  DCPMLA_REQUIRE_GPU();
  for (DcpMerge merge : {DcpMerge::reduce_scatter, DcpMerge::all_to_all}) {
    DcpCase c;
    c.name = "nccl";
    c.world = 1;
    c.mode = Mode::verify;
    c.route = Route::two_stage;
    c.merge = merge;
    c.heads_local = 16;
    c.qlen = 3;
    c.lens = {500, 0, 3, 64};
    c.seed = 900 + uint64_t(merge);
    SCOPED_TRACE(c.describe());
    const GlobalBatch g = make_global(c.lens, c.qlen, c.heads_local, c.seed);
    const Result group = run_gpu(c, g);
    expect_close(group, cpu_reference(g, c), g, "device group vs CPU");

    auto comms = make_nccl_communicators(1);
    NcclCommunicator& comm = *comms[0];
    const Tables t = make_tables(c, {&g});
    DcpStep step(step_config(c, t, g.B, g.qlen), comm);
    cudaStream_t stream = comm.stream();
    const RankInputs in = rank_inputs(g, 0, c.heads_local, step.row_capacity());
    DeviceCache cache(t.num_blocks, c.block_size, c.dtype, stream);
    const BatchDesc desc{g.lens, g.qlen, t.tables[0], t.widths[0], c.mode};
    device_write(in.prefix_positions, in.prefix_requests, in.prefix_latents, desc, Layout{1, 0, c.interleave}, cache,
                 c.kv_scale, stream);
    step.plan(desc);
    DeviceBuffer<bf16> q(in.q_local.size()), lat(in.new_latents.size()), out(size_t(step.row_capacity()) * c.heads_local * kR);
    DeviceBuffer<float> lse(size_t(step.row_capacity()) * c.heads_local);
    upload_on(q, in.q_local, stream);
    upload_on(lat, in.new_latents, stream);
    step.run(q.get(), lat.get(), cache.view, KvScale{c.kv_scale}, out.get(), lse.get());
    comm.synchronize();
    Result eager;
    eager.out.assign(group.out.size(), bf16{});
    eager.lse.assign(group.lse.size(), 0.0f);
    scatter_heads(eager, g, 0, c.heads_local, out.download(), lse.download());
    EXPECT_EQ(0, std::memcmp(eager.out.data(), group.out.data(), group.out.size() * sizeof(bf16)));
    EXPECT_EQ(0, std::memcmp(eager.lse.data(), group.lse.data(), group.lse.size() * sizeof(float)));

    // Graph: capture on the communicator's stream, re-plan the same batch, replay.
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    cuda_ok(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture");
    step.run(q.get(), lat.get(), cache.view, KvScale{c.kv_scale}, out.get(), lse.get());
    cuda_ok(cudaStreamEndCapture(stream, &graph), "cudaStreamEndCapture");
    cuda_ok(cudaGraphInstantiate(&exec, graph, 0), "cudaGraphInstantiate");
    poison_on(out, stream);
    poison_on(lse, stream);
    step.plan(desc);
    cuda_ok(cudaGraphLaunch(exec, stream), "cudaGraphLaunch");
    comm.synchronize();
    Result replay = eager;
    scatter_heads(replay, g, 0, c.heads_local, out.download(), lse.download());
    EXPECT_EQ(0, std::memcmp(replay.out.data(), group.out.data(), group.out.size() * sizeof(bf16)));
    EXPECT_EQ(0, std::memcmp(replay.lse.data(), group.lse.data(), group.lse.size() * sizeof(float)));
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  }
}

// A group of two whose second rank never joins: the non-blocking init gives up after the
// timeout, aborts, and throws (never a hang).
TEST(Nccl, InitTimesOutWhenAPeerNeverJoins) {
  DCPMLA_REQUIRE_GPU();
  NcclOptions o;
  o.timeout = std::chrono::milliseconds(3000);
  const auto start = std::chrono::steady_clock::now();
  try {
    auto comm = make_nccl_communicator(nccl_unique_id(), 2, 0, 0, nullptr, o);
    ADD_FAILURE() << "no error";
  } catch (const CudaError& e) {
    EXPECT_NE(std::string(e.what()).find("ncclCommInitRankConfig"), std::string::npos) << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(60));
}

TEST(Nccl, BadArguments) {
  EXPECT_THROW(make_nccl_communicators(0), Error);
  const NcclId id{};
  EXPECT_THROW(make_nccl_communicator(id, 2, 2, 0), Error);  // rank out of range
  EXPECT_THROW(make_nccl_communicator(id, 1, 0, cuda_device_count()), Error);  // no such device
}

}  // namespace
}  // namespace dcpmla::testing
