// The vocabulary of the contract (SPEC §1, §3, §4): modes, storage dtypes, routes.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

namespace dcpmla {

enum class Mode : int32_t { decode, verify, draft };
enum class KvDtype : int32_t { bf16, fp8_e4m3, fp8_e5m2 };
enum class Route : int32_t { automatic, one_stage, two_stage, split_k };
enum class Backend : int32_t { cpu, cuda };

// Each enum's members and names, in one table per enum (enum_names, found by argument-dependent
// lookup, so that the enums of other headers use the same checks: MergeForm, DcpMerge).
struct EnumName {
  int32_t value;
  std::string_view name;
};
inline constexpr std::array<EnumName, 3> kModeNames{
    {{int32_t(Mode::decode), "decode"}, {int32_t(Mode::verify), "verify"}, {int32_t(Mode::draft), "draft"}}};
inline constexpr std::array<EnumName, 3> kDtypeNames{{{int32_t(KvDtype::bf16), "bf16"},
                                                      {int32_t(KvDtype::fp8_e4m3), "fp8_e4m3"},
                                                      {int32_t(KvDtype::fp8_e5m2), "fp8_e5m2"}}};
inline constexpr std::array<EnumName, 4> kRouteNames{{{int32_t(Route::automatic), "auto"},
                                                      {int32_t(Route::one_stage), "one_stage"},
                                                      {int32_t(Route::two_stage), "two_stage"},
                                                      {int32_t(Route::split_k), "split_k"}}};
inline constexpr std::array<EnumName, 2> kBackendNames{{{int32_t(Backend::cpu), "cpu"}, {int32_t(Backend::cuda), "cuda"}}};
constexpr std::span<const EnumName> enum_names(Mode) { return kModeNames; }
constexpr std::span<const EnumName> enum_names(KvDtype) { return kDtypeNames; }
constexpr std::span<const EnumName> enum_names(Route) { return kRouteNames; }
constexpr std::span<const EnumName> enum_names(Backend) { return kBackendNames; }

template <class E>
concept NamedEnum = requires(E e) { enum_names(e); };

namespace detail {
// "'field' = 7: expected a (0), b (1) or c (2)" and "'field' = 'x': expected a, b or c" (out of
// line: formatting).
[[noreturn]] void fail_member(std::string_view field, int32_t value, std::span<const EnumName> names);
[[noreturn]] void fail_name(std::string_view field, std::string_view s, std::span<const EnumName> names);
}  // namespace detail

// Whether a value (an enum cast from any integer, as C and Python callers may pass) names one
// of the enum's members; require_known throws Error naming `field`, the value and the members.
template <NamedEnum E>
constexpr bool is_known(E e) {
  for (const EnumName& n : enum_names(e))
    if (n.value == int32_t(e)) return true;
  return false;
}
template <NamedEnum E>
void require_known(std::string_view field, E e) {
  if (!is_known(e)) detail::fail_member(field, int32_t(e), enum_names(e));
}
// The member's name ("?" for an unknown value), and the member a name stands for.
template <NamedEnum E>
constexpr std::string_view enum_name(E e) {
  for (const EnumName& n : enum_names(e))
    if (n.value == int32_t(e)) return n.name;
  return "?";
}
template <NamedEnum E>
E parse_enum(std::string_view field, std::string_view s) {
  for (const EnumName& n : enum_names(E{}))
    if (n.name == s) return E(n.value);
  detail::fail_name(field, s, enum_names(E{}));
}

inline Mode parse_mode(std::string_view s) { return parse_enum<Mode>("mode", s); }
inline KvDtype parse_kv_dtype(std::string_view s) { return parse_enum<KvDtype>("kv_dtype", s); }
inline Route parse_route(std::string_view s) { return parse_enum<Route>("route", s); }  // "auto" -> automatic
inline Backend parse_backend(std::string_view s) { return parse_enum<Backend>("device", s); }
inline std::string_view to_string(Mode m) { return enum_name(m); }
inline std::string_view to_string(KvDtype d) { return enum_name(d); }
inline std::string_view to_string(Route r) { return enum_name(r); }  // Route::automatic -> "auto"
inline std::string_view to_string(Backend b) { return enum_name(b); }

inline int bytes_per_value(KvDtype d) { return d == KvDtype::bf16 ? 2 : 1; }

// Latent geometry: D = R + P values per cached token; the value is the first R.
struct LatentDims {
  int kv_lora_rank = 512;  // R
  int rope_dim = 64;       // P
  int dim() const { return kv_lora_rank + rope_dim; }
  // R >= 1, P >= 1 and D fitting int32 (dcpmla::Error naming the field otherwise).
  void validate() const;
};

}  // namespace dcpmla
