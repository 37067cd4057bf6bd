#include "dcpmla/layout.h"

#include "dcpmla/error.h"

namespace dcpmla {

// Plain comparisons, messages formatted only on failure (slot_of calls this per call).
void Layout::validate() const {
  if (world_size < 1) fail("world_size", world_size, ">= 1");
  if (rank < 0 || rank >= world_size)
    fail("rank", rank, fmt::format("0 <= rank < world_size ({})", world_size));
  if (interleave < 1) fail("interleave", interleave, ">= 1");
}

void require_block_size(int block_size) {
  if (block_size < 1 || block_size > kMaxBlockSize)
    fail("block_size", block_size, fmt::format("in [1, {}]", kMaxBlockSize));
}

void Layout::validate_with_block_size(int block_size) const {
  validate();
  require_block_size(block_size);
  if (block_size % interleave != 0)
    fail("interleave", interleave, fmt::format("a divisor of block_size ({})", block_size));
}

namespace {

// SPEC §1: L >= 0; a causal block (decode, verify) needs L >= qlen unless L == 0 (padding).
bool seq_len_ok(Mode mode, int64_t seq_len, int qlen) {
  return seq_len == 0 || (seq_len > 0 && (mode == Mode::draft || seq_len >= qlen));
}

[[noreturn]] void fail_seq_len(std::string_view field, Mode mode, int64_t seq_len, int qlen) {
  if (seq_len < 0) fail(field, seq_len, ">= 0 (0 marks a padding request)");
  fail(field, seq_len, fmt::format(">= qlen ({}) in {} mode, or 0 for padding", qlen, to_string(mode)));
}

}  // namespace

int64_t row_window(Mode mode, int64_t seq_len, int qlen, int t) {
  // Without these checks L < qlen would give a negative window silently.
  require_known("mode", mode);
  if (qlen < 1) fail("qlen", qlen, ">= 1");
  if (mode == Mode::decode && qlen != 1) fail("qlen", qlen, "1 in decode mode");
  if (t < 0 || t >= qlen) fail("t", t, fmt::format("a query row in [0, qlen ({}))", qlen));
  if (!seq_len_ok(mode, seq_len, qlen)) fail_seq_len("seq_len", mode, seq_len, qlen);
  return detail::row_window_unchecked(mode, seq_len, qlen, t);
}

void validate_seq_len(Mode mode, int64_t seq_len, int qlen, int request) {
  // The planner calls this for every request of every step: format only on failure.
  if (!seq_len_ok(mode, seq_len, qlen)) fail_seq_len(fmt::format("seq_lens[{}]", request), mode, seq_len, qlen);
}

std::vector<int64_t> row_local_lengths(Mode mode, int64_t seq_len, int qlen, const Layout& layout) {
  layout.validate();
  require_known("mode", mode);
  require(qlen >= 1 && qlen <= kMaxQlen, "qlen", qlen, fmt::format("in [1, {}]", kMaxQlen));
  if (mode == Mode::decode) require(qlen == 1, "qlen", qlen, "1 in decode mode");
  if (!seq_len_ok(mode, seq_len, qlen)) fail_seq_len("seq_len", mode, seq_len, qlen);
  std::vector<int64_t> lens(static_cast<size_t>(qlen));
  for (int t = 0; t < qlen; ++t)
    lens[size_t(t)] = layout.local_length(detail::row_window_unchecked(mode, seq_len, qlen, t));
  return lens;
}

namespace detail {

int64_t slot_of_validated(int64_t p, std::span<const int32_t> table, int block_size, int64_t num_blocks,
                          const Layout& layout, int request) {
  // Called per token of every step (the DCP step's plan, slot_mapping, slots_of): format only
  // when a check fails.
  if (p < 0) fail("position", p, ">= 0");
  if (layout.owner(p) != layout.rank) return kPadSlot;
  const int64_t i = layout.local_index(p);
  const int64_t entry = i / block_size;
  if (entry >= int64_t(table.size()))
    fail(request < 0 ? std::string("block_table") : fmt::format("block_tables[{}]", request),
         fmt::format("{} entries", table.size()),
         fmt::format("> {} to hold position {} (local index {})", entry, p, i));
  const int32_t block = table[size_t(entry)];
  if (block < 0 || block >= num_blocks)
    fail(request < 0 ? fmt::format("block_table[{}]", entry) : fmt::format("block_tables[{}][{}]", request, entry),
         block, fmt::format("a block id in [0, {})", num_blocks));
  return int64_t(block) * block_size + i % block_size;
}

}  // namespace detail

int64_t slot_of(int64_t p, std::span<const int32_t> table, int block_size, int64_t num_blocks,
                const Layout& layout) {
  // owner/local_index divide by N, I and block_size: an unvalidated layout would trap (SIGFPE)
  // or, with rank >= N, silently map every position to PAD.
  layout.validate_with_block_size(block_size);
  if (num_blocks < 1) fail("num_blocks", num_blocks, ">= 1");
  return detail::slot_of_validated(p, table, block_size, num_blocks, layout);
}

std::vector<int64_t> slot_mapping(std::span<const int64_t> positions, std::span<const int32_t> table,
                                  int block_size, int64_t num_blocks, const Layout& layout) {
  layout.validate_with_block_size(block_size);
  require(num_blocks >= 1, "num_blocks", num_blocks, ">= 1");
  std::vector<int64_t> slots(positions.size());
  for (size_t n = 0; n < positions.size(); ++n)
    slots[n] = detail::slot_of_validated(positions[n], table, block_size, num_blocks, layout);
  return slots;
}

}  // namespace dcpmla
