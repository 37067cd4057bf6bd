// dcpmla_dcp_bench: the single-GPU DCP benchmark of issue 4 (bench::run_dcp_bench): per-rank
// attention over each rank's share at N = 1, 2, 4, 8, the merge kernels' time and bandwidth,
// and the bytes each rank would send per step in each merge form. `dcpmla bench` runs the
// same thing; --json writes the rows with their metadata (bench/results_json.h).
#include <cstdio>
#include <exception>
#include <string>

#include <CLI/CLI.hpp>

#include "../apps/cli_support.h"
#include "dcp_bench_core.h"
#include "dcp_results.h"
#include "dcpmla/plan.h"

int main(int argc, char** argv) {
  using dcpmla::cli::integer_in;
  dcpmla::bench::DcpBenchOptions o;
  std::string json;
  CLI::App app{"dcpmla_dcp_bench: what each of N DCP ranks does per step on this GPU (attention over its share,\n"
               "merge kernels, bytes sent). Needs a CUDA GPU."};
  app.add_option("--json", json, "Also write the rows and their metadata as JSON to this file")
      ->check(dcpmla::cli::writable_file());
  app.add_option("--runs", o.runs, "Timed runs per measurement (median)")->check(integer_in(1, 1000))->capture_default_str();
  app.add_option("--ranks", o.world_sizes, "World sizes N to measure")->check(integer_in(1, 64))->delimiter(',');
  app.add_option("--heads-local", o.heads_local, "Query heads per rank")
      ->check(integer_in(1, dcpmla::max_heads(dcpmla::Backend::cuda)))
      ->delimiter(',');
  app.add_option("--qlen", o.qlens, "Query rows per request")->check(integer_in(1, 16))->delimiter(',');
  app.add_option("--batch", o.batch, "Requests")->check(integer_in(1, 1024))->capture_default_str();
  app.add_option("--context", o.context, "Tokens per request")->check(integer_in<int64_t>(1, 1 << 24))->capture_default_str();
  std::string kv_dtype = "bf16";
  app.add_option("--kv-dtype", kv_dtype, "The cache's dtype (fp8 is read with a cache scale of 0.5)")
      ->check(CLI::IsMember({"bf16", "fp8_e4m3", "fp8_e5m2"}))
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  o.kv_dtype = dcpmla::parse_kv_dtype(kv_dtype);
  try {
    const auto rows = dcpmla::bench::run_dcp_bench(o);
    std::printf("GPU: %s\n%s", dcpmla::bench::device_description(o.device).c_str(),
                dcpmla::bench::format_dcp_bench_table(rows, o).c_str());
    if (!json.empty())
      dcpmla::results::write(json, dcpmla::results::metadata(o.device, argc, argv), dcpmla::results::dcp_rows(rows, o));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dcpmla_dcp_bench: error: %s\n", e.what());
    return 2;
  }
  return 0;
}
