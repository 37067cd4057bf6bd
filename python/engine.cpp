#include "engine.h"

#include <array>
#include <initializer_list>
#include <limits>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "dcpmla/cache.h"
#include "dcpmla/error.h"
#include "dcpmla/merge.h"
#include "dcpmla/numeric.h"
#ifdef DCPMLA_HAS_CUDA
#include <cuda_runtime_api.h>

#include "dcpmla/cuda.h"
#endif

namespace dcpmla::python {

namespace {

// ---- tensor checks (format only when one fails) ---------------------------------------------

// DLPack type codes of the fp8 formats (DLPack 1.1), which nanobind's enum does not name.
constexpr uint8_t kDlFloat8E4m3fn = 10, kDlFloat8E5m2 = 12;
constexpr int32_t kDlCpu = 1, kDlCuda = 2;

// Element kinds a check accepts, as a bit set. The cache is storage: raw integers of its width
// are accepted too (numpy and cupy have no bfloat16, torch's fp8 may arrive viewed as uint8).
enum Kind : uint32_t {
  kF32 = 1u << 0, kBf16 = 1u << 1, kBits16 = 1u << 2, kBits8 = 1u << 3,
  kE4m3 = 1u << 4, kE5m2 = 1u << 5, kI64 = 1u << 6,
};
constexpr uint32_t kBf16Like = kBf16 | kBits16;
constexpr const char* kBf16Text = "bfloat16 (or uint16 / int16 holding bf16 bits)";

uint32_t kind_of(nb::dlpack::dtype d) {
  using C = nb::dlpack::dtype_code;
  if (d.lanes != 1) return 0;
  if (d.code == uint8_t(C::Float) && d.bits == 32) return kF32;
  if (d.code == uint8_t(C::Bfloat) && d.bits == 16) return kBf16;
  if ((d.code == uint8_t(C::UInt) || d.code == uint8_t(C::Int)) && d.bits == 16) return kBits16;
  if ((d.code == uint8_t(C::UInt) || d.code == uint8_t(C::Int)) && d.bits == 8) return kBits8;
  if (d.code == uint8_t(C::Int) && d.bits == 64) return kI64;
  if (d.code == kDlFloat8E4m3fn && d.bits == 8) return kE4m3;
  if (d.code == kDlFloat8E5m2 && d.bits == 8) return kE5m2;
  return 0;
}

std::string dtype_name(nb::dlpack::dtype d) {
  using C = nb::dlpack::dtype_code;
  const char* base = d.code == uint8_t(C::Int)      ? "int"
                     : d.code == uint8_t(C::UInt)    ? "uint"
                     : d.code == uint8_t(C::Float)   ? "float"
                     : d.code == uint8_t(C::Bfloat)  ? "bfloat"
                     : d.code == uint8_t(C::Complex) ? "complex"
                     : d.code == uint8_t(C::Bool)    ? "bool"
                     : d.code == kDlFloat8E4m3fn     ? "float8_e4m3fn"
                     : d.code == kDlFloat8E5m2       ? "float8_e5m2"
                                                     : nullptr;
  if (base == nullptr) return fmt::format("DLPack dtype (code {}, bits {})", d.code, d.bits);
  if (d.code == kDlFloat8E4m3fn || d.code == kDlFloat8E5m2 || d.code == uint8_t(C::Bool)) return base;
  return fmt::format("{}{}", base, d.bits);
}

std::string device_name(int32_t type, int32_t id) {
  if (type == kDlCpu) return "cpu";
  if (type == kDlCuda) return fmt::format("cuda:{}", id);
  return fmt::format("DLPack device type {}", type);
}

std::string placement_name(Placement p) { return p.backend == Backend::cpu ? "cpu" : fmt::format("cuda:{}", p.device); }

// Expected extents, -1 for any; the names say what each is ("[B, qlen, H, D]").
struct Dims {
  size_t n = 0;
  std::array<int64_t, 8> v{};
  Dims(std::initializer_list<int64_t> d) : n(d.size()) { std::copy(d.begin(), d.end(), v.begin()); }
  static Dims any(size_t n) {
    Dims d{};
    d.n = n;
    d.v.fill(-1);
    return d;
  }
};

template <class T>
std::vector<int64_t> shape_of(const T& t) {
  std::vector<int64_t> s;
  for (size_t i = 0; i < t.ndim(); ++i) s.push_back(int64_t(t.shape(i)));
  return s;
}

// A tensor without elements touches no memory, so its strides say nothing: numpy >= 2.4 exports
// an empty array's as 0 (as torch and numpy's own flags do, it counts as contiguous).
template <class T>
bool c_contiguous(const T& t) {
  if (t.size() == 0) return true;
  int64_t expect = 1;
  for (size_t i = t.ndim(); i-- > 0;) {
    if (t.shape(i) != 1 && t.stride(i) != expect) return false;
    expect *= int64_t(t.shape(i));
  }
  return true;
}

template <class T>
void check_placement(const T& t, const char* field, Placement where) {
  const int32_t type = t.device_type(), id = t.device_id();
  const bool ok = where.backend == Backend::cpu ? type == kDlCpu : type == kDlCuda && id == where.device;
  if (!ok)
    fail(fmt::format("{}.device", field), device_name(type, id),
         fmt::format("{} (where this call runs)", placement_name(where)));
}

// dtype, shape (ndim and extents), C-contiguous strides, device and alignment of one tensor:
// `align` bytes on CUDA (the kernels' vector width), whole values on the CPU, which reads no wider.
template <class T>
void check(const T& t, const char* field, uint32_t kinds, const char* dtype_text, const Dims& dims,
           const char* dims_text, Placement where, size_t align) {
  if (!(kind_of(t.dtype()) & kinds)) fail(fmt::format("{}.dtype", field), dtype_name(t.dtype()), dtype_text);
  bool shape_ok = t.ndim() == dims.n;
  for (size_t i = 0; shape_ok && i < dims.n; ++i) shape_ok = dims.v[i] < 0 || int64_t(t.shape(i)) == dims.v[i];
  if (!shape_ok) {
    std::vector<std::string> want;
    for (size_t i = 0; i < dims.n; ++i) want.push_back(dims.v[i] < 0 ? "*" : std::to_string(dims.v[i]));
    fail(fmt::format("{}.shape", field), fmt::format("[{}]", fmt::join(shape_of(t), ", ")),
         fmt::format("{} = [{}]", dims_text, fmt::join(want, ", ")));
  }
  if (!c_contiguous(t)) {
    std::vector<int64_t> strides;
    for (size_t i = 0; i < t.ndim(); ++i) strides.push_back(t.stride(i));
    fail(fmt::format("{}.stride", field), fmt::format("({})", fmt::join(strides, ", ")),
         "C-contiguous strides (pass a contiguous tensor, e.g. .contiguous())");
  }
  check_placement(t, field, where);
  // A producer may export a null pointer with its extents (DLPack does not forbid it); the
  // float32 copies read such a tensor before the library's own null checks.
  if (t.data() == nullptr && t.size() != 0)
    fail(fmt::format("{}.data_ptr", field), "null", fmt::format("memory holding the tensor's {} elements", t.size()));
  if (where.backend == Backend::cpu) align = t.itemsize();
  if (reinterpret_cast<uintptr_t>(t.data()) % align != 0)
    fail(fmt::format("{}.data_ptr", field), fmt::format("{}", t.data()), fmt::format("{}-byte aligned memory", align));
}

// A tensor's bytes, named: every tensor of a call is C-contiguous (checked) on the call's device
// (checked), so it occupies exactly [at, at + bytes).
template <class T>
NamedBytes bytes_of(const char* field, const T& t) {
  return {field, static_cast<const void*>(t.data()), int64_t(t.nbytes())};
}
template <class T>
NamedBytes bytes_of(const char* field, const std::optional<T>& t) {
  return t ? bytes_of(field, *t) : NamedBytes{field};
}

// The backend and device of a tensor that decides a free function's placement.
template <class T>
Placement placement_of(const T& t, const char* field) {
  if (t.device_type() == kDlCpu) return Placement{Backend::cpu, 0};
  if (t.device_type() == kDlCuda) {
#ifdef DCPMLA_HAS_CUDA
    return Placement{Backend::cuda, t.device_id()};
#else
    fail(fmt::format("{}.device", field), device_name(t.device_type(), t.device_id()),
         "cpu: the CUDA backend is not built into this module (pip install with DCPMLA_CUDA=1)");
#endif
  }
  fail(fmt::format("{}.device", field), device_name(t.device_type(), t.device_id()), "cpu or cuda memory");
}

// ---- engine inputs ------------------------------------------------------------------------------

uint32_t cache_kinds(KvDtype d) { return d == KvDtype::bf16 ? kBf16Like : d == KvDtype::fp8_e4m3 ? kBits8 | kE4m3 : kBits8 | kE5m2; }

const char* cache_kinds_text(KvDtype d) {
  return d == KvDtype::bf16       ? "bfloat16 (or uint16 / int16 holding bf16 bits) for kv_dtype bf16"
         : d == KvDtype::fp8_e4m3 ? "uint8 / int8 or float8_e4m3fn for kv_dtype fp8_e4m3"
                                  : "uint8 / int8 or float8_e5m2 for kv_dtype fp8_e5m2";
}

// The engine-owned cache [num_blocks, block_size, D], contiguous; its extents are checked against
// the Attention (validate_run) or the write.
template <class T>
KvCache cache_of(const T& t, KvDtype dtype, Placement where) {
  check(t, "kv_cache", cache_kinds(dtype), cache_kinds_text(dtype), Dims{-1, -1, -1}, "[num_blocks, block_size, D]",
        where, 16);
  if (t.shape(1) > size_t(std::numeric_limits<int>::max()) || t.shape(2) > size_t(std::numeric_limits<int>::max()))
    fail("kv_cache.shape", fmt::format("[{}]", fmt::join(shape_of(t), ", ")), "block_size and D that fit int32");
  return KvCache{const_cast<void*>(static_cast<const void*>(t.data())), int64_t(t.shape(0)), int(t.shape(1)),
                 int(t.shape(2)), dtype};
}

// A float, or a one-element float32 tensor where the call runs: on CUDA its address (read by the
// kernels, so a replayed graph sees the current value); on the CPU its value, read now.
KvScale scale_of(double value, const std::optional<Tensor>& t, KvDtype dtype, Placement where) {
  if (!t) return KvScale{checked_kv_scale(value, dtype)};
  check(*t, "kv_scale", kF32, "float32 (a one-element tensor)", Dims{1}, "[1]", where, 4);
  const auto* p = static_cast<const float*>(t->data());
  if (where.backend == Backend::cpu) return KvScale{checked_kv_scale(double(*p), dtype)};
  return KvScale{1.0f, p};
}

// The bf16 values of a float32 or bf16 host tensor; float32 is rounded into `scratch` (CPU only).
const bf16* host_bf16(const Tensor& t, std::vector<bf16>& scratch) {
  if (kind_of(t.dtype()) != kF32) return static_cast<const bf16*>(t.data());
  const auto* f = static_cast<const float*>(t.data());
  scratch.resize(t.size());
  for (size_t i = 0; i < scratch.size(); ++i) scratch[i] = float_to_bf16(f[i]);
  return scratch.data();
}

// Where a CPU kernel writes a bf16 result for `out` (float32 outputs get scratch, widened after).
bf16* host_bf16_out(OutTensor& t, std::vector<bf16>& scratch) {
  if (kind_of(t.dtype()) != kF32) return static_cast<bf16*>(t.data());
  scratch.resize(t.size());
  return scratch.data();
}

void widen(const std::vector<bf16>& scratch, OutTensor& t) {
  if (kind_of(t.dtype()) != kF32) return;
  auto* f = static_cast<float*>(t.data());
  for (size_t i = 0; i < scratch.size(); ++i) f[i] = bf16_to_float(scratch[i]);
}

#ifdef DCPMLA_HAS_CUDA
cudaStream_t stream_of(uintptr_t s) { return reinterpret_cast<cudaStream_t>(s); }
#endif

}  // namespace

#ifdef DCPMLA_HAS_CUDA
struct Engine::Cuda {
  cuda::Attention attention;
};
#else
struct Engine::Cuda {};
#endif

Engine::Engine(int heads, const std::string& kv_dtype, int block_size, int world_size, int rank, int interleave,
               int max_batch, int max_qlen, int64_t max_local_len, std::optional<double> softmax_scale,
               int kv_lora_rank, const std::string& route, const std::string& device, int device_index) {
  config_.heads = heads;
  config_.kv_dtype = parse_kv_dtype(kv_dtype);
  config_.block_size = block_size;
  config_.layout = Layout{world_size, rank, interleave};
  config_.limits = PlanLimits{max_batch, max_qlen, max_local_len};
  if (softmax_scale) config_.softmax_scale = checked_softmax_scale(*softmax_scale);
  config_.dims.kv_lora_rank = kv_lora_rank;
  config_.route = parse_route(route);
  where_.backend = parse_backend(device);
  if (where_.backend == Backend::cpu) {
    cpu_ = std::make_unique<Attention>(config_);
    return;
  }
#ifdef DCPMLA_HAS_CUDA
  cuda_.reset(new Cuda{cuda::Attention(config_, device_index)});
  where_.device = cuda_->attention.device();
#else
  (void)device_index;
  fail("device", device, "'cpu': the CUDA backend is not built into this module (pip install with DCPMLA_CUDA=1)");
#endif
}

Engine::~Engine() = default;

std::unique_lock<std::mutex> Engine::lock() const {
  std::unique_lock<std::mutex> held(mutex_, std::try_to_lock);
  if (!held.owns_lock()) {
    // Another thread holds it (a run() computing without the GIL, which it needs back to
    // return): wait without the GIL, then take the GIL back.
    nb::gil_scoped_release release;
    held.lock();
  }
  return held;
}

const Plan& Engine::current_plan() const {
#ifdef DCPMLA_HAS_CUDA
  if (cuda_) return cuda_->attention.current_plan();
#endif
  return cpu_->current_plan();
}

bool Engine::planned() const {
  const auto held = lock();
  return planned_;
}
int Engine::batch() const {
  const auto held = lock();
  return planned_ ? current_plan().header().batch : 0;
}
int Engine::qlen() const {
  const auto held = lock();
  return planned_ ? current_plan().header().qlen : 0;
}
std::string Engine::route() const {
  const auto held = lock();
  return planned_ ? std::string(to_string(current_plan().route())) : "none";
}
int Engine::max_segments() const {
  const auto held = lock();
  return planned_ ? current_plan().stats().max_segments : 0;
}

void Engine::plan(HostInts1 seq_lens, HostInts2 block_tables, int qlen, const std::string& mode,
                  std::optional<HostInts1> qlens, uintptr_t stream) {
  const auto held = lock();  // a run() of another thread finishes with the plan it started with
  if (block_tables.shape(0) != seq_lens.shape(0))
    fail("block_tables.shape[0]", block_tables.shape(0),
         fmt::format("{} (B, the length of seq_lens): one table row per request", seq_lens.shape(0)));
  if (block_tables.shape(1) > size_t(std::numeric_limits<int>::max()))
    fail("block_tables.shape[1]", block_tables.shape(1), "a table width that fits int32");
  if (qlens && qlens->shape(0) != seq_lens.shape(0))
    fail("qlens.shape[0]", qlens->shape(0), fmt::format("{} (B, the length of seq_lens)", seq_lens.shape(0)));
  // Rows read in place at their pitch (strides in elements; a row's entries adjacent). The
  // strides of an extent of at most one element are never followed.
  const int64_t rows = int64_t(block_tables.shape(0)), width = int64_t(block_tables.shape(1));
  if (width > 1 && block_tables.stride(1) != 1)
    fail("block_tables.strides[1]", block_tables.stride(1) * 4, "4 bytes: each row's entries adjacent");
  const int64_t pitch = rows > 1 && width > 0 ? block_tables.stride(0) : width;
  if (pitch < width)
    fail("block_tables.strides[0]", pitch * 4, fmt::format(">= the row's {} bytes: rows that do not overlap", width * 4));
  const BatchDesc batch{{seq_lens.data(), seq_lens.size()},
                        qlen,
                        {block_tables.data(), rows == 0 ? size_t(0) : size_t((rows - 1) * pitch + width)},
                        int(width),
                        parse_mode(mode),
                        qlens ? std::span<const int32_t>(qlens->data(), qlens->size()) : std::span<const int32_t>(),
                        pitch};
  if (cpu_) {
    cpu_->plan(batch);
  } else {
#ifdef DCPMLA_HAS_CUDA
    cuda::DeviceScope scope(where_.device);
    // run() checks its tensors against the current plan, and a graph replays later plans on the
    // tensors of its captured run(): a plan of more rows than that run's would write past them.
    cuda_->attention.plan(batch, stream_of(stream), /*fit_captured_rows=*/true);
#else
    (void)stream;
#endif
  }
  planned_ = true;
  packed_ = bool(qlens);
}

void Engine::run(Tensor q, Tensor kv_cache, double kv_scale, std::optional<Tensor> kv_scale_tensor, OutTensor out,
                 OutTensor lse, uintptr_t stream) {
  // The plan stays this one until the kernels are launched (CPU: done, with the GIL released):
  // another thread's plan() waits.
  const auto held = lock();
  if (!planned_) fail("plan", "none", "a plan: call plan(seq_lens, block_tables, qlen) before run()");
  const PlanHeader& h = current_plan().header();
  const int64_t B = h.batch, T = h.qlen, H = config_.heads, D = config_.dims.dim(), R = config_.dims.kv_lora_rank;
  const bool cpu = where_.backend == Backend::cpu;
  const uint32_t kinds = cpu ? kF32 | kBf16Like : kBf16Like;
  const char* text = cpu ? "float32 or bfloat16 (or uint16 / int16 holding bf16 bits)" : kBf16Text;
  if (packed_) {
    const int64_t rows = h.rows;
    check(q, "q", kinds, text, Dims{rows, H, D}, "[sum(qlens), H, D] (the plan's packed rows)", where_, 16);
    check(out, "out", kinds, text, Dims{rows, H, R}, "[sum(qlens), H, kv_lora_rank]", where_, 16);
    check(lse, "lse", kF32, "float32", Dims{rows, H}, "[sum(qlens), H]", where_, 4);
  } else {
    check(q, "q", kinds, text, Dims{B, T, H, D}, "[B, qlen, H, D] (B and qlen of the plan)", where_, 16);
    check(out, "out", kinds, text, Dims{B, T, H, R}, "[B, qlen, H, kv_lora_rank]", where_, 16);
    check(lse, "lse", kF32, "float32", Dims{B, T, H}, "[B, qlen, H]", where_, 4);
  }
  const KvCache cache = cache_of(kv_cache, config_.kv_dtype, where_);
  const KvScale scale = scale_of(kv_scale, kv_scale_tensor, config_.kv_dtype, where_);
  require_disjoint({bytes_of("out", out), bytes_of("lse", lse)},
                   {bytes_of("q", q), bytes_of("kv_cache", kv_cache), bytes_of("kv_scale", kv_scale_tensor)});
  if (cpu) {
    std::vector<bf16> q16, out16;
    const bf16* qp = host_bf16(q, q16);
    bf16* op = host_bf16_out(out, out16);
    {
      nb::gil_scoped_release release;
      cpu_->run(qp, cache, scale, op, static_cast<float*>(lse.data()));
    }
    widen(out16, out);
    return;
  }
#ifdef DCPMLA_HAS_CUDA
  cuda::DeviceScope scope(where_.device);
  cuda_->attention.run(static_cast<const bf16*>(q.data()), cache, scale, static_cast<bf16*>(out.data()),
                       static_cast<float*>(lse.data()), stream_of(stream));
#else
  (void)stream;
#endif
}

void write_kv(OutTensor kv_cache, Tensor latent, Tensor slot_mapping, const std::string& kv_dtype, double kv_scale,
              std::optional<Tensor> kv_scale_tensor, uintptr_t stream) {
  const KvDtype dtype = parse_kv_dtype(kv_dtype);
  const Placement where = placement_of(kv_cache, "kv_cache");
  const KvCache cache = cache_of(kv_cache, dtype, where);
  const bool cpu = where.backend == Backend::cpu;
  const int64_t n = latent.ndim() >= 1 ? int64_t(latent.shape(0)) : -1;
  check(latent, "latent", cpu ? kF32 | kBf16Like : kBf16Like,
        cpu ? "float32 or bfloat16 (or uint16 / int16 holding bf16 bits)" : kBf16Text, Dims{-1, cache.dim},
        "[T, D] (D of kv_cache)", where, 16);
  check(slot_mapping, "slot_mapping", kI64, "int64", Dims{n}, "[T] (T of latent)", where, 8);
  const KvScale scale = scale_of(kv_scale, kv_scale_tensor, dtype, where);
  require_disjoint({bytes_of("kv_cache", kv_cache)},
                   {bytes_of("latent", latent), bytes_of("slot_mapping", slot_mapping),
                    bytes_of("kv_scale", kv_scale_tensor)});
  const auto* slots = static_cast<const int64_t*>(slot_mapping.data());
  if (cpu) {
    std::vector<bf16> scratch;
    const bf16* values = host_bf16(latent, scratch);
    nb::gil_scoped_release release;
    dcpmla::write_kv(cache, values, slots, n, scale.value);
    return;
  }
#ifdef DCPMLA_HAS_CUDA
  cuda::DeviceScope scope(where.device);
  cuda::write_kv(cache, static_cast<const bf16*>(latent.data()), slots, n, scale, stream_of(stream));
#else
  (void)stream;
#endif
}

namespace {

// The partials of a merge, checked: where it runs, N, the rows, the width and the extents the
// outputs must have.
struct MergeInputs {
  Placement where;
  int64_t n = 0, rows = 1, width = 0;
  Dims out_dims = Dims::any(0), lse_dims = Dims::any(0);
};

MergeInputs merge_inputs(const Tensor& out_parts, const Tensor& lse_parts) {
  MergeInputs m;
  m.where = placement_of(out_parts, "out_parts");
  const bool cpu = m.where.backend == Backend::cpu;
  const size_t nd = out_parts.ndim();
  if (nd < 2 || nd > 8)
    fail("out_parts.ndim", nd, "2..8: [N, ..., W] (N partials, then the rows, then the value width)");
  const uint32_t kinds = cpu ? kF32 | kBf16Like : kBf16Like;
  const char* text = cpu ? "float32 or bfloat16 (or uint16 / int16 holding bf16 bits)" : kBf16Text;
  check(out_parts, "out_parts", kinds, text, Dims::any(nd), "[N, ..., W]", m.where, 16);
  // lse_parts [N, ...] and out [..., W], lse [...]: the extents of out_parts.
  Dims lse_parts_dims = Dims::any(nd - 1);
  m.out_dims = Dims::any(nd - 1);
  m.lse_dims = Dims::any(nd - 2);
  for (size_t i = 0; i < nd; ++i) {
    const int64_t e = int64_t(out_parts.shape(i));
    if (i + 1 < nd) lse_parts_dims.v[i] = e;
    if (i >= 1) m.out_dims.v[i - 1] = e;
    if (i >= 1 && i + 1 < nd) {
      m.lse_dims.v[i - 1] = e;
      m.rows *= e;
    }
  }
  m.n = int64_t(out_parts.shape(0));
  m.width = int64_t(out_parts.shape(nd - 1));
  if (m.n < 1 || m.n > std::numeric_limits<int>::max())
    fail("out_parts.shape[0]", m.n, "N >= 1 partials that fit int32");
  if (m.width < 1 || m.width > std::numeric_limits<int>::max())
    fail("out_parts.shape[-1]", m.width, "W >= 1 values per row that fits int32");
  check(lse_parts, "lse_parts", kF32, "float32", lse_parts_dims, "[N, ...] (out_parts' shape without W)", m.where, 4);
  return m;
}

}  // namespace

void check_merge_inputs(Tensor out_parts, Tensor lse_parts) { (void)merge_inputs(out_parts, lse_parts); }

void merge_states(Tensor out_parts, Tensor lse_parts, OutTensor out, OutTensor lse, uintptr_t stream) {
  const MergeInputs m = merge_inputs(out_parts, lse_parts);
  const Placement where = m.where;
  const bool cpu = where.backend == Backend::cpu;
  const int64_t n = m.n, rows = m.rows, width = m.width;
  check(out, "out", kind_of(out_parts.dtype()), "the dtype of out_parts", m.out_dims, "[..., W] (out_parts[0]'s shape)",
        where, 16);
  check(lse, "lse", kF32, "float32", m.lse_dims, "[...] (lse_parts[0]'s shape)", where, 4);
  require_disjoint({bytes_of("out", out), bytes_of("lse", lse)},
                   {bytes_of("out_parts", out_parts), bytes_of("lse_parts", lse_parts)});
  const auto* lp = static_cast<const float*>(lse_parts.data());
  auto* lo = static_cast<float*>(lse.data());
  if (cpu) {
    std::vector<bf16> parts16, out16;
    const bf16* pp = host_bf16(out_parts, parts16);
    bf16* op = host_bf16_out(out, out16);
    {
      nb::gil_scoped_release release;
      combine_partials(pp, lp, int(n), op, lo, rows, int(width));
    }
    widen(out16, out);
    return;
  }
#ifdef DCPMLA_HAS_CUDA
  cuda::DeviceScope scope(where.device);
  cuda::combine_partials(static_cast<const bf16*>(out_parts.data()), lp, int(n), static_cast<bf16*>(out.data()), lo,
                         rows, int(width), stream_of(stream));
#else
  (void)stream;
#endif
}

}  // namespace dcpmla::python
