// The GPU DCP step driven end to end for tests: a global batch (q of all H = N x H_local
// heads, latents of every position), N ranks as threads on one GPU (DeviceGroup), each with
// its cache poisoned with NaN, its prefix written, then DcpStep::plan + run (the step writes
// the new tokens itself). Results are gathered back into the global [B, qlen, H, R] layout
// and compared with the CPU path (mla_attention, one rank = DCP1).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "cuda_helpers.h"
#include "scenario.h"  // test_tuning()
#include "dcpmla/comm_device.h"
#include "dcpmla/dcp.h"
#include "dcpmla/layout.h"
#include "dcpmla/runner.h"

namespace dcpmla::testing {

constexpr int kD = 576, kR = 512;

// The ranks' streams are non-blocking: they do not wait for the legacy default stream, where
// DeviceBuffer's own upload / poison go (a pageable upload may even return before its copy
// lands). Inside rank threads, copy and poison on the rank's stream instead.
template <class T>
void upload_on(const DeviceBuffer<T>& b, const std::vector<T>& host, cudaStream_t s) {
  cuda_ok(cudaMemcpyAsync(b.get(), host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice, s), "upload");
  cuda_ok(cudaStreamSynchronize(s), "upload");
}
template <class T>
void poison_on(const DeviceBuffer<T>& b, cudaStream_t s) {
  cuda_ok(cudaMemsetAsync(b.get(), 0xff, b.size() * sizeof(T), s), "poison");
}

// Eager module loading and a hardware queue per stream for the tests (set before the first
// CUDA call; the environment wins). The library preloads its kernels itself (DcpStep), and
// the CTest test dcp_lazy_module_loading runs with CUDA_MODULE_LOADING=LAZY to check that.
inline const bool kCudaTestEnv = [] {
  setenv("CUDA_MODULE_LOADING", "EAGER", 0);
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);
  return true;
}();

// Ranks as threads on GPU 0; a peer that does not arrive fails the test after 10 s.
inline void run_ranks_on_gpu(int world, const std::function<void(int, DeviceCommunicator&)>& fn) {
  run_device_ranks(world, 0, fn, std::chrono::seconds(10));
}

struct DcpCase {
  std::string name;
  int world = 2;
  Mode mode = Mode::verify;
  KvDtype dtype = KvDtype::bf16;
  float kv_scale = 1.0f;
  int interleave = 1;
  int block_size = 16;
  Route route = Route::automatic;
  DcpMerge merge = DcpMerge::reduce_scatter;
  DataType reduce = DataType::bf16;
  int heads_local = 8;
  int qlen = 1;
  std::vector<int32_t> lens;
  uint64_t seed = 1;

  std::string describe() const {
    std::ostringstream s;
    s << name << ": N " << world << ", " << to_string(mode) << ", " << to_string(dtype) << ", I " << interleave
      << ", block " << block_size << ", route " << to_string(route) << ", merge " << to_string(merge)
      << (reduce == DataType::f32 ? " (f32)" : "") << ", Hl " << heads_local << ", qlen " << qlen << ", lens [";
    for (size_t i = 0; i < lens.size(); ++i) s << (i ? " " : "") << lens[i];
    s << "]";
    return s.str();
  }
};

// One batch in global terms (every rank sees the same arrays).
struct GlobalBatch {
  int B = 0, qlen = 1, H = 0;
  int64_t Lmax = 1;
  std::vector<int32_t> lens;
  std::vector<float> qf, kvf;  // bf16-representable floats: [B, qlen, H, D], [B, Lmax, D]
  std::vector<bf16> q16, kv16;
};

inline GlobalBatch make_global(const std::vector<int32_t>& lens, int qlen, int H, uint64_t seed) {
  GlobalBatch g;
  g.B = int(lens.size());
  g.qlen = qlen;
  g.H = H;
  g.lens = lens;
  for (int32_t L : lens) g.Lmax = std::max<int64_t>(g.Lmax, L);
  g.q16 = random_bf16(size_t(g.B) * qlen * H * kD, seed * 13 + 1);
  g.kv16 = random_bf16(size_t(g.B) * size_t(g.Lmax) * kD, seed * 13 + 2);
  g.qf.resize(g.q16.size());
  g.kvf.resize(g.kv16.size());
  std::transform(g.q16.begin(), g.q16.end(), g.qf.begin(), bf16_to_float);
  std::transform(g.kv16.begin(), g.kv16.end(), g.kvf.begin(), bf16_to_float);
  return g;
}

struct Result {
  std::vector<bf16> out;   // [B, qlen, H, R]
  std::vector<float> lse;  // [B, qlen, H]
  Route route = Route::automatic;
  int64_t cache_mismatch = 0;  // bytes that differ from the CPU write path, all ranks
};

// The CPU path on one rank (DCP1): the reference every GPU result must equal.
// Heads are independent, so a group of more heads than the CPU backend takes (a DCP step
// beyond one launch's max_heads) is computed in slices of at most max_heads(cpu).
inline Result cpu_reference(const GlobalBatch& g, const DcpCase& c) {
  AttentionOptions o;
  o.mode = c.mode;
  o.world_size = 1;
  o.kv_dtype = c.dtype;
  o.kv_scale = c.kv_scale;
  o.block_size = c.block_size;
  o.seed = c.seed;
  const size_t rows = size_t(g.B) * size_t(g.qlen), H = size_t(g.H);
  Result res;
  res.out.resize(rows * H * kR);
  res.lse.resize(rows * H);
  const size_t most = size_t(max_heads(Backend::cpu));
  for (size_t h0 = 0; h0 < H; h0 += most) {
    const size_t hn = std::min(most, H - h0);
    std::vector<float> q(rows * hn * kD);
    for (size_t r = 0; r < rows; ++r)
      std::copy_n(g.qf.begin() + ptrdiff_t((r * H + h0) * kD), hn * kD, q.begin() + ptrdiff_t(r * hn * kD));
    const AttentionResult a = mla_attention(q, g.kvf, g.lens, g.B, g.qlen, int(hn), g.Lmax, kD, o);
    for (size_t r = 0; r < rows; ++r)
      for (size_t h = 0; h < hn; ++h) {
        res.lse[r * H + h0 + h] = a.lse[r * hn + h];
        std::transform(a.out.begin() + ptrdiff_t((r * hn + h) * kR), a.out.begin() + ptrdiff_t((r * hn + h + 1) * kR),
                       res.out.begin() + ptrdiff_t((r * H + h0 + h) * kR), float_to_bf16);
      }
    res.route = a.routes.at(0);
  }
  return res;
}

// Shared block tables for the given batches over one cache per rank: blocks of a random
// permutation, unused entries naming the poisoned spare (the last block).
struct Tables {
  int64_t num_blocks = 1, max_local = 1;
  std::vector<std::vector<int32_t>> tables;  // per batch [B, width]
  std::vector<int> widths;
};

inline Tables make_tables(const DcpCase& c, const std::vector<const GlobalBatch*>& batches) {
  Tables t;
  const Layout group{c.world, 0, c.interleave};
  int64_t total = 0;
  for (const auto* g : batches)
    for (int32_t L : g->lens) {
      total += (group.local_length_of(L, 0) + c.block_size - 1) / c.block_size;
      t.max_local = std::max<int64_t>(t.max_local, group.local_length_of(L, 0));
    }
  t.num_blocks = total + 1;
  std::vector<int32_t> ids(static_cast<size_t>(total));
  std::iota(ids.begin(), ids.end(), 0);
  std::mt19937_64 rng(c.seed * 31 + 7);
  std::shuffle(ids.begin(), ids.end(), rng);
  size_t next = 0;
  for (const auto* g : batches) {
    int width = 1;
    for (int32_t L : g->lens)
      width = std::max<int>(width, int((group.local_length_of(L, 0) + c.block_size - 1) / c.block_size));
    std::vector<int32_t> tab(size_t(g->B) * width, int32_t(t.num_blocks - 1));
    for (int b = 0; b < g->B; ++b) {
      const int64_t need = (group.local_length_of(g->lens[size_t(b)], 0) + c.block_size - 1) / c.block_size;
      for (int64_t j = 0; j < need; ++j) tab[size_t(b) * width + size_t(j)] = ids[next++];
    }
    t.tables.push_back(std::move(tab));
    t.widths.push_back(width);
  }
  return t;
}

// One rank's inputs for a batch: q of its heads and the new tokens' latents, laid out at
// the step's row capacity; plus the prefix tokens it must write beforehand.
struct RankInputs {
  std::vector<bf16> q_local, new_latents;
  std::vector<int64_t> prefix_positions;
  std::vector<int32_t> prefix_requests;
  std::vector<bf16> prefix_latents;
  std::vector<int64_t> block_positions;
  std::vector<int32_t> block_requests;
};

inline RankInputs rank_inputs(const GlobalBatch& g, int rank, int hl, int64_t row_capacity) {
  RankInputs in;
  in.q_local.assign(size_t(row_capacity) * hl * kD, bf16{});
  in.new_latents.assign(size_t(row_capacity) * kD, bf16{});
  for (int b = 0; b < g.B; ++b)
    for (int t = 0; t < g.qlen; ++t) {
      const size_t row = size_t(b) * g.qlen + size_t(t);
      const bf16* src = g.q16.data() + (row * g.H + size_t(rank) * hl) * kD;
      std::copy(src, src + size_t(hl) * kD, in.q_local.begin() + ptrdiff_t(row * hl * kD));
    }
  for (int b = 0; b < g.B; ++b) {
    const int32_t L = g.lens[size_t(b)];
    for (int32_t p = 0; p < L; ++p) {
      const bf16* lat = g.kv16.data() + (size_t(b) * size_t(g.Lmax) + size_t(p)) * kD;
      if (p < L - g.qlen) {
        in.prefix_positions.push_back(p);
        in.prefix_requests.push_back(b);
        in.prefix_latents.insert(in.prefix_latents.end(), lat, lat + kD);
      } else {
        const size_t row = size_t(b) * g.qlen + size_t(p - (L - g.qlen));
        std::copy(lat, lat + kD, in.new_latents.begin() + ptrdiff_t(row * kD));
        in.block_positions.push_back(p);
        in.block_requests.push_back(b);
      }
    }
  }
  return in;
}

inline DcpConfig step_config(const DcpCase& c, const Tables& t, int max_batch, int max_qlen) {
  DcpConfig cfg;
  cfg.world_size = c.world;
  cfg.kv_dtype = c.dtype;
  cfg.heads_local = c.heads_local;
  cfg.interleave = c.interleave;
  cfg.block_size = c.block_size;
  cfg.route = c.route;
  cfg.check_agreement = true;
  cfg.limits = PlanLimits{max_batch, max_qlen, t.max_local};
  cfg.min_segment_tokens = 16;  // several split-K segments on short rows
  cfg.merge = c.merge;
  cfg.reduce_dtype = c.reduce;
  cfg.tuning = test_tuning();
  return cfg;
}

// Places rank r's [rows, Hl, R] into the global [B, qlen, H, R] result.
inline void scatter_heads(Result& res, const GlobalBatch& g, int rank, int hl, const std::vector<bf16>& out,
                          const std::vector<float>& lse) {
  const int64_t rows = int64_t(g.B) * g.qlen;
  for (int64_t row = 0; row < rows; ++row)
    for (int h = 0; h < hl; ++h) {
      const int64_t dst = row * g.H + int64_t(rank) * hl + h, src = row * hl + h;
      res.lse[size_t(dst)] = lse[size_t(src)];
      std::copy_n(out.begin() + src * kR, kR, res.out.begin() + dst * kR);
    }
}

// The CPU write path of one rank (poison, prefix, block), for the byte comparison.
inline std::vector<uint8_t> cpu_cache(const DcpCase& c, const Tables& t, const GlobalBatch& g, size_t which,
                                      int rank, const RankInputs& in, std::vector<uint8_t>* poisoned) {
  PagedCache cpu(CacheConfig{t.num_blocks, c.block_size, kD, c.dtype, c.kv_scale});
  cpu.poison();
  const Layout layout{c.world, rank, c.interleave};
  const auto* data = static_cast<const uint8_t*>(cpu.view().data);
  const size_t bytes = size_t(cpu.config().bytes());
  if (poisoned) poisoned->assign(data, data + bytes);
  const BatchDesc desc{g.lens, g.qlen, t.tables[which], t.widths[which], c.mode};
  cpu.write(in.prefix_latents,
            slots_of(in.prefix_positions, in.prefix_requests, desc, c.block_size, t.num_blocks, layout));
  std::vector<bf16> block;
  for (size_t k = 0; k < in.block_positions.size(); ++k) {
    const int b = in.block_requests[k];
    const int64_t p = in.block_positions[k];
    const bf16* lat = g.kv16.data() + (size_t(b) * size_t(g.Lmax) + size_t(p)) * kD;
    block.insert(block.end(), lat, lat + kD);
  }
  cpu.write(block, slots_of(in.block_positions, in.block_requests, desc, c.block_size, t.num_blocks, layout));
  return std::vector<uint8_t>(data, data + bytes);
}

// The whole GPU DCP step for one batch on c.world ranks (threads on one GPU).
inline Result run_gpu(const DcpCase& c, const GlobalBatch& g) {
  const Tables t = make_tables(c, {&g});
  Result res;
  res.out.assign(size_t(g.B) * g.qlen * g.H * kR, bf16{});
  res.lse.assign(size_t(g.B) * g.qlen * g.H, 0.0f);
  std::mutex mutex;
  run_ranks_on_gpu(c.world, [&](int rank, DeviceCommunicator& comm) {
    cudaStream_t stream = comm.stream();
    DcpStep step(step_config(c, t, g.B, g.qlen), comm);
    const RankInputs in = rank_inputs(g, rank, c.heads_local, step.row_capacity());
    const std::vector<uint8_t> expect_cache = cpu_cache(c, t, g, 0, rank, in, nullptr);
    // This rank's cache shard, owned here as an engine owns it, poisoned, with the prefix
    // written by the device slot mapping and write path.
    DeviceCache cache(t.num_blocks, c.block_size, c.dtype, stream);
    const BatchDesc desc{g.lens, g.qlen, t.tables[0], t.widths[0], c.mode};
    device_write(in.prefix_positions, in.prefix_requests, in.prefix_latents, desc, Layout{c.world, rank, c.interleave},
                 cache, c.kv_scale, stream);
    step.plan(desc);
    DeviceBuffer<bf16> q(in.q_local.size()), lat(in.new_latents.size());
    upload_on(q, in.q_local, stream);
    upload_on(lat, in.new_latents, stream);
    DeviceBuffer<bf16> out(size_t(step.row_capacity()) * c.heads_local * kR);
    DeviceBuffer<float> lse(size_t(step.row_capacity()) * c.heads_local);
    poison_on(out, stream);
    poison_on(lse, stream);
    step.run(q.get(), lat.get(), cache.view, KvScale{c.kv_scale}, out.get(), lse.get());
    comm.synchronize();
    std::vector<bf16> o = out.download();
    std::vector<float> l = lse.download();
    const std::vector<uint8_t> bytes = cache.bytes.download();
    int64_t mismatch = 0;
    for (size_t i = 0; i < bytes.size(); ++i) mismatch += bytes[i] != expect_cache[i];
    std::lock_guard lock(mutex);
    scatter_heads(res, g, rank, c.heads_local, o, l);
    res.route = step.attention().current_plan().route();
    res.cache_mismatch += mismatch;
  });
  return res;
}

inline void expect_close(const Result& got, const Result& ref, const GlobalBatch& g, const std::string& what) {
  const Comparison cmp = compare_rows(got.out, got.lse, ref.out, ref.lse, kR, g.qlen, g.H);
  EXPECT_EQ(cmp.nan_count, 0) << what;
  EXPECT_EQ(cmp.nonzero_empty, 0) << what;
  EXPECT_EQ(cmp.bad_rows, 0) << what << ": max rel_l2 " << cmp.max_rel_l2 << ", lse err " << cmp.max_lse_err
                             << " | worst " << cmp.worst;
}

}  // namespace dcpmla::testing
