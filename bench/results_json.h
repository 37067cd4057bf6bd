// Results files of the benchmarks (dcpmla_bench, dcpmla_dcp_bench, `dcpmla bench`): strict
// JSON written with nlohmann-json, one object {"meta": {...}, "rows": [...]}. "meta" says
// when, from which commit, on which GPU at which clocks and by which command the rows were
// measured. A value that is not a finite number (a ratio against a ceiling that was not
// measured) is written as null: JSON has no inf or nan (nlohmann-json writes them as null).
// No fmt here (nor the library headers that include it): bench.cu includes this, and fmt's
// constexpr code does not compile in nvcc's host pass. The DCP rows: dcp_results.h.
#pragma once

#include <chrono>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <stdexcept>
#include <string>

#include <cuda_runtime.h>
#include <nlohmann/json.hpp>

#include "dcpmla/build_info.h"
#include "dcpmla/types.h"

namespace dcpmla::results {

// The suffix of a row's name for its cache dtype: the records' tables key rows by name, so fp8
// rows are named apart ("" for bf16, "_e4m3", "_e5m2").
inline std::string kv_row_suffix(KvDtype d) {
  return d == KvDtype::bf16 ? "" : d == KvDtype::fp8_e4m3 ? "_e4m3" : "_e5m2";
}

inline nlohmann::json cuda_attribute_mhz(cudaDeviceAttr attr, int device) {
  int khz = 0;
  if (cudaDeviceGetAttribute(&khz, attr, device) != cudaSuccess || khz <= 0) return nullptr;
  return khz / 1000;
}

// The SM clock nvidia-smi reports as the run starts (null where nvidia-smi is absent).
inline nlohmann::json sm_clock_now_mhz(int device) {
  const std::string cmd =
      "nvidia-smi -i " + std::to_string(device) + " --query-gpu=clocks.sm --format=csv,noheader,nounits 2>/dev/null";
  FILE* pipe = popen(cmd.c_str(), "r");
  if (!pipe) return nullptr;
  int mhz = 0;
  const bool read = std::fscanf(pipe, "%d", &mhz) == 1;
  pclose(pipe);
  return read && mhz > 0 ? nlohmann::json(mhz) : nlohmann::json(nullptr);
}

// The command line as the record keeps it: the program and the --json file by their file
// names (what ran, not where this machine keeps it), every other word as given (a varlen
// --shape's lengths are joined by '/').
inline std::string command_line(int argc, char** argv) {
  const auto file_name = [](const std::string& path) { return path.substr(path.rfind('/') + 1); };
  std::string command;
  for (int i = 0; i < argc; ++i) {
    const std::string word = argv[i];
    const bool path = i == 0 || std::string(argv[i - 1]) == "--json";
    const std::string kept = path ? file_name(word)
                             : word.rfind("--json=", 0) == 0 ? "--json=" + file_name(word.substr(7))
                                                               : word;
    command += (i ? " " : "") + kept;
  }
  return command;
}

inline nlohmann::json metadata(int device, int argc, char** argv) {
  const std::string command = command_line(argc, argv);
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
          {"command", command},
#ifdef DCPMLA_PROBE_NO_FILL
          // A measuring build: the bf16 tile streams loaded nothing (cmake/cuda.cmake).
          {"probe_no_fill", true},
#endif
  };
}

inline void write(const std::string& path, const nlohmann::json& meta, const nlohmann::json& rows) {
  std::ofstream f(path);
  if (f) f << nlohmann::json{{"meta", meta}, {"rows", rows}}.dump(1) << "\n";
  if (!f) throw std::runtime_error("dcpmla: field '--json' = " + path + ": expected a file that can be written");
}

}  // namespace dcpmla::results
