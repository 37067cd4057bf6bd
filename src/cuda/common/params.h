// Launch-side declarations shared by the host code (runner.cpp) and the .cu files.
// The kernels take the public POD AttentionParams (attention.h) by value; the small
// kernels below take their own POD params. No framework types cross into a kernel.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "dcpmla/attention.h"
#include "dcpmla/numeric.h"
#include "dcpmla/types.h"

namespace dcpmla::cuda_detail {

// Throws dcpmla::CudaError("<what>: <cuda error string>") unless e == cudaSuccess.
void check(cudaError_t e, const char* what);

struct WriteKvParams {
  const bf16* latents;  // [n, dim]
  const int64_t* slots; // [n]; -1 = PAD
  int64_t n;
  int64_t num_slots;
  int dim;
  KvDtype dtype;
  float scale;
  const float* scale_dev;  // read on the device when set
  int* errors;             // counts slots outside the cache (nullable)
  uint8_t* cache;       // [num_slots, dim] in dtype
};

struct SlotMappingParams {
  const int64_t* positions;   // [n] global positions
  const int32_t* requests;    // [n] request of each position
  int64_t n;
  const int32_t* block_tables;  // [batch, table_width]
  int batch, table_width, block_size;
  int64_t num_blocks;
  int world_size, rank, interleave;
  int64_t* slots;             // [n] out
  int* errors;                // nullable
};

struct MergeParams {
  const bf16* o_parts;     // [n, rows, width]
  const float* lse_parts;  // [n, rows]
  int64_t part_stride_o;   // elements between partial k and k + 1 of o
  int64_t part_stride_lse;
  int n;
  int64_t rows;
  int width;
  bf16* o;                 // [rows, width]; may alias a partial
  float* lse;              // [rows]
};

// Attention kernel variants: rows per CTA (16 MT) x tile tokens x CTAs per SM x dtype.
template <int MT, int NT, int CPS, bool FP8>
void launch_attention_variant(const AttentionParams& p, int grid, cudaStream_t stream);
template <int MT, int NT, int CPS, bool FP8>
int attention_smem_bytes();

void launch_split_merge(const AttentionParams& p, int64_t max_cut_rows, int num_sms, cudaStream_t stream);
void launch_write_kv(const WriteKvParams& p, cudaStream_t stream);
void launch_slot_mapping(const SlotMappingParams& p, cudaStream_t stream);
void launch_merge(const MergeParams& p, cudaStream_t stream);

}  // namespace dcpmla::cuda_detail
