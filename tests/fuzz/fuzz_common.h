// Shared helpers of the libFuzzer harnesses: value pickers that reach the edge cases
// (0, 1, negatives, powers of two, the top of the type) and an invariant check that aborts,
// so that libFuzzer records the input as a crash.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>

#include <fuzzer/FuzzedDataProvider.h>

namespace dcpmla::fuzz {

// One selector, then a value of that magnitude: small (around 0 and 1), moderate, a power
// of two, near the top of the type, or anything. Plain ConsumeIntegral would almost never
// produce the small values where most of the logic branches.
template <class T>
T pick(FuzzedDataProvider& in) {
  constexpr T top = std::numeric_limits<T>::max();
  switch (in.ConsumeIntegralInRange<int>(0, 5)) {
    case 0: return in.ConsumeIntegralInRange<T>(T(-2), T(9));
    case 1: return in.ConsumeIntegralInRange<T>(T(0), T(300));
    case 2: return in.ConsumeIntegralInRange<T>(T(0), T(1) << 20);
    case 3: return T(T(1) << in.ConsumeIntegralInRange<int>(0, std::numeric_limits<T>::digits - 1));
    case 4: return T(top - in.ConsumeIntegralInRange<T>(T(0), T(3)));
    default: return in.ConsumeIntegral<T>();
  }
}

// A field of a configuration: mostly inside [lo, hi], where the code under test does its
// work, sometimes any magnitude of pick(), where its validation does. With a dozen fields,
// drawing each from pick() alone would almost never give a configuration the library accepts.
template <class T>
T field(FuzzedDataProvider& in, T lo, T hi) {
  return in.ConsumeIntegralInRange<int>(0, 7) < 6 ? in.ConsumeIntegralInRange<T>(lo, hi) : pick<T>(in);
}

// n_r(w) exactly as SPEC §2 writes it, computed apart from the library's Layout.
inline int64_t spec_local_length(int64_t w, int64_t world, int64_t rank, int64_t interleave) {
  const __int128 span = __int128(interleave) * world;
  __int128 rem = w % span - __int128(rank) * interleave;
  rem = rem < 0 ? 0 : (rem > interleave ? interleave : rem);
  return int64_t((w / span) * interleave + rem);
}

[[noreturn]] inline void violated(const char* what, const char* file, int line) {
  std::fprintf(stderr, "fuzz invariant violated at %s:%d: %s\n", file, line, what);
  std::abort();
}

}  // namespace dcpmla::fuzz

#define FUZZ_CHECK(cond) \
  do {                   \
    if (!(cond)) ::dcpmla::fuzz::violated(#cond, __FILE__, __LINE__); \
  } while (0)
