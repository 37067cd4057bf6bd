#include "dcpmla/numeric.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numbers>

#include "dcpmla/error.h"

namespace dcpmla {
namespace {

struct Fp8Format {
  int mantissa_bits;
  int bias;
  float max;
  bool has_inf;  // e5m2 is IEEE-like; e4m3fn has no inf and one NaN pattern per sign
};

// Per value: the message is formatted only on failure.
Fp8Format format_of(KvDtype d) {
  if (d == KvDtype::fp8_e4m3) return Fp8Format{3, 7, 448.0f, false};
  if (d == KvDtype::fp8_e5m2) return Fp8Format{2, 15, 57344.0f, true};
  require_known("kv_dtype", d);
  fail("kv_dtype", enum_name(d), "an fp8 dtype (fp8_e4m3 or fp8_e5m2)");
}

}  // namespace

float fp8_max(KvDtype d) { return format_of(d).max; }

uint8_t float_to_fp8(float x, KvDtype d) {
  const Fp8Format f = format_of(d);
  if (std::isnan(x)) return uint8_t(0x7f);  // a NaN pattern in both formats
  const uint8_t sign = std::signbit(x) ? 0x80 : 0;
  float a = std::fabs(x);
  if (a > f.max) a = f.max;  // saturate (inf too)
  // Quantum at a's binade; below the smallest normal the subnormal quantum applies.
  const int min_exp = 1 - f.bias;
  int e;
  std::frexp(a, &e);
  e = std::max(e - 1, min_exp);
  const float quantum = std::ldexp(1.0f, e - f.mantissa_bits);
  const float q = std::nearbyint(a / quantum);  // ties to even in the default mode
  const float v = q * quantum;                  // <= max: max lies on the grid
  if (v == 0.0f) return sign;
  int ve;
  std::frexp(v, &ve);
  ve -= 1;
  uint32_t exp_field, mant;
  if (ve < min_exp) {
    exp_field = 0;
    mant = uint32_t(v / std::ldexp(1.0f, min_exp - f.mantissa_bits));
  } else {
    exp_field = uint32_t(ve + f.bias);
    mant = uint32_t(v / std::ldexp(1.0f, ve - f.mantissa_bits)) - (1u << f.mantissa_bits);
  }
  return uint8_t(sign | (exp_field << f.mantissa_bits) | mant);
}

float fp8_to_float(uint8_t bits, KvDtype d) {
  const Fp8Format f = format_of(d);
  const int exp_bits = 7 - f.mantissa_bits;
  const uint32_t exp_field = (bits >> f.mantissa_bits) & ((1u << exp_bits) - 1);
  const uint32_t mant = bits & ((1u << f.mantissa_bits) - 1);
  const float sign = (bits & 0x80) ? -1.0f : 1.0f;
  const uint32_t exp_all = (1u << exp_bits) - 1;
  if (f.has_inf && exp_field == exp_all)
    return mant == 0 ? sign * std::numeric_limits<float>::infinity()
                     : std::numeric_limits<float>::quiet_NaN();
  if (!f.has_inf && exp_field == exp_all && mant == (1u << f.mantissa_bits) - 1)
    return std::numeric_limits<float>::quiet_NaN();
  if (exp_field == 0) return sign * std::ldexp(float(mant), 1 - f.bias - f.mantissa_bits);
  return sign * std::ldexp(float(mant + (1u << f.mantissa_bits)),
                           int(exp_field) - f.bias - f.mantissa_bits);
}

namespace {

// Compared as doubles: narrowing a value outside float's range is undefined behaviour.
// `value` is printed in the caller's type (a float's 1e-45 is not a double's 1.4e-45).
template <class T>
void check_scale(std::string_view field, T value) {
  constexpr float lo = std::numeric_limits<float>::min(), hi = std::numeric_limits<float>::max();
  // Per run and write with an fp8 cache: the message is formatted only on failure.
  if (!(double(value) >= double(lo) && double(value) <= double(hi)))
    fail(field, value, fmt::format("a positive normal float32, in [{}, {}]", lo, hi));
}

// One rule for softmax_scale given as a double (Python) or a float (C++), as kv_scale_as_given.
template <class T>
float softmax_scale_as_given(T value) {
  check_scale("softmax_scale", value);
  if (double(value) > double(kMaxSoftmaxScale))
    fail("softmax_scale", value, fmt::format("<= {} (a larger scale overflows the float32 scores)", kMaxSoftmaxScale));
  return float(value);
}

// One rule for a cache scale given as a double (Python, CLI) or a float (C++): checked in the
// caller's type, so the message shows the value as given.
template <class T>
float kv_scale_as_given(T value, KvDtype dtype) {
  require_known("kv_dtype", dtype);
  if (dtype == KvDtype::bf16) {
    if (value != T(1)) fail("kv_scale", value, "1.0 for a bf16 cache (the scale is for fp8)");
    return 1.0f;
  }
  check_scale("kv_scale", value);
  if (double(value) > kMaxKvScale)
    fail("kv_scale", value,
         fmt::format("<= {:.4g} (the largest stored value times the scale, and the largest softmax_scale times "
                     "the scale, must stay finite float32)",
                     kMaxKvScale));
  return float(value);
}

}  // namespace

void require_scale(std::string_view field, float value) { check_scale(field, value); }
void require_softmax_scale(float value) { (void)softmax_scale_as_given(value); }
float checked_softmax_scale(double value) { return softmax_scale_as_given(value); }
void require_kv_scale(float value, KvDtype dtype) { (void)kv_scale_as_given(value, dtype); }
float checked_kv_scale(double value, KvDtype dtype) { return kv_scale_as_given(value, dtype); }

float quantize_roundtrip(float x, KvDtype d, float scale) {
  require_kv_scale(scale, d);
  const float b = round_to_bf16(x);
  if (d == KvDtype::bf16) return b;
  return fp8_to_float(float_to_fp8(b / scale, d), d) * scale;
}

}  // namespace dcpmla
