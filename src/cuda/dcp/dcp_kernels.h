// Launch-side declarations of the DCP step's small kernels (dcp_kernels.cu)
// and of the device group's barrier and reduce kernels. POD params only.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "dcpmla/numeric.h"
#include "dcpmla/types.h"

namespace dcpmla::cuda_detail {

inline constexpr int kMaxPeers = 16;  // = kMaxDeviceGroupRanks; also the most 2-D copies per launch

// One rank's side of a device-group barrier: raise flags[me] to its next value, then wait
// until every peer's flag has reached it. Gives up (and raises *abort) after timeout_ns or
// when *abort is set; *status records why (1 timeout, 2 abort seen).
struct BarrierParams {
  unsigned long long* flags;  // [n], device memory, only rank r writes flags[r]
  volatile int* abort;        // mapped host memory
  volatile int* status;       // mapped host memory
  int me, n;
  unsigned long long timeout_ns;
};
void launch_group_barrier(const BarrierParams& p, cudaStream_t stream);

// dst[i] = sum over k < n of src[k][offset + i], float32 accumulation in rank order, one
// rounding to the element type at the end.
struct ReduceParams {
  const void* src[kMaxPeers];
  void* dst;
  int64_t offset, count;
  int n;
  int dtype;  // DataType
};
void launch_group_reduce(const ReduceParams& p, cudaStream_t stream);

// Head-group layout of the gathered heads: rank p's H_local heads are heads
// [(p % rg) Hl, (p % rg + 1) Hl) of group g = p / rg, each group a [rows, Hg] block.
struct HeadGroups {
  int world, me;  // N, this rank
  int rg;         // ranks per group
  int hl, hg;     // H_local, heads per group (rg * hl)
  int64_t rows;   // row capacity (max_batch x max_qlen)
  __host__ __device__ int64_t cell(int peer, int64_t row, int h) const {
    return (int64_t(peer / rg) * rows + row) * hg + int64_t(peer % rg) * hl + h;
  }
  // The merge kernels' items, a warp each: (destination, row, local head), destination-major.
  // Item i is entry `at` = row x hl + head of dest's chunk, reading `cell` of the gathered data.
  struct Item {
    int dest;
    int64_t at, cell;
  };
  __host__ __device__ int64_t items() const { return int64_t(world) * rows * hl; }
  __host__ __device__ Item item(int64_t i) const {
    const int64_t per_dest = rows * hl, at = i % per_dest;
    const int dest = int(i / per_dest);
    return Item{dest, at, cell(dest, at / hl, int(at % hl))};
  }
};

// Merge form (i): with every rank's lse gathered [N][groups x rows x hg], scale this rank's
// partial of each (row, head) by exp(lse_own - lse) into send[dest][rows][hl][R] (bf16 or
// f32), and write the merged lse of this rank's own heads to out_lse [rows][hl].
struct CorrectParams {
  HeadGroups g;
  const float* lse_all;  // [N][groups * rows * hg]
  const bf16* o;         // [groups][rows][hg][R]
  void* send;            // [N][rows][hl][R]
  bool send_f32;
  float* out_lse;        // [rows][hl]
  int width;             // R
};
void launch_correct(const CorrectParams& p, cudaStream_t stream);

// Merge form (ii): pack the partial of each (dest, row, head) into dest's chunk: o
// [rows][hl][R] bf16 followed (at lse_offset bytes) by lse [rows][hl] f32.
struct PackParams {
  HeadGroups g;
  const bf16* o;      // [groups][rows][hg][R]
  const float* lse;   // [groups][rows][hg]
  uint8_t* send;      // [N][chunk_bytes]
  int64_t chunk_bytes, lse_offset;
  int width;
};
void launch_pack(const PackParams& p, cudaStream_t stream);

// two_stage stage B on the device: block_attention_cpu's rule (attention.cpp). Row (b, t, h)
// of this rank's heads attends keys t' <= t of its request's verify block, read as the
// cache stores them (fp8 quantised alike). batch and qlen come from the device plan header,
// so a replayed graph follows the current batch; rows past it are left alone.
struct BlockParams {
  const int32_t* plan_header;  // PlanHeader on the device (batch, qlen)
  const bf16* q;               // [rows][heads][D]
  const bf16* block;           // [rows][D]
  const int32_t* seq_lens;     // [max_batch]
  KvDtype dtype;
  float kv_scale, softmax_scale;
  const float* kv_scale_dev;   // read on the device when set (overrides kv_scale)
  int heads, dim, width;
  int64_t row_capacity;
  bf16* out;                   // [rows][heads][R]
  float* lse;                  // [rows][heads]
};
void launch_block_attention(const BlockParams& p, cudaStream_t stream);

// dst[k] = src[k] (bytes[k] each), k < n, in one launch: the device group's copies run as a
// kernel, not cudaMemcpyAsync, so that they queue with the barrier kernels on the compute
// engine and never wait behind another rank's copy in a shared copy-engine queue.
struct GatherParams {
  const void* src[kMaxPeers];
  void* dst[kMaxPeers];
  int64_t bytes;  // per copy
  int n;
};
void launch_gather(const GatherParams& p, cudaStream_t stream);

// n 2-D copies of `rows` rows of `width` bytes (source and destination pitches in bytes),
// in one launch: the q head relayout after the all-gather.
struct Copy2dParams {
  const void* src[kMaxPeers];
  void* dst[kMaxPeers];
  int64_t rows, width, spitch, dpitch;
  int n;
};
void launch_copy_2d(const Copy2dParams& p, cudaStream_t stream);

// Loads every kernel of this file now. With CUDA's lazy module loading, the first launch
// of a kernel may wait for the device to go idle; a rank doing that while a peer's barrier
// kernel spins waiting for it would deadlock. Called before any device-side barrier.
void preload_dcp_kernels();

// f32 -> bf16 (round to nearest even).
void launch_to_bf16(const float* src, bf16* dst, int64_t n, cudaStream_t stream);


}  // namespace dcpmla::cuda_detail
