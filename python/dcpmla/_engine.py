"""The engine API (SPEC §6): what a serving engine calls every step.

The engine owns its KV caches (one per layer, from its own allocator); an :class:`Attention`
holds one rank's plan and workspace. Per step: :meth:`Attention.plan` once; per layer:
:func:`write_kv` of the step's new latents, then :meth:`Attention.run`, which returns this
rank's partial; :func:`merge_states` combines the ranks' partials (SPEC §2).

Tensors cross into the library without a copy: on ``device="cuda"`` any DLPack producer (torch,
cupy, jax) on the Attention's GPU; on ``device="cpu"`` numpy arrays or torch CPU tensors. A
check that fails raises ``ValueError`` naming the argument and value before anything runs.
"""

from __future__ import annotations

import itertools
import sys
import weakref

import numpy as np

from . import _dcpmla
from ._checks import (_error, _int, _int_array, _is_torch, _native_array, _refuse_lazy_torch, _require_usable_cuda,
                      _scale, _str, _torch)

_DL_CUDA = 2  # DLPack's device type of CUDA memory

# Extended float dtypes that numpy (through ml_dtypes) and torch name but DLPack may not carry:
# passed as raw integers of their width, after checking that the format is the cache's.
_RAW_FLOATS = {"bfloat16": ("bf16", 2), "float8_e4m3fn": ("fp8_e4m3", 1), "float8_e5m2": ("fp8_e5m2", 1)}
_NP_RAW = {1: np.uint8, 2: np.uint16}

# What each argument holds, for the messages that refuse a numpy array before the native call
# (numpy arrays are host arrays: the CPU's dtypes).
_VALUES = "float32 or bfloat16 (ml_dtypes.bfloat16, or uint16 / int16 holding bf16 bits)"
_CACHE = {"bf16": "bfloat16 (ml_dtypes.bfloat16, or uint16 / int16 holding bf16 bits) for kv_dtype bf16",
          "fp8_e4m3": "uint8 / int8 or ml_dtypes.float8_e4m3fn for kv_dtype fp8_e4m3",
          "fp8_e5m2": "uint8 / int8 or ml_dtypes.float8_e5m2 for kv_dtype fp8_e5m2"}


def _raw(field, x, kv_dtype=None):
    """`x`, or a view of it as raw integers where its dtype is an fp8 format (torch, ml_dtypes) or
    a numpy bfloat16 (ml_dtypes): the library reads those bytes as `kv_dtype` says. A format that
    is not `kv_dtype`'s is refused (an e5m2 tensor for an e4m3 cache)."""
    if _is_torch(x):
        name = str(x.dtype)[len("torch."):]
        if not name.startswith("float8"):
            return x  # bfloat16 and the integer types travel through DLPack as they are
        view = lambda: x.view(_torch().uint8)  # noqa: E731
    elif isinstance(x, np.ndarray) and x.dtype.name in _RAW_FLOATS:
        name = x.dtype.name
        view = lambda: x.view(_NP_RAW[x.dtype.itemsize])  # noqa: E731
    else:
        return x
    if _RAW_FLOATS.get(name, (None,))[0] != (kv_dtype or "bf16"):
        raise _error(f"{field}.dtype", name, f"a dtype holding {kv_dtype} values" if kv_dtype else "bfloat16")
    return view()


def _cuda_index(field, x):
    """The CUDA ordinal of a DLPack producer's memory, or None for host memory (or a list). CUDA
    memory with no usable GPU (a driver older than the library's runtime) is refused here, as
    device="cuda" is, before the CUDA runtime answers with an error that names no argument."""
    torch = _torch()
    if torch is not None and type(x) is torch.Tensor:
        # What __dlpack_device__() answers for it, without that Python method (torch/_tensor.py).
        if x.is_cuda:
            index = x.get_device()
            _require_usable_cuda(f"{field}.device", f"cuda:{index}", "host memory")
            return index
        if x.is_cpu:
            return None
    device = getattr(x, "__dlpack_device__", None)
    if device is None:
        return None
    try:
        kind, index = device()
        kind, index = int(kind), int(index)
    except Exception as e:  # a producer's own failure, or not a (device type, ordinal) pair
        raise _error(f"{field}.__dlpack_device__()", f"a {type(x).__name__} whose __dlpack_device__() failed "
                     f"({type(e).__name__}: {e})", "a (device type, device ordinal) pair of integers") from None
    if kind != _DL_CUDA:
        return None
    _require_usable_cuda(f"{field}.device", f"cuda:{index}", "host memory")
    return index


def _stream(stream, x, cuda_index):
    """The cudaStream_t handle a call runs on; None on the CPU (where `stream` must be None).

    None: the producer's current stream: torch's current stream on the device, cupy's current
    stream, else the legacy default stream (0). When `x` is None (plan(), which takes no tensor):
    torch's once torch has set CUDA up, else cupy's where cupy is imported (run() on a cupy array
    queues its kernels there, and a non-blocking stream is not ordered after the legacy stream),
    else torch's where torch is imported, else 0. An explicit stream: an int handle, or an object
    with ``cuda_stream`` (torch) or ``ptr`` (cupy)."""
    if cuda_index is None:
        if stream is not None:
            raise _error("stream", repr(stream), "None on the cpu device")
        return None
    if stream is None:
        torch = _torch()
        if torch is not None and (type(x) is torch.Tensor or (x is None and torch.cuda.is_initialized())):
            # torch's raw current stream, the handle torch.cuda.current_stream() wraps, without
            # building its Stream object (0.3 against 3.6 us a call, bench/python_overhead.py).
            # For plan() (no tensor) only once torch has set CUDA up, which current_stream() does.
            raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
            if raw is not None:
                return raw(cuda_index)
        cupy = sys.modules.get("cupy")
        if cupy is not None and (x is None or isinstance(x, cupy.ndarray)):
            return cupy.cuda.get_current_stream().ptr
        if torch is not None and (x is None or isinstance(x, torch.Tensor)):
            return torch.cuda.current_stream(cuda_index).cuda_stream
        return 0
    handle = stream
    if not isinstance(stream, int):
        handle = getattr(stream, "cuda_stream", getattr(stream, "ptr", None))
    if isinstance(handle, bool) or not isinstance(handle, int) or not 0 <= handle <= 2**64 - 1:
        raise _error("stream", repr(stream), "None, an int cudaStream_t handle, or a stream object with "
                     ".cuda_stream (torch) or .ptr (cupy)")
    return handle


def _dlpack(field, x, stream):
    """What the native call imports: torch and numpy as they are (a call that imports a torch tensor
    once passes torch's own export of it, _once: no stream, no synchronisation, and the call runs
    on torch's stream); other CUDA producers are asked for a capsule on the call's stream (DLPack:
    1 = the legacy default stream), so that they order their pending work before it. `stream` is
    None on the CPU."""
    if not hasattr(x, "__dlpack__"):
        raise _error(field, type(x).__name__, "an array or tensor (numpy, torch, or another DLPack producer)")
    if stream is None or isinstance(x, np.ndarray) or _is_torch(x):
        return x
    try:
        return x.__dlpack__(stream=stream or 1)
    except Exception as e:
        raise _error(field, f"a {type(x).__name__} whose __dlpack__() raised {type(e).__name__}: {e}",
                     "an array or tensor that exports itself through DLPack") from e


def _call(native, *args, tensors):
    """native(*args); where nanobind refuses an argument (a TypeError naming none: a read-only
    or non-native-byte-order array of a producer other than numpy, whose checks are ours, or a
    producer whose __dlpack__() raises), the first of `tensors` ((field, value, writable)) that it
    cannot import alone is named in a ValueError. Capsules (already exported) are not probed again."""
    try:
        return native(*args)
    except TypeError:
        for field, x, writable in tensors:
            if x is None or type(x).__name__ == "PyCapsule":
                continue
            try:
                (_dcpmla._imports_writable if writable else _dcpmla._imports)(x)
            except Exception as e:
                need = "a writable array" if writable else "an array"
                raise _error(field, f"a {type(x).__name__} the native call cannot import ({type(e).__name__})",
                             f"{need} in a plain numeric dtype and the machine's byte order, whose "
                             f"__dlpack__() succeeds") from e
        raise


def _tensor(field, x, stream, expected, *, kv_dtype=None, raw=True, writable=False):
    """What the native call imports for `field`: `x` (as raw integers where _raw says), after the
    checks nanobind would fail with a TypeError that names no argument: a numpy dtype it cannot
    import (object, structured, big-endian, an ml_dtypes format the library does not read) and a
    read-only array the call writes into."""
    torch = _torch()
    if torch is not None and isinstance(x, torch.Tensor):
        _refuse_lazy_torch(field, x)
        dtype = x.dtype
        if type(x) is torch.Tensor and (dtype.itemsize != 1 or not dtype.is_floating_point):
            return x  # what the path below returns for a torch tensor that is not fp8, in a fraction of its time
    if raw:
        x = _raw(field, x, kv_dtype)
    return _dlpack(field, _native_array(field, x, expected, writable), stream)


def _once(x):
    """`x` for a native call that imports it once: a torch tensor as torch's own DLPack export (a
    capsule). The native import of the tensor object takes about 2.7 us (nanobind 3.1 on the GPU
    image), the export and the capsule's import about 0.7 (H100 host, bench/python_overhead.py);
    either takes a tensor that requires grad. A tensor the export
    refuses (a sparse layout) is passed as it is, and the native import names it (_call)."""
    torch = _torch()
    if torch is not None and type(x) is torch.Tensor:
        export = getattr(torch._C, "_to_dlpack", None)
        if export is not None:
            try:
                return export(x)
            except Exception:  # noqa: BLE001 (refused by name as above)
                pass
    return x


def _empty_like(field, like, shape_of, dtype_of_like):
    """A new output in `like`'s framework and on its device: torch.empty or np.empty of shape
    shape_of(like). float32 when `dtype_of_like` is False, else `like`'s dtype. Other producers
    must pass the buffer (their shape is not read)."""
    if _is_torch(like):
        torch = _torch()
        return torch.empty(shape_of(like), dtype=like.dtype if dtype_of_like else torch.float32, device=like.device)
    if isinstance(like, np.ndarray):
        return np.empty(shape_of(like), dtype=like.dtype if dtype_of_like else np.float32)
    raise _error(field, "None", f"a buffer (out= and lse=): outputs are allocated only for torch and numpy "
                 f"inputs, not {type(like).__name__}")


def _kv_scale(kv_scale, stream):
    """(value, tensor) for the native call: a float, or a one-element float32 tensor read when the
    call runs."""
    if hasattr(kv_scale, "__dlpack__"):
        if getattr(kv_scale, "ndim", None) == 0 and hasattr(kv_scale, "reshape"):
            kv_scale = kv_scale.reshape(1)  # a 0-d tensor is one element too (a view: same memory)
        return 1.0, _tensor("kv_scale", kv_scale, stream, "float32 (a one-element array)", raw=False)
    return _scale("kv_scale", kv_scale), None


_ATTENTIONS: "weakref.WeakValueDictionary[int, Attention]" = weakref.WeakValueDictionary()
_HANDLES = itertools.count(1)


def attention_of(handle: int) -> "Attention":
    """The live :class:`Attention` with this :attr:`Attention.handle` (the torch ops take handles)."""
    try:
        return _ATTENTIONS[handle]
    except KeyError:
        raise _error("handle", handle, "the handle of a live dcpmla.Attention") from None


def _device(device):
    """('cpu', None) or ('cuda', ordinal or -1 for the current device) from "cpu", "cuda",
    "cuda:N" or a torch.device."""
    text = str(device) if type(device).__name__ == "device" else device
    text = _str("device", text)
    if text == "cpu":
        return "cpu", None
    # N in ASCII digits within int32 (str.isdigit also takes '²' and other scripts' digits).
    ordinal = text[5:] if text.startswith("cuda:") else ""
    if text != "cuda" and not (ordinal and ordinal.isascii() and ordinal.isdigit() and int(ordinal) <= 2**31 - 1):
        raise _error("device", repr(device), "'cpu', 'cuda' or 'cuda:N' (N a device ordinal)")
    _require_usable_cuda("device", repr(text), "'cpu'")
    return "cuda", -1 if text == "cuda" else int(ordinal)


class Attention:
    """One rank's MLA attention over engine-owned paged latent caches (SPEC §6).

    Args (in SPEC §6's order, positional or keyword; fixed for the object's life, checked now):
        heads: query heads this rank computes (all the group's heads under DCP).
        kv_dtype: ``"bf16"``, ``"fp8_e4m3"`` or ``"fp8_e5m2"``: the caches' storage.
        block_size: tokens per cache block (``block_size % interleave == 0``).
        world_size, rank, interleave: the DCP group (N ranks, this one's rank, runs of I tokens).
        max_batch, max_qlen, max_local_len: capture limits; every plan must fit them, and a CUDA
            graph captured once replays correctly for any plan within them of no more query rows
            than its captured run's (capture with the largest batch you replay: a plan of more
            rows is refused, its replay would write past the captured tensors).
        softmax_scale: score scale, a positive normal float32 up to 65536; None means
            ``D ** -0.5`` (D = kv_lora_rank + 64).
        kv_lora_rank: R, the value width (512 on CUDA).
        route: ``"auto"``, or force ``"one_stage"`` or ``"split_k"`` (tests). Not ``"two_stage"``:
            its stage B reads the verify block's latents, which :meth:`run` does not take, so
            run() would return stage A alone, not this rank's partial (refused; it runs end to
            end in :func:`dcpmla.mla_attention` and the C++ DCP step).
        device: ``"cuda"`` (the current device), ``"cuda:N"``, a torch.device, or ``"cpu"``.

    On CUDA the object owns the plan (two pinned host copies, one device copy) and the split-K
    workspace, allocated here; :meth:`plan` and :meth:`run` allocate nothing.
    """

    def __init__(self, heads, kv_dtype="bf16", block_size=64, world_size=1, rank=0, interleave=1,
                 max_batch=256, max_qlen=8, max_local_len=131072, softmax_scale=None, kv_lora_rank=512,
                 route="auto", device="cuda"):
        backend, index = _device(device)
        if softmax_scale is not None:
            softmax_scale = _scale("softmax_scale", softmax_scale, ", or None for D ** -0.5")
        # Every integer is used from here on as the plain int _int returns: a numpy unsigned
        # scalar (accepted) would wrap or raise OverflowError in the arithmetic below (NEP 50).
        heads = _int("heads", heads)
        block_size = _int("block_size", block_size)
        kv_lora_rank = _int("kv_lora_rank", kv_lora_rank)
        max_batch = _int("max_batch", max_batch)
        max_qlen = _int("max_qlen", max_qlen)
        max_local_len = _int("max_local_len", max_local_len, 1, _dcpmla.max_local_kv_len)
        route = _str("route", route)
        if route == "two_stage":
            raise _error("route", repr(route), "'auto', 'one_stage' or 'split_k' (two_stage's stage B needs the "
                         "verify block's latents, which run() does not take: it would return stage A alone; "
                         "dcpmla.mla_attention runs two_stage end to end)")
        self._native = _dcpmla._Engine(
            heads=heads, kv_dtype=_str("kv_dtype", kv_dtype),
            block_size=block_size, world_size=_int("world_size", world_size),
            rank=_int("rank", rank), interleave=_int("interleave", interleave),
            max_batch=max_batch, max_qlen=max_qlen,
            max_local_len=max_local_len,
            softmax_scale=softmax_scale,
            kv_lora_rank=kv_lora_rank, route=route, device=backend,
            device_index=-1 if index is None else index)
        self.heads = heads
        self.kv_dtype = kv_dtype
        self.kv_lora_rank = kv_lora_rank
        self._max_batch = max_batch
        self._max_rows = max_batch * max_qlen  # the plan's row capacity, fixed for the object's life
        # Table entries a request can use (its largest rank share over block_size): plan() reads
        # no column past them, so a wider table is cut there before anything is copied.
        self._table_cols = -(-max_local_len // block_size)
        self._cuda_index = None if backend == "cpu" else self._native.device_index
        self.device = "cpu" if backend == "cpu" else f"cuda:{self._cuda_index}"
        self.handle = next(_HANDLES)
        _ATTENTIONS[self.handle] = self

    @property
    def batch(self) -> int:
        """B of the current plan (0 before the first)."""
        return self._native.batch

    @property
    def qlen(self) -> int:
        """qlen of the current plan (0 before the first)."""
        return self._native.qlen

    @property
    def route(self) -> str:
        """The route the planner took for the current plan ('none' before the first)."""
        return self._native.route

    def plan(self, seq_lens, block_tables, qlen, mode="verify", *, qlens=None, stream=None):
        """Plans one step for every layer: host work, no allocation, no device synchronisation.

        Args:
            seq_lens: int32 ``[B]`` host array (numpy, a CPU tensor, or a list): ``L_b`` including
                the query block; 0 marks a padding request.
            block_tables: int32 ``[B, table_width]``: each request's block table, shared by all
                ranks (SPEC §3).
            qlen: query rows per request (1 for decode; 1 + k to verify k draft tokens).
            mode: ``"decode"``, ``"verify"`` (causal) or ``"draft"`` (non-causal).
            qlens: per-request query rows (int32 ``[B]``, each in ``[0, qlen]``; qo_indptr style),
                or None for ``qlen`` rows each. With them ``run`` takes q ``[sum(qlens), H, D]``
                packed by request (a mixed batch of decode rows and verify blocks), and request
                b's rows see the windows of its own ``qlens[b]``.
            stream: CUDA only: where the plan's upload is ordered; the runs must be on it or after
                it, on this object's device (a stream of another device is refused). None: torch's
                current stream once torch has set CUDA up, else cupy's current stream where cupy is
                imported, else torch's where torch is imported, else the legacy default stream
                (run()'s default is the producer's current stream: pass both explicitly when mixing
                producers). Never inside a graph capture: plan outside, then replay.

        int32 C-contiguous arrays are read in place, and so are block tables whose rows lie apart
        (a ``[:B, :W]`` slice of an engine's persistent table: no copy each step); columns past
        ``ceil(max_local_len / block_size)`` are never read. Other integer arrays and lists are
        converted (a value that does not fit int32 is refused, naming it). The extents are checked first
        (B <= max_batch, one table row and one qlens entry per request), from the shapes, so that
        a broadcast view of 2**40 entries is refused before anything copies or reads it.
        """
        max_batch = self._max_batch

        def batch(shape):
            if shape[0] > max_batch:
                raise _error("batch", shape[0], f"1..limits.max_batch ({max_batch}): the length of seq_lens")

        seq_lens = _int_array("seq_lens", seq_lens, np.int32, "[B]", check_shape=batch)
        B = seq_lens.shape[0]

        def per_request(field, text):
            def check(shape):
                if shape[0] != B:
                    raise _error(f"{field}.shape[0]", shape[0], f"{B} (B, the length of seq_lens){text}")
            return check

        rows = per_request("block_tables", ": one table row per request")

        def table_shape(shape):
            rows(shape)
            if shape[1] > 2**31 - 1:  # the library's own check, before a broadcast view is copied
                raise _error("block_tables.shape[1]", shape[1], "a table width that fits int32")

        block_tables = _int_array("block_tables", block_tables, np.int32, "[B, table_width]", ndim=2,
                                  check_shape=table_shape, rows_in_place=True, max_cols=self._table_cols)
        if qlens is not None:
            qlens = _int_array("qlens", qlens, np.int32, "[B]", check_shape=per_request("qlens", ""))
        self._native.plan(seq_lens, block_tables, _int("qlen", qlen), _str("mode", mode), qlens,
                          _stream(stream, None, self._cuda_index) or 0)

    def run(self, q, kv_cache, kv_scale=1.0, out=None, lse=None, stream=None):
        """This rank's partial attention of the planned batch over one layer's cache.

        Args:
            q: ``[B, qlen, H, D]`` bfloat16 (CPU: float32 or bfloat16), D = kv_lora_rank + 64;
                ``[sum(qlens), H, D]`` when the plan had qlens.
            kv_cache: ``[num_blocks, block_size, D]``, contiguous, engine-owned: bfloat16 for a bf16
                cache, one byte per value for fp8 (uint8, or torch.float8_e4m3fn / float8_e5m2).
            kv_scale: the fp8 scale, a float or a one-element float32 tensor on the device (read
                when the kernels run, so a replayed graph sees its current value); 1.0 for bf16.
            out: ``[B, qlen, H, kv_lora_rank]``, bfloat16 (CPU: float32 or bfloat16, whatever q's);
                lse: ``[B, qlen, H]`` float32 (packed ``[sum(qlens), ...]`` when the plan had qlens).
                Reused as given; when None, allocated in q's dtype, framework and device
                (torch.empty, np.empty): pass both to keep the call allocation-free.
            stream: None for the producer's current stream (torch: torch.cuda.current_stream()),
                an int handle, or a torch.cuda.Stream / cupy stream.

        Returns:
            ``(out, lse)``: this rank's partial; lse is the natural log, and rows whose rank-local
            window is empty give out 0, lse -inf. Merge the ranks' with :func:`merge_states`.

        out and lse must share no memory with q, kv_cache, kv_scale or each other (refused:
        the kernels would read what they write). On CUDA q, out and kv_cache start 16-byte
        aligned (the kernels' vector width; torch's allocations are); on the CPU any whole-value
        offset runs. One Attention may be used from several threads:
        a plan() waits for a run() in progress (which releases the GIL while it computes).
        """
        s = _stream(stream, q, self._cuda_index)
        # The inputs first, so that a q that is no tensor is named before any output is allocated.
        q_in = _tensor("q", q, s, _VALUES)
        cache_in = _tensor("kv_cache", kv_cache, s, _CACHE[self.kv_dtype], kv_dtype=self.kv_dtype)
        value, tensor = _kv_scale(kv_scale, s)
        if out is None or lse is None:
            lead = self._output_lead(tuple(getattr(q, "shape", ())))
            if out is None:
                out = _empty_like("out", q, lambda _: (*lead, self.heads, self.kv_lora_rank), True)
            if lse is None:
                lse = _empty_like("lse", q, lambda _: (*lead, self.heads), False)
        out_in = _tensor("out", out, s, _VALUES, writable=True)
        lse_out = _tensor("lse", lse, s, "float32", raw=False, writable=True)
        q_in, cache_in, tensor, out_in, lse_out = map(_once, (q_in, cache_in, tensor, out_in, lse_out))
        _call(self._native.run, q_in, cache_in, value, tensor, out_in, lse_out, s or 0,
              tensors=[("q", q_in, False), ("kv_cache", cache_in, False), ("kv_scale", tensor, False),
                       ("out", out_in, True), ("lse", lse_out, True)])
        return out, lse

    def _output_lead(self, shape):
        """The leading extents (rows) of the outputs run() allocates for a q of `shape`: q's own,
        not the plan's (a plan() in another thread may replace the plan before the run takes it,
        and a q that does not fit the plan is refused by name). Only a q that can fit (H, D and at
        most the capacity's rows) sizes the outputs: out holds H x R values per row of q, so a q
        of other trailing extents, or a broadcast view, asked for up to H x R times q's size (a
        MemoryError, not a ValueError). Any other q gets empty placeholders, and the native call
        names q. (A plain loop, not math.prod: torch.compile traces this from torch_ops.run.)"""
        rows = 1
        for n in shape[:-2]:
            rows *= n
        fits = len(shape) in (3, 4) and shape[-2:] == (self.heads, self.kv_lora_rank + 64) and rows <= self._max_rows
        return shape[:-2] if fits else (0,) * max(len(shape) - 2, 0)

    def __repr__(self):
        return (f"dcpmla.Attention(heads={self.heads}, kv_dtype={self.kv_dtype!r}, device={self.device!r}, "
                f"handle={self.handle})")

    def _not_copyable(self, *_):
        # A copy shared the native plan and workspace and the handle (which names the original
        # only: the torch ops then refused the live copy); pickle failed on the native member.
        raise TypeError("dcpmla.Attention cannot be copied or pickled: it owns a native plan and workspace "
                        "(build another with the same arguments)")

    __copy__ = __deepcopy__ = __reduce_ex__ = _not_copyable


def write_kv(kv_cache, latent, slot_mapping, kv_dtype="bf16", kv_scale=1.0, stream=None):
    """Writes new latents into one layer's cache (SPEC §3), in place.

    Args:
        kv_cache: ``[num_blocks, block_size, D]``, as for :meth:`Attention.run`.
        latent: ``[T, D]`` bfloat16 (CPU: float32 or bfloat16); fp8 caches store
            ``rne(sat(latent / kv_scale))``.
        slot_mapping: int64 ``[T]`` rank-local slots (``block * block_size + offset``), -1 where
            the token is not this rank's (PAD, written nowhere); on the cache's device. The CPU
            checks every slot first; on CUDA a slot outside the cache is skipped (checking device
            memory would need a synchronisation). Slots should be distinct: of two tokens with
            one slot the CPU keeps the later, CUDA any mix of their 16-byte groups.
        kv_dtype: the cache's format; kv_scale: float or one-element float32 tensor (fp8 only).
        stream: as for :meth:`Attention.run`. Allocates nothing, never synchronises.
    """
    kv_dtype = _str("kv_dtype", kv_dtype)
    if kv_dtype not in _CACHE:  # before the cache's dtype is read as this format's
        *others, last = _CACHE
        raise _error("kv_dtype", repr(kv_dtype), f"{', '.join(others)} or {last}")  # the library's wording
    index = _cuda_index("kv_cache", kv_cache)
    s = _stream(stream, kv_cache, index)
    if isinstance(slot_mapping, (list, tuple)):
        slot_mapping = _int_array("slot_mapping", slot_mapping, np.int64, "[T]")
    value, tensor = _kv_scale(kv_scale, s)
    cache_text = _CACHE[kv_dtype]
    cache_in = _tensor("kv_cache", kv_cache, s, cache_text, kv_dtype=kv_dtype, writable=True)
    latent_in = _tensor("latent", latent, s, _VALUES)
    slots_in = _tensor("slot_mapping", slot_mapping, s, "int64 [T] (rank-local slots, -1 = PAD)", raw=False)
    cache_in, latent_in, slots_in, tensor = map(_once, (cache_in, latent_in, slots_in, tensor))
    _call(_dcpmla._write_kv, cache_in, latent_in, slots_in, kv_dtype, value, tensor, s or 0,
          tensors=[("kv_cache", cache_in, True), ("latent", latent_in, False), ("slot_mapping", slots_in, False),
                   ("kv_scale", tensor, False)])


def merge_states(out_parts, lse_parts, out=None, lse=None, stream=None):
    """Merges N partials of the same rows with the LSE rule (SPEC §2):
    ``lse = ln sum_r exp(lse_r)``, ``out = sum_r exp(lse_r - lse) out_r``; -inf partials add
    nothing (whatever their out holds), all -inf gives out 0, lse -inf; a NaN or +inf lse makes
    its row NaN.

    Args:
        out_parts: ``[N, ..., W]`` bfloat16 (CPU: float32 or bfloat16; float32 partials are
            rounded to bf16 on entry, as run()'s already are), e.g. the all-gathered
            ``[N, B, qlen, H, 512]`` of :meth:`Attention.run`; lse_parts: ``[N, ...]`` float32.
        out, lse: ``[..., W]`` of out_parts' dtype and ``[...]`` float32, or None to allocate.
        stream: as for :meth:`Attention.run`.

    Returns:
        ``(out, lse)``, lse natural log. out and lse must share no memory with the partials or
        each other (refused).
    """
    s = _stream(stream, out_parts, _cuda_index("out_parts", out_parts))
    parts = _tensor("out_parts", out_parts, s, _VALUES)
    lse_in = _tensor("lse_parts", lse_parts, s, "float32", raw=False)
    if (out is None or lse is None) and (isinstance(out_parts, np.ndarray) or _is_torch(out_parts)):
        # The partials are checked before the outputs are allocated from their shapes: a
        # broadcast view would otherwise ask for petabytes before its strides are refused.
        # (They are imported twice: torch's are exported once for each call, _once.)
        check_parts, check_lse = _once(parts), _once(lse_in)
        _call(_dcpmla._check_merge_inputs, check_parts, check_lse,
              tensors=[("out_parts", check_parts, False), ("lse_parts", check_lse, False)])
    # From out_parts alone (lse's shape is out_parts' without N and W, checked above), and only
    # for producers that have shapes: any other is told to pass the buffers.
    if out is None:
        out = _empty_like("out", out_parts, lambda a: tuple(a.shape[1:]), True)
    if lse is None:
        lse = _empty_like("lse", out_parts, lambda a: tuple(a.shape[1:-1]), False)
    out_in = _tensor("out", out, s, _VALUES, writable=True)
    lse_out = _tensor("lse", lse, s, "float32", raw=False, writable=True)
    parts, lse_in, out_in, lse_out = map(_once, (parts, lse_in, out_in, lse_out))
    _call(_dcpmla._merge_states, parts, lse_in, out_in, lse_out, s or 0,
          tensors=[("out_parts", parts, False), ("lse_parts", lse_in, False), ("out", out_in, True),
                   ("lse", lse_out, True)])
    return out, lse
