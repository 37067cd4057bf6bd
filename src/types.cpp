#include "dcpmla/types.h"

#include <string>

#include "dcpmla/error.h"

namespace dcpmla::detail {
namespace {

// "a, b or c", or with their values "a (0), b (1) or c (2)".
std::string members(std::span<const EnumName> names, bool values) {
  std::string out;
  for (size_t i = 0; i < names.size(); ++i) {
    if (i > 0) out += i + 1 == names.size() ? " or " : ", ";
    out += values ? fmt::format("{} ({})", names[i].name, names[i].value) : std::string(names[i].name);
  }
  return out;
}

}  // namespace

void fail_member(std::string_view field, int32_t value, std::span<const EnumName> names) {
  fail(field, value, members(names, true));
}

void fail_name(std::string_view field, std::string_view s, std::span<const EnumName> names) {
  // Escaped ({fmt}'s debug form without its double quotes): a NUL or control byte in the value
  // would otherwise cut the message, which crosses into Python as a C string, or garble it.
  const std::string escaped = fmt::format("{:?}", s);
  fail(field, fmt::format("'{}'", std::string_view(escaped).substr(1, escaped.size() - 2)), members(names, false));
}

}  // namespace dcpmla::detail

namespace dcpmla {

void LatentDims::validate() const {
  require(kv_lora_rank >= 1, "kv_lora_rank", kv_lora_rank, ">= 1");
  require(rope_dim >= 1, "rope_dim", rope_dim, ">= 1 (kv_lora_rank < D)");
  // D = R + P is an int everywhere downstream (found by fuzz_planner).
  if (rope_dim > INT32_MAX - kv_lora_rank)
    fail("kv_lora_rank + rope_dim", fmt::format("{} + {}", kv_lora_rank, rope_dim),
         fmt::format("a latent width D that fits int32 (<= {})", INT32_MAX));
}

}  // namespace dcpmla
