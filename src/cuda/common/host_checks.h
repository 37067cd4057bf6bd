// Host-side checks the CUDA entry points share (host .cpp files only). Plain comparisons on
// every call; the message is formatted only when a check fails (hot-path rule).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include <fmt/format.h>

#include "dcpmla/error.h"

namespace dcpmla::cuda_detail {

// A device pointer the kernels access `align` bytes at a time (uint4 / cp.async loads, vector
// stores, a float scale): a misaligned one would fault on the device (misaligned address)
// and take the CUDA context down with it, so it is refused here. Null passes (checked apart).
inline void require_aligned(const void* p, size_t align, std::string_view field, std::string_view expected) {
  if (reinterpret_cast<uintptr_t>(p) % align != 0) fail(field, fmt::format("address {}", p), expected);
}

}  // namespace dcpmla::cuda_detail
