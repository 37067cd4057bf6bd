// Input errors: every check names the field, the value and what was expected.
// Thrown as dcpmla::Error (a std::invalid_argument, so Python sees ValueError),
// always before any memory is touched. Never an assert: asserts vanish in release builds.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>

#include <fmt/format.h>

namespace dcpmla {

class Error : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// "field 'seq_lens[2]' = -3: expected >= 0"
template <class T>
[[noreturn]] void fail(std::string_view field, const T& value, std::string_view expected) {
  throw Error(fmt::format("dcpmla: field '{}' = {}: expected {}", field, value, expected));
}

// Its arguments are built before the call: where a message is formatted (fmt::format) and the
// check runs per step, per layer or per element, write `if (!ok) fail(...)` instead.
template <class T>
void require(bool ok, std::string_view field, const T& value, std::string_view expected) {
  if (!ok) fail(field, value, expected);
}

// The product of sizes, or nullopt when a factor is negative or the product overflows int64:
// a size check of valid-looking arguments must not wrap (a max_len of 2^62 once made an
// expected size of 0, then a null read).
inline std::optional<int64_t> checked_product(std::initializer_list<int64_t> factors) {
  int64_t n = 1;
  for (const int64_t f : factors)
    if (f < 0 || __builtin_mul_overflow(n, f, &n)) return std::nullopt;
  return n;
}

}  // namespace dcpmla
