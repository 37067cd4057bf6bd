// The vocabulary of the contract (SPEC §1, §3, §4): modes, storage dtypes, routes.
#pragma once

#include <cstdint>
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

// Whether a value (an enum cast from any integer, as C and Python callers may pass) names one
// of the enum's members; require_known throws Error naming `field`, the value and the members
// ("'mode' = 7: expected decode (0), verify (1) or draft (2)").
bool is_known(Mode m);
bool is_known(KvDtype d);
bool is_known(Route r);
bool is_known(Backend b);
void require_known(std::string_view field, Mode m);
void require_known(std::string_view field, KvDtype d);
void require_known(std::string_view field, Route r);
void require_known(std::string_view field, Backend b);

inline int bytes_per_value(KvDtype d) { return d == KvDtype::bf16 ? 2 : 1; }

// Latent geometry: D = R + P values per cached token; the value is the first R.
struct LatentDims {
  int kv_lora_rank = 512;  // R
  int rope_dim = 64;       // P
  int dim() const { return kv_lora_rank + rope_dim; }
};

}  // namespace dcpmla
