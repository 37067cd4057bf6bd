// The C++ engine loop (README.md, "C++"), built against the installed package by
// `make install-check`: what a serving engine does on every step, on the CPU backend.
// Two DCP ranks (processes or GPUs in a real engine; a loop here) each hold one Attention
// and, per layer, a KV cache the engine allocated. Per step: plan once on each rank; per
// layer: write the step's new latents on each rank (write_kv, with that rank's slot_mapping)
// and run, then merge the ranks' partials. Every layer of every step is checked against the
// float64 reference; exits 1 on a mismatch.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <random>
#include <span>
#include <vector>

#include <dcpmla/engine.h>
#include <dcpmla/error.h>
#include <dcpmla/merge.h>
#include <dcpmla/reference.h>

using dcpmla::bf16;

constexpr int kRanks = 2, kLayers = 3, kHeads = 16, kBlock = 64, kDim = 576, kRankDim = 512;
constexpr int kSteps = 3, kQlen = 2;  // speculative verify: 1 token + 1 draft per step

int main() {
  std::mt19937_64 rng(0);
  std::normal_distribution<float> normal;

  // The batch: prompts of these lengths (request 2 is CUDA-graph padding), each step adding
  // kQlen tokens. The engine's block manager gives every request its blocks up front here, in
  // any order: one table per request, shared by all ranks (each holds its share of a block).
  const std::vector<int32_t> prompt{300, 5, 0, 64};
  const int batch = int(prompt.size());
  const int64_t max_len = 300 + (kSteps - 1) * kQlen;
  const int64_t max_local = dcpmla::Layout{kRanks, 0, 1}.local_length_of(max_len, 0);  // rank 0's share
  const int width = int((max_local + kBlock - 1) / kBlock);
  const int64_t num_blocks = int64_t(batch) * width;
  std::vector<int32_t> tables(num_blocks);  // [batch, width]
  std::iota(tables.begin(), tables.end(), 0);
  std::shuffle(tables.begin(), tables.end(), rng);

  // Per rank: one Attention (it owns the plan and a workspace) and, per layer, the engine's
  // memory for a cache [num_blocks, block_size, D] in bf16 (16-byte aligned, as operator new gives).
  std::vector<dcpmla::Attention> attention;
  std::vector<std::vector<uint8_t>> memory;
  for (int r = 0; r < kRanks; ++r) {
    dcpmla::AttentionConfig config;
    config.heads = kHeads;  // all the group's heads (after the DCP head all-gather)
    config.kv_dtype = dcpmla::KvDtype::bf16;
    config.block_size = kBlock;
    config.layout = dcpmla::Layout{kRanks, r, 1};
    config.limits = dcpmla::PlanLimits{batch, kQlen, max_local};  // every step must fit them
    attention.emplace_back(config);
    for (int l = 0; l < kLayers; ++l) memory.emplace_back(num_blocks * kBlock * kDim * sizeof(bf16));
  }
  auto cache = [&](int r, int l) {
    return dcpmla::KvCache{memory[r * kLayers + l].data(), num_blocks, kBlock, kDim, dcpmla::KvDtype::bf16};
  };

  // What the model produces, kept whole for the reference: each layer's latents [B, max_len, D].
  std::vector<std::vector<float>> latents(kLayers, std::vector<float>(batch * max_len * kDim));
  for (auto& layer : latents)
    for (float& x : layer) x = normal(rng);

  const int64_t cells = int64_t(batch) * kQlen * kHeads;  // (request, query row, head)
  std::vector<int32_t> seq_lens(batch, 0);
  int failures = 0;
  for (int step = 0; step < kSteps; ++step) {
    // The step's lengths (incl. its query block) and new tokens: the whole prompt on the first
    // step (the prefill's writes), then the kQlen tokens being verified.
    std::vector<int64_t> positions;
    std::vector<int32_t> requests;
    for (int b = 0; b < batch; ++b) {
      const int32_t before = seq_lens[b];
      if (prompt[b] > 0) seq_lens[b] = step == 0 ? prompt[b] : before + kQlen;
      for (int64_t p = before; p < seq_lens[b]; ++p) {
        positions.push_back(p);
        requests.push_back(b);
      }
    }
    const int64_t n_new = int64_t(positions.size());
    const dcpmla::BatchDesc step_batch{seq_lens, kQlen, tables, width, dcpmla::Mode::verify};

    // Once per step on each rank: the plan, and the rank-local slots of the new tokens
    // (-1 where another rank owns the position).
    std::vector<std::vector<int64_t>> slots(kRanks);
    for (int r = 0; r < kRanks; ++r) {
      attention[r].plan(step_batch);
      for (int64_t k = 0; k < n_new; ++k) {
        const std::span<const int32_t> table(&tables[requests[k] * width], width);
        slots[r].push_back(dcpmla::slot_mapping({&positions[k], 1}, table, kBlock, num_blocks,
                                                dcpmla::Layout{kRanks, r, 1})[0]);
      }
    }

    for (int l = 0; l < kLayers; ++l) {
      // The layer's inputs: queries [B, qlen, H, D] and the new tokens' latents [n_new, D], bf16.
      std::vector<float> q(cells * kDim);
      for (float& x : q) x = normal(rng);
      std::vector<bf16> q16(q.size()), new_latents(n_new * kDim);
      std::transform(q.begin(), q.end(), q16.begin(), dcpmla::float_to_bf16);
      for (int64_t k = 0; k < n_new; ++k) {
        const float* src = &latents[l][(requests[k] * max_len + positions[k]) * kDim];
        std::transform(src, src + kDim, &new_latents[k * kDim], dcpmla::float_to_bf16);
      }

      // Each rank writes its new tokens into this layer's cache, then attends its shard.
      std::vector<bf16> part_out(kRanks * cells * kRankDim);
      std::vector<float> part_lse(kRanks * cells);
      for (int r = 0; r < kRanks; ++r) {
        dcpmla::write_kv(cache(r, l), new_latents.data(), slots[r].data(), n_new, /*kv_scale=*/1.0f);
        attention[r].run(q16.data(), cache(r, l), dcpmla::KvScale{1.0f}, &part_out[r * cells * kRankDim],
                         &part_lse[r * cells]);
      }
      // The cross-rank merge (in a real group, after an all-gather of the partials).
      std::vector<bf16> out(cells * kRankDim);
      std::vector<float> lse(cells);
      dcpmla::combine_partials(part_out.data(), part_lse.data(), kRanks, out.data(), lse.data(), cells, kRankDim);

      // The check: this layer's float64 reference over the global windows.
      std::vector<float> out_f(out.size());
      std::transform(out.begin(), out.end(), out_f.begin(), dcpmla::bf16_to_float);
      const auto ref = dcpmla::reference_attention(q, latents[l], seq_lens, batch, kQlen, kHeads, max_len, kDim,
                                                   dcpmla::Mode::verify, dcpmla::KvDtype::bf16, 1.0f,
                                                   1.0 / std::sqrt(double(kDim)), kRankDim);
      const auto err = dcpmla::compare(out_f, lse, ref.out, ref.lse, batch, kQlen, kHeads, kRankDim);
      if (!err.within(1e-2)) {
        std::fprintf(stderr, "step %d layer %d: relative L2 %.3g, lse error %.3g, %lld NaN\n", step, l,
                     err.max_rel_l2, err.max_lse_err, (long long)err.nan_count);
        ++failures;
      }
    }
  }

  // Bad input is refused before anything runs, with the field and value named.
  dcpmla::KvCache too_small = cache(0, 0);
  too_small.num_blocks = 1;
  std::vector<bf16> q16(cells * kDim), out(cells * kRankDim);
  std::vector<float> lse(cells);
  try {
    attention[0].run(q16.data(), too_small, dcpmla::KvScale{1.0f}, out.data(), lse.data());
    std::fprintf(stderr, "a cache too small for the tables was accepted\n");
    ++failures;
  } catch (const dcpmla::Error& e) {
    std::printf("refused as it should be: %s\n", e.what());
  }

  std::printf("install check: %s (%d steps x %d layers x %d ranks)\n", failures ? "FAILED" : "ok", kSteps, kLayers,
              kRanks);
  return failures ? 1 : 0;
}
