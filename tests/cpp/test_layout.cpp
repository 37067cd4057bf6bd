#include "dcpmla/layout.h"

#include <gtest/gtest.h>

#include <numeric>
#include <set>

#include "dcpmla/error.h"
#include "dcpmla/runner.h"
#include "test_helpers.h"

namespace dcpmla {

TEST(Layout, SharesSumToWindow) {
  for (int n = 1; n <= 8; ++n)
    for (int il = 1; il <= 4; ++il)
      for (int64_t w = 0; w <= 300; ++w) {
        int64_t sum = 0;
        for (int r = 0; r < n; ++r) sum += Layout{n, r, il}.local_length(w);
        ASSERT_EQ(sum, w) << "N=" << n << " I=" << il;
      }
}

TEST(Layout, LocalLengthCountsOwnedPositions) {
  for (int n = 1; n <= 8; ++n)
    for (int il = 1; il <= 4; ++il)
      for (int r = 0; r < n; ++r) {
        const Layout layout{n, r, il};
        int64_t owned = 0;
        for (int64_t p = 0; p < 200; ++p) {
          ASSERT_EQ(layout.local_length(p), owned);
          if (layout.owner(p) == r) {
            ASSERT_EQ(layout.local_index(p), owned) << "local indices are dense, in order";
            ++owned;
          }
        }
      }
}

TEST(Layout, SlotMappingIsBijectionOntoOwnedSlots) {
  for (int n = 1; n <= 8; ++n)
    for (int il : {1, 2, 4})
      for (int bs : {4, 8, 16}) {
        if (bs % il) continue;
        const int64_t w = 257;
        const int64_t blocks = (w / n + bs) / bs + 2;
        std::vector<int32_t> table(static_cast<size_t>(blocks));
        std::iota(table.rbegin(), table.rend(), 0);  // reversed: not the identity
        std::vector<int64_t> positions(static_cast<size_t>(w));
        std::iota(positions.begin(), positions.end(), 0);
        int64_t total = 0;
        for (int r = 0; r < n; ++r) {
          const Layout layout{n, r, il};
          const auto slots = slot_mapping(positions, table, bs, blocks, layout);
          std::set<int64_t> seen;
          for (int64_t p = 0; p < w; ++p) {
            if (layout.owner(p) != r) {
              ASSERT_EQ(slots[size_t(p)], kPadSlot);
              continue;
            }
            const int64_t i = layout.local_index(p);
            ASSERT_EQ(slots[size_t(p)], int64_t(table[size_t(i / bs)]) * bs + i % bs);
            ASSERT_TRUE(seen.insert(slots[size_t(p)]).second) << "two positions share a slot";
          }
          ASSERT_EQ(int64_t(seen.size()), layout.local_length(w));
          total += int64_t(seen.size());
        }
        ASSERT_EQ(total, w);
      }
}

TEST(Layout, BlockSizeLimit) {
  const std::vector<int32_t> table{0};
  const std::vector<int64_t> positions{0, 1};
  EXPECT_EQ(slot_mapping(positions, table, kMaxBlockSize, 1, Layout{1, 0, 1}), (std::vector<int64_t>{0, 1}));
  EXPECT_THROW(slot_mapping(positions, table, kMaxBlockSize + 1, 1, Layout{1, 0, 1}), Error);
  EXPECT_THROW(Layout({2, 0, INT32_MAX}).validate_with_block_size(INT32_MAX), Error);
}

TEST(Layout, PerRowLengthsCountFromGlobalWindowEnd) {
  // N = 2, r = 1, L = 10, qlen = 3: windows 8, 9, 10 hold 4, 4, 5 positions on rank 1.
  EXPECT_EQ(row_local_lengths(Mode::verify, 10, 3, Layout{2, 1, 1}), (std::vector<int64_t>{4, 4, 5}));
  // The subtracting rule n_r(L) - (qlen - 1 - t) would give 3, 4, 5.
  const Layout rank1{2, 1, 1};
  std::vector<int64_t> subtracting;
  for (int t = 0; t < 3; ++t) subtracting.push_back(rank1.local_length(10) - (3 - 1 - t));
  EXPECT_EQ(subtracting, (std::vector<int64_t>{3, 4, 5}));
  EXPECT_EQ(row_local_lengths(Mode::draft, 10, 3, rank1), (std::vector<int64_t>{5, 5, 5}));
  EXPECT_EQ(row_local_lengths(Mode::verify, 0, 3, rank1), (std::vector<int64_t>{0, 0, 0}));
}

TEST(Layout, RowWindows) {
  EXPECT_EQ(row_window(Mode::decode, 7, 1, 0), 7);
  EXPECT_EQ(row_window(Mode::verify, 7, 3, 0), 5);
  EXPECT_EQ(row_window(Mode::verify, 7, 3, 2), 7);
  EXPECT_EQ(row_window(Mode::draft, 7, 3, 0), 7);
  EXPECT_EQ(row_window(Mode::verify, 0, 3, 1), 0);
  EXPECT_EQ(row_window(Mode::verify, 3, 3, 0), 1);  // L == qlen: the shortest causal block
  EXPECT_EQ(row_window(Mode::draft, 2, 5, 4), 2);    // draft has no L >= qlen rule
}

TEST(Layout, RowWindowRefusesBadArguments) {
  using testing::expect_error;
  expect_error([] { row_window(Mode::verify, 2, 5, 0); }, "'seq_len' = 2");  // was -2, silently
  expect_error([] { row_window(Mode::decode, -1, 1, 0); }, "'seq_len' = -1");
  expect_error([] { row_window(Mode::draft, -1, 1, 0); }, "'seq_len' = -1");
  expect_error([] { row_window(Mode::verify, 7, 3, 3); }, "'t' = 3");
  expect_error([] { row_window(Mode::verify, 7, 3, -1); }, "'t' = -1");
  expect_error([] { row_window(Mode::verify, 7, 0, 0); }, "'qlen' = 0");
  expect_error([] { row_window(Mode::decode, 7, 2, 0); }, "'qlen' = 2");
  expect_error([] { row_window(Mode(7), 7, 1, 0); }, "'mode' = 7");
}

TEST(Layout, SlotOfValidatesLayoutAndBlockSize) {
  using testing::expect_error;
  const std::vector<int32_t> t{0, 1, 2, 3};
  // Each of these divided by zero (SIGFPE), returned a wrong slot or silently gave PAD.
  expect_error([&] { slot_of(3, t, 16, 4, Layout{0, 0, 1}); }, "'world_size' = 0");
  expect_error([&] { slot_of(3, t, 16, 4, Layout{1, 0, 0}); }, "'interleave' = 0");
  expect_error([&] { slot_of(3, t, 0, 4, Layout{}); }, "'block_size' = 0");
  expect_error([&] { slot_of(3, t, -16, 4, Layout{}); }, "'block_size' = -16");
  expect_error([&] { slot_of(5, t, 4, 4, Layout{2, 0, 3}); }, "'interleave' = 3");
  expect_error([&] { slot_of(1, t, 4, 4, Layout{2, 5, 1}); }, "'rank' = 5");
  expect_error([&] { slot_of(0, t, 4, 0, Layout{}); }, "'num_blocks' = 0");
  // Valid: N = 2, I = 2, block 4: p = 6 is rank 1's local index 2, in table[0] = 2 -> slot 10.
  const std::vector<int32_t> table{2, 0};
  EXPECT_EQ(slot_of(6, table, 4, 3, Layout{2, 1, 2}), 10);
  EXPECT_EQ(slot_of(6, table, 4, 3, Layout{2, 0, 2}), kPadSlot);
  EXPECT_EQ(slot_of(9, table, 4, 3, Layout{2, 0, 2}), 1);  // rank 0's local 5: table[1] = 0, slot 1
}

TEST(Layout, SlotsOfValidatesLayoutAndTables) {
  using testing::expect_error;
  const std::vector<int32_t> lens{8, 8}, tables{0, 1, 2, 3};
  BatchDesc batch;
  batch.seq_lens = lens;
  batch.block_tables = tables;
  batch.table_width = 2;
  const std::vector<int64_t> pos{1};
  const std::vector<int32_t> req{1};
  expect_error([&] { slots_of(pos, req, batch, 0, 4, Layout{}); }, "'block_size' = 0");
  expect_error([&] { slots_of(pos, req, batch, 4, 4, Layout{0, 0, 1}); }, "'world_size' = 0");
  expect_error([&] { slots_of(pos, req, batch, 4, 4, Layout{2, 2, 1}); }, "'rank' = 2");
  expect_error([&] { slots_of(pos, req, batch, 4, 4, Layout{1, 0, 3}); }, "'interleave' = 3");
  expect_error([&] { slots_of(pos, req, batch, 4, 0, Layout{}); }, "'num_blocks' = 0");
  // A table span shorter than batch x table_width was read past its end.
  BatchDesc short_tables = batch;
  short_tables.block_tables = std::span<const int32_t>(tables).first(3);
  expect_error([&] { slots_of(pos, req, short_tables, 4, 4, Layout{}); }, "'block_tables' = 3 entries");
  BatchDesc negative_width = batch;
  negative_width.table_width = -1;
  expect_error([&] { slots_of(pos, req, negative_width, 4, 4, Layout{}); }, "'table_width' = -1");
  // Per position: its block index past table_width, a block id out of range or negative.
  const std::vector<int64_t> far{8};  // local index 8 -> entry 2 of a 2-wide table
  expect_error([&] { slots_of(far, req, batch, 4, 4, Layout{}); }, "'block_tables[1]' = 2 entries");
  const std::vector<int32_t> bad_ids{0, -1, 7, 1};
  BatchDesc bad = batch;
  bad.block_tables = bad_ids;
  const std::vector<int64_t> second_block{4};
  const std::vector<int32_t> req0{0};
  expect_error([&] { slots_of(second_block, req0, bad, 4, 4, Layout{}); }, "'block_tables[0][1]' = -1");
  expect_error([&] { slots_of(pos, req, bad, 4, 4, Layout{}); }, "'block_tables[1][0]' = 7");
  const std::vector<int64_t> negative{-1};
  expect_error([&] { slots_of(negative, req, batch, 4, 4, Layout{}); }, "'position' = -1");
  // Valid: N = 2, rank 1, block 4: request 1's positions 1 (local 0) and 7 (local 3) -> table[0] = 2.
  const std::vector<int64_t> two{1, 7, 2};
  const std::vector<int32_t> ones{1, 1, 1};
  EXPECT_EQ(slots_of(two, ones, batch, 4, 4, Layout{2, 1, 1}), (std::vector<int64_t>{8, 11, kPadSlot}));
}

TEST(Layout, RefusesBadInput) {
  using testing::expect_error;
  expect_error([] { Layout{0, 0, 1}.validate(); }, "world_size");
  expect_error([] { Layout{2, 2, 1}.validate(); }, "'rank' = 2");
  expect_error([] { Layout{2, -1, 1}.validate(); }, "rank");
  expect_error([] { Layout{2, 0, 0}.validate(); }, "interleave");
  expect_error([] { Layout{2, 0, 3}.validate_with_block_size(16); }, "'interleave' = 3");
  expect_error([] { row_local_lengths(Mode::verify, 2, 3, Layout{}); }, "'seq_len' = 2: expected >= qlen (3)");
  expect_error([] { row_local_lengths(Mode::verify, -1, 1, Layout{}); }, "'seq_len' = -1: expected >= 0");
  expect_error([] { row_local_lengths(Mode::verify, 4, 0, Layout{}); }, "qlen");
  expect_error([] { row_local_lengths(Mode::decode, 4, 2, Layout{}); }, "qlen");
  // Refused before allocating qlen values (16 GiB here), in every mode.
  expect_error([] { row_local_lengths(Mode::verify, INT32_MAX, INT32_MAX, Layout{}); }, "'qlen' = 2147483647");
  expect_error([] { row_local_lengths(Mode::draft, 5, kMaxQlen + 1, Layout{}); }, "'qlen'");
  expect_error([] { row_local_lengths(Mode::verify, 0, INT32_MAX, Layout{}); }, "'qlen'");
  EXPECT_EQ(row_local_lengths(Mode::draft, 5, kMaxQlen, Layout{}).size(), size_t(kMaxQlen));
  const std::vector<int32_t> table{0, 1};
  const std::vector<int64_t> far{100};
  expect_error([&] { slot_mapping(far, table, 16, 2, Layout{}); }, "block_table");
  const std::vector<int32_t> bad{0, 7};
  const std::vector<int64_t> second_block{20};
  expect_error([&] { slot_mapping(second_block, bad, 16, 2, Layout{}); }, "block_table[1]");
  const std::vector<int64_t> negative{-1};
  expect_error([&] { slot_mapping(negative, table, 16, 2, Layout{}); }, "position");
}

}  // namespace dcpmla
