// Shared test inputs: fresh random latents and queries (never zeros).
#pragma once

#include <random>
#include <vector>

namespace dcpmla::testing {

inline std::vector<float> random_normal(size_t n, uint64_t seed, float stddev = 1.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.0f, stddev);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

}  // namespace dcpmla::testing
