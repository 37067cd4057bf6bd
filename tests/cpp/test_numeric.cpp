#include "dcpmla/numeric.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <numbers>
#include <string>

#include "dcpmla/error.h"
#include "test_helpers.h"

namespace dcpmla {

TEST(Numeric, Bf16RoundsToNearestEven) {
  EXPECT_EQ(float_to_bf16(1.0f).bits, 0x3f80);
  EXPECT_EQ(round_to_bf16(1.0f + 1.0f / 256), 1.0f);                // tie -> even (down)
  EXPECT_EQ(round_to_bf16(1.0f + 3.0f / 256), 1.0f + 4.0f / 256);   // tie -> even (up)
  EXPECT_EQ(round_to_bf16(1.0f + 1.5f / 256), 1.0f + 2.0f / 256);
  EXPECT_TRUE(std::isnan(round_to_bf16(NAN)));
  EXPECT_TRUE(std::isinf(round_to_bf16(INFINITY)));
}

class Fp8 : public ::testing::TestWithParam<KvDtype> {};

TEST_P(Fp8, EveryFiniteCodeRoundTrips) {
  const KvDtype d = GetParam();
  int finite = 0;
  for (int v = 0; v < 256; ++v) {
    const float x = fp8_to_float(uint8_t(v), d);
    if (!std::isfinite(x)) continue;
    ++finite;
    const uint8_t back = float_to_fp8(x, d);
    if (x == 0.0f) EXPECT_EQ(fp8_to_float(back, d), 0.0f);
    else EXPECT_EQ(back, v) << "code " << v << " value " << x;
  }
  EXPECT_EQ(finite, d == KvDtype::fp8_e4m3 ? 254 : 248);
}

TEST_P(Fp8, SaturatesAndRoundsToNearestEven) {
  const KvDtype d = GetParam();
  const float max = fp8_max(d);
  EXPECT_EQ(fp8_to_float(float_to_fp8(max * 4, d), d), max);
  EXPECT_EQ(fp8_to_float(float_to_fp8(-INFINITY, d), d), -max);
  EXPECT_TRUE(std::isnan(fp8_to_float(float_to_fp8(NAN, d), d)));
  // Between 1 and the next code: the midpoint goes to the even code (1.0).
  const float step = d == KvDtype::fp8_e4m3 ? 0.125f : 0.25f;
  EXPECT_EQ(fp8_to_float(float_to_fp8(1.0f + step / 2, d), d), 1.0f);
  EXPECT_EQ(fp8_to_float(float_to_fp8(1.0f + 3 * step / 2, d), d), 1.0f + 2 * step);
  EXPECT_EQ(fp8_max(d), d == KvDtype::fp8_e4m3 ? 448.0f : 57344.0f);
}

TEST_P(Fp8, RoundTripIsWithinHalfAQuantum) {
  const KvDtype d = GetParam();
  const float rel = d == KvDtype::fp8_e4m3 ? 1.0f / 16 : 1.0f / 8;
  for (float x = -3.0f; x <= 3.0f; x += 0.01f) {
    const float y = quantize_roundtrip(x, d, 0.05f);
    EXPECT_LE(std::fabs(y - round_to_bf16(x)), rel * std::fabs(x) + 0.05f * 0.02f) << x;
  }
}

TEST(Numeric, ScalesArePositiveNormalFloat32sReportedAsGiven) {
  for (double ok : {double(std::numeric_limits<float>::min()), 1.0, 0.0417, double(kMaxSoftmaxScale)})
    EXPECT_EQ(checked_softmax_scale(ok), float(ok));
  // Each of these would narrow to 0, a subnormal or inf; the message shows the caller's value.
  const std::pair<double, const char*> bad[] = {
      {1e-50, "= 1e-50:"}, {1e-46, "= 1e-46:"}, {1e-40, "= 1e-40:"}, {1e39, "= 1e+39:"}, {0.0, "= 0:"},
      {-0.5, "= -0.5:"},   {std::nan(""), "= nan:"},   {INFINITY, "= inf:"}};
  for (const auto& [value, shown] : bad) {
    try {
      checked_softmax_scale(value);
      ADD_FAILURE() << "accepted " << value;
    } catch (const Error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find(std::string("'softmax_scale' ") + shown), std::string::npos) << what;
      EXPECT_NE(what.find("positive normal float32"), std::string::npos) << what;
    }
  }
}

// A softmax_scale past kMaxSoftmaxScale overflowed the float32 scores of ordinary inputs
// (1e37: every output NaN, where the float64 reference is finite); it is refused.
TEST(Numeric, SoftmaxScaleHasACeiling) {
  EXPECT_NO_THROW(require_softmax_scale(kMaxSoftmaxScale));
  EXPECT_NO_THROW(require_softmax_scale(0.0417f));
  for (float bad : {65536.5f, 1e37f, std::numeric_limits<float>::max(), 0.0f}) {
    try {
      require_softmax_scale(bad);
      ADD_FAILURE() << "accepted " << bad;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("'softmax_scale'"), std::string::npos) << e.what();
    }
  }
}

// A double just past the ceiling rounds to it as a float32 (65536.003f == 65536): it is
// refused as given, before it narrows.
TEST(Numeric, SoftmaxScaleCeilingIsCheckedBeforeNarrowing) {
  ASSERT_EQ(float(65536.003), kMaxSoftmaxScale);
  testing::expect_error([] { (void)checked_softmax_scale(65536.003); }, "'softmax_scale' = 65536.003: expected <= 65536");
  EXPECT_EQ(checked_softmax_scale(65536.0), kMaxSoftmaxScale);
}

// The fp8 helpers took any other dtype as e5m2 (fp8_max(bf16) was 57344), and quantize_roundtrip
// took any scale (0 gave 0, a bf16 cache's 0.5 was ignored).
TEST(Numeric, Fp8HelpersTakeFp8DtypesAndValidScales) {
  using testing::expect_error;
  expect_error([] { (void)fp8_max(KvDtype::bf16); }, "'kv_dtype' = bf16: expected an fp8 dtype");
  expect_error([] { (void)fp8_max(KvDtype(9)); }, "'kv_dtype' = 9");
  expect_error([] { (void)float_to_fp8(1.0f, KvDtype::bf16); }, "'kv_dtype' = bf16");
  expect_error([] { (void)fp8_to_float(0x3c, KvDtype(-1)); }, "'kv_dtype' = -1");
  expect_error([] { (void)quantize_roundtrip(3.0f, KvDtype::fp8_e4m3, 0.0f); }, "'kv_scale' = 0");
  expect_error([] { (void)quantize_roundtrip(3.0f, KvDtype::fp8_e5m2, -1.0f); }, "'kv_scale' = -1");
  expect_error([] { (void)quantize_roundtrip(3.0f, KvDtype::bf16, 0.5f); }, "'kv_scale' = 0.5");
  expect_error([] { (void)quantize_roundtrip(3.0f, KvDtype(7), 1.0f); }, "'kv_dtype' = 7");
  EXPECT_EQ(quantize_roundtrip(3.0f, KvDtype::bf16, 1.0f), 3.0f);
  EXPECT_EQ(quantize_roundtrip(3.0f, KvDtype::fp8_e4m3, 1.0f), 3.0f);
}

// A scale past FLT_MAX / fp8_max read the largest stored value back as inf, and every score
// of its token as NaN (a finite latent of 3.4e38 at kv_scale 1e38); the CUDA kernels fold
// softmax_scale x kv_scale x log2 e into one float, which must stay finite too. Refused past the
// smaller bound, which names itself.
TEST(Numeric, KvScaleKeepsEveryStoredValueFinite) {
  using testing::expect_error;
  const double most = double(std::numeric_limits<float>::max()) / (65536.0 * std::numbers::log2e);
  EXPECT_EQ(kMaxKvScale, most);
  for (KvDtype d : {KvDtype::fp8_e4m3, KvDtype::fp8_e5m2}) {
    const float largest = std::nextafter(float(most), 0.0f);
    EXPECT_NO_THROW(require_kv_scale(largest, d));
    EXPECT_TRUE(std::isfinite(quantize_roundtrip(3.0e38f, d, largest))) << to_string(d);
    EXPECT_TRUE(std::isfinite(kMaxSoftmaxScale * largest * float(std::numbers::log2e))) << to_string(d);
    expect_error([&] { require_kv_scale(float(most) * 2.0f, d); }, "'kv_scale' = 7.");
    expect_error([&] { (void)checked_kv_scale(1e38, d); }, "'kv_scale' = 1e+38: expected <= 3.59");
  }
}

INSTANTIATE_TEST_SUITE_P(Formats, Fp8, ::testing::Values(KvDtype::fp8_e4m3, KvDtype::fp8_e5m2));

}  // namespace dcpmla
