// Shared test inputs: fresh random latents and queries (never zeros); error messages.
#pragma once

#include <functional>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

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

// Fails the test unless fn throws a dcpmla::Error whose message holds `needle`.
inline void expect_error(const std::function<void()>& fn, const std::string& needle) {
  const std::string message = error_of(fn);
  if (message.empty()) ADD_FAILURE() << "no error; expected one naming " << needle;
  else EXPECT_NE(message.find(needle), std::string::npos) << message;
}

}  // namespace dcpmla::testing
