// dcpmla command-line tool.
//
//   dcpmla demo   runs a mixed batch through the whole DCP path (shard -> page -> write
//                 -> plan -> per-rank attention -> merge) for decode, verify and draft in
//                 bf16 and fp8, and checks every answer twice: against the same batch on
//                 one rank (DCP1) and against the float64 reference; --device cuda runs the
//                 ranks' attention on the GPU (CUDA builds).
//   dcpmla bench  (CUDA builds) what each of --ranks N ranks does per DCP step on this GPU:
//                 attention over its share, merge kernels, bytes sent (bench/dcp_bench_core.cpp).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>
#include <iostream>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "cli_support.h"
#include "dcpmla/build_info.h"
#include "dcpmla/error.h"
#include "dcpmla/plan.h"
#include "dcpmla/reference.h"
#include "dcpmla/runner.h"
#include "dcpmla/types.h"
#ifdef DCPMLA_HAS_MPI
#include "dcpmla/comm_mpi.h"
#endif
#ifdef DCPMLA_HAS_CUDA
#include "../bench/dcp_results.h"
#include "dcpmla/cuda.h"
#include "dcp_bench_core.h"
#endif

namespace {

constexpr double kBound = 1e-2;  // rel L2 of out and absolute lse error
constexpr int kExitExceeded = 1;
constexpr int kExitError = 2;
constexpr int kExitNoDevice = 3;  // --device cuda or bench where no GPU is usable (make demo skips on it)

struct DemoOptions {
  bool json = false;
  int ranks = 4;
  uint64_t seed = 2024;
  int heads = 16;
  bool quick = false;
  std::string device = "cpu";
  dcpmla::RankEngineFactory engines;  // empty: the CPU engines; --device cuda: the GPU's
  // Set when started by mpirun: this process is one rank of the group and the DCP run
  // goes over MPI; otherwise the ranks are threads of this process.
  dcpmla::Communicator* comm = nullptr;
};

struct Case {
  dcpmla::Mode mode;
  int qlen;
  dcpmla::KvDtype dtype;
  float kv_scale;
  int interleave;
};

struct Row {
  int index;
  Case c;
  int ranks;
  std::vector<dcpmla::Route> routes;  // distinct routes the ranks' planners took
  dcpmla::ErrorReport vs_dcp1;
  dcpmla::ErrorReport vs_ref;
  double time_ms;
  bool ok;
};

// The batch: a long request, a medium one, two shorter than the rank count, a
// padding request (L = 0, as CUDA-graph padding makes) and one in between.
std::vector<int32_t> batch_lengths(bool quick, int qlen) {
  std::vector<int32_t> lens = quick ? std::vector<int32_t>{300, 157, 5, 2, 0, 77}
                                    : std::vector<int32_t>{3000, 1537, 5, 2, 0, 777};
  // A causal query block is part of L, so a live request holds at least qlen tokens.
  for (auto& l : lens)
    if (l > 0) l = std::max(l, qlen);
  return lens;
}

std::vector<Case> demo_cases() {
  using dcpmla::KvDtype;
  using dcpmla::Mode;
  // Latents are ~N(0, 1); with scale 0.05 they span about +-100 of e4m3's +-448.
  const float fp8_scale = 0.05f;
  std::vector<Case> cases;
  const struct {
    Mode mode;
    int qlen;
  } modes[] = {{Mode::decode, 1}, {Mode::verify, 4}, {Mode::draft, 3}};
  for (const auto& m : modes) {
    // Alternate the interleave so that every mode meets both I = 1 and I = 2.
    cases.push_back({m.mode, m.qlen, KvDtype::bf16, 1.0f, 1});
    cases.push_back({m.mode, m.qlen, KvDtype::fp8_e4m3, fp8_scale, 2});
  }
  return cases;
}

dcpmla::ErrorReport compare_to(const dcpmla::AttentionResult& got, const std::vector<double>& out,
                               const std::vector<double>& lse, int batch, int qlen, int heads,
                               int rank_dim) {
  return dcpmla::compare(got.out, got.lse, out, lse, batch, qlen, heads, rank_dim);
}

Row run_case(int index, const Case& c, const DemoOptions& opt, std::mt19937_64& rng) {
  const dcpmla::LatentDims dims;  // R = 512, P = 64: DeepSeek-V3's latent
  const int dim = dims.dim();
  const int rank_dim = dims.kv_lora_rank;
  const std::vector<int32_t> seq_lens = batch_lengths(opt.quick, c.qlen);
  const int batch = int(seq_lens.size());
  const int64_t max_len = *std::max_element(seq_lens.begin(), seq_lens.end());

  // Fresh q and kv for every case. Positions past a request's length are NaN: a
  // read beyond a length would show up as NaN in the output.
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> q(size_t(batch) * c.qlen * opt.heads * dim);
  for (auto& x : q) x = normal(rng);
  std::vector<float> kv(size_t(batch) * max_len * dim, std::numeric_limits<float>::quiet_NaN());
  for (int b = 0; b < batch; ++b)
    for (int64_t i = 0; i < int64_t(seq_lens[b]) * dim; ++i) kv[size_t(b * max_len * dim + i)] = normal(rng);

  dcpmla::AttentionOptions o;
  o.mode = c.mode;
  o.interleave = c.interleave;
  o.block_size = 64;
  o.kv_dtype = c.dtype;
  o.kv_scale = c.kv_scale;
  o.kv_lora_rank = rank_dim;
  o.backend = dcpmla::parse_backend(opt.device);
  o.seed = opt.seed + uint64_t(index);  // block tables: a random permutation per case

  o.world_size = opt.ranks;
  const auto t0 = std::chrono::steady_clock::now();
  const dcpmla::AttentionResult dcp =
      opt.comm ? dcpmla::mla_attention_on_rank(q, kv, seq_lens, batch, c.qlen, opt.heads, max_len, dim, o, *opt.comm,
                                               opt.engines)
               : dcpmla::mla_attention(q, kv, seq_lens, batch, c.qlen, opt.heads, max_len, dim, o, opt.engines);
  const auto t1 = std::chrono::steady_clock::now();

  o.world_size = 1;
  const dcpmla::AttentionResult single =
      dcpmla::mla_attention(q, kv, seq_lens, batch, c.qlen, opt.heads, max_len, dim, o, opt.engines);

  const double softmax_scale = 1.0 / std::sqrt(double(dim));
  const dcpmla::ReferenceResult ref =
      dcpmla::reference_attention(q, kv, seq_lens, batch, c.qlen, opt.heads, max_len, dim, c.mode,
                                  c.dtype, c.kv_scale, softmax_scale, rank_dim);

  const std::vector<double> single_out(single.out.begin(), single.out.end());
  const std::vector<double> single_lse(single.lse.begin(), single.lse.end());

  Row row{index, c, opt.ranks, {}, {}, {}, 0.0, false};
  for (dcpmla::Route r : dcp.routes)
    if (std::find(row.routes.begin(), row.routes.end(), r) == row.routes.end()) row.routes.push_back(r);
  row.vs_dcp1 = compare_to(dcp, single_out, single_lse, batch, c.qlen, opt.heads, rank_dim);
  row.vs_ref = compare_to(dcp, ref.out, ref.lse, batch, c.qlen, opt.heads, rank_dim);
  row.time_ms = std::chrono::duration<double, std::milli>(t1 - t0).count();
  row.ok = row.vs_dcp1.within(kBound) && row.vs_ref.within(kBound);
  return row;
}

std::string routes_text(const std::vector<dcpmla::Route>& routes) {
  std::vector<std::string> names;
  for (auto r : routes) names.emplace_back(dcpmla::to_string(r));
  return fmt::format("{}", fmt::join(names, ","));
}

// NaN and inf are not JSON numbers; an error of that kind becomes null (and ok = false).
nlohmann::json number(double x) { return std::isfinite(x) ? nlohmann::json(x) : nlohmann::json(nullptr); }

// A float32 as the shortest decimal that reads back as it (0.05f: 0.05, not 0.0500000007...).
double shortest(float x) { return std::stod(fmt::format("{}", x)); }

nlohmann::json report_json(const dcpmla::ErrorReport& e) {
  return {{"rel_l2", number(e.max_rel_l2)}, {"lse_err", number(e.max_lse_err)}, {"nan_count", e.nan_count}};
}

nlohmann::json row_json(const Row& r) {
  nlohmann::json routes = nlohmann::json::array();
  for (auto route : r.routes) routes.push_back(std::string(dcpmla::to_string(route)));
  return {{"case", r.index},
          {"mode", std::string(dcpmla::to_string(r.c.mode))},
          {"qlen", r.c.qlen},
          {"kv_dtype", std::string(dcpmla::to_string(r.c.dtype))},
          {"kv_scale", shortest(r.c.kv_scale)},
          {"ranks", r.ranks},
          {"interleave", r.c.interleave},
          {"routes", routes},
          {"vs_dcp1", report_json(r.vs_dcp1)},
          {"vs_ref", report_json(r.vs_ref)},
          {"time_ms", r.time_ms},
          {"bound", kBound},
          {"ok", r.ok}};
}

void print_table(const std::vector<Row>& rows, const DemoOptions& opt) {
  const auto lens = batch_lengths(opt.quick, 1);
  fmt::print("dcpmla demo: seq_lens {} (L incl. the query block; 0 = padding), {} heads,\n", lens,
             opt.heads);
  fmt::print("D = 576 (R 512 + P 64), block_size 64, seed {}, device {}; each case on {} ranks vs 1 rank (DCP1)\n",
             opt.seed, opt.device, opt.ranks);
  fmt::print("and vs the float64 reference; pass: rel L2 and |lse err| <= {:g}, no NaN.\n\n", kBound);
  fmt::print("{:>4}  {:<6} {:>4}  {:<8} {:>5} {:>3}  {:<20} {:>9} {:>9}  {:>9} {:>9}  {:>9}  {}\n", "case",
             "mode", "qlen", "dtype", "ranks", "I", "route(s)", "dcp1 L2", "dcp1 lse", "ref L2",
             "ref lse", "time ms", "result");
  for (const Row& r : rows) {
    const bool nan = r.vs_dcp1.nan_count > 0 || r.vs_ref.nan_count > 0;
    fmt::print("{:>4}  {:<6} {:>4}  {:<8} {:>5} {:>3}  {:<20} {:>9.2e} {:>9.2e}  {:>9.2e} {:>9.2e}  {:>9.1f}  {}\n",
               r.index, dcpmla::to_string(r.c.mode), r.c.qlen, dcpmla::to_string(r.c.dtype), r.ranks,
               r.c.interleave, routes_text(r.routes), r.vs_dcp1.max_rel_l2, r.vs_dcp1.max_lse_err,
               r.vs_ref.max_rel_l2, r.vs_ref.max_lse_err, r.time_ms,
               r.ok ? "ok" : (nan ? "FAIL (NaN)" : "FAIL"));
  }
  const auto failed = std::count_if(rows.begin(), rows.end(), [](const Row& r) { return !r.ok; });
  fmt::print("\ntime ms: the whole {}-rank call (shard, write, plan, attend, merge), ranks as {}.\n",
             opt.ranks, opt.comm ? "MPI processes (rank 0's time)" : "threads");
  if (failed)
    fmt::print("{} of {} cases exceed {:g} or hold NaN\n", failed, rows.size(), kBound);
  else
    fmt::print("all {} cases within {:g}\n", rows.size(), kBound);
}

int run_demo(const DemoOptions& opt) {
  std::mt19937_64 rng(opt.seed);
  std::vector<Row> rows;
  const auto cases = demo_cases();
  for (size_t i = 0; i < cases.size(); ++i) rows.push_back(run_case(int(i), cases[i], opt, rng));

  // Under MPI every rank holds the merged result; rank 0 speaks for the group.
  const bool speaker = !opt.comm || opt.comm->rank() == 0;
  if (speaker && opt.json) {
    nlohmann::json out = {{"version", DCPMLA_VERSION_STRING},
                          {"commit", DCPMLA_GIT_COMMIT},
                          {"seed", opt.seed},
                          {"seq_lens", batch_lengths(opt.quick, 1)},
                          {"heads", opt.heads},
                          {"ranks", opt.ranks},
                          {"device", opt.device},
                          {"rows", nlohmann::json::array()}};
    for (const Row& r : rows) out["rows"].push_back(row_json(r));
    fmt::print("{}\n", out.dump(2));
  } else if (speaker) {
    print_table(rows, opt);
  }
  const bool all_ok = std::all_of(rows.begin(), rows.end(), [](const Row& r) { return r.ok; });
  return all_ok ? 0 : kExitExceeded;
}

struct BenchOptions {
  std::vector<int> ranks{1, 2, 4, 8};
  std::vector<int> heads_local{16, 64};
  std::vector<int> qlens{1, 4};
  int batch = 8;
  int64_t context = 131072;
  int runs = 20;
  std::string kv_dtype = "bf16";
  std::string json;
};

#ifdef DCPMLA_HAS_CUDA
int run_bench(const BenchOptions& b, int argc, char** argv) {
  dcpmla::bench::DcpBenchOptions o;
  o.world_sizes = b.ranks;
  o.heads_local = b.heads_local;
  o.qlens = b.qlens;
  o.batch = b.batch;
  o.context = b.context;
  o.runs = b.runs;
  o.kv_dtype = dcpmla::parse_kv_dtype(b.kv_dtype);
  const auto rows = dcpmla::bench::run_dcp_bench(o);
  const std::string gpu = dcpmla::bench::device_description(o.device);
  fmt::print("GPU: {}\n{}", gpu, dcpmla::bench::format_dcp_bench_table(rows, o));
  if (!b.json.empty())
    dcpmla::results::write(b.json, dcpmla::results::metadata(o.device, argc, argv), dcpmla::results::dcp_rows(rows, o));
  return 0;
}
#endif

}  // namespace

int run_cli(int argc, char** argv) {
  CLI::App app{"dcpmla: MLA attention (DeepSeek-V3 style latent attention) for decoding with the\n"
               "KV cache sharded across ranks (decode context parallelism). demo runs the whole path\n"
               "(CPU, or the GPU with --device cuda); bench times the GPU DCP step (CUDA builds)."};
  app.set_version_flag("--version", fmt::format("dcpmla {} (commit {})", DCPMLA_VERSION_STRING, DCPMLA_GIT_COMMIT));
  // At most one subcommand; none is reported below (CLI11 would call an unknown one "required").
  app.require_subcommand(0, 1);
  app.footer("Exit status: 0 every case passed, 1 a case exceeded the bound or gave NaN,\n"
             "2 an error (bad option, or the library refused the input), 3 --device cuda or bench without a usable GPU.");
  using dcpmla::cli::integer_in;
  using dcpmla::cli::writable_file;

  DemoOptions opt;
  CLI::App* demo = app.add_subcommand(
      "demo", "Run a mixed batch on N ranks and check it against 1 rank and a float64 reference");
  demo->footer(
      "Cases: decode (qlen 1), verify (qlen 4) and draft (qlen 3), each in bf16 (interleave 1)\n"
      "and fp8_e4m3 (kv_scale 0.05, interleave 2); block_size 64, route auto. The batch holds\n"
      "long, short, shorter-than-ranks and padding requests (seq_lens 3000, 1537, 5, 2, 0, 777;\n"
      "a live request holds at least qlen tokens) with random q, kv and block tables.\n"
      "Each case runs on --ranks ranks and on 1 rank (DCP1) and is compared with the float64\n"
      "reference: rel L2 of out and |lse error| must stay within 1e-2, with no NaN.\n"
      "time ms is the whole N-rank call: shard, write, plan, attend, merge.\n"
      "--json prints one object: version, commit, seed, seq_lens, heads, ranks, device and the rows.\n"
      "Threads share one process's memory: a --ranks x --heads pair whose case needs more than the\n"
      "library's in-process bound (8 GiB) is refused when that case starts (exit 2).\n\n"
      "Exit status: 0 every case passed, 1 a case exceeded the bound or gave NaN,\n"
      "2 an error (bad option, or the library refused the input), 3 --device cuda or bench without a usable GPU.");
  demo->add_flag("--json", opt.json, "Print the run as JSON instead of a table");
  demo->add_option("--ranks", opt.ranks,
                   "DCP world size: ranks run as threads, or under mpirun one rank per process "
                   "(then it defaults to, and must equal, the number of processes)")
      ->check(integer_in(1, 64))
      ->capture_default_str();
  demo->add_option("--seed", opt.seed, "Seed of q, kv and the block tables")
      ->check(integer_in<uint64_t>(0, UINT64_MAX))
      ->capture_default_str();
  demo->add_option("--heads", opt.heads, "Query heads per request")
      ->check(integer_in(1, 256))
      ->capture_default_str();
  demo->add_option("--device", opt.device, "Where the ranks attend: cpu, or cuda (one GPU, CUDA builds)")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  demo->add_flag("--quick", opt.quick, "Short requests (seq_lens 300, 157, 5, 2, 0, 77) for tests");

  BenchOptions bopt;
  CLI::App* bench = app.add_subcommand(
      "bench", "Time what each of N DCP ranks does per step on this GPU (CUDA builds)");
  bench->footer(
      "For each world size N: one rank's attention over its 1/N share of every request with all\n"
      "N x heads-local heads (after the head all-gather), the merge kernels of both forms with their\n"
      "bandwidth, and the bytes each rank sends per step. Default: batch 8 x 131072, heads-local 16\n"
      "and 64, qlen 1 and 4, N = 1, 2, 4, 8, a bf16 cache. One process and one GPU: each rank's share\n"
      "is timed here; the whole step across GPUs (NCCL, threads or mpirun) is tested, not timed.");
  bench->add_option("--ranks", bopt.ranks, "World sizes N to measure")->check(integer_in(1, 64))->delimiter(',');
  bench->add_option("--heads-local", bopt.heads_local, "Query heads per rank")
      ->check(integer_in(1, dcpmla::max_heads(dcpmla::Backend::cuda)))
      ->delimiter(',');
  bench->add_option("--qlen", bopt.qlens, "Query rows per request")->check(integer_in(1, 16))->delimiter(',');
  bench->add_option("--batch", bopt.batch, "Requests")->check(integer_in(1, 1024))->capture_default_str();
  bench->add_option("--context", bopt.context, "Tokens per request")
      ->check(integer_in<int64_t>(1, 1 << 24))
      ->capture_default_str();
  bench->add_option("--kv-dtype", bopt.kv_dtype, "The cache's dtype (fp8 is read with a cache scale of 0.5)")
      ->check(CLI::IsMember({"bf16", "fp8_e4m3", "fp8_e5m2"}))
      ->capture_default_str();
  bench->add_option("--runs", bopt.runs, "Timed runs per measurement (median)")->check(integer_in(1, 1000))->capture_default_str();
  bench->add_option("--json", bopt.json, "Also write the rows and their metadata (date, commit, GPU, clocks, command) as JSON")
      ->check(writable_file());

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // An unknown word where the subcommand goes is named as such, with the valid ones (an
    // unknown option is CLI11's to report).
    if (dynamic_cast<const CLI::ExtrasError*>(&e) && app.get_subcommands().empty() && !app.remaining().empty() &&
        !app.remaining()[0].starts_with('-')) {
      fmt::print(stderr, "dcpmla: unknown subcommand '{}': expected demo or bench (dcpmla --help)\n", app.remaining()[0]);
      return kExitError;
    }
    // --help and --version exit 0; a bad option exits 2 (CLI11 reports it), as the footer says.
    const int rc = app.exit(e);
    return rc == 0 ? 0 : kExitError;
  }
  if (app.get_subcommands().empty()) {
    fmt::print(stderr, "dcpmla: a subcommand is required: demo or bench (dcpmla --help)\n");
    return kExitError;
  }
  if (opt.device == "cuda") {
#ifdef DCPMLA_HAS_CUDA
    if (!dcpmla::cuda_device_available()) {
      fmt::print(stderr, "dcpmla: demo --device cuda: no usable CUDA device on this machine\n");
      return kExitNoDevice;
    }
    opt.engines = dcpmla::cuda::rank_engine_factory();
#else
    fmt::print(stderr, "dcpmla: demo --device cuda: this dcpmla was built without the CUDA backend (no nvcc)\n");
    return kExitNoDevice;
#endif
  }

  if (*bench) {
#ifdef DCPMLA_HAS_CUDA
    if (!dcpmla::cuda_device_available()) {
      fmt::print(stderr, "dcpmla: bench: no usable CUDA device on this machine\n");
      return kExitNoDevice;
    }
    try {
      return run_bench(bopt, argc, argv);
    } catch (const std::exception& e) {
      fmt::print(stderr, "dcpmla: error: {}\n", e.what());
      return kExitError;
    }
#else
    fmt::print(stderr, "dcpmla: bench: this dcpmla was built without the CUDA backend (no nvcc)\n");
    return kExitNoDevice;
#endif
  }
#ifdef DCPMLA_HAS_MPI
  if (dcpmla::MpiSession::launched()) {
    dcpmla::MpiSession mpi(&argc, &argv);
    try {
      auto comm = dcpmla::make_mpi_communicator();
      if (demo->count("--ranks") == 0) opt.ranks = comm->world_size();
      if (opt.ranks != comm->world_size())
        throw dcpmla::Error(fmt::format("dcpmla: field '--ranks' = {}: expected the number of MPI processes ({})",
                                        opt.ranks, comm->world_size()));
      opt.comm = comm.get();
      return *demo ? run_demo(opt) : 0;
    } catch (const std::exception& e) {
      // The abort path: a failed rank ends the whole job instead of leaving the others
      // waiting in a collective.
      fmt::print(stderr, "dcpmla: rank {}: error: {}\n", mpi.rank(), e.what());
      dcpmla::MpiSession::abort(kExitError);
    }
  }
#endif
  try {
    if (*demo) return run_demo(opt);
  } catch (const std::exception& e) {
    // The library names its own fields (world_size, heads): say which options set them.
    fmt::print(stderr, "dcpmla: error (demo --ranks {} --heads {}): {}\n", opt.ranks, opt.heads, e.what());
    return kExitError;
  }
  return 0;
}

int main(int argc, char** argv) {
  const int rc = run_cli(argc, argv);
  // A full disk or a closed pipe must not pass for a run whose output (strict JSON with
  // --json) was cut short: exit 2 unless the run already failed.
  std::cout.flush();
  if (std::fflush(stdout) != 0 || std::ferror(stdout) || !std::cout) {
    std::fprintf(stderr, "dcpmla: error: writing the output failed: %s\n", std::strerror(errno));
    return rc == 0 ? kExitError : rc;
  }
  return rc;
}
