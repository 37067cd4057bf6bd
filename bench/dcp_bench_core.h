// The single-GPU DCP benchmark (issue 4): per-rank attention time of each rank's share at
// each world size, the merge kernels' time and bandwidth, and the bytes each rank would send
// per step in each merge form. One row per (heads_local, qlen, world_size). Run by
// dcpmla_dcp_bench and `dcpmla bench`; it is bench code, not part of the library.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include "dcpmla/dcp.h"

namespace dcpmla::bench {

struct DcpBenchOptions {
  int batch = 8;
  int64_t context = 131072;
  std::vector<int> heads_local{16, 64};
  std::vector<int> qlens{1, 4};
  std::vector<int> world_sizes{1, 2, 4, 8};
  KvDtype kv_dtype = KvDtype::bf16;  // the cache's (fp8: read with a cache scale of 0.5)
  int warmup = 3, runs = 20;
  int device = 0;
};
struct DcpBenchRow {
  int heads_local, qlen, world_size, heads_total, groups;
  int64_t local_tokens;           // per request on rank 0
  std::string route;
  double attention_us;            // median, all G launches
  double kv_bytes, attention_tbps;
  double correct_us, correct_gbps;      // merge (i): correction kernel
  double reduce_us, reduce_gbps;        // merge (i): local reduce of N chunks (device-group sum kernel)
  double combine_us, combine_gbps;      // merge (ii): local combine of N partials
  double pack_us;                       // merge (ii): packing for the all-to-all
  DcpTraffic traffic;                   // bytes sent by one rank per step
  int64_t q_bytes;                      // this rank's q (H_local heads)
};
std::vector<DcpBenchRow> run_dcp_bench(const DcpBenchOptions& options);
// A text table of the rows (with a legend). Their JSON: bench/dcp_results.h.
std::string format_dcp_bench_table(const std::vector<DcpBenchRow>& rows, const DcpBenchOptions& options);
// The device's name and SM count, for the records.
std::string device_description(int device = 0);

// n bf16 values of unit-variance noise (times stddev) from a seed, on `stream`.
void fill_random(bf16* dst, int64_t n, uint64_t seed, float stddev, cudaStream_t stream);
// A cache's `values` stored values of `dtype` from a seed, on `stream`: bf16 as fill_random
// (stddev 1), fp8 finite values of magnitude 2^-3 .. 2^2 (never zeros: timings on zeros flatter).
void fill_random_cache(void* dst, int64_t values, KvDtype dtype, uint64_t seed, cudaStream_t stream);

}  // namespace dcpmla::bench
