// Shared by the dcpmla tool and the bench binaries: a CLI11 check that an argument is a
// plain decimal integer of type T within [lo, hi], applied to the text before CLI11
// converts it. CLI11's own conversion lets "-1" wrap to 2^64 - 1 for unsigned options and
// saturates values beyond the type; this refuses both and names the option and the value.
#pragma once

#include <charconv>
#include <string>

#include <CLI/CLI.hpp>

namespace dcpmla::cli {

// No fmt: bench.cu includes this, and fmt's constexpr code does not compile in nvcc's host pass.
template <class T>
std::string range(T lo, T hi) {
  return "[" + std::to_string(lo) + ", " + std::to_string(hi) + "]";
}

template <class T>
CLI::Validator integer_in(T lo, T hi) {
  return CLI::Validator(
      [lo, hi](std::string& text) -> std::string {
        T value{};
        const char* end = text.data() + text.size();
        const auto [stop, ec] = std::from_chars(text.data(), end, value);
        if (ec == std::errc() && stop == end && value >= lo && value <= hi) return {};
        return "'" + text + "': expected a decimal integer in " + range(lo, hi);
      },
      "INT in " + range(lo, hi));
}

}  // namespace dcpmla::cli
