// Input errors: every check names the field, the value and what was expected.
// Thrown as dcpmla::Error (a std::invalid_argument, so Python sees ValueError),
// always before any memory is touched. Never an assert: asserts vanish in release builds.
#pragma once

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

template <class T>
void require(bool ok, std::string_view field, const T& value, std::string_view expected) {
  if (!ok) fail(field, value, expected);
}

}  // namespace dcpmla
