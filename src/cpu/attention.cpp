// CPU kernels: the reference every backend is checked against, and the default that runs
// anywhere. Same numerics as the GPU: bf16 q, dequantised kv, float32 scores and
// accumulators, base-2 online softmax, bf16 output, natural-log lse.
#include "dcpmla/attention.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <optional>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "dcpmla/error.h"
#include "dcpmla/merge.h"
#include "parallel.h"

namespace dcpmla {
namespace {

constexpr int kTokensPerChunk = 64;
// A task is one work item's heads [h0, h0 + kHeadsPerTask) at query positions
// [t0, t0 + kPositionsPerTask): its scratch is bounded whatever the qlen.
constexpr int kHeadsPerTask = 16;
constexpr int kPositionsPerTask = 16;

// Eight independent sums so the compiler vectorises without reassociating.
float dot(const float* a, const float* b, int n) {
  float s[8] = {};
  int j = 0;
  for (; j + 8 <= n; j += 8)
    for (int k = 0; k < 8; ++k) s[k] += a[j + k] * b[j + k];
  for (; j < n; ++j) s[0] += a[j] * b[j];
  return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
}

struct Dequantizer {
  KvDtype dtype;
  float scale;
  std::array<float, 256> table{};

  Dequantizer(KvDtype d, float s) : dtype(d), scale(s) {
    if (d != KvDtype::bf16)
      for (int v = 0; v < 256; ++v) table[size_t(v)] = fp8_to_float(uint8_t(v), d) * s;
  }
  void row(const uint8_t* src, int dim, float* dst) const {
    if (dtype == KvDtype::bf16) {
      const auto* h = reinterpret_cast<const bf16*>(src);
      for (int j = 0; j < dim; ++j) dst[j] = bf16_to_float(h[j]);
    } else {
      for (int j = 0; j < dim; ++j) dst[j] = table[src[j]];
    }
  }
};

// Running base-2 softmax state of one (row, head): m = max of s*log2(e), l = sum 2^(s*log2e - m).
struct RowState {
  float m = kNegInf;
  float l = 0.0f;
};

// Attention of heads [h0, h1) at query positions [t0, t1) of request b over local tokens
// [tok_begin, tok_end) of the sharded cache, each row masked at its own local length. Leaves
// (acc, state) per (t - t0, h).
void attend_range(const AttentionParams& p, const Dequantizer& deq, int b, int h0, int h1, int t0, int t1,
                  int64_t tok_begin, int64_t tok_end, std::vector<float>& acc, std::vector<RowState>& state) {
  const PlanView& plan = p.plan;
  const int q0 = plan.q_start[b] + t0, qlen = t1 - t0, page = plan.header->page;
  const int D = p.dim, R = p.rank_dim, nh = h1 - h0;
  const int64_t row_bytes = int64_t(D) * bytes_per_value(p.kv_dtype);
  const int32_t* lens = plan.row_local_len + q0;
  const int32_t* subpages = plan.subpage_table + int64_t(b) * plan.header->table_stride;

  std::vector<float> qf(size_t(qlen) * nh * D);
  for (int t = 0; t < qlen; ++t)
    for (int h = h0; h < h1; ++h) {
      const bf16* src = p.q + ((int64_t(q0) + t) * p.heads + h) * D;
      float* dst = qf.data() + (size_t(t) * nh + size_t(h - h0)) * D;
      for (int j = 0; j < D; ++j) dst[j] = bf16_to_float(src[j]);
    }
  // [tok_begin, tok_end) ends at or before the longest row (WorkItem): nothing past it is read.
  acc.assign(size_t(qlen) * nh * R, 0.0f);
  state.assign(size_t(qlen) * nh, RowState{});

  std::vector<float> kbuf(size_t(kTokensPerChunk) * D);
  std::array<float, kTokensPerChunk> s{};
  for (int64_t c0 = tok_begin; c0 < tok_end; c0 += kTokensPerChunk) {
    const int n = int(std::min<int64_t>(kTokensPerChunk, tok_end - c0));
    for (int j = 0; j < n; ++j) {
      const int64_t i = c0 + j;
      const int64_t slot = int64_t(subpages[i / page]) * page + i % page;
      deq.row(p.kv + slot * row_bytes, D, kbuf.data() + size_t(j) * D);
    }
    for (int t = 0; t < qlen; ++t) {
      const int valid = int(std::clamp<int64_t>(lens[t] - c0, 0, n));
      if (valid == 0) continue;
      for (int hh = 0; hh < nh; ++hh) {
        const float* q = qf.data() + (size_t(t) * nh + size_t(hh)) * D;
        float chunk_max = kNegInf;
        for (int j = 0; j < valid; ++j) {
          s[size_t(j)] = dot(q, kbuf.data() + size_t(j) * D, D) * p.softmax_scale * kLog2e;
          chunk_max = std::max(chunk_max, s[size_t(j)]);
        }
        RowState& st = state[size_t(t) * nh + size_t(hh)];
        float* a = acc.data() + (size_t(t) * nh + size_t(hh)) * R;
        const float m_new = std::max(st.m, chunk_max);
        const float alpha = std::exp2(st.m - m_new);  // 0 when st.m = -inf
        if (alpha != 1.0f) {
          for (int r = 0; r < R; ++r) a[r] *= alpha;
          st.l *= alpha;
        }
        for (int j = 0; j < valid; ++j) {
          const float w = std::exp2(s[size_t(j)] - m_new);
          st.l += w;
          const float* v = kbuf.data() + size_t(j) * D;
          for (int r = 0; r < R; ++r) a[r] += w * v[r];
        }
        st.m = m_new;
      }
    }
  }
}

}  // namespace

int64_t cpu_attention_scratch_bytes(const LatentDims& dims) {
  const int64_t D = dims.dim(), rows = int64_t(kHeadsPerTask) * kPositionsPerTask;
  // attend_range's keys, q rows, accumulators and row states; the merge's one row.
  return 4 * (kTokensPerChunk * D + rows * D + rows * dims.kv_lora_rank + 2 * rows + dims.kv_lora_rank);
}

int64_t split_workspace_floats(const Planner& planner) {
  if (!planner.may_cut()) return 0;
  const auto& c = planner.config();
  return split_workspace_floats(planner.work_capacity(), c.limits.max_qlen, c.heads, c.dims.kv_lora_rank);
}

int64_t split_workspace_floats(int64_t work_capacity, int max_qlen, int heads, int rank_dim) {
  const auto refuse = [&](std::string_view expected) {
    fail("split-K workspace", fmt::format("{} x {} x {} x ({} + 2) floats", work_capacity, max_qlen, heads, rank_dim),
         expected);
  };
  // (A negative rank_dim gave a wrong count: -2 made 0 floats.)
  if (work_capacity < 1 || max_qlen < 1 || heads < 1 || rank_dim < 1)
    refuse("work_capacity, max_qlen, heads and rank_dim >= 1");
  const auto floats = checked_product({work_capacity, max_qlen, heads, int64_t(rank_dim) + 2});
  if (!floats) refuse("a count that fits int64 (lower heads, kv_lora_rank or the limits)");
  return *floats;
}

AttentionParams attention_params(const PlannerConfig& c, const bf16* q, const uint8_t* kv, const KvScale& kv_scale,
                                 float softmax_scale, const PlanView& plan, float* workspace, bf16* out,
                                 float* lse) {
  const int R = c.dims.kv_lora_rank;
  const int64_t parts = int64_t(plan.work_capacity) * plan.max_qlen * c.heads;
  // No workspace (a planner that never cuts): no partials, and no offsets from a null pointer.
  float* part_m = workspace != nullptr ? workspace + parts * R : nullptr;
  float* part_l = workspace != nullptr ? workspace + parts * (R + 1) : nullptr;
  return AttentionParams{q,   kv,   c.kv_dtype, kv_scale.value, kv_scale.device, softmax_scale, c.heads,
                         c.dims.dim(), R, plan, out, lse, workspace, part_m, part_l, nullptr};
}

void validate_attention_params(const AttentionParams& p) {
  const PlanView& v = p.plan;
  require(v.header != nullptr && v.row_local_len != nullptr && v.q_start != nullptr && v.subpage_table != nullptr &&
              v.work != nullptr && v.chunk_work != nullptr && v.split_request != nullptr && v.split_slot != nullptr,
          "plan", "a view with null buffers", "a view over a copy of a plan (Plan::view_at)");
  // Arrays of int32 (the header and work items too), read whole (the CUDA kernels also by 4-byte
  // cp.async): a view Plan::view_at did not make may point anywhere.
  static_assert(alignof(PlanHeader) == 4 && alignof(WorkItem) == 4);
  for (const auto& [field, at] : {std::pair<std::string_view, const void*>{"plan.header", v.header},
                                  {"plan.row_local_len", v.row_local_len},
                                  {"plan.q_start", v.q_start},
                                  {"plan.subpage_table", v.subpage_table},
                                  {"plan.work", v.work},
                                  {"plan.chunk_work", v.chunk_work},
                                  {"plan.split_request", v.split_request},
                                  {"plan.split_slot", v.split_slot}})
    require_aligned(at, 4, field, "4-byte aligned memory (the plan's int32 arrays)");
  // Every run passes here: messages are formatted only on failure.
  require_kv_scale(p.kv_scale, p.kv_dtype);  // the dtype too
  if (p.heads < 1) fail("heads", p.heads, ">= 1");
  if (p.rank_dim < 1) fail("rank_dim", p.rank_dim, ">= 1");
  if (p.dim <= p.rank_dim) fail("dim", p.dim, fmt::format("> rank_dim ({}): D = R + the rope part", p.rank_dim));
  require_softmax_scale(p.softmax_scale);
  if (v.max_qlen < 1 || v.max_batch < 1 || v.work_capacity < 1 || v.chunk_capacity < 1)
    fail("plan capacities",
         fmt::format("max_batch {}, max_qlen {}, work_capacity {}, chunk_capacity {}", v.max_batch, v.max_qlen,
                     v.work_capacity, v.chunk_capacity),
         ">= 1 each");
}

void attention_cpu(const AttentionParams& p) {
  validate_attention_params(p);
  const PlanView& plan = p.plan;
  const PlanHeader& h = *plan.header;
  if (p.kv_scale_dev != nullptr) fail("kv_scale_dev", "a device pointer", "null on the cpu backend (a host kv_scale)");
  if (h.rows > 0 && (p.q == nullptr || p.kv == nullptr || p.out == nullptr || p.lse == nullptr))
    fail(p.q == nullptr ? "q" : p.kv == nullptr ? "kv" : p.out == nullptr ? "out" : "lse", "null", "a host pointer");
  if (h.split_requests > 0 && (p.part_o == nullptr || p.part_m == nullptr || p.part_l == nullptr))
    fail("part_o/part_m/part_l", "null", "a split-K workspace (split_workspace_floats floats): the plan cut a request");
  // Whole values (the kernels read no wider); an fp8 cache's values are bytes.
  for (const auto& [field, at, align] : {std::tuple<std::string_view, const void*, size_t>{"q", p.q, 2},
                                         {"kv", p.kv, size_t(bytes_per_value(p.kv_dtype))},
                                         {"out", p.out, 2},
                                         {"lse", p.lse, 4},
                                         {"part_o", p.part_o, 4},
                                         {"part_m", p.part_m, 4},
                                         {"part_l", p.part_l, 4}})
    require_aligned(at, align, field, "memory aligned to whole values (2 bytes a bf16, 4 a float32)");
  // The outputs apart from q, each other and the partials (sized by the plan's rows and its
  // capacities; the cache's extent is not known here: the engine's run checks it).
  const int64_t cells = int64_t(h.rows) * p.heads;
  const int64_t parts = int64_t(plan.work_capacity) * plan.max_qlen * p.heads;
  require_disjoint({{"out", p.out, cells * p.rank_dim * 2}, {"lse", p.lse, cells * 4}},
                   {{"q", p.q, cells * p.dim * 2},
                    {"part_o", p.part_o, p.part_o != nullptr ? parts * p.rank_dim * 4 : 0},
                    {"part_m", p.part_m, p.part_m != nullptr ? parts * 4 : 0},
                    {"part_l", p.part_l, p.part_l != nullptr ? parts * 4 : 0}});
  const int R = p.rank_dim, H = p.heads;
  const int64_t slot_rows = int64_t(h.qlen) * H;  // rows of one partial slot
  const Dequantizer deq(p.kv_dtype, p.kv_scale);
  const int head_blocks = (H + kHeadsPerTask - 1) / kHeadsPerTask;
  const int position_blocks = (h.qlen + kPositionsPerTask - 1) / kPositionsPerTask;
  const int64_t tasks = int64_t(h.work_count) * position_blocks * head_blocks;

  // The pieces in any order (the chunks exist for the GPU's CTAs): a whole request writes
  // out and lse, a piece of a cut request its partial slot.
  detail::parallel_for(tasks, detail::Schedule::dynamic, [&](int64_t task) {
    const WorkItem item = plan.work[task / (int64_t(position_blocks) * head_blocks)];
    const int b = item.request, q0 = plan.q_start[b], qlen = plan.q_start[b + 1] - q0;
    const int t0 = int(task / head_blocks % position_blocks) * kPositionsPerTask;
    if (t0 >= qlen) return;  // a request with fewer rows than the plan's qlen
    const int t1 = std::min(qlen, t0 + kPositionsPerTask);
    const int h0 = int(task % head_blocks) * kHeadsPerTask, h1 = std::min(H, h0 + kHeadsPerTask);
    std::vector<float> acc;
    std::vector<RowState> state;
    attend_range(p, deq, b, h0, h1, t0, t1, item.tok_begin, item.tok_end, acc, state);
    const int nh = h1 - h0;
    for (int t = t0; t < t1; ++t)
      for (int hh = 0; hh < nh; ++hh) {
        const RowState& st = state[size_t(t - t0) * nh + size_t(hh)];
        const float* a = acc.data() + (size_t(t - t0) * nh + size_t(hh)) * R;
        // l = 0 only when the row read no key. A NaN l (a NaN or inf in q or kv) stays NaN in
        // out and lse: an lse of -inf would read as an empty row that the merges drop.
        const float inv = st.l == 0.0f ? 0.0f : 1.0f / st.l;
        if (item.slot >= 0) {
          const int64_t row = item.slot * slot_rows + int64_t(t) * H + h0 + hh;
          float* o = p.part_o + row * R;
          for (int r = 0; r < R; ++r) o[r] = a[r] * inv;
          p.part_m[row] = st.m;
          p.part_l[row] = st.l;
        } else {
          const int64_t row = (int64_t(q0) + t) * H + h0 + hh;
          bf16* o = p.out + row * R;
          for (int r = 0; r < R; ++r) o[r] = float_to_bf16(a[r] * inv);
          p.lse[row] = st.l == 0.0f ? kNegInf : (st.m + std::log2(st.l)) * kLn2;
        }
      }
  });

  // Combine the pieces of each cut request.
  const int64_t rows = int64_t(h.split_requests) * slot_rows;
  detail::parallel_for(rows, detail::Schedule::even, [&](int64_t x) {
    const int i = int(x / slot_rows);
    const int64_t in_slot = x % slot_rows;
    const int b = plan.split_request[i];
    if (in_slot >= int64_t(plan.q_start[b + 1] - plan.q_start[b]) * H) return;
    const int first = plan.split_slot[i], pieces = plan.split_slot[i + 1] - first;
    const int64_t base = first * slot_rows + in_slot, row = int64_t(plan.q_start[b]) * H + in_slot;
    detail::merge_split_k_unchecked(p.part_o + base * R, p.part_m + base, p.part_l + base, pieces, slot_rows * R,
                                    slot_rows, R, p.out + row * R, p.lse + row);
  });
}

void block_attention_cpu(const BlockAttentionParams& p) {
  // Before the parallel loop: nothing may throw inside it.
  if (p.batch < 0) fail("batch", p.batch, ">= 0");
  if (p.qlen < 1) fail("qlen", p.qlen, ">= 1");
  if (p.q_heads < 1) fail("q_heads", p.q_heads, ">= 1");
  if (p.heads < 1) fail("heads", p.heads, ">= 1");
  if (p.head_begin < 0 || int64_t(p.head_begin) + p.heads > p.q_heads)
    fail("head_begin", p.head_begin, fmt::format("in [0, q_heads - heads] = [0, {}]", int64_t(p.q_heads) - p.heads));
  if (p.rank_dim < 1) fail("rank_dim", p.rank_dim, ">= 1");
  if (p.dim <= p.rank_dim) fail("dim", p.dim, fmt::format("> rank_dim ({}): D = R + the rope part", p.rank_dim));
  require_kv_scale(p.kv_scale, p.kv_dtype);
  require_softmax_scale(p.softmax_scale);
  if (p.batch > 0 &&
      (p.q == nullptr || p.block_kv == nullptr || p.seq_lens == nullptr || p.out == nullptr || p.lse == nullptr))
    fail("q/block_kv/seq_lens/out/lse", "null", "host pointers");
  require_value_aligned(p.q, "q");
  require_value_aligned(p.block_kv, "block_kv");
  require_value_aligned(p.seq_lens, "seq_lens");
  require_value_aligned(p.out, "out");
  require_value_aligned(p.lse, "lse");
  const int D = p.dim, R = p.rank_dim;
  for (int b = 0; b < p.batch; ++b)
    if (p.seq_lens[b] != 0 && p.seq_lens[b] < p.qlen)
      fail(fmt::format("seq_lens[{}]", b), p.seq_lens[b], fmt::format("0 (padding) or >= qlen ({})", p.qlen));
  // The outputs apart from the inputs (an out over q rewrote rows not yet read; an lse over
  // seq_lens rewrote the lengths). q's bytes bound every other extent (heads <= q_heads, R < D).
  const std::optional<int64_t> q_bytes = checked_product({p.batch, p.qlen, p.q_heads, D, 2});
  if (!q_bytes) fail("q", fmt::format("{} x {} x {} x {} values", p.batch, p.qlen, p.q_heads, D), "bytes that fit int64");
  const int64_t rows = int64_t(p.batch) * p.qlen * p.heads;
  require_disjoint({{"out", p.out, rows * R * 2}, {"lse", p.lse, rows * 4}},
                   {{"q", p.q, *q_bytes},
                    {"block_kv", p.block_kv, int64_t(p.batch) * p.qlen * D * 2},
                    {"seq_lens", p.seq_lens, int64_t(p.batch) * 4}});
  // Key i of request b as the cache would hold it, into k (D floats): each key is dequantised
  // where it is used, twice, so a row's scratch stays 2 D + qlen + R floats.
  const auto load_key = [&](int b, int i, std::vector<float>& k) {
    const bf16* ks = p.block_kv + (int64_t(b) * p.qlen + i) * D;
    for (int j = 0; j < D; ++j) k[size_t(j)] = quantize_roundtrip(bf16_to_float(ks[j]), p.kv_dtype, p.kv_scale);
  };
  detail::parallel_for(rows, detail::Schedule::even, [&](int64_t row) {
    const int b = int(row / (int64_t(p.qlen) * p.heads));
    const int t = int(row / p.heads % p.qlen);
    const int h = p.head_begin + int(row % p.heads);
    bf16* out = p.out + row * R;
    const int keys = p.seq_lens[b] == 0 ? 0 : t + 1;  // causal inside the block
    if (keys == 0) {
      std::fill(out, out + R, bf16{});
      p.lse[row] = kNegInf;
      return;
    }
    std::vector<float> q(static_cast<size_t>(D)), k(static_cast<size_t>(D)), s(static_cast<size_t>(keys)),
        acc(static_cast<size_t>(R), 0.0f);
    const bf16* qs = p.q + ((int64_t(b) * p.qlen + t) * p.q_heads + h) * D;
    for (int j = 0; j < D; ++j) q[size_t(j)] = bf16_to_float(qs[j]);
    float m = kNegInf;
    for (int i = 0; i < keys; ++i) {
      load_key(b, i, k);
      s[size_t(i)] = dot(q.data(), k.data(), D) * p.softmax_scale * kLog2e;
      m = std::max(m, s[size_t(i)]);
    }
    float l = 0.0f;
    for (int i = 0; i < keys; ++i) {
      const float w = std::exp2(s[size_t(i)] - m);
      l += w;
      load_key(b, i, k);
      for (int r = 0; r < R; ++r) acc[size_t(r)] += w * k[size_t(r)];
    }
    for (int r = 0; r < R; ++r) out[r] = float_to_bf16(acc[size_t(r)] / l);
    p.lse[row] = (m + std::log2(l)) * kLn2;
  });
}

}  // namespace dcpmla
