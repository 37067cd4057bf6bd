// The single-GPU DCP benchmark (dcp_bench_core.h): what one rank of an N-rank
// group does per step, without the communication: attention of all N x H_local heads over
// its 1/N share of every request, and the merge kernels on their real shapes.
#include <algorithm>
#include <cmath>
#include <memory>
#include <numeric>
#include <random>
#include <vector>

#include <cuda_runtime.h>

#include "dcp/dcp_kernels.h"
#include "dcp_bench_core.h"
#include "dcpmla/dcp.h"
#include "dcpmla/error.h"
#include "dcpmla/layout.h"
#include "common/params.h"
#include "common/resources.h"

namespace dcpmla::bench {
namespace {

using cuda_detail::check;
constexpr int kDim = 576, kRank = 512;

// Device memory for the bench (the library's RAII owner).
struct Buffer : cuda_detail::DeviceBuffer {
  explicit Buffer(size_t bytes) : DeviceBuffer(bytes, "cudaMalloc(bench)") {}
};

// Median time (us) of `runs` calls of fn after `warmup`, each between two events.
template <class Fn>
double time_us(cudaStream_t s, int warmup, int runs, Fn fn) {
  const cuda_detail::Event a("cudaEventCreate(bench)", cudaEventDefault), b("cudaEventCreate(bench)", cudaEventDefault);
  for (int i = 0; i < warmup; ++i) fn();
  std::vector<float> ms(size_t(std::max(runs, 1)));
  for (auto& m : ms) {
    check(cudaEventRecord(a.get(), s), "cudaEventRecord");
    fn();
    check(cudaEventRecord(b.get(), s), "cudaEventRecord");
    check(cudaEventSynchronize(b.get()), "cudaEventSynchronize");
    check(cudaEventElapsedTime(&m, a.get(), b.get()), "cudaEventElapsedTime");
  }
  std::nth_element(ms.begin(), ms.begin() + ptrdiff_t(ms.size() / 2), ms.end());
  return double(ms[ms.size() / 2]) * 1000.0;
}

}  // namespace

std::vector<DcpBenchRow> run_dcp_bench(const DcpBenchOptions& o) {
  require(o.batch >= 1, "batch", o.batch, ">= 1");
  require(o.context >= 1, "context", o.context, ">= 1");
  require(cuda_device_available(), "device", o.device, "a CUDA GPU (none is usable on this machine)");
  check(cudaSetDevice(o.device), "cudaSetDevice(bench)");
  const cuda_detail::Stream owned_stream("cudaStreamCreate(bench)");
  cudaStream_t stream = owned_stream.get();
  std::vector<DcpBenchRow> rows;
  for (int hl : o.heads_local)
    for (int qlen : o.qlens)
      for (int N : o.world_sizes) {
        require(N >= 1, "world_size", N, ">= 1");
        DcpBenchRow row{};
        row.heads_local = hl;
        row.qlen = qlen;
        row.world_size = N;
        row.heads_total = N * hl;
        const int rg = dcp_ranks_per_group(N, hl), hg = rg * hl, G = N / rg;
        row.groups = G;
        // Rank 0's share (the largest) of every request: context / N tokens, interleave 1.
        const Layout layout{N, 0, 1};
        const int64_t local = layout.local_length(o.context);
        row.local_tokens = local;
        const int block = 64;
        const int64_t per_req = (local + block - 1) / block, num_blocks = per_req * o.batch;
        AttentionConfig ac;
        ac.heads = hg;
        ac.layout = layout;
        ac.block_size = block;
        ac.limits = PlanLimits{o.batch, qlen, local};
        ac.kv_dtype = o.kv_dtype;
        cuda::Attention runner(ac, o.device);
        const int value_bytes = bytes_per_value(o.kv_dtype);
        Buffer cache(size_t(num_blocks) * block * kDim * value_bytes);
        const KvCache cache_view{cache.get(), num_blocks, block, kDim, o.kv_dtype};
        const KvScale kv_scale{o.kv_dtype == KvDtype::bf16 ? 1.0f : 0.5f};
        fill_random_cache(cache.get(), num_blocks * block * kDim, o.kv_dtype, 11 + uint64_t(N), stream);
        std::vector<int32_t> ids(static_cast<size_t>(num_blocks));
        std::iota(ids.begin(), ids.end(), 0);
        std::mt19937_64 rng(5);
        std::shuffle(ids.begin(), ids.end(), rng);
        const std::vector<int32_t> lens(size_t(o.batch), int32_t(o.context));
        const BatchDesc desc{lens, qlen, ids, int(per_req), qlen == 1 ? Mode::decode : Mode::verify};
        runner.plan(desc, stream);
        row.route = std::string(to_string(runner.current_plan().route()));

        const int64_t rows_n = int64_t(o.batch) * qlen, cells_all = rows_n * N * hl, cells = rows_n * hl;
        Buffer q(size_t(cells_all) * kDim * 2), out(size_t(cells_all) * kRank * 2), lse(size_t(cells_all) * 4);
        fill_random(q.as<bf16>(), cells_all * kDim, 7, 1.0f, stream);
        row.attention_us = time_us(stream, o.warmup, o.runs, [&] {
          for (int g = 0; g < G; ++g)
            runner.run(q.as<bf16>() + int64_t(g) * rows_n * hg * kDim, cache_view, kv_scale,
                       out.as<bf16>() + int64_t(g) * rows_n * hg * kRank, lse.as<float>() + int64_t(g) * rows_n * hg,
                       stream);
        });
        row.kv_bytes = double(o.batch) * double(local) * kDim * value_bytes * G;  // each launch reads the shard
        row.attention_tbps = row.kv_bytes / (row.attention_us * 1e-6) / 1e12;

        // Merge (i): correction on the gathered lse, and the receiving side's sum of N chunks.
        const cuda_detail::HeadGroups hgp{N, 0, rg, hl, hg, rows_n};
        Buffer lse_all(size_t(cells_all) * N * 4), send(size_t(cells_all) * kRank * 2);
        check(cudaMemsetAsync(lse_all.get(), 0, size_t(cells_all) * N * 4, stream), "cudaMemsetAsync(lse_all)");
        Buffer out_lse(size_t(cells) * 4), mine(size_t(cells) * kRank * 2);
        row.correct_us = time_us(stream, o.warmup, o.runs, [&] {
          cuda_detail::launch_correct(
              cuda_detail::CorrectParams{hgp, lse_all.as<float>(), out.as<bf16>(), send.get(), false, out_lse.as<float>(), kRank},
              stream);
        });
        const double correct_bytes = double(cells_all) * (kRank * 2 * 2 + 4.0 * N);
        row.correct_gbps = correct_bytes / (row.correct_us * 1e-6) / 1e9;
        std::vector<std::unique_ptr<Buffer>> peers;
        cuda_detail::ReduceParams rp{};
        for (int k = 0; k < N; ++k) {
          peers.push_back(std::make_unique<Buffer>(size_t(cells_all) * kRank * 2));
          check(cudaMemsetAsync(peers.back()->get(), 0, size_t(cells_all) * kRank * 2, stream), "cudaMemsetAsync(peer)");
          rp.src[k] = peers.back()->get();
        }
        rp.dst = mine.get();
        rp.offset = 0;
        rp.count = cells * kRank;
        rp.n = N;
        rp.dtype = int(DataType::bf16);
        row.reduce_us = time_us(stream, o.warmup, o.runs, [&] { cuda_detail::launch_group_reduce(rp, stream); });
        row.reduce_gbps = double(cells) * kRank * 2 * (N + 1) / (row.reduce_us * 1e-6) / 1e9;

        // Merge (ii): packing per destination and the local combine of N received partials.
        const int64_t lse_off = (cells * kRank * 2 + 15) / 16 * 16, chunk = (lse_off + cells * 4 + 255) / 256 * 256;
        Buffer a2a(size_t(chunk) * N), recv(size_t(chunk) * N);
        check(cudaMemsetAsync(recv.get(), 0, size_t(chunk) * N, stream), "cudaMemsetAsync(recv)");
        row.pack_us = time_us(stream, o.warmup, o.runs, [&] {
          cuda_detail::launch_pack(
              cuda_detail::PackParams{hgp, out.as<bf16>(), lse.as<float>(), a2a.as<uint8_t>(), chunk, lse_off, kRank},
              stream);
        });
        row.combine_us = time_us(stream, o.warmup, o.runs, [&] {
          cuda_detail::launch_merge(
              cuda_detail::MergeParams{recv.as<bf16>(), reinterpret_cast<const float*>(recv.as<uint8_t>() + lse_off),
                                       chunk / 2, chunk / 4, N, cells, kRank, mine.as<bf16>(), out_lse.as<float>()},
              stream);
        });
        row.combine_gbps = (double(cells) * (kRank * 2 + 4) * (N + 1)) / (row.combine_us * 1e-6) / 1e9;
        row.traffic = dcp_traffic(N, rows_n, hl, kRank, DataType::bf16);
        row.q_bytes = cells * kDim * 2;
        check(cudaStreamSynchronize(stream), "cudaStreamSynchronize(bench)");
        rows.push_back(row);
      }
  return rows;
}

std::string format_dcp_bench_table(const std::vector<DcpBenchRow>& rows, const DcpBenchOptions& o) {
  std::string t = fmt::format(
      "DCP step, one GPU: batch {} x context {}, {} cache; each rank attends all N x H_local heads over its 1/N "
      "share.\n"
      "attn: per-rank attention (all head groups), median of {} runs; merge (i) = correction + reduce of N "
      "chunks, merge (ii) = pack + combine of N partials;\nsent: bytes one rank sends per step (q all-gather; "
      "merge (i) lse all-gather + bf16 reduce-scatter; merge (ii) all-to-all), (N-1) shares each.\n\n",
      o.batch, o.context, to_string(o.kv_dtype), o.runs);
  t += fmt::format("{:>3} {:>4} {:>2} {:>4} {:>2} {:>7} {:>9} {:>10} {:>6} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>10} {:>10} {:>10}\n",
                   "Hl", "qlen", "N", "H", "G", "local", "route", "attn us", "TB/s", "corr us", "red us", "pack us",
                   "comb us", "comb GB/s", "corr GB/s", "sent q KB", "sent (i)", "sent (ii)");
  for (const auto& r : rows)
    t += fmt::format("{:>3} {:>4} {:>2} {:>4} {:>2} {:>7} {:>9} {:>10.1f} {:>6.2f} {:>8.2f} {:>8.2f} {:>8.2f} {:>8.2f} {:>8.0f} "
                     "{:>8.0f} {:>10.1f} {:>10.1f} {:>10.1f}\n",
                     r.heads_local, r.qlen, r.world_size, r.heads_total, r.groups, r.local_tokens, r.route,
                     r.attention_us, r.attention_tbps, r.correct_us, r.reduce_us, r.pack_us, r.combine_us,
                     r.combine_gbps, r.correct_gbps, r.traffic.q_all_gather / 1024.0,
                     r.traffic.merge_total(DcpMerge::reduce_scatter) / 1024.0,
                     r.traffic.merge_total(DcpMerge::all_to_all) / 1024.0);
  t += "(sent columns in KiB)\n";
  return t;
}

std::string device_description(int device) {
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
  return fmt::format("{} ({} SMs)", prop.name, prop.multiProcessorCount);
}

}  // namespace dcpmla::bench
