// The conformance entry point's options (AttentionOptions) for a test case, and the lengths
// the cases share. The conformance tests' case structs name the fields alike (mode, world,
// interleave, block_size, dtype, route); each test adds what it varies beyond them (merge
// form, segment length).
#pragma once

#include <algorithm>
#include <cstdint>

#include "dcpmla/runner.h"

namespace dcpmla::testing {

template <class Case>
AttentionOptions case_options(const Case& c, float kv_scale, uint64_t seed) {
  AttentionOptions o;
  o.mode = c.mode;
  o.world_size = c.world;
  o.interleave = c.interleave;
  o.block_size = c.block_size;
  o.kv_dtype = c.dtype;
  o.kv_scale = kv_scale;
  o.route = c.route;
  o.seed = seed;
  return o;
}

// A request the last rank holds none of, where the mode allows one: a random length of at most
// (N - 1) x I tokens (positions go to the ranks in runs of I, rank 0 first), but at least the
// qlen rows verify and decode need (draft reads [0, L) whatever its rows).
template <class Case, class Rng>
int32_t short_length(const Case& c, int qlen, Rng& rng) {
  const int32_t fewest = c.mode == Mode::draft ? 1 : qlen;
  return std::max(fewest, int32_t(rng() % uint64_t((c.world - 1) * c.interleave + 1)));
}

}  // namespace dcpmla::testing
