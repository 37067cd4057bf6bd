#include "dcpmla/types.h"

#include <array>
#include <utility>

#include "dcpmla/error.h"

namespace dcpmla {
namespace {

// One name table per enum serves both directions.
template <class E, size_t N>
E parse(const std::array<std::pair<E, std::string_view>, N>& names, std::string_view field,
        std::string_view s, std::string_view expected) {
  for (const auto& [e, name] : names)
    if (name == s) return e;
  fail(field, fmt::format("'{}'", s), expected);
}

template <class E, size_t N>
std::string_view name_of(const std::array<std::pair<E, std::string_view>, N>& names, E e) {
  for (const auto& [v, name] : names)
    if (v == e) return name;
  return "?";
}

constexpr std::array<std::pair<Mode, std::string_view>, 3> kModes{
    {{Mode::decode, "decode"}, {Mode::verify, "verify"}, {Mode::draft, "draft"}}};
constexpr std::array<std::pair<KvDtype, std::string_view>, 3> kDtypes{
    {{KvDtype::bf16, "bf16"}, {KvDtype::fp8_e4m3, "fp8_e4m3"}, {KvDtype::fp8_e5m2, "fp8_e5m2"}}};
constexpr std::array<std::pair<Route, std::string_view>, 4> kRoutes{{{Route::automatic, "auto"},
                                                                     {Route::one_stage, "one_stage"},
                                                                     {Route::two_stage, "two_stage"},
                                                                     {Route::split_k, "split_k"}}};
constexpr std::array<std::pair<Backend, std::string_view>, 2> kBackends{
    {{Backend::cpu, "cpu"}, {Backend::cuda, "cuda"}}};

}  // namespace

Mode parse_mode(std::string_view s) { return parse(kModes, "mode", s, "decode, verify or draft"); }
KvDtype parse_kv_dtype(std::string_view s) {
  return parse(kDtypes, "kv_dtype", s, "bf16, fp8_e4m3 or fp8_e5m2");
}
Route parse_route(std::string_view s) {
  return parse(kRoutes, "route", s, "auto, one_stage, two_stage or split_k");
}
Backend parse_backend(std::string_view s) { return parse(kBackends, "device", s, "cpu or cuda"); }

std::string_view to_string(Mode m) { return name_of(kModes, m); }
std::string_view to_string(KvDtype d) { return name_of(kDtypes, d); }
std::string_view to_string(Route r) { return name_of(kRoutes, r); }
std::string_view to_string(Backend b) { return name_of(kBackends, b); }

}  // namespace dcpmla
