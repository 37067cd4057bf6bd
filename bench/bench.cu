// dcpmla_bench: the ceilings (device-to-device copy, cuBLAS bf16 8192^3 GEMM), a plain
// baseline (gather pages -> cuBLAS batched GEMMs -> softmax kernel -> GEMM), and dcpmla's
// attention at uniform shapes and at the varlen serving batches engines send (issue 13).
// Per shape, three times of the whole call an engine makes (Attention::run: the kernel, and
// the combine when the plan cut a request; a captured graph always holds it), each the
// median over calls after warm-up, with several KV caches rotated so that L2 does not
// flatter: the device time of calls queued behind a spin kernel (no host gap; the headline
// `us`), the device time of CUDA-graph replays queued alike, and the synchronous per-call
// time on the host (launch + sync included); and the mean device time of the calls queued
// with no event between them (`b2b_us`: each call's kernels may then start beside the call
// before); after each of the four, the SM clock (`sm_mhz_after`: a card at its power cap runs
// long compute-bound steps below its top clock). A table on stdout and, with --json, the rows
// and their metadata (bench/results_json.h). `dcpmla_bench --help` lists the options.
// --sweep also times every other kernel variant (AttentionTuning) at each shape and gives
// its rel L2 against the default variant's output, "variant:us(relL2)". --trace records, for
// one more call of each shape, every CTA's start and end on the GPU's global timer
// (AttentionParams::trace), summarises where the call's time goes and lists each CTA's time
// beside its work. --shape times uniform shapes of one's own (BATCH:CONTEXT:HEADS:QLEN[:KV_DTYPE]),
// to look for the shapes the built-in set misses.
#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "../apps/cli_support.h"
#include "dcpmla/cuda.h"
#include "common/resources.h"
#include "dcp_bench_core.h"
#include "dcpmla/layout.h"
#include "results_json.h"

using namespace dcpmla;

namespace {

void ck(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "bench: %s: %s\n", what, cudaGetErrorString(e));
    std::exit(2);
  }
}
void ckb(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS) {
    std::fprintf(stderr, "bench: %s: cublas status %d\n", what, int(s));
    std::exit(2);
  }
}

__device__ uint64_t mix(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return x;
}

// Uniform [-1, 1) bf16 (never zeros: timings on zeros flatter).
__global__ void fill_bf16(__nv_bfloat16* p, size_t n, uint64_t seed) {
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const uint64_t r = mix(seed * 0x9e3779b97f4a7c15ull + i);
    p[i] = __float2bfloat16(float(int64_t(r >> 40) - (1 << 23)) / float(1 << 23));
  }
}
void fill_cache(uint8_t* p, size_t bytes, KvDtype d, uint64_t seed) {
  if (d != KvDtype::bf16) return dcpmla::bench::fill_random_cache(p, int64_t(bytes), d, seed, 0);  // (the DCP bench's)
  fill_bf16<<<4096, 256>>>(reinterpret_cast<__nv_bfloat16*>(p), bytes / 2, seed);
  ck(cudaGetLastError(), "fill");
}

// ---- plain baseline ---------------------------------------------------------------------
// Gather a request's local tokens into a dense (Lpad, 576) bf16 matrix (dequantising fp8).
__global__ void gather_kernel(const uint8_t* kv, KvDtype dt, float kv_scale, const int32_t* subpages,
                              int table_stride, int page, const int32_t* longest, int Lpad, __nv_bfloat16* dense) {
  const int b = blockIdx.y;
  const int bpv = dt == KvDtype::bf16 ? 2 : 1;
  for (int j = blockIdx.x; j < Lpad; j += gridDim.x) {
    __nv_bfloat16* dst = dense + (size_t(b) * Lpad + j) * 576;
    if (j >= longest[b]) {
      for (int c = threadIdx.x; c < 576; c += blockDim.x) dst[c] = __float2bfloat16(0.0f);
      continue;
    }
    const int64_t slot = int64_t(subpages[size_t(b) * table_stride + j / page]) * page + j % page;
    const uint8_t* src = kv + slot * 576 * bpv;
    for (int c = threadIdx.x; c < 576; c += blockDim.x) {
      float v;
      if (dt == KvDtype::bf16) v = __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(src)[c]);
      else {
        const __half_raw h = __nv_cvt_fp8_to_halfraw(src[c], dt == KvDtype::fp8_e5m2 ? __NV_E5M2 : __NV_E4M3);
        v = __half2float(__half(h)) * kv_scale;
      }
      dst[c] = __float2bfloat16(v);
    }
  }
}

// One block per (b, t, h) row: masked softmax of S (float, scaled) -> P bf16 and lse.
__global__ void softmax_kernel(const float* S, int L, const int32_t* row_len, int qlen, int heads, float scale,
                               __nv_bfloat16* P, float* lse) {
  const int64_t row = blockIdx.x;
  const int b = int(row / (int64_t(qlen) * heads)), t = int(row / heads % qlen);
  const int n = row_len[b * qlen + t];
  const float* s = S + row * L;
  __nv_bfloat16* p = P + row * L;
  __shared__ float red[32];
  float m = -INFINITY;
  for (int j = threadIdx.x; j < n; j += blockDim.x) m = fmaxf(m, s[j] * scale);
  for (int d = 16; d; d >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, d));
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = m;
  __syncthreads();
  m = -INFINITY;
  for (int w = 0; w < int(blockDim.x >> 5); ++w) m = fmaxf(m, red[w]);
  __syncthreads();
  float sum = 0.0f;
  for (int j = threadIdx.x; j < L; j += blockDim.x) {
    const float e = j < n ? __expf(s[j] * scale - m) : 0.0f;
    sum += e;
    p[j] = __float2bfloat16(e);
  }
  for (int d = 16; d; d >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, d);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = sum;
  __syncthreads();
  sum = 0.0f;
  for (int w = 0; w < int(blockDim.x >> 5); ++w) sum += red[w];
  if (threadIdx.x == 0) lse[row] = n > 0 ? m + logf(sum) : -INFINITY;
  // P is unnormalised; the output GEMM is scaled by 1/sum below.
  __syncthreads();
  if (n > 0)
    for (int j = threadIdx.x; j < n; j += blockDim.x) p[j] = __float2bfloat16(__bfloat162float(p[j]) / sum);
}

// A timing event (the library's RAII owner, with timing enabled).
dcpmla::cuda_detail::Event timing_event() { return dcpmla::cuda_detail::Event("cudaEventCreate(bench)", cudaEventDefault); }

template <class F>
float median_ms(int runs, F&& call) {
  const auto a = timing_event(), b = timing_event();
  std::vector<float> t;
  for (int i = 0; i < runs; ++i) {
    ck(cudaEventRecord(a.get()), "record");
    call(i);
    ck(cudaEventRecord(b.get()), "record");
    ck(cudaEventSynchronize(b.get()), "sync");
    float ms = 0;
    ck(cudaEventElapsedTime(&ms, a.get(), b.get()), "elapsed");
    t.push_back(ms);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// Holds the stream for `ns` nanoseconds, so that the calls enqueued behind it start back to back.
__global__ void spin_kernel(uint64_t ns) {
  uint64_t start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  while (now - start < ns);
}
// Holds `st` for 20 ms, far longer than enqueueing the timed calls takes.
void hold_stream(cudaStream_t st) { spin_kernel<<<1, 1, 0, st>>>(uint64_t(20) * 1000 * 1000); }

// One thread counts its cycles over `ns` of the global timer: the SM clock, in MHz.
__global__ void sm_clock_kernel(uint64_t ns, double* mhz) {
  uint64_t start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  const long long c0 = clock64();
  do asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  while (now - start < ns);
  *mhz = double(clock64() - c0) * 1e3 / double(now - start);
}
// The SM clock right after a column's timed calls (0.1 ms of counting, into `dev`). A card at
// its power cap runs long compute-bound steps below its top clock, so a later column of such a
// shape can read slower than an earlier one for that alone (bench/NOTES.md, fifty-ninth session).
double sm_clock_mhz(cudaStream_t st, double* dev) {
  sm_clock_kernel<<<1, 1, 0, st>>>(100 * 1000, dev);
  double mhz = 0;
  ck(cudaMemcpyAsync(&mhz, dev, sizeof mhz, cudaMemcpyDeviceToHost, st), "clock probe");
  ck(cudaStreamSynchronize(st), "clock probe");
  return mhz;
}

// Median device time per call of `runs` calls enqueued on `st` behind a spin kernel: what a
// call costs inside an engine's step, without the host's launch gaps.
template <class F>
float queued_median_ms(int runs, cudaStream_t st, F&& call) {
  std::vector<dcpmla::cuda_detail::Event> ev;
  for (int i = 0; i <= runs; ++i) ev.push_back(timing_event());
  hold_stream(st);
  ck(cudaEventRecord(ev[0].get(), st), "record");
  for (int i = 0; i < runs; ++i) {
    call(i);
    ck(cudaEventRecord(ev[size_t(i) + 1].get(), st), "record");
  }
  ck(cudaStreamSynchronize(st), "queued runs");
  std::vector<float> t;
  for (int i = 0; i < runs; ++i) {
    float ms = 0;
    ck(cudaEventElapsedTime(&ms, ev[size_t(i)].get(), ev[size_t(i) + 1].get()), "elapsed");
    t.push_back(ms);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// Mean device time per call of `runs` calls enqueued back to back on `st` behind a spin kernel,
// with no event between them: the first event is recorded before the first call and the second
// after the last. Unlike queued_median_ms it lets each call's kernels overlap the call before
// (a programmatic dependent launch starts beside the stream's previous kernel), as a stream of
// an engine's kernels does.
template <class F>
float back_to_back_mean_ms(int runs, cudaStream_t st, F&& call) {
  const auto a = timing_event(), b = timing_event();
  hold_stream(st);
  ck(cudaEventRecord(a.get(), st), "record");
  for (int i = 0; i < runs; ++i) call(i);
  ck(cudaEventRecord(b.get(), st), "record");
  ck(cudaStreamSynchronize(st), "back-to-back runs");
  float ms = 0;
  ck(cudaEventElapsedTime(&ms, a.get(), b.get()), "elapsed");
  return ms / float(runs);
}

// Median host time of a call followed by a stream synchronisation (what a naive caller sees).
template <class F>
float sync_median_ms(int runs, cudaStream_t st, F&& call) {
  std::vector<float> t;
  for (int i = 0; i < runs; ++i) {
    const auto a = std::chrono::steady_clock::now();
    call(i);
    ck(cudaStreamSynchronize(st), "sync call");
    t.push_back(std::chrono::duration<float, std::milli>(std::chrono::steady_clock::now() - a).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// The page the table's rows are timed with (FlashMLA's, whose anchors they stand beside);
// --block-size times others under other names.
constexpr int kTableBlockSize = 64;

struct Shape {
  std::string name;
  int batch;
  std::vector<int32_t> lens;  // global L_b (context incl. the query block)
  int heads, qlen;
  KvDtype dtype;
  int world = 1, rank = 0;
  int block_size = kTableBlockSize;  // the cache's page (--block-size)
};

// One traced call (--trace), on another cache copy than the call before it, µs from the first
// attention CTA's start: when the last attention CTA started (the launch's spread), when the
// attention CTAs ended (10th, 50th percentile, last), a CTA's median time, and the combine's
// first start (after its wait) and last end (none when the plan cut nothing). timer_step_us:
// the smallest step between two distinct stamps (the global timer's resolution bounds every
// figure). ctas: every attention CTA's start and time beside the work the plan gave it (its
// pieces, those of cut requests, and its tiles over them), the SM it ran on and that SM's clock
// over the CTA (its cycles over its ns: a power-limited card runs below its top clock), for fitting
// the schedule's cost model to what the GPU took (scripts/cta_fit.py) and comparing the SMs'
// paces (scripts/cta_sm_pace.py); combine: every working combine CTA's start and time.
struct CtaRecord {
  double start_us = 0, busy_us = 0, mhz = 0;  // mhz: its SM cycles over its ns
  int pieces = 0, cut_pieces = 0, tiles = 0, sm = 0;
};
struct Trace {
  int attention_ctas = 0, combine_ctas = 0;
  double last_start = 0, end_p10 = 0, end_p50 = 0, end_last = 0, cta_p50 = 0, mhz_p50 = 0;
  double combine_first_start = 0, combine_last_end = 0, timer_step_us = 0;
  std::vector<CtaRecord> ctas;
  std::vector<double> combine_start_us, combine_busy_us;  // each working combine CTA's (after its wait)
};

struct Row {
  Shape s;
  std::string route, variant, sweep;
  int work_items = 0, cut_requests = 0;
  ScheduleCost cost;      // the schedule's cost model this row's plan was dealt with
  int rows_per_unit = 0;  // query rows a CTA's unit covers (the kernel's)
  double us = 0, graph_us = 0, sync_us = 0, b2b_us = 0, kv_GBps = 0, tflops = 0, base_us = 0, check = -1;
  double mhz_us = 0, mhz_b2b = 0, mhz_graph = 0, mhz_sync = 0;  // the SM clock after each column
  double kv_bytes = 0, flops = 0;
  std::optional<Trace> trace;
};

// The summary of one traced call's stamps (kTraceEntries, 0 = not written).
Trace summarise_trace(const std::vector<uint64_t>& t) {
  std::vector<uint64_t> starts, ends, sms, cstarts, cends, all;
  for (int b = 0; b < kTraceCtas; ++b) {
    if (t[size_t(2 * b)] != 0 && t[size_t(2 * b + 1)] != 0) {
      starts.push_back(t[size_t(2 * b)]);
      ends.push_back(t[size_t(2 * b + 1)]);
      sms.push_back(t[size_t(kTraceSm + b)]);
    }
    if (t[size_t(kTraceCombine + 2 * b)] != 0 && t[size_t(kTraceCombine + 2 * b + 1)] != 0) {
      cstarts.push_back(t[size_t(kTraceCombine + 2 * b)]);
      cends.push_back(t[size_t(kTraceCombine + 2 * b + 1)]);
    }
  }
  Trace r;
  r.attention_ctas = int(starts.size());
  r.combine_ctas = int(cstarts.size());
  if (starts.empty()) return r;
  const uint64_t t0 = *std::min_element(starts.begin(), starts.end());
  const auto us = [&](uint64_t v) { return double(v - t0) * 1e-3; };
  // Attention CTAs 0 .. n - 1 (they stamp in order; the tests check it).
  std::vector<double> busy, mhz;
  for (size_t b = 0; b < starts.size(); ++b) {
    r.ctas.push_back({us(starts[b]), double(ends[b] - starts[b]) * 1e-3});
    r.ctas.back().sm = int(sms[b]);
    const uint64_t c0 = t[size_t(kTraceCycles + 2 * b)], c1 = t[size_t(kTraceCycles + 2 * b + 1)];
    if (ends[b] > starts[b] && c1 > c0) r.ctas.back().mhz = double(c1 - c0) * 1e3 / double(ends[b] - starts[b]);
    busy.push_back(r.ctas.back().busy_us);
    mhz.push_back(r.ctas.back().mhz);
  }
  std::sort(ends.begin(), ends.end());
  std::sort(busy.begin(), busy.end());
  const auto at = [](const auto& v, double q) { return v[size_t(q * double(v.size() - 1))]; };
  r.last_start = us(*std::max_element(starts.begin(), starts.end()));
  r.end_p10 = us(at(ends, 0.1));
  r.end_p50 = us(at(ends, 0.5));
  r.end_last = us(ends.back());
  r.cta_p50 = at(busy, 0.5);
  std::sort(mhz.begin(), mhz.end());
  r.mhz_p50 = at(mhz, 0.5);
  if (!cstarts.empty()) {
    r.combine_first_start = us(*std::min_element(cstarts.begin(), cstarts.end()));
    r.combine_last_end = us(*std::max_element(cends.begin(), cends.end()));
  }
  all = starts;
  all.insert(all.end(), ends.begin(), ends.end());
  std::sort(all.begin(), all.end());
  uint64_t step = 0;
  for (size_t i = 1; i < all.size(); ++i)
    if (all[i] != all[i - 1] && (step == 0 || all[i] - all[i - 1] < step)) step = all[i] - all[i - 1];
  r.timer_step_us = double(step) * 1e-3;
  for (size_t k = 0; k < cstarts.size(); ++k) {
    r.combine_start_us.push_back(us(cstarts[k]));
    r.combine_busy_us.push_back(double(cends[k] - cstarts[k]) * 1e-3);
  }
  return r;
}

// The plan's work for each of `grid` CTAs of `rows` rows (unit_cursor's walk: CTA slot c runs
// chunk c / groups for row group c % groups; a piece counts where its request has rows in the
// group).
void add_cta_work(Trace& tr, const Plan& plan, int heads, int rows, int tile_tokens) {
  const PlanHeader& h = plan.header();
  const PlanView v = plan.view();
  const int grid = int(tr.ctas.size());
  const int groups = row_groups_of(int64_t(h.widest_qlen) * heads, rows);
  for (int c = 0; c < grid; ++c) {
    CtaRecord& rec = tr.ctas[size_t(c)];
    for (int slot = c; slot < groups * h.chunks; slot += grid) {
      const int group = slot % groups, k = slot / groups;
      for (int w = v.chunk_work[k]; w < v.chunk_work[k + 1]; ++w) {
        const WorkItem& it = v.work[w];
        if ((v.q_start[it.request + 1] - v.q_start[it.request]) * heads <= group * rows) continue;
        ++rec.pieces;
        rec.cut_pieces += it.slot >= 0;
        rec.tiles += (it.tok_end - it.tok_begin + tile_tokens - 1) / tile_tokens;
      }
    }
  }
}

nlohmann::json cta_json(const std::vector<CtaRecord>& ctas) {
  nlohmann::json j = {{"start_us", nlohmann::json::array()}, {"busy_us", nlohmann::json::array()},
                      {"pieces", nlohmann::json::array()},   {"cut_pieces", nlohmann::json::array()},
                      {"tiles", nlohmann::json::array()},    {"sm", nlohmann::json::array()},
                      {"mhz", nlohmann::json::array()}};
  for (const CtaRecord& c : ctas) {
    j["start_us"].push_back(c.start_us);
    j["busy_us"].push_back(c.busy_us);
    j["pieces"].push_back(c.pieces);
    j["cut_pieces"].push_back(c.cut_pieces);
    j["tiles"].push_back(c.tiles);
    j["sm"].push_back(c.sm);
    j["mhz"].push_back(c.mhz);
  }
  return j;
}

double copy_GBps = 0, gemm_TFLOPs = 0;

void measure_ceilings(int runs) {
  const size_t bytes = size_t(2) << 30;
  void *a, *b;
  ck(cudaMalloc(&a, bytes), "malloc copy");
  ck(cudaMalloc(&b, bytes), "malloc copy");
  fill_bf16<<<4096, 256>>>(static_cast<__nv_bfloat16*>(a), bytes / 2, 1);
  for (int i = 0; i < 3; ++i) ck(cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice), "copy");
  const float ms = median_ms(runs, [&](int) { cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice); });
  copy_GBps = 2.0 * bytes / (ms * 1e-3) / 1e9;
  cudaFree(a);
  cudaFree(b);

  const int n = 8192;
  __nv_bfloat16 *A, *B, *C;
  ck(cudaMalloc(&A, size_t(n) * n * 2), "malloc gemm");
  ck(cudaMalloc(&B, size_t(n) * n * 2), "malloc gemm");
  ck(cudaMalloc(&C, size_t(n) * n * 2), "malloc gemm");
  fill_bf16<<<4096, 256>>>(A, size_t(n) * n, 2);
  fill_bf16<<<4096, 256>>>(B, size_t(n) * n, 3);
  cublasHandle_t h;
  ckb(cublasCreate(&h), "cublasCreate");
  const float one = 1.0f, zero = 0.0f;
  auto gemm = [&](int) {
    ckb(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &one, A, CUDA_R_16BF, n, B, CUDA_R_16BF, n, &zero, C,
                     CUDA_R_16BF, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
        "gemm");
  };
  for (int i = 0; i < 3; ++i) gemm(0);
  const float gms = median_ms(runs, gemm);
  gemm_TFLOPs = 2.0 * n * double(n) * n / (gms * 1e-3) / 1e12;
  cublasDestroy(h);
  cudaFree(A);
  cudaFree(B);
  cudaFree(C);
}

std::string variant_name(const cuda::AttentionVariant& v) {
  if (v.kernel == 2) return "wg" + std::to_string(v.rows_per_cta) + "_n" + std::to_string(v.tile_tokens);
  if (v.kernel == 3) return "f8swap" + std::to_string(v.rows_per_cta);
  if (v.kernel == 4) return "b16swap" + std::to_string(v.rows_per_cta);
  return "m" + std::to_string(v.rows_per_cta) + "_n" + std::to_string(v.tile_tokens) + "_c" + std::to_string(v.ctas_per_sm);
}
double bf16_bits_to_double(uint16_t h) {
  const uint32_t u = uint32_t(h) << 16;
  float x;
  std::memcpy(&x, &u, 4);
  return double(x);
}
bool same_variant(const cuda::AttentionVariant& a, const cuda::AttentionVariant& b) {
  return a.kernel == b.kernel && a.rows_per_cta == b.rows_per_cta && a.tile_tokens == b.tile_tokens &&
         a.ctas_per_sm == b.ctas_per_sm;
}

Row run_shape(const Shape& s, int runs, bool baseline, bool sweep, bool trace,
              const std::optional<ScheduleCost>& cost, cublasHandle_t blas) {
  Row row;
  row.s = s;
  const Mode mode = s.qlen == 1 ? Mode::decode : Mode::verify;
  const int block = s.block_size;
  const Layout layout{s.world, s.rank, 1};
  int64_t max_local = 1, total_blocks = 0;
  for (int32_t L : s.lens) {
    const int64_t largest = layout.local_length_of(L, 0);
    max_local = std::max(max_local, largest);
    total_blocks += (largest + block - 1) / block;
  }
  AttentionConfig c;
  c.kv_dtype = s.dtype;
  c.heads = s.heads;
  c.layout = layout;
  c.block_size = block;
  c.limits = PlanLimits{s.batch, s.qlen, max_local};
  c.schedule_cost = cost;
  const float kv_scale = s.dtype == KvDtype::bf16 ? 1.0f : 0.5f;
  const float sm_scale = 1.0f / std::sqrt(576.0f);
  cuda::Attention runner(c);
  const int sms = runner.num_sms();

  // Random (not identity) block tables.
  int width = 0;
  std::vector<int> needed;
  for (int32_t L : s.lens) {
    needed.push_back(int((layout.local_length_of(L, 0) + block - 1) / block));
    width = std::max(width, needed.back());
  }
  std::vector<int32_t> ids(static_cast<size_t>(total_blocks));
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), std::mt19937_64(11));
  std::vector<int32_t> tables(size_t(s.batch) * width, 0);
  for (int b = 0, next = 0; b < s.batch; ++b)
    for (int j = 0; j < needed[size_t(b)]; ++j) tables[size_t(b) * width + j] = ids[size_t(next++)];
  cudaStream_t st;
  ck(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), "stream");
  runner.plan(BatchDesc{s.lens, s.qlen, tables, width, mode}, st);
  row.route = std::string(to_string(runner.current_plan().route()));
  row.work_items = runner.current_plan().header().work_count;
  row.cut_requests = runner.current_plan().header().split_requests;
  row.cost = runner.planner().config().cost;
  row.rows_per_unit = runner.planner().config().rows_per_unit;

  // KV caches rotated: at least 2 copies and 1 GiB in all (the L2 is 60 MB).
  const size_t cache_bytes = size_t(total_blocks) * block * 576 * bytes_per_value(s.dtype);
  const int copies = int(std::clamp<size_t>((size_t(1) << 30) / std::max<size_t>(cache_bytes, 1) + 1, 2, 6));
  std::vector<uint8_t*> caches;
  for (int k = 0; k < copies; ++k) {
    uint8_t* p;
    ck(cudaMalloc(&p, cache_bytes), "malloc cache copy");
    caches.push_back(p);
  }
  for (int k = 0; k < copies; ++k) fill_cache(caches[size_t(k)], cache_bytes, s.dtype, 100 + k);

  const size_t rows = size_t(s.batch) * s.qlen * s.heads;
  __nv_bfloat16* q;
  bf16 *out, *out_base;
  float *lse, *lse_base;
  ck(cudaMalloc(&q, rows * 576 * 2), "malloc q");
  ck(cudaMalloc(&out, rows * 512 * 2), "malloc out");
  ck(cudaMalloc(&out_base, rows * 512 * 2), "malloc out");
  ck(cudaMalloc(&lse, rows * 4), "malloc lse");
  ck(cudaMalloc(&lse_base, rows * 4), "malloc lse");
  fill_bf16<<<1024, 256>>>(q, rows * 576, 7);

  const KvCache view{caches[0], total_blocks, block, 576, s.dtype};
  AttentionParams p = runner.params(reinterpret_cast<const bf16*>(q), view, KvScale{kv_scale}, out, lse);
  // The engine API's call (Attention::run): eagerly it launches the combine only when the plan
  // cut a request; captured, wherever the planner may cut.
  auto call = [&](int i) {
    runner.run(reinterpret_cast<const bf16*>(q), KvCache{caches[size_t(i % copies)], total_blocks, block, 576, s.dtype},
               KvScale{kv_scale}, out, lse, st);
  };
  for (int i = 0; i < 3; ++i) call(i);
  ck(cudaStreamSynchronize(st), "warm-up");
  const dcpmla::cuda_detail::DeviceBuffer clock(sizeof(double), "clock probe");
  row.us = queued_median_ms(runs, st, call) * 1e3;
  row.mhz_us = sm_clock_mhz(st, clock.as<double>());
  row.b2b_us = back_to_back_mean_ms(runs, st, call) * 1e3;
  row.mhz_b2b = sm_clock_mhz(st, clock.as<double>());
  // One graph per cache copy, each the call captured once.
  std::vector<cudaGraphExec_t> graphs;
  for (int k = 0; k < copies; ++k) {
    cudaGraph_t g;
    cudaGraphExec_t e;
    ck(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal), "begin capture");
    call(k);
    ck(cudaStreamEndCapture(st, &g), "end capture");
    ck(cudaGraphInstantiate(&e, g, 0), "instantiate");
    cudaGraphDestroy(g);
    graphs.push_back(e);
  }
  auto replay = [&](int i) { ck(cudaGraphLaunch(graphs[size_t(i % copies)], st), "graph launch"); };
  for (int i = 0; i < 3; ++i) replay(i);
  row.graph_us = queued_median_ms(runs, st, replay) * 1e3;
  row.mhz_graph = sm_clock_mhz(st, clock.as<double>());
  row.sync_us = sync_median_ms(runs, st, call) * 1e3;
  row.mhz_sync = sm_clock_mhz(st, clock.as<double>());
  for (cudaGraphExec_t e : graphs) cudaGraphExecDestroy(e);
  ck(cudaDeviceSynchronize(), "timed runs");
  const cuda::AttentionVariant chosen = cuda::attention_variant(s.qlen, s.heads, s.dtype);
  row.variant = variant_name(chosen);
  if (sweep) {
    // Every kernel variant at this shape (same plan, same caches): the mma.sync kernel's
    // tile / occupancy knobs, the wgmma kernel (16- and 32-row shapes padded to 64), for fp8
    // caches the fp8 swap kernel (16-row groups), for bf16 ones the bf16 swap kernel (groups of
    // 16 or 32 rows).
    // Each is also compared with the default variant on cache 0 (rel L2 of out, full size).
    // The plan is the default variant's: a variant with other rows per CTA runs on a plan
    // balanced for those rows, not its own (marked "@plan<rows>": its time is not what it
    // would take as the default).
    const size_t nout = rows * 512;
    std::vector<uint16_t> ref(nout), got(nout);
    p.kv = caches[0];
    cuda::attention(p, st, sms);
    ck(cudaStreamSynchronize(st), "sweep ref");
    ck(cudaMemcpy(ref.data(), out, nout * 2, cudaMemcpyDeviceToHost), "d2h sweep ref");
    std::vector<cuda::AttentionVariant> seen;
    for (const cuda::AttentionTuning t : {cuda::AttentionTuning{32, 1, 1}, cuda::AttentionTuning{64, 1, 1},
                                          cuda::AttentionTuning{32, 2, 1}, cuda::AttentionTuning{0, 0, 2},
                                          cuda::AttentionTuning{0, 0, 3}, cuda::AttentionTuning{0, 0, 4}}) {
      const cuda::AttentionVariant v = cuda::attention_variant(s.qlen, s.heads, s.dtype, t);
      if (t.kernel == 1 && (v.tile_tokens != t.tile_tokens || v.ctas_per_sm != t.ctas_per_sm)) continue;  // not built
      if (std::any_of(seen.begin(), seen.end(), [&](const auto& u) { return same_variant(u, v); })) continue;
      seen.push_back(v);
      auto variant_call = [&](int i) {
        p.kv = caches[size_t(i % copies)];
        cuda::attention(p, st, sms, true, t);
      };
      for (int i = 0; i < 3; ++i) variant_call(i);
      const float vms = queued_median_ms(runs, st, variant_call);
      variant_call(0);
      ck(cudaStreamSynchronize(st), "sweep");
      ck(cudaMemcpy(got.data(), out, nout * 2, cudaMemcpyDeviceToHost), "d2h sweep");
      double num = 0, den = 0;
      for (size_t i = 0; i < nout; ++i) {
        const double a = bf16_bits_to_double(got[i]), r = bf16_bits_to_double(ref[i]);
        num += (a - r) * (a - r);
        den += r * r;
      }
      char buf[128];
      const std::string plan_note =
          v.rows_per_cta != chosen.rows_per_cta ? "@plan" + std::to_string(chosen.rows_per_cta) : "";
      std::snprintf(buf, sizeof buf, "%s%s%s:%.1f(%.0e)", row.sweep.empty() ? "" : " ", variant_name(v).c_str(),
                    plan_note.c_str(), vms * 1e3, den > 0 ? std::sqrt(num / den) : std::sqrt(num));
      row.sweep += buf;
    }
  }

  if (trace) {
    // The default variant on the same plan (the free function: its combine launches for every
    // plan and, when nothing was cut, exits before its stamps), after a call on another cache
    // copy, so that the traced call reads DRAM as the timed ones do.
    uint64_t* stamps;
    ck(cudaMalloc(&stamps, kTraceEntries * sizeof(uint64_t)), "malloc trace");
    ck(cudaMemsetAsync(stamps, 0, kTraceEntries * sizeof(uint64_t), st), "memset trace");
    AttentionParams tp = p;
    tp.kv = caches[1];
    call(0);
    tp.trace = stamps;
    cuda::attention(tp, st, sms);
    ck(cudaStreamSynchronize(st), "traced call");
    std::vector<uint64_t> host(kTraceEntries);
    ck(cudaMemcpy(host.data(), stamps, kTraceEntries * sizeof(uint64_t), cudaMemcpyDeviceToHost), "d2h trace");
    cudaFree(stamps);
    row.trace = summarise_trace(host);
    const cuda::AttentionVariant v = cuda::attention_variant(s.qlen, s.heads, s.dtype);
    add_cta_work(*row.trace, runner.current_plan(), s.heads, v.rows_per_cta, v.tile_tokens);
  }

  // Bytes: every local token once; flops: 2 rows x (D + R) per (row, local key).
  const Plan& plan = runner.current_plan();
  double tokens = 0, row_keys = 0;
  for (int b = 0; b < s.batch; ++b) {
    int longest = 0;
    for (int t = 0; t < s.qlen; ++t) {
      longest = std::max(longest, plan.row_local_len(b, t));
      row_keys += plan.row_local_len(b, t);
    }
    tokens += longest;
  }
  row.kv_bytes = tokens * 576 * bytes_per_value(s.dtype);
  row.flops = 2.0 * row_keys * s.heads * (576 + 512);
  row.kv_GBps = row.kv_bytes / (row.us * 1e-6) / 1e9;
  row.tflops = row.flops / (row.us * 1e-6) / 1e12;

  // The baseline pads every request to the longest: skipped where its buffers exceed 8 GiB.
  int64_t longest_row = 1;
  for (int b = 0; b < s.batch; ++b)
    for (int t = 0; t < s.qlen; ++t) longest_row = std::max<int64_t>(longest_row, plan.row_local_len(b, t));
  const double dense_bytes = double(s.batch) * longest_row * (576 * 2 + double(s.qlen) * s.heads * 6);
  if (baseline && dense_bytes <= double(size_t(8) << 30)) {
    // Dense padded buffers per request: the plain approach pays for Lpad = the longest row.
    int Lpad = 0;
    std::vector<int32_t> longest(size_t(s.batch)), row_len(size_t(s.batch) * s.qlen);
    for (int b = 0; b < s.batch; ++b) {
      for (int t = 0; t < s.qlen; ++t) {
        row_len[size_t(b) * s.qlen + t] = plan.row_local_len(b, t);
        longest[size_t(b)] = std::max(longest[size_t(b)], plan.row_local_len(b, t));
      }
      Lpad = std::max(Lpad, longest[size_t(b)]);
    }
    Lpad = std::max(Lpad, 1);
    const int qh = s.qlen * s.heads;
    __nv_bfloat16 *dense, *P;
    float* S;
    int32_t *d_longest, *d_rowlen;
    ck(cudaMalloc(&dense, size_t(s.batch) * Lpad * 576 * 2), "malloc dense");
    ck(cudaMalloc(&S, size_t(s.batch) * qh * Lpad * 4), "malloc S");
    ck(cudaMalloc(&P, size_t(s.batch) * qh * Lpad * 2), "malloc P");
    ck(cudaMalloc(&d_longest, longest.size() * 4), "malloc");
    ck(cudaMalloc(&d_rowlen, row_len.size() * 4), "malloc");
    ck(cudaMemcpy(d_longest, longest.data(), longest.size() * 4, cudaMemcpyHostToDevice), "copy");
    ck(cudaMemcpy(d_rowlen, row_len.data(), row_len.size() * 4, cudaMemcpyHostToDevice), "copy");
    const float one = 1.0f, zero = 0.0f;
    auto base = [&](int i) {
      const uint8_t* kv = caches[size_t(i % copies)];
      gather_kernel<<<dim3(1024, s.batch), 192>>>(kv, s.dtype, kv_scale, p.plan.subpage_table, plan.header().table_stride,
                                                 block, d_longest, Lpad, dense);
      // S^T (Lpad x qh, col-major) = K (op T of 576 x Lpad) * Q^T (576 x qh)
      ckb(cublasGemmStridedBatchedEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, Lpad, qh, 576, &one, dense, CUDA_R_16BF, 576,
                                     int64_t(Lpad) * 576, q, CUDA_R_16BF, 576, int64_t(qh) * 576, &zero, S,
                                     CUDA_R_32F, Lpad, int64_t(qh) * Lpad, s.batch, CUBLAS_COMPUTE_32F,
                                     CUBLAS_GEMM_DEFAULT),
          "baseline QK");
      softmax_kernel<<<unsigned(rows), 256>>>(S, Lpad, d_rowlen, s.qlen, s.heads, sm_scale, P, lse_base);
      // O^T (512 x qh) = V^T (512 x Lpad, ld 576) * P^T (Lpad x qh)
      ckb(cublasGemmStridedBatchedEx(blas, CUBLAS_OP_N, CUBLAS_OP_N, 512, qh, Lpad, &one, dense, CUDA_R_16BF, 576,
                                     int64_t(Lpad) * 576, P, CUDA_R_16BF, Lpad, int64_t(qh) * Lpad, &zero, out_base,
                                     CUDA_R_16BF, 512, int64_t(qh) * 512, s.batch, CUBLAS_COMPUTE_32F,
                                     CUBLAS_GEMM_DEFAULT),
          "baseline PV");
    };
    for (int i = 0; i < 2; ++i) base(i);
    ck(cudaDeviceSynchronize(), "baseline warm-up");
    row.base_us = median_ms(std::max(5, runs / 4), base) * 1e3;
    // Agreement of dcpmla with the baseline on the last cache (a sanity check of both).
    base(0);
    p.kv = caches[0];
    cuda::attention(p, st, sms);
    ck(cudaDeviceSynchronize(), "check");
    std::vector<uint16_t> a(rows * 512), bvec(rows * 512);
    ck(cudaMemcpy(a.data(), out, a.size() * 2, cudaMemcpyDeviceToHost), "d2h");
    ck(cudaMemcpy(bvec.data(), out_base, bvec.size() * 2, cudaMemcpyDeviceToHost), "d2h");
    double num = 0, den = 0;
    auto f = [](uint16_t h) {
      uint32_t u = uint32_t(h) << 16;
      float x;
      std::memcpy(&x, &u, 4);
      return double(x);
    };
    for (size_t i = 0; i < a.size(); ++i) {
      num += (f(a[i]) - f(bvec[i])) * (f(a[i]) - f(bvec[i]));
      den += f(bvec[i]) * f(bvec[i]);
    }
    row.check = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
    cudaFree(dense);
    cudaFree(S);
    cudaFree(P);
    cudaFree(d_longest);
    cudaFree(d_rowlen);
  }
  for (int k = 0; k < copies; ++k) cudaFree(caches[size_t(k)]);
  cudaFree(q);
  cudaFree(out);
  cudaFree(out_base);
  cudaFree(lse);
  cudaFree(lse_base);
  cudaStreamDestroy(st);
  return row;
}

Shape uniform(const char* name, int batch, int ctx, int heads, int qlen, KvDtype d, int world = 1, int rank = 0) {
  return Shape{name, batch, std::vector<int32_t>(size_t(batch), ctx), heads, qlen, d, world, rank};
}

// A shape from --shape "BATCH:CONTEXT:HEADS:QLEN[:KV_DTYPE]": CONTEXT is every request's
// length (a uniform shape, named from its fields: b64_c8192_h32_q3, + _e4m3 / _e5m2 for fp8) or
// BATCH lengths joined by '/' (a varlen batch, such as a held-out serving batch: named
// b<BATCH>_v<longest>_<6 hex digits of the lengths' hash>_h.._q..); nullopt and a message on
// stderr when a field is not a decimal integer in its range.
std::optional<Shape> parse_shape(const std::string& spec) {
  const auto split = [](const std::string& text, char sep) {
    std::vector<std::string> f;
    for (size_t at = 0;;) {
      const size_t next = text.find(sep, at);
      f.push_back(text.substr(at, next == std::string::npos ? std::string::npos : next - at));
      if (next == std::string::npos) return f;
      at = next + 1;
    }
  };
  const std::vector<std::string> f = split(spec, ':');
  const auto fail = [&](const std::string& why) {
    std::fprintf(stderr, "dcpmla_bench: --shape %s: %s\n", spec.c_str(), why.c_str());
    return std::nullopt;
  };
  if (f.size() != 4 && f.size() != 5) return fail("expected BATCH:CONTEXT:HEADS:QLEN[:KV_DTYPE]");
  // Field `name` (its text) into v, checked as the CLIs check every integer option
  // (cli::integer_in: decimal, no leading zeros, within lo..hi); the message, empty if it passes.
  const auto number = [](const std::string& name, std::string text, int lo, int hi, int& v) {
    const std::string why = dcpmla::cli::integer_in(lo, hi)(text);
    if (why.empty()) std::from_chars(text.data(), text.data() + text.size(), v);
    return why.empty() ? why : name + " " + why;
  };
  const char* names[4] = {"BATCH", "CONTEXT", "HEADS", "QLEN"};
  const int lo[4] = {1, 1, 1, 1}, hi[4] = {1024, 1 << 24, dcpmla::max_heads(dcpmla::Backend::cuda), 16};
  int v[4];
  for (int i : {0, 2, 3})
    if (const std::string why = number(names[i], f[size_t(i)], lo[i], hi[i], v[i]); !why.empty()) return fail(why);
  const std::vector<std::string> ctx = split(f[1], '/');
  if (ctx.size() != 1 && ctx.size() != size_t(v[0]))
    return fail("CONTEXT has " + std::to_string(ctx.size()) + " lengths, expected 1 or BATCH = " + std::to_string(v[0]));
  std::vector<int32_t> lens;
  for (size_t b = 0; b < ctx.size(); ++b) {
    const std::string name = ctx.size() == 1 ? "CONTEXT" : "CONTEXT length " + std::to_string(b);
    if (const std::string why = number(name, ctx[b], lo[1], hi[1], v[1]); !why.empty()) return fail(why);
    lens.push_back(v[1]);
  }
  KvDtype d = KvDtype::bf16;
  if (f.size() == 5) {
    try {
      d = dcpmla::parse_kv_dtype(f[4]);
    } catch (const std::exception& e) {
      return fail(e.what());
    }
  }
  std::string context = "_c" + f[1];
  if (lens.size() > 1) {
    uint32_t hash = 2166136261u;  // FNV-1a over the lengths' text
    for (const char ch : f[1]) hash = (hash ^ uint8_t(ch)) * 16777619u;
    char tag[16];
    std::snprintf(tag, sizeof tag, "_%06x", unsigned(hash & 0xffffffu));
    context = "_v" + std::to_string(*std::max_element(lens.begin(), lens.end())) + tag;
  } else {
    lens.assign(size_t(v[0]), lens[0]);
  }
  const std::string name = "b" + f[0] + context + "_h" + f[2] + "_q" + f[3] + dcpmla::results::kv_row_suffix(d);
  return Shape{name, v[0], lens, v[2], v[3], d};
}

// The serving batches engines send (fixed seeds, so every run times the same lengths):
//  uniform: 64 requests of 512..16384 tokens; lognormal: 64 requests around 4k with a long
//  tail (sigma 1, capped at 128k); one128k: one 131072-token request among 63 of 256..2048.
std::vector<int32_t> serving_lengths(const std::string& kind) {
  std::mt19937_64 rng(kind == "uniform" ? 1 : kind == "lognormal" ? 2 : 3);
  std::vector<int32_t> lens;
  if (kind == "uniform") {
    std::uniform_int_distribution<int32_t> u(512, 16384);
    for (int i = 0; i < 64; ++i) lens.push_back(u(rng));
  } else if (kind == "lognormal") {
    std::lognormal_distribution<double> ln(std::log(4096.0), 1.0);
    for (int i = 0; i < 64; ++i) lens.push_back(int32_t(std::clamp(ln(rng), 64.0, 131072.0)));
  } else {
    std::uniform_int_distribution<int32_t> u(256, 2048);
    lens.push_back(131072);
    for (int i = 0; i < 63; ++i) lens.push_back(u(rng));
  }
  return lens;
}

std::vector<Shape> serving_shapes() {
  std::vector<Shape> out;
  for (const char* kind : {"uniform", "lognormal", "one128k"})
    for (int heads : {16, 128})
      for (int qlen : {1, 2, 4})
        for (KvDtype d : {KvDtype::bf16, KvDtype::fp8_e4m3}) {
          const std::vector<int32_t> lens = serving_lengths(kind);
          out.push_back(Shape{std::string("serve_") + kind + "_h" + std::to_string(heads) + "_q" + std::to_string(qlen) +
                                  dcpmla::results::kv_row_suffix(d),
                              int(lens.size()), lens, heads, qlen, d});
        }
  return out;
}

}  // namespace

int bench_main(int argc, char** argv) {
  std::string json_path;
  int runs = 30;
  bool quick = false, no_baseline = false, sweep = false, no_ceilings = false, serving = false, trace = false;
  std::vector<std::string> only, custom;
  std::vector<double> schedule;
  int block_size = kTableBlockSize;
  CLI::App app{"dcpmla_bench: the copy and GEMM ceilings, a plain baseline (gather + cuBLAS + softmax) and\n"
               "dcpmla's attention at uniform and varlen shapes, on GPU 0: device time queued behind a spin\n"
               "kernel, the mean of calls queued back to back with no event between them, CUDA-graph replay\n"
               "time and synchronous per-call time, each with the SM clock right after it (a card at its power\n"
               "cap runs long compute-bound steps slower). Needs a CUDA GPU: without one it says so and exits\n"
               "with 77."};
  app.add_option("--json", json_path, "Also write the rows and their metadata as JSON to this file")
      ->check(dcpmla::cli::writable_file());
  app.add_option("--runs", runs, "Timed calls per measurement (median)")
      ->check(dcpmla::cli::integer_in(3, 100000))
      ->capture_default_str();
  app.add_flag("--quick", quick, "Only the four headline shapes");
  app.add_flag("--serving", serving,
               "Also the varlen serving batches (uniform 512..16k, lognormal around 4k, one 128k among short ones; "
               "16 and 128 heads, qlen 1, 2, 4, bf16 and fp8_e4m3)");
  app.add_flag("--no-baseline", no_baseline, "Skip the baseline (its columns are null in the JSON)");
  app.add_flag("--sweep", sweep, "Also time every other kernel variant at each shape (on the default variant's plan; @plan<rows> marks a variant with other rows per CTA)");
  app.add_flag("--no-ceilings", no_ceilings, "Skip the ceilings (the ratios to them are null in the JSON)");
  app.add_flag("--trace", trace, "Also trace one more call of each shape: every CTA's start and end on the GPU's global timer, summarised, with each attention CTA's time beside its pieces, tiles, SM and clock (the JSON's \"trace\", \"trace.ctas\" for scripts/cta_fit.py and \"trace.combine\"; the mma.sync reference kernel does not stamp)");
  app.add_option("--only", only,
                 "Run only these shapes (comma-separated names, picked from every shape: --quick and --serving do "
                 "not narrow it)")
      ->delimiter(',');
  app.add_option("--shape", custom,
                 "Time these shapes, BATCH:CONTEXT:HEADS:QLEN[:KV_DTYPE] (comma-separated; CONTEXT one length for "
                 "every request, or BATCH lengths joined by '/' for a varlen batch; KV_DTYPE bf16, fp8_e4m3 or "
                 "fp8_e5m2, default bf16; fp8 read with a cache scale of 0.5), named b<B>_c<C>_h<H>_q<Q>[_e4m3|_e5m2] "
                 "(varlen: b<B>_v<longest>_<hash of the lengths>_h<H>_q<Q>..): alone, or after the shapes --only "
                 "picks")
      ->delimiter(',');
  app.add_option("--schedule", schedule, "The schedule's cost model: piece,cut,slack[,combine[,combine_piece]] (ScheduleCost, in tiles; combine and combine_piece ScheduleCost's defaults when left out; default: each kernel's calibration, calibrated_schedule_cost); each JSON row records the cost its plan was dealt with (\"cost_model\", which scripts/cta_fit.py compares with the trace)")
      ->delimiter(',')
      ->expected(3, 5)
      ->check(dcpmla::cli::number_in(0.0, kMaxScheduleCost));
  app.add_option("--block-size", block_size,
                 "Tokens a cache page holds, for every shape (engines page by 1, 16, 32, 64 or more); a size other "
                 "than 64 names each row <shape>_blk<N>, so that it never stands for the default rows")
      ->check(dcpmla::cli::integer_in(1, kMaxBlockSize))
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  const bool baseline = !no_baseline, ceilings = !no_ceilings;

  const KvDtype BF = KvDtype::bf16, E4 = KvDtype::fp8_e4m3;
  std::vector<Shape> shapes{
      uniform("decode16", 128, 4096, 16, 1, BF),
      uniform("verify16_q4", 128, 4096, 16, 4, BF),
      uniform("decode128", 128, 4096, 128, 1, BF),
      uniform("decode16_e4m3", 128, 4096, 16, 1, E4),
  };
  // --only picks from every shape; without it --quick and --serving choose the set.
  const bool every = !only.empty();
  if (!quick || every) {
    const std::vector<Shape> more{
        uniform("verify16_q4_b132", 132, 4096, 16, 4, BF),
        uniform("decode16_ctx1k", 128, 1024, 16, 1, BF),
        uniform("decode16_ctx32k", 32, 32768, 16, 1, BF),
        uniform("verify128_q2", 64, 8192, 128, 2, BF),
        uniform("decode128_ctx64k", 16, 65536, 128, 1, BF),
        uniform("verify128_ctx128k_q4", 8, 131072, 128, 4, BF),
        Shape{"ragged16_q4", 4, {4641, 45118, 1730, 1696}, 16, 4, BF},
        uniform("decode128_e4m3", 128, 4096, 128, 1, E4),
        uniform("dcp_w8r3_q4", 128, 8 * 4096, 16, 4, BF, 8, 3),
        // DCP's per-rank view: N = 8 over a 128k context is 16k local tokens per rank, at the
        // 128 heads of the group after the head all-gather.
        uniform("dcp8_rank_ctx128k_h128_q1", 16, 131072, 128, 1, BF, 8, 3),
        uniform("dcp8_rank_ctx128k_h128_q4", 16, 131072, 128, 4, BF, 8, 3),
        uniform("dcp8_rank_ctx128k_h128_q4_e4m3", 16, 131072, 128, 4, E4, 8, 3),
    };
    shapes.insert(shapes.end(), more.begin(), more.end());
  }
  if (serving || every) {
    const std::vector<Shape> varlen = serving_shapes();
    shapes.insert(shapes.end(), varlen.begin(), varlen.end());
  }
  std::vector<Shape> custom_shapes;
  for (const std::string& spec : custom) {
    const std::optional<Shape> sh = parse_shape(spec);
    if (!sh) return 2;
    custom_shapes.push_back(*sh);
  }
  const auto wanted = [&](const std::string& name) {
    return only.empty() ? custom.empty() : std::find(only.begin(), only.end(), name) != only.end();
  };
  for (const std::string& name : only)
    if (std::none_of(shapes.begin(), shapes.end(), [&](const Shape& s) { return s.name == name; })) {
      std::string names;
      for (const Shape& s : shapes) names += " " + s.name;
      std::fprintf(stderr, "dcpmla_bench: --only %s: expected one of the shapes:%s\n", name.c_str(), names.c_str());
      return 2;
    }
  // (The names are checked before the GPU is touched: a wrong one costs no ceiling run.)
  if (dcpmla::cuda_detail::device_count() == 0) {
    std::fprintf(stderr, "dcpmla_bench: no CUDA device (or driver): nothing to time\n");
    return 77;
  }
  cudaDeviceProp prop;
  ck(cudaGetDeviceProperties(&prop, 0), "props");
  std::printf("device: %s, %d SMs, L2 %d MB\n", prop.name, prop.multiProcessorCount, prop.l2CacheSize >> 20);
  if (ceilings) measure_ceilings(runs);
  std::printf("ceilings: D2D copy %.0f GB/s (read + write), cuBLAS bf16 8192^3 GEMM %.0f TFLOP/s\n", copy_GBps,
              gemm_TFLOPs);
  std::optional<ScheduleCost> cost;  // none: each shape's kernel's calibration
  if (!schedule.empty())
    cost = ScheduleCost{schedule[0], schedule[1], schedule[2], schedule.size() > 3 ? schedule[3] : ScheduleCost{}.combine,
                        schedule.size() > 4 ? schedule[4] : ScheduleCost{}.combine_piece};
  if (cost)
    std::printf("schedule cost: piece %.2f, cut %.2f, slack %.3f, combine %.2f + %.2f per cut piece per chunk\n",
                cost->piece, cost->cut, cost->slack, cost->combine, cost->combine_piece);
  cublasHandle_t blas;
  ckb(cublasCreate(&blas), "cublasCreate");
  std::vector<Row> rows;
  std::vector<Shape> to_run;
  std::copy_if(shapes.begin(), shapes.end(), std::back_inserter(to_run),
               [&](const Shape& s) { return wanted(s.name); });
  to_run.insert(to_run.end(), custom_shapes.begin(), custom_shapes.end());
  for (Shape& s : to_run) {
    s.block_size = block_size;
    if (block_size != kTableBlockSize) s.name += "_blk" + std::to_string(block_size);
  }
  for (const Shape& s : to_run) {
    rows.push_back(run_shape(s, runs, baseline, sweep, trace, cost, blas));
    const Row& r = rows.back();
    std::fprintf(stderr,
                 "  %-32s %9.1f us (back to back %.1f, graph %.1f, sync %.1f; SM MHz after each %.0f %.0f %.0f %.0f)  %7.0f "
                 "GB/s  %6.1f TFLOP/s  route %s (%d cut)  %s  [%s]\n",
                 s.name.c_str(), r.us, r.b2b_us, r.graph_us, r.sync_us, r.mhz_us, r.mhz_b2b, r.mhz_graph, r.mhz_sync,
                 r.kv_GBps, r.tflops, r.route.c_str(), r.cut_requests, r.variant.c_str(), r.sweep.c_str());
    if (r.trace)
      std::fprintf(stderr,
                   "    trace: %d CTAs, last start %.1f us, ends p10 %.1f p50 %.1f last %.1f (a CTA %.1f at %.0f MHz); combine %d "
                   "CTAs %.1f..%.1f us; timer step %.3f us\n",
                   r.trace->attention_ctas, r.trace->last_start, r.trace->end_p10, r.trace->end_p50, r.trace->end_last,
                   r.trace->cta_p50, r.trace->mhz_p50, r.trace->combine_ctas, r.trace->combine_first_start, r.trace->combine_last_end,
                   r.trace->timer_step_us);
  }
  cublasDestroy(blas);

  // Ratios to a ceiling that was not measured, and baseline columns without a baseline, are null.
  const auto measured = [](bool ok, double v) { return ok ? nlohmann::json(v) : nlohmann::json(nullptr); };
  nlohmann::json json_rows = nlohmann::json::array();
  for (const Row& r : rows) {
    const bool base = r.base_us > 0;
    json_rows.push_back({{"name", r.s.name},
                         {"batch", r.s.batch},
                         {"context", *std::max_element(r.s.lens.begin(), r.s.lens.end())},
                         {"heads", r.s.heads},
                         {"qlen", r.s.qlen},
                         {"kv_dtype", std::string(to_string(r.s.dtype))},
                         {"world", r.s.world},
                         {"rank", r.s.rank},
                         {"block_size", r.s.block_size},
                         {"route", r.route},
                         {"variant", r.variant},
                         {"work_items", r.work_items},
                         {"cut_requests", r.cut_requests},
                         {"cost_model", {{"piece", r.cost.piece},
                                         {"cut", r.cost.cut},
                                         {"slack", r.cost.slack},
                                         {"combine", r.cost.combine},
                                         {"combine_piece", r.cost.combine_piece},
                                         {"rows_per_unit", r.rows_per_unit}}},
                         {"mean_context", std::accumulate(r.s.lens.begin(), r.s.lens.end(), 0.0) / r.s.lens.size()},
                         {"us", r.us},
                         {"b2b_us", r.b2b_us},
                         {"graph_us", r.graph_us},
                         {"sync_us", r.sync_us},
                         {"sm_mhz_after", {{"us", r.mhz_us}, {"b2b_us", r.mhz_b2b}, {"graph_us", r.mhz_graph}, {"sync_us", r.mhz_sync}}},
                         {"kv_GBps", r.kv_GBps},
                         {"TFLOPs", r.tflops},
                         {"copy_ratio", measured(copy_GBps > 0, r.kv_GBps / copy_GBps)},
                         {"gemm_ratio", measured(gemm_TFLOPs > 0, r.tflops / gemm_TFLOPs)},
                         {"baseline_us", measured(base, r.base_us)},
                         {"speedup", measured(base, r.base_us / r.us)},
                         {"rel_l2_vs_baseline", measured(base, r.check)},
                         {"copy_GBps", measured(copy_GBps > 0, copy_GBps)},
                         {"gemm_TFLOPs", measured(gemm_TFLOPs > 0, gemm_TFLOPs)},
                         {"sweep_us", r.sweep},
                         {"trace", r.trace ? nlohmann::json{{"attention_ctas", r.trace->attention_ctas},
                                                            {"last_start_us", r.trace->last_start},
                                                            {"end_p10_us", r.trace->end_p10},
                                                            {"end_p50_us", r.trace->end_p50},
                                                            {"end_last_us", r.trace->end_last},
                                                            {"cta_p50_us", r.trace->cta_p50},
                                                            {"cta_mhz_p50", r.trace->mhz_p50},
                                                            {"combine_ctas", r.trace->combine_ctas},
                                                            {"combine_first_start_us", r.trace->combine_first_start},
                                                            {"combine_last_end_us", r.trace->combine_last_end},
                                                            {"timer_step_us", r.trace->timer_step_us},
                                                            {"ctas", cta_json(r.trace->ctas)},
                                                            {"combine", {{"start_us", r.trace->combine_start_us},
                                                                         {"busy_us", r.trace->combine_busy_us}}}}
                                           : nlohmann::json(nullptr)}});
  }
  if (!json_path.empty()) {
    try {
      dcpmla::results::write(json_path, dcpmla::results::metadata(0, argc, argv), json_rows);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "dcpmla_bench: %s\n", e.what());
      return 2;
    }
  }

  std::printf("\n%-32s %5s %7s %5s %4s %-9s %-9s %9s %9s %9s %8s %7s %6s %6s %9s %7s %8s\n", "shape", "batch", "ctx",
              "heads", "qlen", "kv", "route", "us", "graph us", "sync us", "KV GB/s", "TFLOP/s", "%copy", "%gemm",
              "base us", "speedup", "relL2");
  for (const Row& r : rows) {
    const int ctx = *std::max_element(r.s.lens.begin(), r.s.lens.end());
    std::printf("%-32s %5d %7d %5d %4d %-9s %-9s %9.1f %9.1f %9.1f %8.0f %7.1f %6.1f %6.1f %9.1f %7.2f %8.4f\n",
                r.s.name.c_str(), r.s.batch, ctx, r.s.heads, r.s.qlen, std::string(to_string(r.s.dtype)).c_str(),
                r.route.c_str(), r.us, r.graph_us, r.sync_us, r.kv_GBps, r.tflops, 100 * r.kv_GBps / copy_GBps, 100 * r.tflops / gemm_TFLOPs, r.base_us,
                r.base_us > 0 ? r.base_us / r.us : 0.0, r.check);
  }
  return 0;
}

// A refusal by the library (dcpmla::Error: a shape the planner or a kernel refuses; error.h's fmt
// does not compile in nvcc's host pass, so caught as what it derives from) ends the run with its
// message and exit status 2, not std::terminate after the ceilings have been timed.
int main(int argc, char** argv) {
  try {
    return bench_main(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dcpmla_bench: %s\n", e.what());
    return 2;
  }
}
