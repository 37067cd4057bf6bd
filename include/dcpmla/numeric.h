// Storage number formats: bf16 and the two OCP fp8 formats, bit-exact on the host.
// fp8 storage follows SPEC §3: stored = rne(sat(bf16(x) / scale)) in float32, read = stored * scale.
#pragma once

#include <cstdint>
#include <cstring>
#include <limits>
#include <numbers>
#include <string_view>

#include "dcpmla/types.h"

namespace dcpmla {

// The softmax's constants, defined once for the host and the kernels: scores go to base 2
// (exp2), the lse back to the natural log; -inf is the maximum of an empty row and the lse of
// a row with no key.
inline constexpr float kLog2e = std::numbers::log2e_v<float>;
inline constexpr float kLn2 = std::numbers::ln2_v<float>;
inline constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Same layout as CUDA's __nv_bfloat16, so buffers cross into kernels unchanged.
struct bf16 {
  uint16_t bits = 0;
};

inline float bf16_to_float(bf16 h) {
  uint32_t u = uint32_t(h.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round to nearest even; NaN stays NaN (quiet), inf stays inf.
inline bf16 float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16{uint16_t((u >> 16) | 0x40u)};
  u += 0x7fffu + ((u >> 16) & 1u);
  return bf16{uint16_t(u >> 16)};
}

inline float round_to_bf16(float f) { return bf16_to_float(float_to_bf16(f)); }

// Largest finite value of each fp8 format (e4m3fn: 448, e5m2: 57344). These three take an fp8
// dtype only (dcpmla::Error naming kv_dtype otherwise).
float fp8_max(KvDtype d);

// x saturated to the format's range, rounded to nearest even (the caller divides by
// the scale first, in float32). NaN -> NaN.
uint8_t float_to_fp8(float x, KvDtype d);
float fp8_to_float(uint8_t bits, KvDtype d);

// A scale (softmax_scale, kv_scale) must be a positive normal float32: zero would silently
// mean "default" where 0 is the default's marker, a subnormal loses its precision and makes
// 1 / scale overflow, inf and NaN poison every score. Throws dcpmla::Error naming the field
// and the value as the caller gave it (a double from Python is checked before it narrows).
void require_scale(std::string_view field, float value);
// softmax_scale also at most kMaxSoftmaxScale: the kernels scale scores in float32, and a
// huge finite scale overflows them for ordinary inputs (1e37 made every output NaN, where
// the float64 reference stays finite). Models use about D^-0.5 times a small factor.
inline constexpr float kMaxSoftmaxScale = 65536.0f;
void require_softmax_scale(float value);
// The same for a double (from Python), checked before it narrows (65536.003 would round to the
// ceiling itself) and reported as given.
float checked_softmax_scale(double value);

// The largest fp8 cache scale, about 3.6e33: the CUDA kernels fold softmax_scale x kv_scale x
// log2 e into one float32, and every stored value must read back finite (fp8_max x scale).
inline constexpr double kMaxKvScale =
    double(std::numeric_limits<float>::max()) / (double(kMaxSoftmaxScale) * std::numbers::log2e);
static_assert(kMaxKvScale * 57344.0 <= double(std::numeric_limits<float>::max()), "e5m2's largest value reads back");

// A cache scale (read = stored * scale): exactly 1 for bf16, else a positive normal float32 of
// at most kMaxKvScale (beyond, the largest stored value, or the CUDA kernels' folded score
// scale, is inf and the scores NaN); the dtype must be known. checked_kv_scale takes it as a
// double (Python, CLI), checked before it narrows, the message showing the value as given.
void require_kv_scale(float value, KvDtype dtype);
float checked_kv_scale(double value, KvDtype dtype);

// One stored value of a cache of dtype d with the given scale (require_kv_scale), read back as
// float.
float quantize_roundtrip(float x, KvDtype d, float scale);

}  // namespace dcpmla
