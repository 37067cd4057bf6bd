// Fuzzes the write path (SPEC §3): slot_mapping of arbitrary positions through an arbitrary
// block table and layout, then PagedCache::write of those slots (and of corrupted ones).
// Every input must either succeed or raise dcpmla::Error, and:
//  - slot_mapping refuses exactly the inputs the contract calls bad (oracle below);
//  - every returned slot is PAD or lies inside the cache; PAD exactly where the rank does
//    not own the position, and no other rank of the group claims an owned one;
//  - owned positions map bijectively onto their slots: with distinct table ids, each slot
//    maps back (through the table and the layout) to the one position it came from;
//  - a write with any bad slot raises and leaves the cache untouched; a good write stores
//    each row in its slot (the last writer of a repeated slot wins) and touches nothing else.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <optional>
#include <vector>

#include "dcpmla/cache.h"
#include "dcpmla/error.h"
#include "dcpmla/layout.h"
#include "fuzz_common.h"

using namespace dcpmla;
using dcpmla::fuzz::field;
using dcpmla::fuzz::pick;

namespace {

constexpr int kMaxPositions = 128;
constexpr int kMaxTableWidth = 64;
constexpr int kMaxRanksChecked = 16;
constexpr int64_t kCacheCapBytes = int64_t(1) << 18;  // harness cap: caches built per input

struct Spec {
  int64_t world, rank, interleave, block_size, num_blocks;
  int64_t owner(int64_t p) const { return (p / interleave) % world; }
  int64_t local(int64_t p) const { return (p / (interleave * world)) * interleave + p % interleave; }
  // Inverse of local() on rank r: the global position of local index i.
  int64_t global(int64_t i, int64_t r) const { return (i / interleave) * interleave * world + r * interleave + i % interleave; }
};

bool mapping_is_valid(const Spec& s, const std::vector<int64_t>& positions, const std::vector<int32_t>& table) {
  if (s.world < 1 || s.rank < 0 || s.rank >= s.world || s.interleave < 1) return false;
  if (s.block_size < 1 || s.block_size > kMaxBlockSize || s.block_size % s.interleave) return false;
  if (s.num_blocks < 1) return false;
  for (int64_t p : positions) {
    if (p < 0) return false;
    if (s.owner(p) != s.rank) continue;
    const int64_t entry = s.local(p) / s.block_size;
    if (entry >= int64_t(table.size())) return false;
    if (table[size_t(entry)] < 0 || table[size_t(entry)] >= s.num_blocks) return false;
  }
  return true;
}

void check_write(FuzzedDataProvider& in, const Spec& s, std::vector<int64_t> slots) {
  CacheConfig cfg;
  cfg.num_blocks = s.num_blocks;
  cfg.block_size = int(s.block_size);
  cfg.dim = in.ConsumeBool() ? in.ConsumeIntegralInRange<int>(1, 16) : pick<int32_t>(in);
  cfg.dtype = KvDtype(in.ConsumeIntegralInRange<int>(0, 2));
  switch (in.ConsumeIntegralInRange<int>(0, 3)) {
    case 0: cfg.scale = 1.0f; break;
    case 1: cfg.scale = 0.03125f; break;
    default: cfg.scale = in.ConsumeFloatingPoint<float>();  // 0, negatives, inf, nan, subnormals
  }
  const bool bytes_overflow =
      cfg.dim >= 1 && __int128(cfg.num_blocks) * cfg.block_size * cfg.dim * bytes_per_value(cfg.dtype) > INT64_MAX;
  const bool valid = cfg.num_blocks >= 1 && cfg.block_size >= 1 && cfg.block_size <= kMaxBlockSize &&
                     cfg.dim >= 1 && !bytes_overflow &&
                     (cfg.dtype == KvDtype::bf16 ? cfg.scale == 1.0f
                                                  : std::isnormal(cfg.scale) && cfg.scale > 0.0f &&
                                                        double(cfg.scale) <= kMaxKvScale);
  if (valid && cfg.bytes() > kCacheCapBytes) return;  // accepted by design, too big to build per input
  std::optional<PagedCache> cache;
  try {
    cache.emplace(cfg);
  } catch (const Error&) {
    FUZZ_CHECK(!valid);
    return;
  }
  FUZZ_CHECK(valid);
  cache->poison();
  const std::vector<uint8_t> poisoned(cache->data(), cache->data() + cfg.bytes());

  // Sometimes corrupt one slot (past the end, negative, anything) or the latent count.
  if (!slots.empty() && in.ConsumeIntegralInRange<int>(0, 3) == 0)
    slots[in.ConsumeIntegralInRange<size_t>(0, slots.size() - 1)] = pick<int64_t>(in);
  size_t values = slots.size() * size_t(cfg.dim);
  if (in.ConsumeIntegralInRange<int>(0, 15) == 0) values = in.ConsumeBool() || values == 0 ? values + 1 : values - 1;
  std::vector<bf16> latents(values);
  for (auto& x : latents) x = bf16{in.ConsumeIntegral<uint16_t>()};  // any bits: NaN, inf, subnormal

  bool slots_ok = values == slots.size() * size_t(cfg.dim);
  for (int64_t slot : slots) slots_ok &= slot == kPadSlot || (slot >= 0 && slot < cfg.num_slots());
  try {
    cache->write(latents, slots);
  } catch (const Error&) {
    FUZZ_CHECK(!slots_ok);
    FUZZ_CHECK(std::equal(poisoned.begin(), poisoned.end(), cache->data()));  // nothing written
    return;
  }
  FUZZ_CHECK(slots_ok);
  const int64_t row_bytes = int64_t(cfg.dim) * bytes_per_value(cfg.dtype);
  std::map<int64_t, size_t> last_writer;
  for (size_t n = 0; n < slots.size(); ++n)
    if (slots[n] != kPadSlot) last_writer[slots[n]] = n;
  std::vector<uint8_t> row(static_cast<size_t>(row_bytes));
  for (int64_t slot = 0; slot < cfg.num_slots(); ++slot) {
    const uint8_t* got = cache->data() + slot * row_bytes;
    const auto it = last_writer.find(slot);
    if (it == last_writer.end()) {
      FUZZ_CHECK(std::equal(got, got + row_bytes, poisoned.begin() + slot * row_bytes));
      continue;
    }
    encode_latent(latents.data() + it->second * size_t(cfg.dim), cfg.dim, cfg.dtype, cfg.scale, row.data());
    FUZZ_CHECK(std::equal(row.begin(), row.end(), got));
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  Spec s;
  s.world = field<int32_t>(in, 1, 16);
  s.rank = field<int32_t>(in, 0, int32_t(std::max<int64_t>(0, s.world - 1)));
  s.interleave = field<int32_t>(in, 1, 8);
  // Mostly a multiple of the interleave (the contract's rule), sometimes anything.
  s.block_size = s.interleave * in.ConsumeIntegralInRange<int64_t>(1, 64);
  if (!in.ConsumeIntegralInRange<int>(0, 3) || s.block_size > INT32_MAX) s.block_size = pick<int32_t>(in);
  s.num_blocks = field<int64_t>(in, 1, 1 << 12);

  // Table: distinct valid ids (a permutation), valid ids with repeats, or anything.
  std::vector<int32_t> table(in.ConsumeIntegralInRange<size_t>(0, kMaxTableWidth));
  const int table_kind = in.ConsumeIntegralInRange<int>(0, 2);
  const int64_t hi = std::clamp<int64_t>(s.num_blocks, 1, INT32_MAX) - 1;
  const int64_t start = in.ConsumeIntegralInRange<int64_t>(0, hi);
  for (size_t j = 0; j < table.size(); ++j) {
    if (table_kind == 0) table[j] = int32_t(hi - (start + int64_t(j)) % (hi + 1));  // distinct while j <= hi
    else if (table_kind == 1) table[j] = int32_t(in.ConsumeIntegralInRange<int64_t>(0, hi));
    else table[j] = pick<int32_t>(in);
  }
  std::vector<int64_t> positions(in.ConsumeIntegralInRange<size_t>(0, kMaxPositions));
  const int64_t base = in.ConsumeBool() ? 0 : pick<int64_t>(in);
  for (auto& p : positions) {
    if (!in.ConsumeBool()) p = pick<int64_t>(in);
    else if (__builtin_add_overflow(base, in.ConsumeIntegralInRange<int64_t>(0, 4096), &p)) p = base;
  }
  if (in.ConsumeBool()) std::sort(positions.begin(), positions.end());

  const bool valid = s.world >= 1 && s.world <= INT32_MAX && mapping_is_valid(s, positions, table);
  const Layout layout{int(s.world), int(s.rank), int(s.interleave)};
  std::vector<int64_t> slots;
  try {
    slots = slot_mapping(positions, table, int(s.block_size), s.num_blocks, layout);
  } catch (const Error&) {
    FUZZ_CHECK(!valid);
    return 0;
  }
  FUZZ_CHECK(valid);
  FUZZ_CHECK(slots.size() == positions.size());

  // Which table entry holds a block id, when the ids in use are distinct.
  std::map<int32_t, int64_t> entry_of;
  bool distinct = true;
  for (size_t n = 0; n < positions.size(); ++n) {
    if (s.owner(positions[n]) != s.rank) continue;
    const int64_t entry = s.local(positions[n]) / s.block_size;
    const auto [it, fresh] = entry_of.emplace(table[size_t(entry)], entry);
    distinct &= fresh || it->second == entry;
  }
  std::map<int64_t, int64_t> position_of;
  for (size_t n = 0; n < positions.size(); ++n) {
    const int64_t p = positions[n], slot = slots[n];
    if (s.owner(p) != s.rank) {
      FUZZ_CHECK(slot == kPadSlot);
      continue;
    }
    const int64_t i = s.local(p);
    FUZZ_CHECK(slot == int64_t(table[size_t(i / s.block_size)]) * s.block_size + i % s.block_size);
    FUZZ_CHECK(slot >= 0 && __int128(slot) < __int128(s.num_blocks) * s.block_size);
    if (!distinct) continue;
    const auto [it, fresh] = position_of.emplace(slot, p);
    FUZZ_CHECK(fresh || it->second == p);  // injective: one slot, one position
    const int64_t back = entry_of.at(int32_t(slot / s.block_size)) * s.block_size + slot % s.block_size;
    FUZZ_CHECK(s.global(back, s.rank) == p);  // and the slot maps back to its position
  }

  // Exactly one rank of the group owns each position: every other rank maps it to PAD.
  if (s.world <= kMaxRanksChecked)
    for (int r = 0; r < s.world; ++r) {
      if (r == s.rank) continue;
      const Layout other{int(s.world), r, int(s.interleave)};
      for (int64_t p : positions)
        if (s.owner(p) != r) FUZZ_CHECK(slot_of(p, table, int(s.block_size), s.num_blocks, other) == kPadSlot);
    }

  check_write(in, s, std::move(slots));
  return 0;
}
