#include "dcpmla/layout.h"

#include "dcpmla/error.h"

namespace dcpmla {

void Layout::validate() const {
  require(world_size >= 1, "world_size", world_size, ">= 1");
  require(rank >= 0 && rank < world_size, "rank", rank,
          fmt::format("0 <= rank < world_size ({})", world_size));
  require(interleave >= 1, "interleave", interleave, ">= 1");
}

void Layout::validate_with_block_size(int block_size) const {
  validate();
  require(block_size >= 1 && block_size <= kMaxBlockSize, "block_size", block_size,
          fmt::format("in [1, {}]", kMaxBlockSize));
  require(block_size % interleave == 0, "interleave", interleave,
          fmt::format("a divisor of block_size ({})", block_size));
}

int64_t row_window(Mode mode, int64_t seq_len, int qlen, int t) {
  if (seq_len == 0) return 0;
  return mode == Mode::draft ? seq_len : seq_len - qlen + t + 1;
}

void validate_seq_len(Mode mode, int64_t seq_len, int qlen, int request) {
  // The planner calls this for every request of every step: format only on failure.
  if (seq_len < 0) fail(fmt::format("seq_lens[{}]", request), seq_len, ">= 0 (0 marks a padding request)");
  if (mode != Mode::draft && seq_len != 0 && seq_len < qlen)
    fail(fmt::format("seq_lens[{}]", request), seq_len,
         fmt::format(">= qlen ({}) in {} mode, or 0 for padding", qlen, to_string(mode)));
}

std::vector<int64_t> row_local_lengths(Mode mode, int64_t seq_len, int qlen, const Layout& layout) {
  layout.validate();
  require(qlen >= 1 && qlen <= kMaxQlen, "qlen", qlen, fmt::format("in [1, {}]", kMaxQlen));
  if (mode == Mode::decode) require(qlen == 1, "qlen", qlen, "1 in decode mode");
  validate_seq_len(mode, seq_len, qlen, 0);
  std::vector<int64_t> lens(static_cast<size_t>(qlen));
  for (int t = 0; t < qlen; ++t) lens[size_t(t)] = layout.local_length(row_window(mode, seq_len, qlen, t));
  return lens;
}

int64_t slot_of(int64_t p, std::span<const int32_t> table, int block_size, int64_t num_blocks,
                const Layout& layout) {
  // Called per token of every step (the DCP step's plan, the conformance driver): format only
  // when a check fails.
  if (p < 0) fail("position", p, ">= 0");
  if (layout.owner(p) != layout.rank) return kPadSlot;
  const int64_t i = layout.local_index(p);
  const int64_t entry = i / block_size;
  if (entry >= int64_t(table.size()))
    fail("block_table", fmt::format("{} entries", table.size()),
         fmt::format("> {} to hold position {} (local index {})", entry, p, i));
  const int32_t block = table[size_t(entry)];
  if (block < 0 || block >= num_blocks)
    fail(fmt::format("block_table[{}]", entry), block, fmt::format("a block id in [0, {})", num_blocks));
  return int64_t(block) * block_size + i % block_size;
}

std::vector<int64_t> slot_mapping(std::span<const int64_t> positions, std::span<const int32_t> table,
                                  int block_size, int64_t num_blocks, const Layout& layout) {
  layout.validate_with_block_size(block_size);
  require(num_blocks >= 1, "num_blocks", num_blocks, ">= 1");
  std::vector<int64_t> slots(positions.size());
  for (size_t n = 0; n < positions.size(); ++n)
    slots[n] = slot_of(positions[n], table, block_size, num_blocks, layout);
  return slots;
}

}  // namespace dcpmla
