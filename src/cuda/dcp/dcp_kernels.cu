// The DCP step's small kernels: the cross-rank merge (correction for the reduce-scatter
// form, packing for the all-to-all form), two_stage's stage B, and the device group's
// barrier and reduce. All natural-log lse; -inf partials carry no weight and an all -inf
// row gives o = 0, lse = -inf (never NaN).
#include <algorithm>

#include "dcp/dcp_kernels.h"
#include "common/params.h"
#include "common/utils.cuh"

namespace dcpmla::cuda_detail {
namespace {

__device__ __forceinline__ float bf16f(bf16 v) { return __uint_as_float(uint32_t(v.bits) << 16); }
__device__ __forceinline__ bf16 to_bf16(float x) {
  const __nv_bfloat16 h = __float2bfloat16_rn(x);
  return *reinterpret_cast<const bf16*>(&h);
}

int grid_for(int64_t items, int per_block, int cap = 8192) {
  return int(std::max<int64_t>(1, std::min<int64_t>((items + per_block - 1) / per_block, cap)));
}

}  // namespace

// ---- device group ---------------------------------------------------------------------

__global__ void group_barrier_kernel(const BarrierParams p) {
  if (threadIdx.x != 0) return;
  if (*p.abort) {
    if (*p.status == 0) *p.status = 2;
    return;
  }
  volatile unsigned long long* flags = p.flags;
  const unsigned long long e = flags[p.me] + 1;
  __threadfence();  // this rank's earlier writes (previous kernels, copies) before the flag
  flags[p.me] = e;
  const unsigned long long t0 = global_ns();
  for (int peer = 0; peer < p.n; ++peer) {
    unsigned iter = 0;
    while (flags[peer] < e) {
      if ((++iter & 31u) == 0) {
        if (*p.abort) {
          if (*p.status == 0) *p.status = 2;
          return;
        }
        if (global_ns() - t0 > p.timeout_ns) {
          *p.status = 1;
          *p.abort = 1;  // the others leave too
          __threadfence_system();
          return;
        }
      }
      __nanosleep(256);
    }
  }
  __threadfence();  // peers' writes before their flags are visible to what follows
}

void launch_group_barrier(const BarrierParams& p, cudaStream_t stream) {
  group_barrier_kernel<<<1, 32, 0, stream>>>(p);
  check(cudaGetLastError(), "group_barrier_kernel launch");
}

__global__ void group_reduce_kernel(const ReduceParams p) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < p.count; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t at = p.offset + i;
    if (p.dtype == 2) {  // i32: exact
      long long s = 0;
      for (int k = 0; k < p.n; ++k) s += static_cast<const int32_t*>(p.src[k])[at];
      static_cast<int32_t*>(p.dst)[i] = int32_t(s);
    } else if (p.dtype == 1) {  // bf16
      float s = 0.0f;
      for (int k = 0; k < p.n; ++k) s += bf16f(static_cast<const bf16*>(p.src[k])[at]);
      static_cast<bf16*>(p.dst)[i] = to_bf16(s);
    } else {
      float s = 0.0f;
      for (int k = 0; k < p.n; ++k) s += static_cast<const float*>(p.src[k])[at];
      static_cast<float*>(p.dst)[i] = s;
    }
  }
}

void launch_group_reduce(const ReduceParams& p, cudaStream_t stream) {
  if (p.count == 0) return;
  group_reduce_kernel<<<grid_for(p.count, 256, 4096), 256, 0, stream>>>(p);
  check(cudaGetLastError(), "group_reduce_kernel launch");
}

__global__ void gather_kernel(const GatherParams p) {
  const bool vec = (p.bytes % 16) == 0;
  for (int k = 0; k < p.n; ++k) {
    const bool aligned = vec && (reinterpret_cast<uintptr_t>(p.src[k]) % 16) == 0 &&
                         (reinterpret_cast<uintptr_t>(p.dst[k]) % 16) == 0;
    if (aligned) {
      const uint4* s = static_cast<const uint4*>(p.src[k]);
      uint4* d = static_cast<uint4*>(p.dst[k]);
      for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < p.bytes / 16;
           i += int64_t(gridDim.x) * blockDim.x)
        d[i] = s[i];
    } else {
      const uint8_t* s = static_cast<const uint8_t*>(p.src[k]);
      uint8_t* d = static_cast<uint8_t*>(p.dst[k]);
      for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < p.bytes; i += int64_t(gridDim.x) * blockDim.x)
        d[i] = s[i];
    }
  }
}

void launch_gather(const GatherParams& p, cudaStream_t stream) {
  if (p.n == 0 || p.bytes == 0) return;
  gather_kernel<<<grid_for(p.bytes / 16 + 1, 256, 1024), 256, 0, stream>>>(p);
  check(cudaGetLastError(), "gather_kernel launch");
}

// One 16-byte vector per thread and step when every pitch and address allows, else bytes.
__global__ void copy_2d_kernel(const Copy2dParams p) {
  for (int k = 0; k < p.n; ++k) {
    const bool vec = p.width % 16 == 0 && p.spitch % 16 == 0 && p.dpitch % 16 == 0 &&
                     reinterpret_cast<uintptr_t>(p.src[k]) % 16 == 0 && reinterpret_cast<uintptr_t>(p.dst[k]) % 16 == 0;
    const int64_t unit = vec ? 16 : 1, per_row = p.width / unit, total = per_row * p.rows;
    for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
      const int64_t r = i / per_row, c = i % per_row;
      const uint8_t* s = static_cast<const uint8_t*>(p.src[k]) + r * p.spitch + c * unit;
      uint8_t* d = static_cast<uint8_t*>(p.dst[k]) + r * p.dpitch + c * unit;
      if (vec) *reinterpret_cast<uint4*>(d) = *reinterpret_cast<const uint4*>(s);
      else *d = *s;
    }
  }
}

void launch_copy_2d(const Copy2dParams& p, cudaStream_t stream) {
  if (p.n == 0 || p.rows == 0 || p.width == 0) return;
  copy_2d_kernel<<<grid_for(p.rows * p.width / 16 + 1, 256, 1024), 256, 0, stream>>>(p);
  check(cudaGetLastError(), "copy_2d_kernel launch");
}

// ---- merge form (i): correction before the reduce-scatter -----------------------------

__global__ void __launch_bounds__(256) correct_kernel(const CorrectParams p) {
  const int lane = threadIdx.x & 31;
  const HeadGroups& g = p.g;
  const int64_t stride = int64_t(g.world / g.rg) * g.rows * g.hg;  // one rank's gathered lse
  for (int64_t item = int64_t(blockIdx.x) * 8 + (threadIdx.x >> 5); item < g.items(); item += int64_t(gridDim.x) * 8) {
    const auto [dest, at, c] = g.item(item);
    // A NaN partial poisons its cell rather than being dropped as an empty rank (the
    // library's NaN rule, docs/design.md): nan_max, as every merge; fmaxf would skip it.
    float m = kNegInf;
    for (int k = 0; k < g.world; ++k) m = nan_max(m, p.lse_all[k * stride + c]);
    float sum = 0.0f;
    if (m != kNegInf)
      for (int k = 0; k < g.world; ++k) {
        const float l = p.lse_all[k * stride + c];
        if (l != kNegInf) sum += expf(l - m);
      }
    const float global = m == kNegInf ? kNegInf : m + logf(sum);
    const float own = p.lse_all[g.me * stride + c];
    // exp(own - m) / sum, not exp(own - global): at a large |lse| the log of the sum rounds away
    // in m + log(sum). An empty partial adds nothing, whatever its out holds (SPEC §2).
    const bool empty = m == kNegInf || own == kNegInf;
    const float scale = empty ? 0.0f : expf(own - m) / sum;
    const bf16* src = p.o + c * p.width;
    for (int col = lane * 2; col < p.width; col += 64) {
      const float a = empty ? 0.0f : scale * bf16f(src[col]), b = empty ? 0.0f : scale * bf16f(src[col + 1]);
      if (p.send_f32) {
        *reinterpret_cast<float2*>(static_cast<float*>(p.send) + item * p.width + col) = make_float2(a, b);
      } else {
        const uint32_t packed = pack_bf16x2(a, b);
        *reinterpret_cast<uint32_t*>(static_cast<bf16*>(p.send) + item * p.width + col) = packed;
      }
    }
    if (dest == g.me && lane == 0) p.out_lse[at] = global;
  }
}

void launch_correct(const CorrectParams& p, cudaStream_t stream) {
  const int64_t items = p.g.items();
  if (items == 0) return;
  correct_kernel<<<grid_for(items, 8), 256, 0, stream>>>(p);
  check(cudaGetLastError(), "correct_kernel launch");
}

// ---- merge form (ii): pack (o, lse) per destination -----------------------------------

__global__ void __launch_bounds__(256) pack_kernel(const PackParams p) {
  const int lane = threadIdx.x & 31;
  const HeadGroups& g = p.g;
  const int vecs = p.width / 8;  // 16-byte vectors per row
  for (int64_t item = int64_t(blockIdx.x) * 8 + (threadIdx.x >> 5); item < g.items(); item += int64_t(gridDim.x) * 8) {
    const auto [dest, at, c] = g.item(item);
    const uint4* src = reinterpret_cast<const uint4*>(p.o + c * p.width);
    uint8_t* chunk = p.send + dest * p.chunk_bytes;
    uint4* dst = reinterpret_cast<uint4*>(chunk + at * p.width * 2);
    for (int v = lane; v < vecs; v += 32) dst[v] = src[v];
    if (lane == 0) reinterpret_cast<float*>(chunk + p.lse_offset)[at] = p.lse[c];
  }
}

void launch_pack(const PackParams& p, cudaStream_t stream) {
  const int64_t items = p.g.items();
  if (items == 0) return;
  pack_kernel<<<grid_for(items, 8), 256, 0, stream>>>(p);
  check(cudaGetLastError(), "pack_kernel launch");
}

// ---- two_stage stage B -----------------------------------------------------------------

template <KvDtype DT>
__device__ __forceinline__ float read_as_cache(bf16 v, float scale) {
  const float x = bf16f(v);
  if constexpr (DT == KvDtype::bf16) {
    return x;
  } else {
    constexpr __nv_fp8_interpretation_t kind = DT == KvDtype::fp8_e4m3 ? __NV_E4M3 : __NV_E5M2;
    const __nv_fp8_storage_t q = __nv_cvt_float_to_fp8(x / scale, __NV_SATFINITE, kind);
    const __half_raw h = __nv_cvt_fp8_to_halfraw(q, kind);
    return __half2float(*reinterpret_cast<const __half*>(&h)) * scale;
  }
}

// One warp per (row, head). Scores of the (at most qlen) keys are recomputed in the second
// pass instead of kept: the block is a handful of tokens.
template <KvDtype DT>
__global__ void __launch_bounds__(256) block_attention_kernel(const BlockParams p) {
  const int lane = threadIdx.x & 31;
  const int batch = p.plan_header[1], qlen = p.plan_header[2];
  const float kv_scale = p.kv_scale_dev != nullptr ? *p.kv_scale_dev : p.kv_scale;
  const int64_t live = int64_t(batch) * qlen;
  const int64_t rows = (live < p.row_capacity ? live : p.row_capacity) * p.heads;
  for (int64_t item = int64_t(blockIdx.x) * 8 + (threadIdx.x >> 5); item < rows; item += int64_t(gridDim.x) * 8) {
    const int64_t row = item / p.heads;
    const int b = int(row / qlen), t = int(row % qlen);
    bf16* out = p.out + item * p.width;
    const int keys = p.seq_lens[b] == 0 ? 0 : t + 1;  // causal inside the block
    if (keys == 0) {
      for (int col = lane; col < p.width; col += 32) out[col] = bf16{};
      if (lane == 0) p.lse[item] = kNegInf;
      continue;
    }
    const bf16* q = p.q + item * p.dim;
    auto score = [&](int i) {
      const bf16* k = p.block + (int64_t(b) * qlen + i) * p.dim;
      float s = 0.0f;
      for (int j = lane; j < p.dim; j += 32) s += bf16f(q[j]) * read_as_cache<DT>(k[j], kv_scale);
#pragma unroll
      for (int d = 16; d; d >>= 1) s += __shfl_xor_sync(0xffffffffu, s, d);
      return s * p.softmax_scale * kLog2e;
    };
    float m = kNegInf;
    for (int i = 0; i < keys; ++i) m = fmaxf(m, score(i));
    float l = 0.0f;
    float acc[16];  // width <= 512: columns lane, lane + 32, ...
#pragma unroll
    for (int k = 0; k < 16; ++k) acc[k] = 0.0f;
    for (int i = 0; i < keys; ++i) {
      const float w = exp2f(score(i) - m);
      l += w;
      const bf16* k = p.block + (int64_t(b) * qlen + i) * p.dim;
#pragma unroll
      for (int kk = 0; kk < 16; ++kk) {
        const int col = lane + 32 * kk;
        if (col < p.width) acc[kk] += w * read_as_cache<DT>(k[col], kv_scale);
      }
    }
#pragma unroll
    for (int kk = 0; kk < 16; ++kk) {
      const int col = lane + 32 * kk;
      if (col < p.width) out[col] = to_bf16(acc[kk] / l);
    }
    if (lane == 0) p.lse[item] = (m + log2f(l)) * kLn2;
  }
}

void launch_block_attention(const BlockParams& p, cudaStream_t stream) {
  const int grid = grid_for(p.row_capacity * p.heads, 8);
  switch (p.dtype) {
    case KvDtype::bf16: block_attention_kernel<KvDtype::bf16><<<grid, 256, 0, stream>>>(p); break;
    case KvDtype::fp8_e4m3: block_attention_kernel<KvDtype::fp8_e4m3><<<grid, 256, 0, stream>>>(p); break;
    case KvDtype::fp8_e5m2: block_attention_kernel<KvDtype::fp8_e5m2><<<grid, 256, 0, stream>>>(p); break;
  }
  check(cudaGetLastError(), "block_attention_kernel launch");
}

// ---- small helpers -----------------------------------------------------------------------

__global__ void to_bf16_kernel(const float* src, bf16* dst, int64_t n);

void preload_dcp_kernels() {
  cudaFuncAttributes a;
  check(cudaFuncGetAttributes(&a, group_barrier_kernel), "cudaFuncGetAttributes(group_barrier_kernel)");
  check(cudaFuncGetAttributes(&a, group_reduce_kernel), "cudaFuncGetAttributes(group_reduce_kernel)");
  check(cudaFuncGetAttributes(&a, gather_kernel), "cudaFuncGetAttributes(gather_kernel)");
  check(cudaFuncGetAttributes(&a, copy_2d_kernel), "cudaFuncGetAttributes(copy_2d_kernel)");
  check(cudaFuncGetAttributes(&a, correct_kernel), "cudaFuncGetAttributes(correct_kernel)");
  check(cudaFuncGetAttributes(&a, pack_kernel), "cudaFuncGetAttributes(pack_kernel)");
  check(cudaFuncGetAttributes(&a, block_attention_kernel<KvDtype::bf16>), "cudaFuncGetAttributes(block_attention)");
  check(cudaFuncGetAttributes(&a, block_attention_kernel<KvDtype::fp8_e4m3>), "cudaFuncGetAttributes(block_attention)");
  check(cudaFuncGetAttributes(&a, block_attention_kernel<KvDtype::fp8_e5m2>), "cudaFuncGetAttributes(block_attention)");
  check(cudaFuncGetAttributes(&a, to_bf16_kernel), "cudaFuncGetAttributes(to_bf16_kernel)");
}


__global__ void to_bf16_kernel(const float* src, bf16* dst, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    dst[i] = to_bf16(src[i]);
}

void launch_to_bf16(const float* src, bf16* dst, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  to_bf16_kernel<<<grid_for(n, 256, 4096), 256, 0, stream>>>(src, dst, n);
  check(cudaGetLastError(), "to_bf16_kernel launch");
}

}  // namespace dcpmla::cuda_detail
