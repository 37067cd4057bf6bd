// Shared test inputs: fresh random latents and queries (never zeros); error messages.
#pragma once

#include <functional>
#include <random>
#include <string>
#include <vector>

#include "dcpmla/error.h"

namespace dcpmla::testing {

inline std::vector<float> random_normal(size_t n, uint64_t seed, float stddev = 1.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.0f, stddev);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

// The message of the dcpmla::Error that fn throws; empty when it throws none.
inline std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return {};
}

}  // namespace dcpmla::testing
