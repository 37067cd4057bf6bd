#include "dcpmla/types.h"

#include <array>
#include <string>
#include <utility>

#include "dcpmla/error.h"

namespace dcpmla {
namespace {

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

template <class E, size_t N>
bool known(const std::array<std::pair<E, std::string_view>, N>& names, E e) {
  for (const auto& [v, name] : names)
    if (v == e) return true;
  return false;
}

// "a, b or c", or with their values "a (0), b (1) or c (2)".
template <class E, size_t N>
std::string members(const std::array<std::pair<E, std::string_view>, N>& names, bool values) {
  std::string out;
  for (size_t i = 0; i < N; ++i) {
    if (i > 0) out += i + 1 == N ? " or " : ", ";
    out += values ? fmt::format("{} ({})", names[i].second, int(names[i].first)) : std::string(names[i].second);
  }
  return out;
}

// One name table per enum serves both directions.
template <class E, size_t N>
E parse(const std::array<std::pair<E, std::string_view>, N>& names, std::string_view field, std::string_view s) {
  for (const auto& [e, name] : names)
    if (name == s) return e;
  fail(field, fmt::format("'{}'", s), members(names, false));
}

template <class E, size_t N>
void require_member(const std::array<std::pair<E, std::string_view>, N>& names, std::string_view field, E e) {
  if (!known(names, e)) fail(field, int(e), members(names, true));
}

}  // namespace

Mode parse_mode(std::string_view s) { return parse(kModes, "mode", s); }
KvDtype parse_kv_dtype(std::string_view s) { return parse(kDtypes, "kv_dtype", s); }
Route parse_route(std::string_view s) { return parse(kRoutes, "route", s); }
Backend parse_backend(std::string_view s) { return parse(kBackends, "device", s); }

std::string_view to_string(Mode m) { return name_of(kModes, m); }
std::string_view to_string(KvDtype d) { return name_of(kDtypes, d); }
std::string_view to_string(Route r) { return name_of(kRoutes, r); }
std::string_view to_string(Backend b) { return name_of(kBackends, b); }

bool is_known(Mode m) { return known(kModes, m); }
bool is_known(KvDtype d) { return known(kDtypes, d); }
bool is_known(Route r) { return known(kRoutes, r); }
bool is_known(Backend b) { return known(kBackends, b); }
void require_known(std::string_view field, Mode m) { require_member(kModes, field, m); }
void require_known(std::string_view field, KvDtype d) { require_member(kDtypes, field, d); }
void require_known(std::string_view field, Route r) { require_member(kRoutes, field, r); }
void require_known(std::string_view field, Backend b) { require_member(kBackends, field, b); }

}  // namespace dcpmla
