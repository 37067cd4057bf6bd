// The device's fp8 decodes, to bf16 (fp8x16_to_bf16x16: the mma.sync kernels) and to f16
// (fp8x16_to_f16x16: the wgmma kernel's fp8 producer), against the host decoder, for every
// pair of stored bytes of both formats: bit-exact for every number (subnormals, zeros of both
// signs, e5m2's infinities), NaN for every NaN code. A scenario's random cache never holds
// most of these codes.
#include <cuda_fp16.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "common/utils.cuh"
#include "cuda_helpers.h"

namespace {

// Thread i decodes the 16 bytes 16 i .. 16 i + 15 of `in` into out[8 i .. 8 i + 7] (bf16 or,
// F16, f16 pairs).
template <bool F16>
__global__ void decode_kernel(const uint4* in, uint32_t* out, int n, bool e5m2) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  uint32_t v[8];
  if constexpr (F16) dcpmla::cuda_detail::fp8x16_to_f16x16(in[i], e5m2, v);
  else dcpmla::cuda_detail::fp8x16_to_bf16x16(in[i], e5m2, v);
  for (int k = 0; k < 8; ++k) out[8 * i + k] = v[k];
}

template <bool F16>
float bits_to_float(uint16_t b) {
  if constexpr (F16) {
    __half_raw h;
    h.x = b;
    return __half2float(__half(h));
  }
  const uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

template <bool F16>
void check_format(dcpmla::KvDtype d) {
  using dcpmla::testing::DeviceBuffer;
  // Every 16-bit pattern as one pair: 65536 pairs, 8 pairs a 16-byte chunk.
  std::vector<uint8_t> bytes(2 * 65536);
  for (uint32_t v = 0; v < 65536; ++v) {
    bytes[2 * v] = uint8_t(v & 0xffu);
    bytes[2 * v + 1] = uint8_t(v >> 8);
  }
  const int chunks = int(bytes.size() / 16);
  std::vector<uint4> packed(static_cast<size_t>(chunks));
  std::memcpy(packed.data(), bytes.data(), bytes.size());
  DeviceBuffer<uint4> in(packed);
  DeviceBuffer<uint32_t> out(size_t(chunks) * 8);
  out.poison();
  decode_kernel<F16><<<(chunks + 127) / 128, 128>>>(in.get(), out.get(), chunks, d == dcpmla::KvDtype::fp8_e5m2);
  dcpmla::testing::cuda_ok(cudaGetLastError(), "decode_kernel launch");
  dcpmla::testing::cuda_ok(cudaDeviceSynchronize(), "decode_kernel");
  const std::vector<uint32_t> got = out.download();
  int bad = 0;
  for (size_t k = 0; k < bytes.size(); ++k) {
    const uint16_t b = uint16_t(got[k / 2] >> (16 * (k % 2)));
    const float want = dcpmla::fp8_to_float(bytes[k], d);
    const float have = bits_to_float<F16>(b);
    const bool ok = std::isnan(want) ? std::isnan(have) : std::memcmp(&want, &have, sizeof want) == 0;
    if (!ok && ++bad <= 5)
      ADD_FAILURE() << "byte 0x" << std::hex << int(bytes[k]) << " (pair position " << std::dec << k % 2
                    << "): want " << want << ", got " << (F16 ? "f16" : "bf16") << " 0x" << std::hex << b;
  }
  EXPECT_EQ(bad, 0);
}

// (format, target): every pair of both formats to bf16 and to f16.
class CudaFp8Decode : public ::testing::TestWithParam<std::tuple<dcpmla::KvDtype, bool>> {};

TEST_P(CudaFp8Decode, EveryPairIsExact) {
  DCPMLA_REQUIRE_GPU();
  const auto [d, f16] = GetParam();
  if (f16) check_format<true>(d);
  else check_format<false>(d);
}

INSTANTIATE_TEST_SUITE_P(Formats, CudaFp8Decode,
                         ::testing::Combine(::testing::Values(dcpmla::KvDtype::fp8_e4m3, dcpmla::KvDtype::fp8_e5m2),
                                            ::testing::Bool()),
                         [](const auto& info) {
                           return std::string(std::get<0>(info.param) == dcpmla::KvDtype::fp8_e5m2 ? "e5m2" : "e4m3") +
                                  (std::get<1>(info.param) ? "_to_f16" : "_to_bf16");
                         });

}  // namespace
