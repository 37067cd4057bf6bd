// Tile shapes of the sm_90a attention kernel (mma.sync m16n8k16 + cp.async pipeline).
// One CTA of 8 warps serves M = 16 * MT query rows (qlen x heads, flattened) of each
// piece of its chunk, streaming its KV in tiles of NT tokens through a ring of stages.
#pragma once

namespace dcpmla::cuda_detail {

inline constexpr int kDim = 576;          // D: key = the whole latent
inline constexpr int kRank = 512;         // R: value = the first R values
inline constexpr int kThreads = 256;      // 8 warps
inline constexpr int kSmemPerSm = 233472; // 228 KiB on sm_90, 1 KiB of it reserved per CTA
inline constexpr int kSmemPerCta = 232448;
inline constexpr int kMaxStages = 8;

// MT: m16 row tiles per CTA (1, 2, 4); NT: tokens per stage (32, 64); CPS: CTAs per SM
// (2 only for MT = 1: two CTAs overlap each other's softmax and barriers); FP8: the
// cache stores fp8 (dequantised in shared memory) instead of bf16.
template <int MT, int NT, int CPS, bool FP8>
struct AttnConfig {
  static_assert(MT == 1 || MT == 2 || MT == 4);
  static_assert(NT == 32 || NT == 64);
  static_assert(CPS == 1 || (CPS == 2 && MT == 1));
  static constexpr int M = 16 * MT;  // query rows per CTA
  // Warp grid of S = Q K^T: WM along rows (one m16 tile each), WN along tokens, WK along D.
  // WK > 1 keeps each warp's share of Q in registers (K read once); at M = 64 that would
  // not fit beside the output accumulators, so Q is re-read from shared memory.
  static constexpr int WM = MT;
  static constexpr int WK = MT == 4 ? 1 : (CPS == 2 ? 4 : 2);
  static constexpr int WN = 8 / (WM * WK);
  static constexpr int NTILES = NT / 8;      // n8 tiles of a stage
  static constexpr int NTW = NTILES / WN;    // n8 tiles per warp
  static constexpr int KSTEPS = kDim / 16;   // 36
  static constexpr int KS = KSTEPS / WK;     // k16 steps per warp
  static constexpr bool Q_IN_REGS = WK > 1;
  // Independent accumulator sets of S: the k16 steps of a warp form a chain of dependent
  // mma; ACC sets cut it ACC-fold (summed after the loop).
  static constexpr int ACC = NTW == 1 ? 3 : 2;
  static_assert(WM * WN * WK == 8 && NTW >= 1 && KS * WK == KSTEPS);

  static constexpr int ROW_BYTES = kDim * 2;                  // a bf16 row in shared memory
  static constexpr int STORED_ROW_BYTES = FP8 ? kDim : kDim * 2;
  static constexpr int STAGE_BYTES = NT * STORED_ROW_BYTES;

  static constexpr int Q_BYTES = M * ROW_BYTES;                        // (M, D) bf16, swizzled
  static constexpr int CONV_BYTES = FP8 ? NT * ROW_BYTES : 0;          // (NT, D) dequantised tile
  static constexpr int P_BYTES = M * NT * 2;                           // (M, NT) bf16
  static constexpr int RED_FLOATS = (WK - 1) * WM * WN * NTW * 4 * 32; // S partials of wk > 0
  static constexpr int STAT_FLOATS = M /*len*/ + WN * M /*max, then l*/ + M /*alpha*/ + M /*m*/;
  static constexpr int FIXED_BYTES = Q_BYTES + CONV_BYTES + P_BYTES + 4 * (RED_FLOATS + STAT_FLOATS);
  static constexpr int BUDGET = (CPS == 1 ? kSmemPerCta : kSmemPerSm / CPS - 1024) - 1024;
  static constexpr int STAGES_FIT = (BUDGET - FIXED_BYTES) / STAGE_BYTES;
  static constexpr int STAGES = STAGES_FIT < kMaxStages ? STAGES_FIT : kMaxStages;
  static_assert(STAGES >= 2, "tile does not fit twice in shared memory");
  static constexpr int SMEM_BYTES = FIXED_BYTES + STAGES * STAGE_BYTES;
};

}  // namespace dcpmla::cuda_detail
