// The conformance entry point's options (AttentionOptions) for a test case. The conformance
// tests' case structs name the fields alike (mode, world, interleave, block_size, dtype,
// route); each test adds what it varies beyond them (merge form, segment length).
#pragma once

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

}  // namespace dcpmla::testing
