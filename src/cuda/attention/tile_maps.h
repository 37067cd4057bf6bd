// Which producer thread moves which bytes of a KV tile (64 tokens of 576 values) into a
// 128-byte-swizzled stage (swz128, swizzle.cuh: column block b holds values 64 b .. 64 b + 63 of
// every token, the token's 16-byte chunk c of the block at chunk c ^ (token % 8) of its
// 128-byte row). Host-callable, so that a test without a GPU checks what the kernels' speed
// rests on (tests/cuda/test_tile_maps.cpp): every chunk moved once, a warp's load instruction
// reading whole 32-byte sectors, and a quarter warp's eight 16-byte stores falling on eight
// distinct bank groups.
#pragma once

#include <cuda_runtime_api.h>  // __host__ __device__ under a host compiler too

namespace dcpmla::cuda_detail {

// bf16 tiles by cp.async (stream_bf16_tiles): thread t copies chunk chunk(t) of every column
// block of tokens token(t, j) (j < 4): a warp's copy reads 4 tokens x 128 contiguous bytes.
struct Bf16TileMap {
  static constexpr int kTokens = 4;  // per thread
  __host__ __device__ static constexpr int token(int t, int j) { return (t >> 3) + 16 * j; }
  __host__ __device__ static constexpr int chunk(int t) { return t & 7; }
};

// fp8 tiles dequantised by the 64-row kernel's producer (wgmma_fp8_producer): thread t loads
// fp8 chunk fp8_chunk(t, k) (16 values) of piece k (64 bytes: column block k) of tokens
// token(t, h) (h < 2), four threads a token, and stores its values as bf16 chunks
// bf16_chunk(t, e) (e < 2) of block k. A warp's load instruction reads 64 contiguous bytes of
// each of eight tokens; a quarter warp's stores are two tokens whose swizzles differ in the
// lowest chunk bit. (Two threads a token, each one 32-byte half of every piece, touched 16
// lines a load instruction and read every sector twice: 1.5-5.5 % slower on the fp8 64-row
// rows; bench/NOTES.md, fifteenth session.)
struct Fp8TileMap {
  static constexpr int kTokens = 2;  // per thread
  __host__ __device__ static constexpr int token(int t, int h) { return (t >> 2) + 32 * h; }
  __host__ __device__ static constexpr int fp8_chunk(int t, int k) { return 4 * k + (t & 3); }
  __host__ __device__ static constexpr int bf16_chunk(int t, int e) { return 2 * (t & 3) + e; }
};

}  // namespace dcpmla::cuda_detail
