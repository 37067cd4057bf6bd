// The vocabulary of the contract (SPEC §1, §3, §4): modes, storage dtypes, routes.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <string>
#include <string_view>

namespace dcpmla {

enum class Mode : int32_t { decode, verify, draft };
enum class KvDtype : int32_t { bf16, fp8_e4m3, fp8_e5m2 };
enum class Route : int32_t { automatic, one_stage, two_stage, split_k };
enum class Backend : int32_t { cpu, cuda };

Mode parse_mode(std::string_view s);
KvDtype parse_kv_dtype(std::string_view s);
Route parse_route(std::string_view s);  // "auto" -> Route::automatic
Backend parse_backend(std::string_view s);

std::string_view to_string(Mode m);
std::string_view to_string(KvDtype d);
std::string_view to_string(Route r);  // Route::automatic -> "auto"
std::string_view to_string(Backend b);

namespace detail {
// Each enum's members and names (types.cpp parses and prints with them).
template <class E, size_t N>
using Names = std::array<std::pair<E, std::string_view>, N>;
inline constexpr Names<Mode, 3> kModeNames{{{Mode::decode, "decode"}, {Mode::verify, "verify"}, {Mode::draft, "draft"}}};
inline constexpr Names<KvDtype, 3> kDtypeNames{
    {{KvDtype::bf16, "bf16"}, {KvDtype::fp8_e4m3, "fp8_e4m3"}, {KvDtype::fp8_e5m2, "fp8_e5m2"}}};
inline constexpr Names<Route, 4> kRouteNames{
    {{Route::automatic, "auto"}, {Route::one_stage, "one_stage"}, {Route::two_stage, "two_stage"}, {Route::split_k, "split_k"}}};
inline constexpr Names<Backend, 2> kBackendNames{{{Backend::cpu, "cpu"}, {Backend::cuda, "cuda"}}};

template <class E, size_t N>
constexpr bool is_member(const Names<E, N>& names, E e) {
  for (const auto& [v, name] : names)
    if (v == e) return true;
  return false;
}

// "'mode' = 7: expected decode (0), verify (1) or draft (2)" (out of line: formatting).
[[noreturn]] void fail_unknown(std::string_view field, Mode m);
[[noreturn]] void fail_unknown(std::string_view field, KvDtype d);
[[noreturn]] void fail_unknown(std::string_view field, Route r);
[[noreturn]] void fail_unknown(std::string_view field, Backend b);
}  // namespace detail

// Whether a value (an enum cast from any integer, as C and Python callers may pass) names one
// of the enum's members; require_known throws Error naming `field`, the value and the members.
// Inline: the planner checks a mode per query row.
inline bool is_known(Mode m) { return detail::is_member(detail::kModeNames, m); }
inline bool is_known(KvDtype d) { return detail::is_member(detail::kDtypeNames, d); }
inline bool is_known(Route r) { return detail::is_member(detail::kRouteNames, r); }
inline bool is_known(Backend b) { return detail::is_member(detail::kBackendNames, b); }
template <class E>
void require_known(std::string_view field, E e) {
  if (!is_known(e)) detail::fail_unknown(field, e);
}

inline int bytes_per_value(KvDtype d) { return d == KvDtype::bf16 ? 2 : 1; }

// Latent geometry: D = R + P values per cached token; the value is the first R.
struct LatentDims {
  int kv_lora_rank = 512;  // R
  int rope_dim = 64;       // P
  int dim() const { return kv_lora_rank + rope_dim; }
};

}  // namespace dcpmla
