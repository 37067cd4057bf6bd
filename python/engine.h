// The engine API (SPEC §6) on framework tensors: what the bindings of _dcpmla call. Tensors
// arrive through DLPack (torch, cupy, jax on CUDA; numpy or torch on the CPU) without a copy;
// every check below names the argument and value (dcpmla::Error, which Python sees as
// ValueError) and runs before anything is launched. Nothing here allocates, formats or
// synchronises on the run / write_kv path unless a check fails (the CPU backend converts
// float32 tensors to bf16 through scratch vectors: it is the testing path, not the fast one).
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include "dcpmla/engine.h"
#include "dcpmla/types.h"

namespace dcpmla::python {

namespace nb = nanobind;

// Any tensor: dtype, device, shape and strides are checked by the callee, so that a mismatch is a
// ValueError naming the argument rather than nanobind's generic TypeError.
using Tensor = nb::ndarray<nb::ro>;
using OutTensor = nb::ndarray<>;
// Host int32 arrays the planner reads (the Python layer converts lists and other int dtypes).
using HostInts1 = nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
// Block tables: rows may lie apart (a [:B, :W] slice of an engine's wider table), each row's
// entries adjacent (the Python layer copies any other layout).
using HostInts2 = nb::ndarray<const int32_t, nb::ndim<2>, nb::device::cpu>;

// Where an engine's tensors live: the backend and, for CUDA, the device ordinal.
struct Placement {
  Backend backend = Backend::cpu;
  int device = 0;
};

// One rank's Attention (CPU or CUDA) as the Python class dcpmla.Attention holds it.
//
// Threads: every method that reads or changes the plan holds the engine's mutex for its whole
// call, so a plan() from one Python thread waits for a run() of another (which releases the GIL
// while the CPU kernels compute) instead of replacing the plan under it. The rule that keeps the
// GIL and the mutex from deadlocking: a thread never *waits* for the mutex while it holds the
// GIL (lock() releases the GIL around the wait); it may wait for the GIL while it holds the mutex
// (run() takes the GIL back after its kernels). Other threads keep running Python during a run.
class Engine {
 public:
  // device < 0 on CUDA: the current device. softmax_scale: none for D^-0.5.
  Engine(int heads, const std::string& kv_dtype, int block_size, int world_size, int rank, int interleave,
         int max_batch, int max_qlen, int64_t max_local_len, std::optional<double> softmax_scale,
         int kv_lora_rank, const std::string& route, const std::string& device, int device_index);
  ~Engine();

  // The one place a step's host arrays become a BatchDesc (per-request qlens join it here).
  // qlens (optional, one per request): per-request query rows; q, out and lse are then packed
  // [sum(qlens), H, ...] instead of [B, qlen, H, ...].
  void plan(HostInts1 seq_lens, HostInts2 block_tables, int qlen, const std::string& mode,
            std::optional<HostInts1> qlens, uintptr_t stream);
  // kv_scale_tensor: a one-element float32 tensor on the engine's device (read when the kernels
  // run on CUDA), else kv_scale.
  void run(Tensor q, Tensor kv_cache, double kv_scale, std::optional<Tensor> kv_scale_tensor, OutTensor out,
           OutTensor lse, uintptr_t stream);

  const AttentionConfig& config() const { return config_; }
  Placement placement() const { return where_; }
  // The current plan's properties, each read under the mutex (0 / "none" before the first plan).
  bool planned() const;
  int batch() const;  // of the current plan
  int qlen() const;
  std::string route() const;  // the current plan's route
  int max_segments() const;   // the most pieces the current plan cut one request into (tests)

 private:
  // Takes the mutex; called with the GIL held, it releases the GIL while it waits (see above).
  std::unique_lock<std::mutex> lock() const;
  const Plan& current_plan() const;

  mutable std::mutex mutex_;  // guards the plan (cpu_ / cuda_, planned_, packed_)

  AttentionConfig config_;
  Placement where_;
  std::unique_ptr<Attention> cpu_;
  struct Cuda;  // cuda::Attention where the CUDA backend is built
  std::unique_ptr<Cuda> cuda_;
  bool planned_ = false;
  bool packed_ = false;
};

// SPEC §3 write path on a tensor cache: latent [T, D], slot_mapping [T] int64 (-1 = PAD); the
// cache shares no memory with latent, slot_mapping or the kv_scale tensor (checked).
void write_kv(OutTensor kv_cache, Tensor latent, Tensor slot_mapping, const std::string& kv_dtype, double kv_scale,
              std::optional<Tensor> kv_scale_tensor, uintptr_t stream);

// SPEC §2 merge: out_parts [N, ..., W], lse_parts [N, ...] -> out [..., W], lse [...]. The
// outputs share no memory with the partials or each other (checked).
void merge_states(Tensor out_parts, Tensor lse_parts, OutTensor out, OutTensor lse, uintptr_t stream);
// merge_states' checks of the partials alone (what the Python layer calls before it allocates the
// outputs from their shapes).
void check_merge_inputs(Tensor out_parts, Tensor lse_parts);

}  // namespace dcpmla::python
