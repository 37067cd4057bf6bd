// DCP layout (SPEC §2): which rank owns a global position, where it lives on that
// rank, and how many positions of a window each rank holds.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "dcpmla/types.h"

namespace dcpmla {

// The PAD slot id: a token this rank does not own is written nowhere.
inline constexpr int64_t kPadSlot = -1;

// Largest block_size accepted (the contract names 16, 64 and managed blocks of 256 or
// 1024). Far larger blocks only waste memory -- every request holds at least one block on
// every rank -- and a block_size near 2^31 would make a cache of terabytes.
inline constexpr int kMaxBlockSize = 1 << 16;
// Throws Error unless block_size is in [1, kMaxBlockSize].
void require_block_size(int block_size);

// Largest query block (rows per request) accepted: a verify block is 1 + a few draft
// tokens. Bounds every allocation sized by qlen (row_local_lengths, a plan's rows) before it
// is made; qlen = 2^31 - 1 would otherwise ask for 16 GiB.
inline constexpr int kMaxQlen = 1 << 12;

struct Layout {
  int world_size = 1;  // N
  int rank = 0;        // r
  int interleave = 1;  // I: positions are dealt round-robin in runs of I

  // Throws dcpmla::Error unless N >= 1, 0 <= r < N, I >= 1. The members below divide by
  // N and I unchecked (they run per token): every public entry taking a Layout calls this.
  void validate() const;
  // Also requires block_size in [1, kMaxBlockSize] and block_size % I == 0 (a run of I never
  // straddles a block).
  void validate_with_block_size(int block_size) const;

  // Owner of global position p: (p / I) mod N.
  int owner(int64_t p) const { return int((p / interleave) % world_size); }
  // Index of p on its owner: (p / (I N)) I + p mod I.
  int64_t local_index(int64_t p) const {
    return (p / (int64_t(interleave) * world_size)) * interleave + p % interleave;
  }
  // n_r(w): positions of [0, w) held by this rank; sum over ranks equals w.
  int64_t local_length(int64_t w) const { return local_length_of(w, rank); }
  int64_t local_length_of(int64_t w, int r) const {
    const int64_t span = int64_t(interleave) * world_size;
    int64_t rem = w % span - int64_t(r) * interleave;
    rem = rem < 0 ? 0 : (rem > interleave ? interleave : rem);
    return (w / span) * interleave + rem;
  }
};

// Global window length of query row t (SPEC §1): decode/verify see [0, L - qlen + t],
// draft sees [0, L). A padding request (L = 0) has empty windows. Throws unless mode is
// valid, qlen >= 1 (1 in decode), 0 <= t < qlen and L is valid for the mode (validate_seq_len).
int64_t row_window(Mode mode, int64_t seq_len, int qlen, int t);

namespace detail {
// row_window for callers that validated mode, qlen and seq_len once for the batch (the
// planner and the reference, per query row; the reference's loop is OpenMP, where a throw
// would terminate).
inline int64_t row_window_unchecked(Mode mode, int64_t seq_len, int qlen, int t) {
  if (seq_len == 0) return 0;
  return mode == Mode::draft ? seq_len : seq_len - qlen + t + 1;
}
}  // namespace detail

// Checks L against the mode: L >= 0, and L >= qlen unless L == 0 (padding) for causal modes.
void validate_seq_len(Mode mode, int64_t seq_len, int qlen, int request);

// Per-row rank-local lengths n_r(w_t), t = 0..qlen-1, counted from the global window
// end. (Not n_r(L) - (qlen-1-t): the hidden tail is spread over several ranks.)
std::vector<int64_t> row_local_lengths(Mode mode, int64_t seq_len, int qlen, const Layout& layout);

// Rank-local slot of global position p in a request whose (shared) block table is
// `table`, or kPadSlot when this rank does not own p. Throws on an invalid layout or
// block_size (validate_with_block_size), num_blocks < 1, p < 0, or when the table is too
// short or names a block outside [0, num_blocks).
int64_t slot_of(int64_t p, std::span<const int32_t> table, int block_size, int64_t num_blocks,
                const Layout& layout);

// slot_of for each position (one request); the layout is validated once.
std::vector<int64_t> slot_mapping(std::span<const int64_t> positions, std::span<const int32_t> table,
                                  int block_size, int64_t num_blocks, const Layout& layout);

namespace detail {
// slot_of for loops that validated layout, block_size and num_blocks once (slot_mapping,
// slots_of): checks only p and the table. `request` >= 0 names the table in messages as
// block_tables[request]; -1 as block_table.
int64_t slot_of_validated(int64_t p, std::span<const int32_t> table, int block_size, int64_t num_blocks,
                          const Layout& layout, int request = -1);
}  // namespace detail

}  // namespace dcpmla
