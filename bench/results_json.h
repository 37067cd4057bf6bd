// Results files of the benchmarks (dcpmla_bench, dcpmla_dcp_bench, `dcpmla bench`): strict
// JSON written with nlohmann-json, one object {"meta": {...}, "rows": [...]}. "meta" says
// when, from which commit, on which GPU at which clocks and by which command the rows were
// measured. A value that is not a finite number (a ratio against a ceiling that was not
// measured) is written as null: JSON has no inf or nan (nlohmann-json writes them as null).
#pragma once

#include <chrono>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <string>
#include <vector>

#include <cuda_runtime.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "dcpmla/build_info.h"
#include "dcpmla/dcp.h"
#include "dcpmla/error.h"

namespace dcpmla::results {

inline nlohmann::json cuda_attribute_mhz(cudaDeviceAttr attr, int device) {
  int khz = 0;
  if (cudaDeviceGetAttribute(&khz, attr, device) != cudaSuccess || khz <= 0) return nullptr;
  return khz / 1000;
}

// The SM clock nvidia-smi reports as the run starts (null where nvidia-smi is absent).
inline nlohmann::json sm_clock_now_mhz(int device) {
  const std::string cmd = fmt::format("nvidia-smi -i {} --query-gpu=clocks.sm --format=csv,noheader,nounits 2>/dev/null", device);
  FILE* pipe = popen(cmd.c_str(), "r");
  if (!pipe) return nullptr;
  int mhz = 0;
  const bool read = std::fscanf(pipe, "%d", &mhz) == 1;
  pclose(pipe);
  return read && mhz > 0 ? nlohmann::json(mhz) : nlohmann::json(nullptr);
}

inline nlohmann::json metadata(int device, int argc, char** argv) {
  std::string command;
  for (int i = 0; i < argc; ++i) command += (i ? " " : "") + std::string(argv[i]);
  const std::time_t now = std::chrono::system_clock::to_time_t(std::chrono::system_clock::now());
  char date[32];
  std::strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  cudaDeviceProp prop{};
  const bool have_gpu = cudaGetDeviceProperties(&prop, device) == cudaSuccess;
  int driver = 0, runtime = 0;
  cudaDriverGetVersion(&driver);
  cudaRuntimeGetVersion(&runtime);
  return {{"date", date},
          {"commit", DCPMLA_GIT_COMMIT},
          {"version", DCPMLA_VERSION_STRING},
          {"gpu", have_gpu ? nlohmann::json(prop.name) : nlohmann::json(nullptr)},
          {"sms", have_gpu ? nlohmann::json(prop.multiProcessorCount) : nlohmann::json(nullptr)},
          {"cuda_driver", driver},
          {"cuda_runtime", runtime},
          {"clocks",
           {{"sm_max_mhz", cuda_attribute_mhz(cudaDevAttrClockRate, device)},
            {"mem_max_mhz", cuda_attribute_mhz(cudaDevAttrMemoryClockRate, device)},
            {"sm_at_start_mhz", sm_clock_now_mhz(device)}}},
          {"command", command}};
}

inline void write(const std::string& path, const nlohmann::json& meta, const nlohmann::json& rows) {
  std::ofstream f(path);
  if (f) f << nlohmann::json{{"meta", meta}, {"rows", rows}}.dump(1) << "\n";
  if (!f) fail("--json", path, "a file that can be written");
}

inline nlohmann::json dcp_rows(const std::vector<cuda::DcpBenchRow>& rows, const cuda::DcpBenchOptions& o) {
  nlohmann::json out = nlohmann::json::array();
  for (const auto& r : rows)
    out.push_back({{"name", fmt::format("dcp_rank_h{}_q{}_n{}", r.heads_local, r.qlen, r.world_size)},
                   {"batch", o.batch},
                   {"context", o.context},
                   {"heads_local", r.heads_local},
                   {"qlen", r.qlen},
                   {"world_size", r.world_size},
                   {"heads_total", r.heads_total},
                   {"launches", r.groups},
                   {"local_tokens", r.local_tokens},
                   {"kv_dtype", "bf16"},
                   {"route", r.route},
                   {"attention_us", r.attention_us},
                   {"kv_TBps", r.attention_tbps},
                   {"correct_us", r.correct_us},
                   {"correct_GBps", r.correct_gbps},
                   {"reduce_us", r.reduce_us},
                   {"reduce_GBps", r.reduce_gbps},
                   {"pack_us", r.pack_us},
                   {"combine_us", r.combine_us},
                   {"combine_GBps", r.combine_gbps},
                   {"q_bytes", r.q_bytes},
                   {"sent_q_all_gather", r.traffic.q_all_gather},
                   {"sent_lse_all_gather", r.traffic.lse_all_gather},
                   {"sent_reduce_scatter_bf16", r.traffic.reduce_scatter},
                   {"sent_all_to_all", r.traffic.all_to_all}});
  return out;
}

}  // namespace dcpmla::results
