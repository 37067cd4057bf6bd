// _dcpmla: the one binding file. It only registers functions; host-side checks live in
// the library (runner, layout: dcpmla::Error -> ValueError), in engine.cpp (the engine API's
// tensors) and in the thin Python layer (python/dcpmla/: dtypes, ranks and shapes of arrays).
#include <algorithm>
#include <array>
#include <functional>
#include <numeric>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/array.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "dcpmla/error.h"
#include "engine.h"
#include "dcpmla/layout.h"
#include "dcpmla/runner.h"
#include "dcpmla/types.h"
#ifdef DCPMLA_HAS_CUDA
#include "dcpmla/cuda.h"
#endif

namespace nb = nanobind;
using namespace nb::literals;

namespace {

#ifdef DCPMLA_HAS_CUDA
constexpr bool kCudaBuilt = true;
#else
constexpr bool kCudaBuilt = false;
#endif

// Host arrays from any DLPack / buffer producer. The ranks are part of the type, so a
// wrong rank never reaches the library (the Python layer reports it as ValueError first).
template <class T, size_t N>
using HostArray = nb::ndarray<const T, nb::ndim<N>, nb::c_contig, nb::device::cpu>;

template <class T>
using NumpyArray = nb::ndarray<nb::numpy, T>;

// Hands a vector's storage to numpy without a copy; the capsule frees it.
template <class T>
NumpyArray<T> to_numpy(std::vector<T>&& values, std::initializer_list<size_t> shape) {
  auto* owned = new std::vector<T>(std::move(values));
  nb::capsule owner(owned, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
  return NumpyArray<T>(owned->data(), shape, owner);
}

dcpmla::Backend backend_of(const std::string& device) {
  const dcpmla::Backend backend = dcpmla::parse_backend(device);
  if (backend == dcpmla::Backend::cuda && !kCudaBuilt)
    dcpmla::fail("device", device,
                 "'cpu': the CUDA backend is not built into this module (rebuild with DCPMLA_CUDA=ON)");
  return backend;
}

// The conformance call's options, parsed and checked as given (doubles, so that no value
// narrows to a different float silently).
dcpmla::AttentionOptions options_of(const std::string& mode, int world_size, int interleave, int block_size,
                                    const std::string& kv_dtype, double kv_scale, double softmax_scale,
                                    int kv_lora_rank, const std::string& route, const std::string& merge,
                                    const std::string& device, uint64_t seed,
                                    const std::optional<HostArray<int32_t, 1>>& qlens,
                                    std::optional<int> min_segment_tokens) {
  dcpmla::AttentionOptions options;
  options.mode = dcpmla::parse_mode(mode);
  options.world_size = world_size;
  options.interleave = interleave;
  options.block_size = block_size;
  options.kv_dtype = dcpmla::parse_kv_dtype(kv_dtype);
  options.kv_scale = dcpmla::checked_kv_scale(kv_scale, options.kv_dtype);
  options.softmax_scale = dcpmla::checked_softmax_scale(softmax_scale);
  options.kv_lora_rank = kv_lora_rank;
  options.route = dcpmla::parse_route(route);
  options.merge = dcpmla::parse_merge_form(merge);
  options.backend = backend_of(device);
  options.seed = seed;
  if (qlens) options.qlens.assign(qlens->data(), qlens->data() + qlens->size());
  if (min_segment_tokens) options.min_segment_tokens = *min_segment_tokens;
  return options;
}

dcpmla::RankEngineFactory engines_of(dcpmla::Backend backend) {
#ifdef DCPMLA_HAS_CUDA
  if (backend == dcpmla::Backend::cuda) return dcpmla::cuda::rank_engine_factory();
#endif
  (void)backend;
  return {};  // the CPU engines
}

// The conformance call's extents from the shapes of q [B, qlen, H, D] (with qlens: [sum(qlens),
// 1, H, D], and B is seq_lens') and kv [B, Lmax, D]. Narrowed to int only once they fit: q
// [1, 1, 2^31 + 4, 2] was refused as heads = -2147483644, and 2^32 + 3 heads would be read as 3
// (then a puzzling size mismatch).
struct Extents {
  int batch, qlen, heads, dim;
  size_t rows;
  int64_t max_len;
};

Extents extents_of(std::array<size_t, 4> q, std::array<size_t, 3> kv, size_t seq_lens,
                   const dcpmla::AttentionOptions& options, bool packed) {
  const auto extent = [](const char* field, size_t v) {
    if (v > size_t(std::numeric_limits<int>::max())) dcpmla::fail(field, v, "an extent that fits int32");
    return int(v);
  };
  Extents e{extent("q.shape[0]", q[0]), extent("q.shape[1]", q[1]), extent("q.shape[2]", q[2]),
            extent("q.shape[3]", q[3]), q[0] * q[1], int64_t(kv[1])};
  if (packed) {
    const auto& qlens = options.qlens;
    e.batch = extent("seq_lens.shape[0]", seq_lens);
    e.qlen = std::max(1, qlens.empty() ? 1 : *std::max_element(qlens.begin(), qlens.end()));
    e.rows = q[0];
  }
  return e;
}

// What _mla_attention would refuse before it allocates, from q's and kv's shapes, with
// caller_bytes (the Python layer's copies of strided inputs, not yet made) in the memory bound.
void check_mla_attention(std::array<size_t, 4> q_shape, std::array<size_t, 3> kv_shape,
                         HostArray<int32_t, 1> seq_lens, const std::string& mode, int world_size, int interleave,
                         int block_size, const std::string& kv_dtype, double kv_scale, double softmax_scale,
                         int kv_lora_rank, const std::string& route, const std::string& merge,
                         const std::string& device, uint64_t seed, std::optional<HostArray<int32_t, 1>> qlens,
                         std::optional<int> min_segment_tokens, double caller_bytes) {
  const dcpmla::AttentionOptions options =
      options_of(mode, world_size, interleave, block_size, kv_dtype, kv_scale, softmax_scale, kv_lora_rank, route,
                 merge, device, seed, qlens, min_segment_tokens);
  const Extents e = extents_of(q_shape, kv_shape, seq_lens.shape(0), options, bool(qlens));
  const auto count = [](const auto& shape) {
    return std::accumulate(shape.begin(), shape.end(), uint64_t(1), std::multiplies<>());
  };
  dcpmla::check_mla_attention(count(q_shape), count(kv_shape), {seq_lens.data(), seq_lens.size()}, e.batch, e.qlen,
                              e.heads, e.max_len, e.dim, options, engines_of(options.backend), caller_bytes);
}

// q [B, qlen, H, D], kv [B, Lmax, D], seq_lens [B] -> (out [B, qlen, H, R], lse [B, qlen, H],
// the route each rank's planner took, the most pieces each rank's plan cut one request into).
std::tuple<NumpyArray<float>, NumpyArray<float>, std::vector<std::string>, std::vector<int>> mla_attention(
    HostArray<float, 4> q, HostArray<float, 3> kv, HostArray<int32_t, 1> seq_lens,
    const std::string& mode, int world_size, int interleave, int block_size,
    const std::string& kv_dtype, double kv_scale, double softmax_scale, int kv_lora_rank,
    const std::string& route, const std::string& merge, const std::string& device,
    uint64_t seed, std::optional<HostArray<int32_t, 1>> qlens, std::optional<int> min_segment_tokens) {
  const dcpmla::AttentionOptions options =
      options_of(mode, world_size, interleave, block_size, kv_dtype, kv_scale, softmax_scale, kv_lora_rank, route,
                 merge, device, seed, qlens, min_segment_tokens);
  const Extents e = extents_of({q.shape(0), q.shape(1), q.shape(2), q.shape(3)},
                               {kv.shape(0), kv.shape(1), kv.shape(2)}, seq_lens.shape(0), options, bool(qlens));
  const dcpmla::RankEngineFactory engines = engines_of(options.backend);
  dcpmla::AttentionResult result;
  {
    nb::gil_scoped_release release;
    result = dcpmla::mla_attention({q.data(), q.size()}, {kv.data(), kv.size()},
                                   {seq_lens.data(), seq_lens.size()}, e.batch, e.qlen, e.heads,
                                   e.max_len, e.dim, options, engines);
  }
  const size_t rank_dim = size_t(kv_lora_rank), rows = e.rows, heads = size_t(e.heads);
  // NOTE: the numpy views below take the vectors as they are; a size the shapes do not
  // describe would be read out of bounds, so it is an internal error, not a view.
  if (result.out.size() != rows * heads * rank_dim || result.lse.size() != rows * heads)
    throw std::runtime_error("dcpmla: internal error: mla_attention returned " +
                             std::to_string(result.out.size()) + " out / " +
                             std::to_string(result.lse.size()) + " lse values for " + std::to_string(rows) +
                             " rows of " + std::to_string(heads) + " heads");
  std::vector<std::string> routes;
  for (dcpmla::Route r : result.routes) routes.emplace_back(dcpmla::to_string(r));
  if (qlens)
    return {to_numpy(std::move(result.out), {rows, heads, rank_dim}), to_numpy(std::move(result.lse), {rows, heads}),
            std::move(routes), std::move(result.max_segments)};
  const size_t batch = size_t(e.batch), qlen = size_t(e.qlen);
  return {to_numpy(std::move(result.out), {batch, qlen, heads, rank_dim}),
          to_numpy(std::move(result.lse), {batch, qlen, heads}), std::move(routes), std::move(result.max_segments)};
}

int64_t local_length(int64_t w, int world_size, int rank, int interleave) {
  const dcpmla::Layout layout{world_size, rank, interleave};
  layout.validate();
  return layout.local_length(w);
}

std::vector<int64_t> row_local_lengths(const std::string& mode, int64_t seq_len, int qlen,
                                       int world_size, int rank, int interleave) {
  const dcpmla::Layout layout{world_size, rank, interleave};
  layout.validate();
  return dcpmla::row_local_lengths(dcpmla::parse_mode(mode), seq_len, qlen, layout);
}

NumpyArray<int64_t> slot_mapping(HostArray<int64_t, 1> positions, HostArray<int32_t, 1> block_table,
                                 int block_size, int64_t num_blocks, int world_size, int rank,
                                 int interleave) {
  const dcpmla::Layout layout{world_size, rank, interleave};
  layout.validate_with_block_size(block_size);
  std::vector<int64_t> slots =
      dcpmla::slot_mapping({positions.data(), positions.size()},
                           {block_table.data(), block_table.size()}, block_size, num_blocks, layout);
  const size_t n = slots.size();
  return to_numpy(std::move(slots), {n});
}

}  // namespace

NB_MODULE(_dcpmla, m) {
  m.doc() = "dcpmla native module (internal): use the functions of the dcpmla package.";
  m.attr("__version__") = DCPMLA_VERSION_STRING;
  m.attr("cuda_available") = kCudaBuilt;
  m.attr("max_in_process_bytes") = dcpmla::kMaxInProcessBytes;
  m.attr("max_local_kv_len") = dcpmla::kMaxLocalKvLen;
  m.attr("max_qlen") = dcpmla::kMaxQlen;
  m.attr("cuda_architectures") = DCPMLA_CUDA_ARCHITECTURES;  // "" without the CUDA backend
  m.def("cuda_device_available", [] {
#ifdef DCPMLA_HAS_CUDA
    return dcpmla::cuda_device_available();
#else
    return false;
#endif
  }, "True when the CUDA backend is built in and a CUDA device is usable.");

  m.def("_mla_attention", &mla_attention, "q"_a, "kv"_a, "seq_lens"_a, "mode"_a, "world_size"_a,
        "interleave"_a, "block_size"_a, "kv_dtype"_a, "kv_scale"_a, "softmax_scale"_a,
        "kv_lora_rank"_a, "route"_a, "merge"_a, "device"_a, "seed"_a, "qlens"_a = nb::none(),
        "min_segment_tokens"_a = nb::none(),
        "The whole DCP path (SPEC §5). Returns (out [B,qlen,H,R] float32, lse [B,qlen,H] float32 "
        "natural log, routes taken per rank, the most pieces each rank's plan cut one request into); "
        "with qlens, q is [sum(qlens), 1, H, D] and the results [sum(qlens), H, R] and [sum(qlens), H]. "
        "min_segment_tokens: the planner's floor of a cut request's pieces (None: the library's default; "
        "tests lower it).");
  m.def("_check_mla_attention", &check_mla_attention, "q_shape"_a, "kv_shape"_a, "seq_lens"_a, "mode"_a,
        "world_size"_a, "interleave"_a, "block_size"_a, "kv_dtype"_a, "kv_scale"_a, "softmax_scale"_a,
        "kv_lora_rank"_a, "route"_a, "merge"_a, "device"_a, "seed"_a, "qlens"_a = nb::none(),
        "min_segment_tokens"_a = nb::none(), "caller_bytes"_a = 0.0,
        "What _mla_attention refuses before it allocates, from q's and kv's shapes alone, with caller_bytes "
        "(the copies of strided inputs the caller is about to make) counted in the in-process memory bound.");
  m.def("local_length", &local_length, "w"_a, "world_size"_a, "rank"_a, "interleave"_a,
        "n_r(w): positions of the global window [0, w) held by `rank`.");
  m.def("row_local_lengths", &row_local_lengths, "mode"_a, "seq_len"_a, "qlen"_a, "world_size"_a,
        "rank"_a, "interleave"_a,
        "Per-row rank-local lengths n_r(w_t), t = 0..qlen-1, counted from the global window end.");
  m.def("slot_mapping", &slot_mapping, "positions"_a, "block_table"_a, "block_size"_a,
        "num_blocks"_a, "world_size"_a, "rank"_a, "interleave"_a,
        "Rank-local cache slot of each global position (int64), -1 (PAD) where `rank` does not own it.");

  using dcpmla::python::Engine;
  nb::class_<Engine>(m, "_Engine", "One rank's Attention (SPEC §6); dcpmla.Attention wraps it.")
      .def(nb::init<int, const std::string&, int, int, int, int, int, int, int64_t, std::optional<double>, int,
                    const std::string&, const std::string&, int>(),
           "heads"_a, "kv_dtype"_a, "block_size"_a, "world_size"_a, "rank"_a, "interleave"_a, "max_batch"_a,
           "max_qlen"_a, "max_local_len"_a, "softmax_scale"_a.none(), "kv_lora_rank"_a, "route"_a, "device"_a,
           "device_index"_a)
      .def("plan", &Engine::plan, "seq_lens"_a, "block_tables"_a, "qlen"_a, "mode"_a, "qlens"_a.none(), "stream"_a,
           "Plans the step: seq_lens int32 [B], block_tables int32 [B, W], qlens int32 [B] or None (host, "
           "C-contiguous).")
      .def("run", &Engine::run, "q"_a, "kv_cache"_a, "kv_scale"_a, "kv_scale_tensor"_a.none(), "out"_a, "lse"_a,
           "stream"_a, "This rank's partial into out [B, qlen, H, R] and lse [B, qlen, H] (natural log).")
      .def_prop_ro("batch", &Engine::batch, "B of the current plan (0 before the first plan).")
      .def_prop_ro("qlen", &Engine::qlen, "qlen of the current plan (0 before the first plan).")
      .def_prop_ro("route", &Engine::route, "The route of the current plan ('none' before the first plan).")
      .def_prop_ro("max_segments", &Engine::max_segments,
                   "The most pieces the current plan cut one request into (1: none cut; 0 before the first "
                   "plan or with no rows). Tests check that a forced split_k cut.")
      .def_prop_ro("device_index", [](const Engine& e) { return e.placement().device; },
                   "The CUDA device ordinal (0 on the CPU).");
  m.def("_write_kv", &dcpmla::python::write_kv, "kv_cache"_a, "latent"_a, "slot_mapping"_a, "kv_dtype"_a,
        "kv_scale"_a, "kv_scale_tensor"_a.none(), "stream"_a,
        "SPEC §3 write: latent [T, D] into kv_cache at slot_mapping [T] (int64, -1 = PAD).");
  m.def("_check_merge_inputs", &dcpmla::python::check_merge_inputs, "out_parts"_a, "lse_parts"_a,
        "merge_states' checks of out_parts [N, ..., W] and lse_parts [N, ...] alone (before outputs are allocated).");
  // Probes, called only after nanobind refused a call's arguments with a TypeError that names none:
  // the Python layer finds the tensor it cannot import alone and names it.
  m.def("_imports", [](const dcpmla::python::Tensor&) {}, "x"_a, "Imports x as a read-only tensor (a probe).");
  m.def("_imports_writable", [](const dcpmla::python::OutTensor&) {}, "x"_a,
        "Imports x as a writable tensor (a probe).");
  m.def("_merge_states", &dcpmla::python::merge_states, "out_parts"_a, "lse_parts"_a, "out"_a, "lse"_a, "stream"_a,
        "SPEC §2 merge of N partials [N, ..., W] / [N, ...] into out [..., W] / lse [...] (natural log).");
}
