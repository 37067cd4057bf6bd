// dcpmla_wgmma_probe: what the tensor pipe gives each wgmma form the attention kernels chain
// (or could: S over other tile sizes), measured alone, so that a kernel design starts from
// the rate a form can reach on this GPU rather than from the datasheet. For each form,
// warpgroups issue the same chain again and again on shared-memory operands (values do not
// matter); the table gives the SM cycles per chain (clock64, median over CTAs) and the bf16
// MACs per SM cycle of all issuing warpgroups together, also as a fraction of the dense peak
// (2048 MACs per SM cycle):
//   s_ss64    S of a 64-token tile: 36 x m64n64k16, Q and K from shared memory (the wgmma
//             kernel's S)
//   s_rs64    the same with Q from registers (only K read from shared memory; ptxas gives
//             each in-flight step its own A registers, so the chain holds 144 of them)
//   s_ss32    S of a 32-token tile: 36 x m64n32k16 from shared memory (Q, the A operand, read
//             once per 32 tokens instead of 64: what smaller tiles would cost S)
//   s_ss128   S of a 128-token tile: 36 x m64n128k16 from shared memory (one issuer: the
//             tile is 144 KiB)
//   pv_ss256  P V of one warpgroup's half of O: 4 x m64n256k16, P and V (MN-major) from
//             shared memory (the wgmma kernel's WG1)
//   pv_rs256  the same with P from registers (its WG0)
// with 1 or 2 warpgroups issuing at once (each its own K / V tile, one Q), and beside them
// (the stream column): nothing; a warp streaming cp.async from global memory into shared
// memory, 8 KiB a round trip ("warp"); or, with one issuer, a producer warpgroup that copies
// one 72 KiB tile (64 tokens of 576 bf16, by the 64-row kernel's copy pattern) as each chain
// starts, back to back when a fill outlasts a chain, from DRAM ("tile": the shared-memory
// writes the kernel's fill makes beside its S) or from tiles that stay in L2 ("tile_l2": the
// second row group's CTA of a 128-head request reads its tiles there). The tile rows also give
// the SM cycles per fill (fill_cycles: a fill's own time when fills run back to back, i.e.
// when it exceeds the chain's), what one SM's tile stream takes when every SM streams at once.
// Then the tile stream alone (forms fill_cp_async / fill_bulk / fill_box): one CTA per SM streams
// 72 KiB tiles into shared memory with 1, 2 or 3 tiles in flight, by 128 threads' cp.async (the
// kernels' producers), by one thread's bulk copies (cp.async.bulk, 8 KiB contiguous each, the
// TMA unit's best case) or by one thread's tensor-map boxes (64 dims x 64 rows of the 1152-byte
// token rows, 128-byte swizzle: the layout a stage takes), from DRAM or from L2 (stream "dram"
// / "l2"): SM cycles per tile and the bytes per second landed in all SMs together. More tiles in
// flight going faster means a stream bound by latency (deeper pipelines pay); the same rate, by
// bandwidth. Share "own": every CTA its own tiles (one row group); "pair": CTAs 2k and 2k + 1
// land the same tiles (the two row groups of a 128-head request today); "multicast": a cluster
// of two lands the same tiles, each CTA issuing half of every tile's blocks multicast to both,
// so L2 sends each tile once per pair.
// One CTA on every SM. Needs an sm_90a GPU.
// `dcpmla_wgmma_probe --help`; --json writes the rows with their metadata.
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include <cuda.h>
#include <cuda_runtime.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "../apps/cli_support.h"
#include "attention/kv_box_maps.h"
#include "attention/swizzle.cuh"
#include "attention/tile_maps.h"
#include "attention/wgmma.cuh"
#include "common/resources.h"
#include "common/utils.cuh"
#include "results_json.h"

namespace {

namespace cd = dcpmla::cuda_detail;

enum Form : int { kSss64, kSrs64, kSss128, kPVss256, kPVrs256, kSss32 };
constexpr const char* kFormNames[] = {"s_ss64", "s_rs64", "s_ss128", "pv_ss256", "pv_rs256", "s_ss32"};

constexpr int kDim = 576;
constexpr int kQBytes = 64 * kDim * 2;  // Q (64, 576) bf16; P V forms read P from its first 8 KiB
constexpr int kTileFillBytes = 64 * kDim * 2;  // a bf16 KV tile: the tile fill's landing area
constexpr double kPeakMacPerClk = 2048.0;

// What runs beside the issuers: nothing, a warp's cp.async stream (8 KiB a round trip, into an
// 8 KiB area), or a warpgroup's tile fill (one 72 KiB tile as each chain starts) from DRAM or
// from L2 (two tiles per CTA, read again and again).
enum Stream : int { kNoStream, kWarpStream, kTileFill, kTileFillL2 };
constexpr const char* kStreamNames[] = {"no", "warp", "tile", "tile_l2"};
__host__ __device__ constexpr bool is_tile_fill(int stream) { return stream == kTileFill || stream == kTileFillL2; }
constexpr int stream_threads(int stream) { return stream == kWarpStream ? 32 : is_tile_fill(stream) ? 128 : 0; }
constexpr int stream_bytes(int stream) {
  return stream == kWarpStream ? 8192 : is_tile_fill(stream) ? kTileFillBytes : 0;
}

// KV tokens of a form's tile (P V forms: 64).
__host__ __device__ constexpr int tile_tokens(int form) { return form == kSss128 ? 128 : form == kSss32 ? 32 : 64; }
__host__ __device__ constexpr int tile_bytes(int form) { return tile_tokens(form) * kDim * 2; }
// M x N x K of S over a tile; P V: 256 columns of O over 64 tokens.
constexpr double macs_per_chain(int form) {
  return form == kPVss256 || form == kPVrs256 ? 64.0 * 256 * 64 : 64.0 * tile_tokens(form) * kDim;
}
constexpr int smem_bytes(int form, int issuers, int stream) {
  return kQBytes + issuers * tile_bytes(form) + stream_bytes(stream) + 1024;
}

using cd::check;

// One chain of FORM on the warpgroup's tile (sK_a) and the shared Q / P (sQ_a); the same A
// fragment registers for every step of the register forms.
template <int FORM>
__device__ __forceinline__ float chain(uint32_t sQ_a, uint32_t sK_a, const uint32_t (&a)[4]) {
  if constexpr (FORM != kPVss256 && FORM != kPVrs256) {
    constexpr int NTOK = tile_tokens(FORM);  // S's N
    float acc[NTOK / 2];
    const cd::SmemDesc dq(sQ_a, 16, 1024), dk(sK_a, 16, 1024);
    cd::wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < kDim / 16; ++ks) {
      const uint32_t offq = uint32_t((ks >> 2) * (64 * 128) + (ks & 3) * 32);
      const uint32_t offk = uint32_t((ks >> 2) * (NTOK * 128) + (ks & 3) * 32);
      if constexpr (FORM == kSrs64) cd::wgmma_m64n64k16_rs<0>(acc, a, dk.at(offk), ks > 0);
      else if constexpr (NTOK == 32) cd::wgmma_m64n32k16_ss<0>(acc, dq.at(offq), dk.at(offk), ks > 0);
      else if constexpr (NTOK == 64) cd::wgmma_m64n64k16_ss<0>(acc, dq.at(offq), dk.at(offk), ks > 0);
      else cd::wgmma_m64n128k16_ss<0>(acc, dq.at(offq), dk.at(offk), ks > 0);
    }
    cd::wgmma_commit();
    cd::wgmma_wait<0>();
    cd::fence_regs(acc);
    return acc[0];
  } else {
    float acc[128];
#pragma unroll
    for (int k = 0; k < 128; ++k) acc[k] = 0.0f;
    const cd::SmemDesc dp(sQ_a, 16, 1024), dv(sK_a, 64 * 128, 1024);
    cd::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      if constexpr (FORM == kPVss256) cd::wgmma_m64n256k16_ss<1>(acc, dp.at(kk * 32), dv.at(kk * 2048), 1);
      else cd::wgmma_m64n256k16_rs<1>(acc, a, dv.at(kk * 2048), 1);
    }
    cd::wgmma_commit();
    cd::wgmma_wait<0>();
    cd::fence_regs(acc);
    return acc[0];
  }
}

// Thread t (< 128) of a warpgroup's cp.async copy of the 72 KiB tile at `from` (64 rows of 576
// bf16) into the 128-byte swizzled layout at dst, by the kernels' producer map (Bf16TileMap);
// not committed.
__device__ __forceinline__ void copy_tile_cp_async(uint32_t dst, const uint4* from, int t) {
  using Map = cd::Bf16TileMap;
  const int lc = Map::chunk(t);
#pragma unroll
  for (int j = 0; j < Map::kTokens; ++j) {
    const int tok = Map::token(t, j);
#pragma unroll
    for (int m = 0; m < kDim / 64; ++m)
      cd::cp_async_16(dst + cd::swz128(tok, m, lc, 64 * 128), from + tok * (kDim / 8) + lc + 8 * m, 16);
  }
}

template <int FORM, int ISSUERS, int STREAM>
__global__ void __launch_bounds__(128 * ISSUERS + stream_threads(STREAM), 1)
    probe_kernel(int iters, const uint4* __restrict__ src, size_t src_chunks, long long* cycles,
                 long long* fill_cycles, float* sink) {
  static_assert(!is_tile_fill(STREAM) || ISSUERS == 1, "a tile fill fits beside one issuer's tile");
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  __shared__ int issuers_done, chains_started;
  uint8_t* base = &cd::aligned_shared<uint8_t>(smem_raw);
  const int tid = threadIdx.x, wg = tid >> 7, t = tid & 127;
  const int used = kQBytes + ISSUERS * tile_bytes(FORM);
  // Small bf16 values (2^-7) so that the accumulators stay finite.
  for (int i = tid; i < used / 4; i += blockDim.x) reinterpret_cast<uint32_t*>(base)[i] = 0x3C003C00u;
  if (tid == 0) issuers_done = chains_started = 0;
  cd::fence_proxy_async();
  __syncthreads();

  const uint32_t sQ_a = cd::smem_addr(base);
  if (wg < ISSUERS) {
    const uint32_t a[4] = {0x3C003C00u, 0x3C003C00u, 0x3C003C00u, 0x3C003C00u};
    const uint32_t sK_a = sQ_a + kQBytes + wg * tile_bytes(FORM);
    float s = 0.0f;
    const long long t0 = clock64();
#pragma unroll 1
    for (int it = 0; it < iters; ++it) {
      if (is_tile_fill(STREAM) && t == 0) *static_cast<volatile int*>(&chains_started) = it + 1;
      s += chain<FORM>(sQ_a, sK_a, a);
    }
    const long long t1 = clock64();
    if (t == 0) {
      cycles[blockIdx.x * ISSUERS + wg] = t1 - t0;
      atomicAdd(&issuers_done, 1);
    }
    if (s == 1234.5f) sink[0] = s;  // keeps the chains
  } else if constexpr (is_tile_fill(STREAM)) {
    // One tile per chain started, as the kernel's producer refills a stage while S runs, by its
    // map (Bf16TileMap) into the 128-byte swizzled layout; each CTA walks its own tiles through
    // the source: all of it (far more than L2 holds: from DRAM), or two tiles per CTA (L2).
    const uint32_t dst = sQ_a + used;
    constexpr size_t kTileChunks = kTileFillBytes / 16;
    const size_t window = STREAM == kTileFillL2 ? 2 * gridDim.x * kTileChunks : src_chunks;
    size_t tile = blockIdx.x;
    long long f0 = 0;
    int filled = 0;
    for (;; ++filled) {
      while (*static_cast<volatile int*>(&chains_started) <= filled &&
             *static_cast<volatile int*>(&issuers_done) < ISSUERS) {
      }
      if (*static_cast<volatile int*>(&issuers_done) == ISSUERS) break;
      if (filled == 0) f0 = clock64();
      copy_tile_cp_async(dst, src + (tile * kTileChunks) % (window - kTileChunks + 1), t);
      asm volatile("cp.async.commit_group;\n" ::: "memory");
      asm volatile("cp.async.wait_group 0;\n" ::: "memory");
      tile += gridDim.x;
    }
    // Cycles per fill (the last one is cut short by the issuer's end: counted whole).
    if (t == 0) fill_cycles[blockIdx.x] = filled > 0 ? (clock64() - f0) / filled : 0;
  } else if constexpr (STREAM == kWarpStream) {
    // One warp (the issuers keep the registers): 8 KiB a round, 16 bytes per copy, from
    // anywhere in the source buffer.
    const uint32_t dst = sQ_a + used;
    size_t chunk = size_t(blockIdx.x) * 4096 + t;
    while (*static_cast<volatile int*>(&issuers_done) < ISSUERS) {
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        cd::cp_async_16(dst + (j * 32 + t) * 16, src + chunk % src_chunks, 16);
        chunk += 32 * size_t(gridDim.x) * 16 + 512;
      }
      asm volatile("cp.async.commit_group;\n" ::: "memory");
      asm volatile("cp.async.wait_group 0;\n" ::: "memory");
    }
  }
}

// The tile stream alone: each CTA (or pair, below) walks its tiles through the source (all of
// it: DRAM; or two tiles per walker: L2) into INFLIGHT areas of 72 KiB, a tile in flight per
// area. Copiers: 128 threads' cp.async by the kernels' producer map from 64 rows of 1152 bytes
// (a 64-token page); one thread's bulk copies of nine contiguous 8 KiB blocks (the TMA unit's
// best case); or one thread's nine 2D tensor-map boxes (64 dims x 64 rows, 128-byte swizzle)
// from the same 1152-byte rows as cp.async, the layout the kernels' stages take. Sharing: each
// CTA its own tiles (16 heads: one row group); CTAs 2k and 2k + 1 the same tiles, each landing
// all of it (128 heads today: the two row groups' CTAs, neighbours on a GPC); or a cluster of
// two landing the same tiles, rank r issuing blocks [5 r, 5 r + 5) multicast to both (L2 sends
// each tile once per pair).
enum Copier : int { kCpAsync, kBulk, kBox };
enum Share : int { kOwn, kPair, kMulticast };
constexpr const char* kCopierNames[] = {"fill_cp_async", "fill_bulk", "fill_box"};
constexpr const char* kShareNames[] = {"own", "pair", "multicast"};

template <int INFLIGHT, int COPIER, bool L2, int SHARE>
__global__ void __launch_bounds__(128, 1)
    fill_kernel(int tiles, const uint4* __restrict__ src, size_t src_chunks, const __grid_constant__ CUtensorMap map,
                long long* cycles) {
  static_assert(SHARE != kMulticast || COPIER != kCpAsync, "cp.async cannot multicast");
  constexpr bool MC = SHARE == kMulticast, TMA = COPIER != kCpAsync;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  __shared__ __align__(8) uint64_t bars[INFLIGHT];
  uint8_t* base = &cd::aligned_shared<uint8_t>(smem_raw);
  const uint32_t area0 = cd::smem_addr(base), bar0 = cd::smem_addr(bars);
  const int t = threadIdx.x;
  constexpr size_t kTileChunks = kTileFillBytes / 16;
  const size_t walker = SHARE == kOwn ? blockIdx.x : blockIdx.x / 2, walkers = SHARE == kOwn ? gridDim.x : gridDim.x / 2;
  const size_t src_tiles = src_chunks / kTileChunks, window = L2 ? 2 * walkers : src_tiles;
  auto tile_index = [&](int k) { return (walker + size_t(k) * walkers) % window; };
  if (TMA && t == 0)
    for (int a = 0; a < INFLIGHT; ++a) cd::mbar_init(bar0 + 8 * a, 1);
  if constexpr (MC) {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    cd::cluster_sync();
  }
  __syncthreads();
  const long long c0 = clock64();
  if constexpr (TMA) {
    // Thread 0 issues each tile's nine blocks (MC: its rank's share, multicast to both CTAs).
    // An area is reissued once its previous tile has landed (MC: in both CTAs, cluster barrier).
    const int b0 = MC ? 5 * int(cd::cluster_ctarank()) : 0, b1 = min(b0 + (MC ? 5 : kDim / 64), kDim / 64);
    auto landed = [&](int k) {  // tile k's area is free again (k >= INFLIGHT: tile k - INFLIGHT landed)
      if (k >= INFLIGHT && t == 0) cd::mbar_wait(bar0 + 8 * (k % INFLIGHT), uint32_t((k / INFLIGHT - 1) & 1));
      if (MC) cd::cluster_sync();
    };
    for (int k = 0; k < tiles; ++k) {
      const int a = k % INFLIGHT;
      if (k >= INFLIGHT) landed(k);
      if (t == 0) {
        const uint32_t bar = bar0 + 8 * a;
        cd::mbar_arrive_expect_tx(bar, kTileFillBytes);
        const size_t tile = tile_index(k);
        for (int b = b0; b < b1; ++b) {
          const uint32_t dst = area0 + a * kTileFillBytes + b * 8192;
          if constexpr (COPIER == kBulk) {
            const uint4* from = src + tile * kTileChunks + b * 512;
            if constexpr (MC) cd::bulk_copy_g2s_multicast(dst, from, 8192, bar, uint16_t(3));
            else cd::bulk_copy_g2s(dst, from, 8192, bar);
          } else {
            const int x = 64 * b, y = int(tile * 64);
            if constexpr (MC) cd::tensor_box_g2s_multicast(dst, &map, x, y, bar, uint16_t(3));
            else cd::tensor_box_g2s(dst, &map, x, y, bar);
          }
        }
      }
    }
    // The last INFLIGHT tiles (with MC: no CTA exits while its peer's copies may still land in it).
    for (int k = max(tiles, INFLIGHT); k < tiles + INFLIGHT; ++k) landed(k);
  } else {
    for (int k = 0; k < tiles; ++k) {
      copy_tile_cp_async(area0 + (k % INFLIGHT) * kTileFillBytes, src + tile_index(k) * kTileChunks, t);
      asm volatile("cp.async.commit_group;\n" ::: "memory");
      asm volatile("cp.async.wait_group %0;\n" ::"n"(INFLIGHT - 1) : "memory");
    }
    asm volatile("cp.async.wait_group 0;\n" ::: "memory");
  }
  if (t == 0) cycles[blockIdx.x] = (clock64() - c0) / tiles;
}

// The median of the CTAs' counts.
double median(std::vector<long long> v) {
  std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
  return double(v[v.size() / 2]);
}

struct FillRow {
  std::string copier, source, share;
  int inflight;
  double cycles_per_tile, gbps;
};

template <int INFLIGHT, int COPIER, bool L2, int SHARE>
FillRow run_fill(int sms, const uint4* src, size_t src_chunks, const CUtensorMap& map, long long* d_cycles) {
  auto kernel = fill_kernel<INFLIGHT, COPIER, L2, SHARE>;
  const int smem = INFLIGHT * kTileFillBytes + 1024;
  check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem), "cudaFuncSetAttribute");
  const int tiles = 2000;  // 132 SMs x 2000 x 72 KiB = 19 GB: several milliseconds
  cudaLaunchAttribute cluster{};
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = SHARE == kMulticast ? 2 : 1;
  cluster.val.clusterDim.y = cluster.val.clusterDim.z = 1;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(unsigned(SHARE == kOwn ? sms : sms / 2 * 2));
  cfg.blockDim = dim3(128);
  cfg.dynamicSmemBytes = size_t(smem);
  cfg.attrs = &cluster;
  cfg.numAttrs = 1;
  auto launch = [&](int n) {
    check(cudaLaunchKernelEx(&cfg, kernel, n, src, src_chunks, map, d_cycles), "fill probe launch");
  };
  launch(tiles / 10);  // warm-up
  const cd::Event e0("cudaEventCreate(fill)", cudaEventDefault), e1("cudaEventCreate(fill)", cudaEventDefault);
  check(cudaEventRecord(e0.get()), "cudaEventRecord");
  launch(tiles);
  check(cudaEventRecord(e1.get()), "cudaEventRecord");
  check(cudaEventSynchronize(e1.get()), "fill probe run");
  float ms = 0.0f;
  check(cudaEventElapsedTime(&ms, e0.get(), e1.get()), "cudaEventElapsedTime");
  std::vector<long long> cyc(cfg.gridDim.x);
  check(cudaMemcpy(cyc.data(), d_cycles, cyc.size() * sizeof(long long), cudaMemcpyDeviceToHost), "cudaMemcpy");
  return FillRow{kCopierNames[COPIER], L2 ? "l2" : "dram", kShareNames[SHARE], INFLIGHT, median(cyc),
                 double(cfg.gridDim.x) * tiles * kTileFillBytes / (ms * 1e-3) / 1e9};
}

struct Row {
  std::string form;
  int issuers;
  std::string stream;
  double cycles_per_chain, mac_per_clk, peak_ratio, tflops, clock_mhz, fill_cycles;
};

template <int FORM, int ISSUERS, int STREAM>
Row run(int sms, const uint4* src, size_t src_chunks, long long* d_cycles, long long* d_fill, float* d_sink) {
  auto kernel = probe_kernel<FORM, ISSUERS, STREAM>;
  const int smem = smem_bytes(FORM, ISSUERS, STREAM);
  check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem), "cudaFuncSetAttribute");
  // About 10^10 MACs per warpgroup: several milliseconds per launch.
  const int iters = int(1e10 / macs_per_chain(FORM));
  const int threads = 128 * ISSUERS + stream_threads(STREAM);
  kernel<<<sms, threads, smem>>>(iters / 10, src, src_chunks, d_cycles, d_fill, d_sink);  // warm-up
  check(cudaGetLastError(), "probe launch");
  const cd::Event e0("cudaEventCreate(probe)", cudaEventDefault), e1("cudaEventCreate(probe)", cudaEventDefault);
  check(cudaEventRecord(e0.get()), "cudaEventRecord");
  kernel<<<sms, threads, smem>>>(iters, src, src_chunks, d_cycles, d_fill, d_sink);
  check(cudaEventRecord(e1.get()), "cudaEventRecord");
  check(cudaEventSynchronize(e1.get()), "probe run");
  float ms = 0.0f;
  check(cudaEventElapsedTime(&ms, e0.get(), e1.get()), "cudaEventElapsedTime");
  std::vector<long long> cyc(size_t(sms) * ISSUERS);
  check(cudaMemcpy(cyc.data(), d_cycles, cyc.size() * sizeof(long long), cudaMemcpyDeviceToHost), "cudaMemcpy");
  const double chain_cycles = median(cyc);
  const double per_chain = chain_cycles / iters;
  double fill = 0.0;
  if constexpr (is_tile_fill(STREAM)) {
    std::vector<long long> fc(static_cast<size_t>(sms));
    check(cudaMemcpy(fc.data(), d_fill, fc.size() * sizeof(long long), cudaMemcpyDeviceToHost), "cudaMemcpy");
    fill = median(fc);
  }
  const double mac_clk = ISSUERS * macs_per_chain(FORM) / per_chain;
  const double total_macs = double(sms) * ISSUERS * iters * macs_per_chain(FORM);
  return Row{kFormNames[FORM], ISSUERS, kStreamNames[STREAM], per_chain, mac_clk, mac_clk / kPeakMacPerClk,
             2.0 * total_macs / (ms * 1e-3) / 1e12, chain_cycles / (ms * 1e3), fill};
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"dcpmla_wgmma_probe: SM cycles per chain and bf16 MACs per SM cycle of the wgmma forms the "
               "attention kernels chain (S and P V, operands from shared memory or registers), with one or two "
               "warpgroups issuing, beside nothing, a warp's cp.async stream, or (one issuer) a 72 KiB tile fill "
               "from DRAM or L2 as each chain starts; then the tile stream alone, SM cycles per 72 KiB tile by "
               "copier (128 threads' cp.async, one thread's bulk copies or tensor-map boxes), source (DRAM, L2) "
               "and share (each CTA its own tiles, pairs of CTAs on the same tiles, clusters of two multicasting "
               "them). Needs an sm_90a GPU."};
  std::string json_path;
  app.add_option("--json", json_path, "Also write the rows and their metadata as JSON to this file")
      ->check(dcpmla::cli::writable_file());
  CLI11_PARSE(app, argc, argv);
  try {
    cudaDeviceProp prop{};
    check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
    if (prop.major != 9) throw std::runtime_error(std::string("needs an sm_90 GPU, found ") + prop.name);
    const size_t src_bytes = size_t(1) << 30;
    const cd::DeviceBuffer src_buf(src_bytes, "cudaMalloc(probe source)");
    const cd::DeviceBuffer cycles_buf(sizeof(long long) * prop.multiProcessorCount * 2, "cudaMalloc(probe cycles)");
    const cd::DeviceBuffer fill_buf(sizeof(long long) * prop.multiProcessorCount, "cudaMalloc(probe fill cycles)");
    const cd::DeviceBuffer sink_buf(sizeof(float), "cudaMalloc(probe sink)");
    check(cudaMemset(src_buf.get(), 0, src_bytes), "cudaMemset");
    const uint4* src = src_buf.as<const uint4>();
    long long* d_cycles = cycles_buf.as<long long>();
    long long* d_fill = fill_buf.as<long long>();
    float* d_sink = sink_buf.as<float>();
    const int sms = prop.multiProcessorCount;
    const size_t chunks = src_bytes / sizeof(uint4);
    std::vector<Row> rows;
    auto both = [&]<int FORM, int ISSUERS>() {
      rows.push_back(run<FORM, ISSUERS, kNoStream>(sms, src, chunks, d_cycles, d_fill, d_sink));
      rows.push_back(run<FORM, ISSUERS, kWarpStream>(sms, src, chunks, d_cycles, d_fill, d_sink));
      if constexpr (ISSUERS == 1 && FORM != kSss128) {
        rows.push_back(run<FORM, ISSUERS, kTileFill>(sms, src, chunks, d_cycles, d_fill, d_sink));
        rows.push_back(run<FORM, ISSUERS, kTileFillL2>(sms, src, chunks, d_cycles, d_fill, d_sink));
      }
    };
    both.template operator()<kSss64, 1>();
    both.template operator()<kSss64, 2>();
    both.template operator()<kSss32, 1>();
    both.template operator()<kSss32, 2>();
    both.template operator()<kSrs64, 1>();
    // Two register-form issuers and the streaming warp: 9 warps put 3 on one SM sub-partition,
    // 168 registers each, too few for the chain's in-flight A fragments (ptxas serialises it).
    rows.push_back(run<kSrs64, 2, kNoStream>(sms, src, chunks, d_cycles, d_fill, d_sink));
    both.template operator()<kSss128, 1>();
    both.template operator()<kPVss256, 1>();
    both.template operator()<kPVss256, 2>();
    both.template operator()<kPVrs256, 1>();
    rows.push_back(run<kPVrs256, 2, kNoStream>(sms, src, chunks, d_cycles, d_fill, d_sink));

    std::vector<FillRow> fills;
    const CUtensorMap map = cd::bf16_rows_map(src, src_bytes / (kDim * 2), 64);  // the box copier's source rows
    // One copier and share, from DRAM and (unless only DRAM) from L2.
    auto sources = [&]<int INFLIGHT, int COPIER, int SHARE>(bool l2) {
      fills.push_back(run_fill<INFLIGHT, COPIER, false, SHARE>(sms, src, chunks, map, d_cycles));
      if (l2) fills.push_back(run_fill<INFLIGHT, COPIER, true, SHARE>(sms, src, chunks, map, d_cycles));
    };
    auto fill_rows = [&]<int INFLIGHT>() {
      sources.template operator()<INFLIGHT, kCpAsync, kOwn>(true);
      sources.template operator()<INFLIGHT, kBulk, kOwn>(true);
      sources.template operator()<INFLIGHT, kBox, kOwn>(true);
      if constexpr (INFLIGHT > 1) {
        // The 128-head pattern: pairs of CTAs on the same tiles (from DRAM: the first of a
        // pair to ask brings a tile into L2), or clusters of two multicasting them.
        sources.template operator()<INFLIGHT, kCpAsync, kPair>(false);
        sources.template operator()<INFLIGHT, kBox, kPair>(false);
        sources.template operator()<INFLIGHT, kBulk, kMulticast>(true);
        sources.template operator()<INFLIGHT, kBox, kMulticast>(true);
      }
    };
    fill_rows.template operator()<1>();
    fill_rows.template operator()<2>();
    fill_rows.template operator()<3>();

    std::printf("device: %s, %d SMs; peak %g bf16 MACs per SM cycle\n", prop.name, sms, kPeakMacPerClk);
    std::printf("%-10s %7s %7s %14s %12s %8s %9s %9s %12s\n", "form", "issuers", "stream", "cycles/chain",
                "MAC/clk/SM", "xpeak", "TFLOP/s", "SM MHz", "cycles/fill");
    nlohmann::json jrows = nlohmann::json::array();
    for (const Row& r : rows) {
      std::printf("%-10s %7d %7s %14.1f %12.1f %8.3f %9.1f %9.0f %12.0f\n", r.form.c_str(), r.issuers,
                  r.stream.c_str(), r.cycles_per_chain, r.mac_per_clk, r.peak_ratio, r.tflops, r.clock_mhz,
                  r.fill_cycles);
      jrows.push_back({{"form", r.form},
                       {"issuers", r.issuers},
                       {"stream", r.stream},
                       {"cycles_per_chain", r.cycles_per_chain},
                       {"mac_per_clk_sm", r.mac_per_clk},
                       {"peak_ratio", r.peak_ratio},
                       {"TFLOPs", r.tflops},
                       {"sm_clock_mhz", r.clock_mhz},
                       {"fill_cycles", r.fill_cycles}});
    }
    std::printf("\n%-14s %7s %10s %9s %16s %9s\n", "form", "source", "share", "inflight", "cycles/tile/SM",
                "GB/s");
    for (const FillRow& f : fills) {
      std::printf("%-14s %7s %10s %9d %16.0f %9.0f\n", f.copier.c_str(), f.source.c_str(), f.share.c_str(),
                  f.inflight, f.cycles_per_tile, f.gbps);
      jrows.push_back({{"form", f.copier},
                       {"stream", f.source},
                       {"share", f.share},
                       {"inflight", f.inflight},
                       {"cycles_per_tile", f.cycles_per_tile},
                       {"GBps", f.gbps}});
    }
    if (!json_path.empty()) dcpmla::results::write(json_path, dcpmla::results::metadata(0, argc, argv), jrows);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dcpmla_wgmma_probe: %s\n", e.what());
    return 1;
  }
  return 0;
}
