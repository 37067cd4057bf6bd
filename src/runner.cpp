#include "dcpmla/runner.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstring>
#include <numeric>
#include <optional>
#include <random>

#include <fmt/ranges.h>

#include "dcpmla/attention.h"
#include "dcpmla/error.h"
#include "dcpmla/merge.h"
#include "cpu/parallel.h"

namespace dcpmla {
namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

void merge_across_ranks(Communicator& comm, MergeForm form, const bf16* o, const float* lse,
                        int64_t rows, int heads, int width, bf16* out, float* out_lse) {
  const int n = comm.world_size();
  // Checked before the first collective; every rank gets the same arguments, so all fail alike.
  require_known("merge", form);
  if (rows < 0) fail("rows", rows, ">= 0");
  if (heads < 1) fail("heads", heads, ">= 1");
  if (width < 1) fail("width", width, ">= 1");
  // n x rows x heads x width values gathered: they must be addressable in int64.
  if (!checked_product({n, rows, heads, width, 4}))
    fail("rows", rows,
         fmt::format("world_size {} x rows x heads {} x width {} float32 values whose bytes fit int64", n, heads, width));
  if (form == MergeForm::scatter_heads && heads % n != 0)
    fail("heads", heads, fmt::format("a multiple of world_size ({}) for merge = scatter_heads", n));
  if (rows > 0 && (o == nullptr || lse == nullptr || out == nullptr || out_lse == nullptr))
    fail(o == nullptr ? "o" : lse == nullptr ? "lse" : out == nullptr ? "out" : "out_lse", "null", "a host pointer");
  require_value_aligned(o, "o");
  require_value_aligned(lse, "lse");
  require_value_aligned(out, "out");
  require_value_aligned(out_lse, "out_lse");
  const int64_t cells = rows * heads;  // (row, head) pairs
  const int64_t kept_cells = form == MergeForm::all_heads ? cells : cells / n;  // out's
  require_disjoint({{"out", out, kept_cells * width * 2}, {"out_lse", out_lse, kept_cells * 4}},
                   {{"o", o, cells * width * 2}, {"lse", lse, cells * 4}});
  std::vector<float> all_lse(size_t(n * cells));
  comm.all_gather(lse, all_lse.data(), size_t(cells), DataType::f32);
  if (form == MergeForm::all_heads) {
    std::vector<bf16> all_o(size_t(n * cells * width));
    comm.all_gather(o, all_o.data(), size_t(cells * width), DataType::bf16);
    combine_partials(all_o.data(), all_lse.data(), n, out, out_lse, cells, width);
    return;
  }
  // Scale this rank's partial by exp(lse_r - lse) and sum over ranks with a reduce-scatter
  // whose chunk k holds the heads rank k keeps, in float32.
  const int kept = heads / n, me = comm.rank();
  std::vector<float> chunks(size_t(cells * width));
  for (int64_t c = 0; c < cells; ++c) {
    const auto [m, sum] = lse_stats(n, [&](int k) { return all_lse[size_t(k * cells + c)]; });
    const float global = m == kNegInf ? kNegInf : m + std::log(sum);
    const float own = lse[c];
    // exp(own - m) / sum, not exp(own - global): at a large |lse| the log of the sum rounds
    // away in m + log(sum), and the weights summed to N instead of 1. An empty partial adds
    // nothing, whatever its out holds (SPEC §2: 0 x NaN would poison the row).
    const bool empty = m == kNegInf || own == kNegInf;
    const float scale = empty ? 0.0f : std::exp(own - m) / sum;
    const int64_t row = c / heads, h = c % heads, dest_rank = h / kept;
    float* dst = chunks.data() + ((dest_rank * rows + row) * kept + h % kept) * width;
    for (int j = 0; j < width; ++j) dst[j] = empty ? 0.0f : scale * bf16_to_float(o[c * width + j]);
    if (dest_rank == me) out_lse[row * kept + h % kept] = global;
  }
  std::vector<float> mine(size_t(rows * kept * width));
  comm.reduce_scatter_sum(chunks.data(), mine.data(), mine.size(), DataType::f32);
  for (size_t i = 0; i < mine.size(); ++i) out[i] = float_to_bf16(mine[i]);
}

void require_rank_cache(const AttentionConfig& config, const CacheConfig& cache) {
  config.dims.validate();
  require_cache_layout(config.kv_dtype, config.block_size, config.dims.dim(), cache.dtype, cache.block_size, cache.dim);
}

namespace {

class CpuRank final : public RankEngine {
 public:
  // The cache is checked against the configuration first: a write of another block size would put
  // tokens in the wrong slots before attend() refused the cache.
  CpuRank(const AttentionConfig& config, const CacheConfig& cache)
      : config_((require_rank_cache(config, cache), config)), cache_(cache), attention_(config) {}

  void poison() override { cache_.poison(); }
  void write(std::span<const bf16> latents, std::span<const int64_t> positions, std::span<const int32_t> requests,
             const BatchDesc& batch) override {
    cache_.write(latents, slots_of(positions, requests, batch, config_.block_size, cache_.config().num_blocks,
                                   config_.layout));
  }
  void plan(const BatchDesc& batch) override { attention_.plan(batch); }
  const Plan& current_plan() const override { return attention_.current_plan(); }
  void attend(const bf16* q, bf16* out, float* lse) override {
    attention_.run(q, cache_.view(), KvScale{cache_.config().scale}, out, lse);
  }

 private:
  AttentionConfig config_;
  PagedCache cache_;
  Attention attention_;
};

}  // namespace

std::vector<int64_t> slots_of(std::span<const int64_t> positions, std::span<const int32_t> requests,
                              const BatchDesc& batch, int block_size, int64_t num_blocks, const Layout& layout) {
  // Checked once, not per position: the layout (owner/local_index divide by N and I), the block
  // size and the tables' shape (the planner's rule), so that every subspan below is in bounds.
  layout.validate_with_block_size(block_size);
  if (num_blocks < 1) fail("num_blocks", num_blocks, ">= 1");
  validate_table_shape(batch);
  if (requests.size() != positions.size())
    fail("requests", requests.size(), fmt::format("one request index per position ({})", positions.size()));
  std::vector<int64_t> slots(positions.size());
  for (size_t n = 0; n < positions.size(); ++n) {
    const int32_t b = requests[n];
    if (b < 0 || size_t(b) >= batch.seq_lens.size())
      fail(fmt::format("requests[{}]", n), b, fmt::format("a request in [0, {})", batch.seq_lens.size()));
    const auto table = batch.table_of(size_t(b));
    // Per position: p >= 0, its block index within table_width, its block id in [0, num_blocks).
    slots[n] = detail::slot_of_validated(positions[n], table, block_size, num_blocks, layout, b);
  }
  return slots;
}

std::unique_ptr<RankEngine> make_cpu_rank(const AttentionConfig& config, const CacheConfig& cache) {
  return std::make_unique<CpuRank>(config, cache);
}

void check_ranks_agree(Communicator& comm, std::span<const int32_t> signature, std::string_view what) {
  const int n = comm.world_size();
  std::vector<int32_t> all(signature.size() * size_t(n));
  comm.all_gather(signature.data(), all.data(), signature.size(), DataType::i32);
  for (int r = 0; r < n; ++r)
    if (!std::equal(signature.begin(), signature.end(), all.begin() + ptrdiff_t(r * signature.size())))
      throw Error(fmt::format("dcpmla: field '{}' of rank {}: expected the same on every rank: rank {} has [{}], "
                              "rank {} has [{}]",
                              what, r, comm.rank(), fmt::join(signature, ", "), r,
                              fmt::join(all.begin() + ptrdiff_t(r * signature.size()),
                                        all.begin() + ptrdiff_t((r + 1) * signature.size()), ", ")));
}

void refuse_together(Communicator& comm, std::exception_ptr refused, std::string_view what) {
  const int n = comm.world_size();
  const int32_t mine = refused ? 1 : 0;
  std::vector<int32_t> all(static_cast<size_t>(n));
  try {
    comm.all_gather(&mine, all.data(), 1, DataType::i32);
  } catch (...) {
    // A peer that failed or never came: this rank's own error still names the field.
    if (refused) std::rethrow_exception(refused);
    throw;
  }
  if (refused) std::rethrow_exception(refused);
  std::vector<int> refusing;
  for (int r = 0; r < n; ++r)
    if (all[size_t(r)] != 0) refusing.push_back(r);
  if (!refusing.empty())
    throw Error(fmt::format("dcpmla: {}: refused by rank {} (its own error names the field), so rank {} refuses too",
                            what, fmt::join(refusing, ", "), comm.rank()));
}

namespace {

// The validated, bf16-rounded inputs of the conformance path with their block tables;
// identical on every rank (the tables come from options.seed).
struct Inputs {
  int batch, qlen, heads, dim;
  int64_t rows;    // query rows: batch x qlen, or sum(qlens)
  int64_t tokens;  // sum(seq_lens): the latents written
  int64_t max_len, longest, num_blocks, width;
  float softmax_scale;
  std::vector<int32_t> seq_lens, qlens;  // copies: what was checked is what is used
  std::vector<bf16> q16, kv16, latents;
  std::vector<int32_t> tables, requests;
  std::vector<int64_t> positions;
  Mode mode;
  BatchDesc desc() const { return BatchDesc{seq_lens, qlen, tables, int(width), mode, qlens}; }
};

// a x b x c as a count, or an error naming the field: the size checks of valid-looking
// arguments wrapped before (max_len 2^62 made kv's expected size 0, then a null read).
int64_t checked_count(std::string_view field, int64_t a, int64_t b, int64_t c) {
  const auto n = checked_product({a, b, c});
  if (!n) fail(field, fmt::format("{} x {} x {} values", a, b, c), "a size that fits int64");
  return *n;
}

// Validates the conformance path's arguments and sizes its inputs (rows, tokens, tables),
// allocating nothing: load() makes the copies once the memory check has passed.
Inputs prepare(uint64_t q_size, uint64_t kv_size, std::span<const int32_t> seq_lens_in, int batch,
               int qlen, int heads, int64_t max_len, int dim, const AttentionOptions& o,
               const RankEngineFactory& engines) {
  require(o.backend == Backend::cpu || bool(engines), "device", to_string(o.backend),
          "cpu: the default engines are the CPU kernels (the CUDA backend passes its own)");
  require(batch >= 1, "batch", batch, ">= 1");
  require(qlen >= 1 && qlen <= kMaxQlen, "qlen", qlen, fmt::format("in [1, {}]", kMaxQlen));
  require(heads >= 1, "heads", heads, ">= 1");
  // The planner checks these too, but only once every rank's cache is allocated and written.
  require_known("mode", o.mode);
  if (o.mode == Mode::decode && qlen != 1) fail("qlen", qlen, "1 in decode mode");
  require_known("route", o.route);
  if (o.route == Route::two_stage && o.mode != Mode::verify)
    fail("route", "two_stage", fmt::format("a route that serves mode {} (two_stage is verify-only)", to_string(o.mode)));
  require_known("kv_dtype", o.kv_dtype);
  require(max_len >= 0, "max_len", max_len, ">= 0");
  require(o.kv_lora_rank >= 1 && o.kv_lora_rank < dim, "kv_lora_rank", o.kv_lora_rank,
          fmt::format("in [1, D) with D = {}", dim));
  // Copies, read from here on: the caller's arrays may change under a call made without the
  // GIL (another Python thread writing them), and the lengths that were checked must be the
  // ones that size and fill the tables.
  std::vector<int32_t> qlens(o.qlens.begin(), o.qlens.end());
  require(qlens.empty() || qlens.size() == size_t(batch), "qlens", fmt::format("{} entries", qlens.size()),
          fmt::format("none or batch = {}", batch));
  int64_t rows = int64_t(batch) * qlen;
  if (!qlens.empty()) {
    rows = 0;
    for (int b = 0; b < batch; ++b) {
      require(qlens[size_t(b)] >= 0 && qlens[size_t(b)] <= qlen, fmt::format("qlens[{}]", b), qlens[size_t(b)],
              fmt::format("in [0, qlen ({})]", qlen));
      rows += qlens[size_t(b)];
    }
  }
  require(dim >= 2, "dim", dim, ">= 2 (kv_lora_rank + rope_dim)");
  const int64_t q_values = checked_count("q", rows, heads, dim), kv_values = checked_count("kv", batch, max_len, dim);
  require(q_size == uint64_t(q_values), "q", fmt::format("{} values", q_size),
          fmt::format("{} x heads x D = {}", qlens.empty() ? "batch x qlen" : "sum(qlens)", q_values));
  require(kv_size == uint64_t(kv_values), "kv", fmt::format("{} values", kv_size),
          fmt::format("batch x max_len x D = {}", kv_values));
  require(seq_lens_in.size() == size_t(batch), "seq_lens", fmt::format("{} entries", seq_lens_in.size()),
          fmt::format("batch = {}", batch));
  std::vector<int32_t> seq_lens(seq_lens_in.begin(), seq_lens_in.end());
  for (int b = 0; b < batch; ++b) {
    validate_seq_len(o.mode, seq_lens[size_t(b)], qlens.empty() ? qlen : qlens[size_t(b)], b);
    require(seq_lens[size_t(b)] <= max_len, fmt::format("seq_lens[{}]", b), seq_lens[size_t(b)],
            fmt::format("<= kv's length axis ({})", max_len));
  }
  const Layout group{o.world_size, 0, o.interleave};
  group.validate_with_block_size(o.block_size);
  require_known("merge", o.merge);
  if (o.merge == MergeForm::scatter_heads)
    require(heads % o.world_size == 0, "heads", heads,
            fmt::format("a multiple of world_size ({}) for merge = scatter_heads", o.world_size));

  Inputs in;
  in.batch = batch, in.qlen = qlen, in.heads = heads, in.dim = dim, in.max_len = max_len, in.mode = o.mode;
  in.rows = rows;
  in.seq_lens = std::move(seq_lens);
  in.qlens = std::move(qlens);
  AttentionConfig scale_config;
  scale_config.softmax_scale = o.softmax_scale;
  scale_config.dims = LatentDims{o.kv_lora_rank, dim - o.kv_lora_rank};
  in.softmax_scale = softmax_scale_of(scale_config);  // checked; D^-0.5 by default
  KvScale{o.kv_scale}.validate(o.kv_dtype);
  // The block table's shape: each request takes the entries its largest shard (rank 0's)
  // needs, one spare block at the end.
  in.tokens = 0;
  in.width = 1;
  in.longest = 1;
  int64_t total = 0;
  for (int b = 0; b < batch; ++b) {
    const int64_t largest = group.local_length_of(in.seq_lens[size_t(b)], 0);
    total += ceil_div(largest, o.block_size);
    in.width = std::max(in.width, ceil_div(largest, o.block_size));
    in.longest = std::max(in.longest, largest);
    in.tokens += in.seq_lens[size_t(b)];
  }
  in.num_blocks = total + 1;
  return in;
}

// The inputs' bf16 copies, block tables and latents (prepare() sized them; check_memory()
// counted them).
void load(Inputs& in, std::span<const float> q, std::span<const float> kv, const AttentionOptions& o) {
  const int batch = in.batch, dim = in.dim;
  const Layout group{o.world_size, 0, o.interleave};
  // The model's numbers are bf16: round once on entry.
  in.q16.resize(q.size());
  in.kv16.resize(kv.size());
  std::transform(q.begin(), q.end(), in.q16.begin(), float_to_bf16);
  std::transform(kv.begin(), kv.end(), in.kv16.begin(), float_to_bf16);

  // One shared block table: each request's entries come from a random permutation of the
  // blocks. The last block is a spare that stays poisoned and fills unused table entries, so
  // a stray read shows as NaN.
  std::vector<int32_t> ids(static_cast<size_t>(in.num_blocks - 1));
  std::iota(ids.begin(), ids.end(), 0);
  std::mt19937_64 rng(o.seed);
  std::shuffle(ids.begin(), ids.end(), rng);
  in.tables.assign(size_t(batch * in.width), int32_t(in.num_blocks - 1));
  for (int b = 0, next = 0; b < batch; ++b) {
    const int64_t needed = ceil_div(group.local_length_of(in.seq_lens[size_t(b)], 0), o.block_size);
    for (int64_t j = 0; j < needed; ++j) in.tables[size_t(b * in.width + j)] = ids[size_t(next++)];
  }

  // Every token of every request, in request order (the write path skips unowned ones).
  in.positions.reserve(size_t(in.tokens));
  in.requests.reserve(size_t(in.tokens));
  in.latents.reserve(size_t(in.tokens) * size_t(dim));
  for (int b = 0; b < batch; ++b)
    for (int64_t p = 0; p < in.seq_lens[size_t(b)]; ++p) {
      in.positions.push_back(p);
      in.requests.push_back(b);
      const bf16* row = in.kv16.data() + (size_t(b) * size_t(in.max_len) + size_t(p)) * dim;
      in.latents.insert(in.latents.end(), row, row + dim);
    }
}

// The one place the conformance options become a rank's engine configuration.
AttentionConfig rank_config(const Inputs& in, const AttentionOptions& o, int rank) {
  AttentionConfig config;
  config.heads = in.heads;
  config.kv_dtype = o.kv_dtype;
  config.block_size = o.block_size;
  config.layout = Layout{o.world_size, rank, o.interleave};
  config.limits = PlanLimits{in.batch, in.qlen, in.longest};
  config.softmax_scale = in.softmax_scale;
  config.dims = LatentDims{o.kv_lora_rank, in.dim - o.kv_lora_rank};
  config.route = o.route;
  config.min_segment_tokens = o.min_segment_tokens;
  return config;
}

CacheConfig cache_config(const Inputs& in, const AttentionOptions& o) {
  return CacheConfig{in.num_blocks, o.block_size, in.dim, o.kv_dtype, o.kv_scale};
}

// Everything the conformance path will hold in this process, counted before anything is
// allocated (the planner also checks the configuration here, once): the inputs' bf16 copies,
// latents and tables (shared by the ranks), and per rank here its merge buffers (each rank
// gathers every rank's partial, so that term grows as N^2), its plans (sized by the batch
// even when no request has a query row: one for a CPU engine, a CUDA engine's two staging
// copies) and, with the CPU engines, its cache shard and kernel workspace (the CUDA engines
// keep those in device memory). caller_bytes: what the caller holds for the call beside.
void check_memory(const Inputs& in, const AttentionOptions& o, int ranks_here, bool cpu_engines,
                  double caller_bytes = 0) {
  const int N = o.world_size;
  const Planner sizing(planner_config(rank_config(in, o, 0), o.backend, kCpuWorkers, kCpuRowsPerUnit));
  const double cells = double(in.rows) * in.heads, R = o.kv_lora_rank;
  double per_rank = (double(N) + 3) * cells * (R * 2 + 4) + cells * R * 4 +
                    (cpu_engines ? 1 : 2) * double(sizing.plan_host_bytes());
  if (cpu_engines)  // the workspace as the CPU engine takes it: none for one_stage
    per_rank += double(cache_config(in, o).bytes()) + 4.0 * double(split_workspace_floats(sizing));
  const double shared = 2.0 * (double(in.rows) * in.heads * in.dim + double(in.batch) * in.max_len * in.dim +
                               double(in.tokens) * in.dim) +
                        12.0 * double(in.tokens) + 4.0 * double(in.batch) * double(in.width) + 4.0 * double(in.num_blocks);
  // The CPU kernels' scratch on every thread: each rank's thread (run_ranks) opens its own
  // OpenMP team, so the ranks here run up to ranks_here x parallel_threads() at once.
  const double scratch = cpu_engines ? double(cpu_attention_scratch_bytes(sizing.config().dims)) *
                                           double(ranks_here) * detail::parallel_threads()
                                     : 0.0;
  const double total = shared + per_rank * ranks_here + scratch + caller_bytes;
  require(total <= double(kMaxInProcessBytes),
          "host memory (input copies; per rank: plans, cache, workspace, merge buffers; the CPU kernels' scratch)",
          fmt::format("{} for {} rank(s) here{}", bytes_text(total), ranks_here,
                      caller_bytes > 0 ? fmt::format(", {} of it the caller's copies of strided inputs",
                                                     bytes_text(caller_bytes))
                                       : ""),
          fmt::format("<= {} in one process (lower world_size, block_size, heads, kv_lora_rank or the batch)",
                      bytes_text(double(kMaxInProcessBytes))));
}

// This rank's engine with its shard written and the batch planned: everything a rank can
// refuse on its own, done before its first collective.
std::unique_ptr<RankEngine> set_up_rank(const Inputs& in, const AttentionOptions& o, int rank,
                                        const RankEngineFactory& engines) {
  auto engine = (engines ? engines : RankEngineFactory(make_cpu_rank))(rank_config(in, o, rank), cache_config(in, o));
  if (engine == nullptr) fail("engines", "a factory that returned null", fmt::format("a RankEngine for rank {}", rank));
  if (o.poison) engine->poison();
  const BatchDesc desc = in.desc();
  engine->write(in.latents, in.positions, in.requests, desc);
  engine->plan(desc);
  return engine;
}

// FNV-1a over 64-bit words (the tail zero-padded), one multiply a word: ranks handed different
// inputs must not merge their partials. Each step is a bijection of the running hash, so inputs
// of one length that differ in one word always hash apart.
template <class T>
std::array<int32_t, 2> hash_of(std::span<const T> values) {
  const std::span<const std::byte> bytes = std::as_bytes(values);
  uint64_t h = 14695981039346656037ull;
  for (size_t i = 0; i < bytes.size(); i += 8) {
    uint64_t word = 0;
    std::memcpy(&word, bytes.data() + i, std::min<size_t>(8, bytes.size() - i));
    h = (h ^ word) * 1099511628211ull;
  }
  return {int32_t(uint32_t(h)), int32_t(uint32_t(h >> 32))};
}
// The rows of each request: qlens, or qlen each when none are given (the same batch either way).
std::array<int32_t, 2> rows_hash(const Inputs& in) {
  const std::vector<int32_t> rows = in.qlens.empty() ? std::vector<int32_t>(size_t(in.batch), in.qlen) : in.qlens;
  return hash_of(std::span<const int32_t>(rows));
}

AttentionResult run_rank(const Inputs& in, const AttentionOptions& o, RankEngine& engine, Communicator& comm) {
  const int rank = comm.rank(), N = o.world_size, R = o.kv_lora_rank, heads = in.heads, qlen = in.qlen;
  const int64_t rows = in.rows;
  const Route route = engine.current_plan().route();
  // Everything the ranks' partials depend on but the block tables (a table or block size of
  // its own gives the same partial): the values of q and of every token below its request's
  // length too (what lies past a length is never read, and may differ). Whether stage B runs
  // must agree too; split_k or one_stage is each rank's own schedule.
  const auto lens = hash_of(std::span<const int32_t>(in.seq_lens)), per_request = rows_hash(in);
  const auto q_values = hash_of(std::span<const bf16>(in.q16)), kv_values = hash_of(std::span<const bf16>(in.latents));
  const int32_t signature[] = {in.batch,
                               qlen,
                               heads,
                               R,
                               in.dim,
                               int32_t(rows),
                               int32_t(rows >> 32),
                               lens[0],
                               lens[1],
                               per_request[0],
                               per_request[1],
                               q_values[0],
                               q_values[1],
                               kv_values[0],
                               kv_values[1],
                               int32_t(in.mode),
                               o.interleave,
                               int32_t(o.kv_dtype),
                               std::bit_cast<int32_t>(o.kv_scale),
                               std::bit_cast<int32_t>(in.softmax_scale),
                               int32_t(route == Route::two_stage),
                               int32_t(o.merge)};
  check_ranks_agree(comm, signature,
                    "batch, qlen, heads, R, D, rows (low, high), hashes (low, high) of seq_lens, rows per request, "
                    "q and the tokens below each length, mode, interleave, kv_dtype, kv_scale bits, "
                    "softmax_scale bits, two_stage, merge");

  std::vector<bf16> part(size_t(rows * heads * R));
  std::vector<float> part_lse(size_t(rows * heads));
  engine.attend(in.q16.data(), part.data(), part_lse.data());

  const bool scatter = o.merge == MergeForm::scatter_heads;
  const int kept = scatter ? heads / N : heads, head_begin = scatter ? rank * kept : 0;
  std::vector<bf16> merged(size_t(rows * kept * R));
  std::vector<float> merged_lse(size_t(rows * kept));
  merge_across_ranks(comm, o.merge, part.data(), part_lse.data(), rows, heads, R, merged.data(), merged_lse.data());

  if (route == Route::two_stage) {
    // Balanced two_stage: the prefix (stage A) is merged across ranks first, then each
    // rank attends the verify block (stage B) for the heads it keeps and merges locally.
    std::vector<bf16> block(size_t(rows * in.dim));
    for (int b = 0; b < in.batch; ++b)
      for (int t = 0; t < qlen && in.seq_lens[size_t(b)] > 0; ++t) {
        const int64_t p = in.seq_lens[size_t(b)] - qlen + t;
        const bf16* src = in.kv16.data() + (size_t(b) * size_t(in.max_len) + size_t(p)) * in.dim;
        std::copy(src, src + in.dim, block.begin() + (int64_t(b) * qlen + t) * in.dim);
      }
    std::vector<bf16> ob(merged.size());
    std::vector<float> lb(merged_lse.size());
    block_attention_cpu(BlockAttentionParams{in.q16.data(), block.data(), in.seq_lens.data(), o.kv_dtype, o.kv_scale,
                                             in.softmax_scale, in.batch, qlen, heads, head_begin, kept, in.dim, R,
                                             ob.data(), lb.data()});
    merge_state(merged.data(), merged_lse.data(), ob.data(), lb.data(), merged.data(), merged_lse.data(),
                rows * kept, R);
  }

  // Every rank returns the whole result: scatter_heads gathers the kept heads.
  std::vector<bf16> all_o = std::move(merged);
  std::vector<float> all_lse = std::move(merged_lse);
  if (scatter) {
    std::vector<bf16> go(size_t(N) * all_o.size());
    std::vector<float> gl(size_t(N) * all_lse.size());
    comm.all_gather(all_o.data(), go.data(), all_o.size(), DataType::bf16);
    comm.all_gather(all_lse.data(), gl.data(), all_lse.size(), DataType::f32);
    all_o.assign(size_t(rows * heads * R), bf16{});
    all_lse.assign(size_t(rows * heads), 0.0f);
    for (int k = 0; k < N; ++k)
      for (int64_t row = 0; row < rows; ++row)
        for (int j = 0; j < kept; ++j) {
          const int64_t dst = row * heads + k * kept + j, src = (k * rows + row) * kept + j;
          all_lse[size_t(dst)] = gl[size_t(src)];
          std::copy_n(go.begin() + src * R, R, all_o.begin() + dst * R);
        }
  }
  AttentionResult result;
  result.out.resize(all_o.size());
  std::transform(all_o.begin(), all_o.end(), result.out.begin(), bf16_to_float);
  result.lse = std::move(all_lse);
  // Each rank's route and the most pieces its plan cut one request into (tests check that a
  // forced split_k did cut).
  std::vector<int32_t> plans(size_t(2 * N));
  const std::array<int32_t, 2> mine{int32_t(route), engine.current_plan().stats().max_segments};
  comm.all_gather(mine.data(), plans.data(), 2, DataType::i32);
  for (int k = 0; k < N; ++k) {
    result.routes.push_back(Route(plans[size_t(2 * k)]));
    result.max_segments.push_back(plans[size_t(2 * k + 1)]);
  }
  return result;
}

Inputs checked_inputs(uint64_t q_size, uint64_t kv_size, std::span<const int32_t> seq_lens, int batch, int qlen,
                      int heads, int64_t max_len, int dim, const AttentionOptions& options,
                      const RankEngineFactory& engines, double caller_bytes) {
  Inputs in = prepare(q_size, kv_size, seq_lens, batch, qlen, heads, max_len, dim, options, engines);
  require_in_process_world(options.world_size);  // before the memory bound, which counts its ranks
  check_memory(in, options, options.world_size, !engines, caller_bytes);
  return in;
}

}  // namespace

AttentionResult mla_attention_on_rank(std::span<const float> q, std::span<const float> kv,
                                      std::span<const int32_t> seq_lens, int batch, int qlen, int heads,
                                      int64_t max_len, int dim, const AttentionOptions& options,
                                      Communicator& comm, const RankEngineFactory& engines) {
  std::optional<Inputs> in;
  std::unique_ptr<RankEngine> engine;
  std::exception_ptr refused;
  try {
    require(comm.world_size() == options.world_size, "world_size", options.world_size,
            fmt::format("the communicator's size ({})", comm.world_size()));
    in.emplace(prepare(q.size(), kv.size(), seq_lens, batch, qlen, heads, max_len, dim, options, engines));
    check_memory(*in, options, 1, !engines);
    load(*in, q, kv, options);
    engine = set_up_rank(*in, options, comm.rank(), engines);
  } catch (...) {
    refused = std::current_exception();
  }
  try {
    // A communicator may have no way to abort its peers (MPI): a rank that refused its inputs
    // says so in the first collective, and every rank raises there.
    refuse_together(comm, refused, "mla_attention_on_rank");
    return run_rank(*in, options, *engine, comm);
  } catch (...) {
    comm.abort();  // the peers' collectives raise instead of waiting for this rank
    throw;
  }
}

void check_mla_attention(uint64_t q_size, uint64_t kv_size, std::span<const int32_t> seq_lens, int batch, int qlen,
                         int heads, int64_t max_len, int dim, const AttentionOptions& options,
                         const RankEngineFactory& engines, double caller_bytes) {
  checked_inputs(q_size, kv_size, seq_lens, batch, qlen, heads, max_len, dim, options, engines, caller_bytes);
}

AttentionResult mla_attention(std::span<const float> q, std::span<const float> kv,
                              std::span<const int32_t> seq_lens, int batch, int qlen, int heads,
                              int64_t max_len, int dim, const AttentionOptions& options,
                              const RankEngineFactory& engines) {
  Inputs in = checked_inputs(q.size(), kv.size(), seq_lens, batch, qlen, heads, max_len, dim, options, engines, 0);
  load(in, q, kv, options);
  AttentionResult result;
  run_ranks(options.world_size, [&](int rank, Communicator& comm) {
    const auto engine = set_up_rank(in, options, rank, engines);
    AttentionResult mine = run_rank(in, options, *engine, comm);
    if (rank == 0) result = std::move(mine);
  });
  return result;
}

}  // namespace dcpmla
