#include "dcpmla/types.h"

#include <array>
#include <string>
#include <utility>

#include "dcpmla/error.h"

namespace dcpmla {
namespace {

template <class E, size_t N>
std::string_view name_of(const detail::Names<E, N>& names, E e) {
  for (const auto& [v, name] : names)
    if (v == e) return name;
  return "?";
}

using detail::kBackendNames;
using detail::kDtypeNames;
using detail::kModeNames;
using detail::kRouteNames;

// "a, b or c", or with their values "a (0), b (1) or c (2)".
template <class E, size_t N>
std::string members(const detail::Names<E, N>& names, bool values) {
  std::string out;
  for (size_t i = 0; i < N; ++i) {
    if (i > 0) out += i + 1 == N ? " or " : ", ";
    out += values ? fmt::format("{} ({})", names[i].second, int(names[i].first)) : std::string(names[i].second);
  }
  return out;
}

// One name table per enum serves both directions.
template <class E, size_t N>
E parse(const detail::Names<E, N>& names, std::string_view field, std::string_view s) {
  for (const auto& [e, name] : names)
    if (name == s) return e;
  fail(field, fmt::format("'{}'", s), members(names, false));
}

}  // namespace

Mode parse_mode(std::string_view s) { return parse(kModeNames, "mode", s); }
KvDtype parse_kv_dtype(std::string_view s) { return parse(kDtypeNames, "kv_dtype", s); }
Route parse_route(std::string_view s) { return parse(kRouteNames, "route", s); }
Backend parse_backend(std::string_view s) { return parse(kBackendNames, "device", s); }

std::string_view to_string(Mode m) { return name_of(kModeNames, m); }
std::string_view to_string(KvDtype d) { return name_of(kDtypeNames, d); }
std::string_view to_string(Route r) { return name_of(kRouteNames, r); }
std::string_view to_string(Backend b) { return name_of(kBackendNames, b); }

namespace detail {
void fail_unknown(std::string_view field, Mode m) { fail(field, int(m), members(kModeNames, true)); }
void fail_unknown(std::string_view field, KvDtype d) { fail(field, int(d), members(kDtypeNames, true)); }
void fail_unknown(std::string_view field, Route r) { fail(field, int(r), members(kRouteNames, true)); }
void fail_unknown(std::string_view field, Backend b) { fail(field, int(b), members(kBackendNames, true)); }
}  // namespace detail

}  // namespace dcpmla
