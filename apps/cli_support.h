// Shared by the dcpmla tool and the bench binaries: CLI11 checks applied to an argument's text
// before anything runs. integer_in: a plain decimal integer of type T within [lo, hi] (CLI11's
// own conversion lets "-1" wrap to 2^64 - 1 for unsigned options, saturates values beyond the
// type and reads a leading 0 as octal, so "--heads 016" ran 14 heads; this refuses all three
// and names the option and the value). number_in: a finite decimal number within [lo, hi].
// writable_file: an output file that can be written, checked before a benchmark of minutes
// instead of after it.
#pragma once

#include <charconv>
#include <cstdio>
#include <filesystem>
#include <string>
#include <type_traits>

#include <unistd.h>

#include <CLI/CLI.hpp>

namespace dcpmla::cli {

// No fmt: bench.cu includes this, and fmt's constexpr code does not compile in nvcc's host pass.
template <class T>
std::string text_of(T value) {
  if constexpr (std::is_floating_point_v<T>) {
    char buffer[32];
    std::snprintf(buffer, sizeof buffer, "%g", double(value));
    return buffer;
  } else {
    return std::to_string(value);
  }
}

template <class T>
std::string range(T lo, T hi) {
  return "[" + text_of(lo) + ", " + text_of(hi) + "]";
}

template <class T>
CLI::Validator integer_in(T lo, T hi) {
  return CLI::Validator(
      [lo, hi](std::string& text) -> std::string {
        T value{};
        const char* end = text.data() + text.size();
        const auto [stop, ec] = std::from_chars(text.data(), end, value);
        const size_t digit = text.starts_with('-') ? 1 : 0;  // the first digit
        const bool leading_zero = text.size() > digit + 1 && text[digit] == '0';
        if (ec == std::errc() && stop == end && !leading_zero && value >= lo && value <= hi) return {};
        return "'" + text + "': expected a decimal integer in " + range(lo, hi) + (leading_zero ? ", without leading zeros" : "");
      },
      "INT in " + range(lo, hi));
}

// A plain decimal number within [lo, hi]: NaN and the infinities are outside every range (CLI11's
// own CLI::Range compares, and lets NaN through).
inline CLI::Validator number_in(double lo, double hi) {
  return CLI::Validator(
      [lo, hi](std::string& text) -> std::string {
        double value = 0;
        const char* end = text.data() + text.size();
        const auto [stop, ec] = std::from_chars(text.data(), end, value);
        if (ec == std::errc() && stop == end && value >= lo && value <= hi) return {};
        return "'" + text + "': expected a number in " + range(lo, hi);
      },
      "NUMBER in " + range(lo, hi));
}

inline CLI::Validator writable_file() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        namespace fs = std::filesystem;
        if (text.empty()) return "'': expected a file path";
        const fs::path path(text);
        std::error_code ec;
        if (fs::is_directory(path, ec)) return "'" + text + "': expected a file, not a directory";
        const fs::path dir = path.has_parent_path() ? path.parent_path() : fs::path(".");
        if (fs::exists(path, ec) ? access(text.c_str(), W_OK) != 0 : access(dir.c_str(), W_OK) != 0)
          return "'" + text + "': expected a file that can be written (in an existing, writable directory)";
        return {};
      },
      "FILE (written)");
}

}  // namespace dcpmla::cli
