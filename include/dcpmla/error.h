// Input errors: every check names the field, the value and what was expected.
// Thrown as dcpmla::Error (a std::invalid_argument, so Python sees ValueError),
// always before any memory is touched. Never an assert: asserts vanish in release builds.
#pragma once

#include <cstddef>
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

// "field 'seq_lens[2]' = -3: expected >= 0 (0 marks a padding request)"
template <class T>
Error make_error(std::string_view field, const T& value, std::string_view expected) {
  return Error(fmt::format("dcpmla: field '{}' = {}: expected {}", field, value, expected));
}

template <class T>
[[noreturn]] void fail(std::string_view field, const T& value, std::string_view expected) {
  throw make_error(field, value, expected);
}

// Its arguments are built before the call: where a message is formatted (fmt::format) and the
// check runs per step, per layer or per element, write `if (!ok) fail(...)` instead.
template <class T>
void require(bool ok, std::string_view field, const T& value, std::string_view expected) {
  if (!ok) fail(field, value, expected);
}

// A size in a refusal: GiB to three digits and the exact bytes, so that a size just past a limit
// never reads as the limit ("8 GiB: expected at most 8 GiB").
inline std::string bytes_text(double bytes) {
  return fmt::format("{:.3g} GiB ({:.0f} bytes)", bytes / double(int64_t(1) << 30), bytes);
}

// A pointer read or written `align` bytes at a time (a whole value; on CUDA uint4 / cp.async
// loads and vector stores): on a device a misaligned one faults and takes the CUDA context
// down, on the host it is undefined behaviour, so it is refused. Null passes (checked apart).
// A plain comparison, formatted only on failure: the run entries pass here every layer.
inline void require_aligned(const void* p, size_t align, std::string_view field, std::string_view expected) {
  if (reinterpret_cast<uintptr_t>(p) % align != 0) fail(field, fmt::format("address {}", p), expected);
}

// Host memory of whole T values (the CPU backend reads and writes no wider): a misaligned T*
// is undefined behaviour.
template <class T>
void require_value_aligned(const T* p, std::string_view field) {
  if (reinterpret_cast<uintptr_t>(p) % alignof(T) != 0)
    fail(field, fmt::format("address {}", static_cast<const void*>(p)),
         fmt::format("{}-byte aligned memory (whole values)", alignof(T)));
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

// A buffer of a call, named for the message: bytes [at, at + bytes); bytes 0 (absent) overlaps
// nothing.
struct NamedBytes {
  std::string_view field;
  const void* at = nullptr;
  int64_t bytes = 0;
};

// Refuses an output that shares a byte with an input or with another output: aliased buffers
// give silently wrong answers (or a cache corrupted by its own read). Address comparisons
// only, so it runs on every call; no formatting unless it throws.
inline void require_disjoint(std::initializer_list<NamedBytes> outputs, std::initializer_list<NamedBytes> inputs) {
  auto overlap = [](const NamedBytes& a, const NamedBytes& b) {
    const auto x = reinterpret_cast<uintptr_t>(a.at), y = reinterpret_cast<uintptr_t>(b.at);
    return a.bytes > 0 && b.bytes > 0 && x < y + uint64_t(b.bytes) && y < x + uint64_t(a.bytes);
  };
  auto refuse = [](const NamedBytes& out, const NamedBytes& other) {
    fail(out.field,
         fmt::format("{} bytes at {}, overlapping {} ({} bytes at {})", out.bytes, out.at, other.field, other.bytes,
                     other.at),
         "memory that shares no byte with the call's other tensors (pass a separate buffer)");
  };
  for (auto o = outputs.begin(); o != outputs.end(); ++o) {
    for (const NamedBytes& in : inputs)
      if (overlap(*o, in)) refuse(*o, in);
    for (auto other = o + 1; other != outputs.end(); ++other)
      if (overlap(*o, *other)) refuse(*o, *other);
  }
}

}  // namespace dcpmla
