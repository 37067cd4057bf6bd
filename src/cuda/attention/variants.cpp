// The one table of compiled attention kernel variants, and the choice among them: adding a
// variant is one line here (plus its instantiation file under instantiations/).
#include "attention/variants.h"

#include <stdexcept>

#include "common/params.h"

namespace dcpmla::cuda_detail {
namespace {

constexpr uint32_t kBf16 = 1u << int(KvDtype::bf16);
constexpr uint32_t kE4m3 = 1u << int(KvDtype::fp8_e4m3);
constexpr uint32_t kE5m2 = 1u << int(KvDtype::fp8_e5m2);

// mma.sync: 16 MT rows per CTA, NT-token tiles, CPS CTAs per SM; fp8 caches dequantised.
template <int MT, int NT, int CPS, bool FP8>
constexpr KernelVariant mma() {
  return {Kernel::mma, 16 * MT, NT, CPS, FP8 ? kE4m3 | kE5m2 : kBf16, &launch_attention_variant<MT, NT, CPS, FP8>,
          &attention_smem_bytes<MT, NT, CPS, FP8>};
}
template <bool FP8>
constexpr KernelVariant wgmma() {
  return {Kernel::wgmma, 64, 64, 1, FP8 ? kE4m3 | kE5m2 : kBf16, &launch_attention_wgmma<FP8>,
          &attention_wgmma_smem_bytes<FP8>};
}
template <bool E5M2, int M>
constexpr KernelVariant fp8_swap() {
  return {Kernel::fp8_swap, M, 64, 1, E5M2 ? kE5m2 : kE4m3, &launch_attention_fp8_swap<E5M2, M>,
          &attention_fp8_swap_smem_bytes<E5M2, M>};
}

template <int M>
constexpr KernelVariant bf16_swap() {
  return {Kernel::bf16_swap, M, 64, 1, kBf16, &launch_attention_bf16_swap<M>, &attention_bf16_swap_smem_bytes<M>};
}

constexpr KernelVariant kVariants[] = {
    mma<1, 32, 1, false>(), mma<1, 32, 1, true>(), mma<1, 64, 1, false>(), mma<1, 64, 1, true>(),
    mma<1, 32, 2, false>(), mma<1, 32, 2, true>(), mma<2, 32, 1, false>(), mma<2, 32, 1, true>(),
    mma<2, 64, 1, false>(), mma<2, 64, 1, true>(), mma<4, 32, 1, false>(), mma<4, 32, 1, true>(),
    mma<4, 64, 1, false>(), mma<4, 64, 1, true>(), wgmma<false>(),         wgmma<true>(),
    fp8_swap<false, 16>(),  fp8_swap<true, 16>(),       fp8_swap<false, 32>(),   fp8_swap<true, 32>(),
    bf16_swap<16>(),        bf16_swap<32>(),
};

}  // namespace

std::span<const KernelVariant> variant_table() { return kVariants; }

const KernelVariant& find_variant(Kernel kernel, int rows_per_cta, int tile_tokens, int ctas_per_sm, KvDtype dtype) {
  for (const KernelVariant& v : kVariants)
    if (v.kernel == kernel && v.rows_per_cta == rows_per_cta && v.tile_tokens == tile_tokens &&
        v.ctas_per_sm == ctas_per_sm && (v.dtypes & (1u << int(dtype))))
      return v;
  throw std::logic_error("dcpmla: no compiled attention variant for this configuration");
}

// 64-row CTAs (qlen x heads > 32: verify at 16 heads, 128 heads) take the wgmma kernel for
// every cache: for bf16 the mma.sync kernel is bound by ldmatrix traffic there, and for fp8
// the wgmma kernel's dequantising producer warpgroup keeps the conversion off the tensor
// cores' path, 1.4-1.6x faster than the fp8 swap kernel's eight 16-row groups at 64+ rows
// (bench/NOTES.md, 2026-12-01). Below 64 rows fp8 caches take the fp8 swap kernel (it reads
// the cache without dequantising it; 2.7-3x faster than the dequantising kernels at 32
// rows), at 32 rows in its role-split form (one CTA reads each tile once for all 32 rows,
// one consumer on the scores and one on the values: 5-6 % faster than two 16-row CTAs in its
// first form, tenth session, and 6 % faster again, forty-fourth). bf16 caches: 16-row
// CTAs the bf16 swap kernel, 32-row ones the wgmma kernel padded to 64 rows: both stream
// through a producer warpgroup that runs ahead across units, which the serving batches' many
// units per CTA reward (H200, ninth session: at 16 rows the swap kernel 1-3.5 % faster than
// mma.sync on the serving rows; at 32 rows the padded wgmma kernel 4 % faster than mma.sync
// and 2 % faster than the 32-row swap kernel).
Kernel default_kernel(int rows_per_cta, bool fp8) {
  if (rows_per_cta == 64) return Kernel::wgmma;
  if (fp8) return Kernel::fp8_swap;
  return rows_per_cta == 16 ? Kernel::bf16_swap : Kernel::wgmma;
}

}  // namespace dcpmla::cuda_detail
