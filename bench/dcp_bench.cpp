// dcpmla_dcp_bench: the single-GPU DCP benchmark of issue 4 (cuda::run_dcp_bench): per-rank
// attention over each rank's share at N = 1, 2, 4, 8, the merge kernels' time and bandwidth,
// and the bytes each rank would send per step in each merge form.
//   dcpmla_dcp_bench [--json FILE] [--runs N] [--ranks N[,N...]] [--heads-local H[,H...]]
//                    [--qlen Q[,Q...]] [--batch B] [--context L]
// `dcpmla bench` runs the same thing.
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "dcpmla/dcp.h"

namespace {

std::vector<int> ints(const std::string& s) {
  std::vector<int> v;
  size_t at = 0;
  while (at <= s.size()) {
    const size_t comma = s.find(',', at);
    v.push_back(std::atoi(s.substr(at, comma == std::string::npos ? std::string::npos : comma - at).c_str()));
    if (comma == std::string::npos) break;
    at = comma + 1;
  }
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  dcpmla::cuda::DcpBenchOptions o;
  std::string json;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const bool has = i + 1 < argc;
    if (a == "--json" && has) json = argv[++i];
    else if (a == "--runs" && has) o.runs = std::atoi(argv[++i]);
    else if (a == "--ranks" && has) o.world_sizes = ints(argv[++i]);
    else if (a == "--heads-local" && has) o.heads_local = ints(argv[++i]);
    else if (a == "--qlen" && has) o.qlens = ints(argv[++i]);
    else if (a == "--batch" && has) o.batch = std::atoi(argv[++i]);
    else if (a == "--context" && has) o.context = std::atoll(argv[++i]);
    else {
      std::fprintf(stderr,
                   "usage: dcpmla_dcp_bench [--json FILE] [--runs N] [--ranks N,...] [--heads-local H,...] "
                   "[--qlen Q,...] [--batch B] [--context L]\n");
      return 2;
    }
  }
  try {
    const auto rows = dcpmla::cuda::run_dcp_bench(o);
    const std::string gpu = dcpmla::cuda::device_description(o.device);
    std::printf("GPU: %s\n%s", gpu.c_str(), dcpmla::cuda::format_dcp_bench_table(rows, o).c_str());
    if (!json.empty()) {
      FILE* f = std::fopen(json.c_str(), "w");
      if (!f) {
        std::fprintf(stderr, "cannot write %s\n", json.c_str());
        return 2;
      }
      std::fputs(dcpmla::cuda::format_dcp_bench_json(rows, o, "\"gpu\": \"" + gpu + "\"").c_str(), f);
      std::fclose(f);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dcpmla_dcp_bench: error: %s\n", e.what());
    return 2;
  }
  return 0;
}
