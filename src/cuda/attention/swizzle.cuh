// Shared-memory layouts of the attention kernels: where 16-byte chunk `chunk` of row `row` of
// an operand sits (byte offset from the buffer's base). The XOR with the row spreads the rows
// that one ldmatrix / wgmma access reads over distinct banks.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>  // __host__ __device__ under a host compiler too

#include "config.h"

namespace dcpmla::cuda_detail {

// mma.sync kernel: a (rows, 576) bf16 buffer in whole rows of 1152 B (= 0 mod 128, so
// without the XOR the 8 rows an ldmatrix reads would share banks).
__device__ __forceinline__ uint32_t swz(int row, int chunk) {
  return uint32_t(row * (kDim * 2) + ((chunk ^ (row & 7)) << 4));
}

// mma.sync kernel's P, (M, NT) bf16: rows of NT / 8 chunks. With 4 chunks (64 B) pairs of rows
// share banks, hence the row >> 1.
template <int NT>
__device__ __forceinline__ uint32_t swz_p(int row, int chunk) {
  if constexpr (NT == 64) return uint32_t(row * 128 + ((chunk ^ (row & 7)) << 4));
  else return uint32_t(row * 64 + ((chunk ^ ((row >> 1) & 3)) << 4));
}

// wgmma operands on swizzle atoms (the 128-byte swizzle of SmemDesc): a stack of
// column blocks of 128-byte rows, `block_bytes` apart (each on a 1024-byte boundary); chunk
// c (< 8) of a row of block `block` sits at chunk c ^ (row % 8). Callers pass the block and
// the chunk within it: split from a flat chunk index at run time they cost registers.
// Host-callable for the producers' map test (tile_maps.h).
__host__ __device__ __forceinline__ uint32_t swz128(int row, int block, int chunk, int block_bytes) {
  return uint32_t(block * block_bytes + row * 128 + ((chunk ^ (row & 7)) << 4));
}

}  // namespace dcpmla::cuda_detail
