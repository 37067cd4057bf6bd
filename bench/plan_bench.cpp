// Planner::plan per step on one core (issue 11: <= 10 us for 128 requests x 4096 local tokens,
// <= 50 us at 16384, <= 20 us for a ragged split_k batch). Host work only: the planner of a
// DCP rank (rank 0 of 8, so each global length is 8 x the local one) with the CUDA backend's
// configuration, re-planning the same batch into one plan. Block tables are a random
// permutation of the blocks. `make bench-plan` builds and runs it; results in docs/perf.md.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "dcpmla/engine.h"

namespace {

using namespace dcpmla;

constexpr int kWorld = 8;

struct Shape {
  std::string name;
  std::vector<int32_t> local_lens;  // this rank's tokens per request
  int qlen;
  Mode mode;
  int block_size;
  bool split_k;  // the batch must take split_k (checked once, before timing)
};

// Per request, ceil(local / block_size) entries of one random permutation of all blocks.
struct Batch {
  std::vector<int32_t> seq_lens, tables;
  int width = 0;
};

Batch make_batch(const Shape& s, std::mt19937_64& rng) {
  Batch b;
  for (int32_t local : s.local_lens) {
    b.seq_lens.push_back(local * kWorld);  // rank 0 holds exactly `local` of them
    b.width = std::max(b.width, (local + s.block_size - 1) / s.block_size);
  }
  std::vector<int32_t> ids(s.local_lens.size() * size_t(b.width));
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  b.tables = std::move(ids);
  return b;
}

void plan_step(benchmark::State& state, const Shape& s) {
  std::mt19937_64 rng(1);
  const Batch b = make_batch(s, rng);
  AttentionConfig a;
  a.heads = 16;
  a.block_size = s.block_size;
  a.layout = Layout{kWorld, 0, 1};
  a.limits = PlanLimits{128, 8, 131072};
  const Planner planner(planner_config(a, Backend::cuda, 132, 64));
  Plan plan = planner.make_plan();
  const BatchDesc batch{b.seq_lens, s.qlen, b.tables, b.width, s.mode};
  planner.plan(batch, plan);
  if (s.split_k && plan.route() != Route::split_k) {
    state.SkipWithError("the batch does not take split_k");
    return;
  }
  for (auto _ : state) {
    planner.plan(batch, plan);
    benchmark::DoNotOptimize(plan.header());
    benchmark::ClobberMemory();
  }
  int64_t entries = 0;
  for (int32_t local : s.local_lens) entries += (local + s.block_size - 1) / s.block_size;
  state.counters["requests"] = double(s.local_lens.size());
  state.counters["table_entries"] = double(entries);
}

std::vector<Shape> shapes() {
  std::vector<int32_t> mix(64);
  std::mt19937_64 rng(7);
  for (auto& len : mix) len = 512 + int32_t(rng() % (16896 - 512 + 1));
  return {
      {"a_b128_local4096_bs64", std::vector<int32_t>(128, 4096), 1, Mode::decode, 64, false},
      {"b_b128_local16384_bs64", std::vector<int32_t>(128, 16384), 1, Mode::decode, 64, false},
      {"c1_ragged4_q4_bs64", {4641, 45118, 1730, 1696}, 4, Mode::verify, 64, true},
      {"c2_mix64_512to16.5k_bs64", mix, 1, Mode::decode, 64, true},
      {"d_b128_local4096_bs16", std::vector<int32_t>(128, 4096), 1, Mode::decode, 16, false},
      // Pages of one token (SGLang's default): a table entry per token.
      {"e_b128_local4096_bs1", std::vector<int32_t>(128, 4096), 1, Mode::decode, 1, false},
  };
}

}  // namespace

int main(int argc, char** argv) {
  // Repetitions come from the command line (--benchmark_repetitions; `make bench-plan` asks for
  // 10, aggregates only): set here, they would override the flags silently.
  for (const Shape& s : shapes())
    benchmark::RegisterBenchmark(s.name.c_str(), plan_step, s)->Unit(benchmark::kMicrosecond);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
