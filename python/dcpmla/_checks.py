"""Argument checks shared by the package's entry points: each raises ValueError in the
library's wording (include/dcpmla/error.h), ``dcpmla: field 'F' = V: expected E``."""

from __future__ import annotations

import math
import numbers
import sys

import numpy as np

from . import _dcpmla

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_BOOLS = (bool, np.bool_)  # integers to Python and numpy, refused wherever an integer is asked for


def _error(field, value, expected):
    # The library's wording (include/dcpmla/error.h), so both layers read alike.
    return ValueError(f"dcpmla: field '{field}' = {value}: expected {expected}")


def _int(field, value, lo=_INT32_MIN, hi=_INT32_MAX):
    if isinstance(value, _BOOLS) or not isinstance(value, (numbers.Integral, np.integer)):
        raise _error(field, repr(value), "an integer")
    value = int(value)
    if not lo <= value <= hi:
        raise _error(field, value, f"an integer in [{lo}, {hi}]")
    return value


_FLOAT32 = np.finfo(np.float32)


def _scale(field, value, default_hint=""):
    """A positive normal float32 (the library's rule, numeric.h: require_scale), checked on the
    value as given so that nothing narrows silently: 1e-46 would become 0.0 in float32."""
    if isinstance(value, _BOOLS) or not isinstance(value, (numbers.Real, np.floating)):
        raise _error(field, repr(value), "a real number")
    try:
        as_double = float(value)
    except OverflowError:  # an int beyond double's range
        as_double = math.inf
    if not float(_FLOAT32.tiny) <= as_double <= float(_FLOAT32.max):
        raise _error(field, value, f"a positive normal float32, in [{_FLOAT32.tiny}, {_FLOAT32.max}]{default_hint}")
    return as_double


def _str(field, value):
    if not isinstance(value, str):
        raise _error(field, repr(value), "a string")
    # What the native call could not read whole: a NUL would end its C string (and its error
    # message), and a lone surrogate has no UTF-8 form (nanobind's TypeError names no field).
    if "\0" in value:
        raise _error(field, repr(value), "a string without NUL characters")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise _error(field, ascii(value), "a string with a UTF-8 form (no lone surrogates)") from None
    return value


def _refuse_masked(field, x):
    """A numpy masked array is an ndarray whose mask the library would not see: every element,
    masked or not, would be read as a value (the ninth audit found the mask dropped silently)."""
    if isinstance(x, np.ma.MaskedArray):
        raise _error(field, "a numpy masked array",
                     "a plain array: the library reads every element and would ignore the mask "
                     "(pass x.filled(value) or x.data)")


def _torch():
    """torch when the caller has imported it (dcpmla never imports it itself), else None."""
    return sys.modules.get("torch")


def _is_torch(x):
    """Whether `x` is a torch tensor (of any subclass), without importing torch."""
    torch = _torch()
    return torch is not None and isinstance(x, torch.Tensor)


def _refuse_lazy_torch(field, x):
    """Refuses the torch tensors (`x` is one) whose memory does not hold their values: a nested
    tensor (no single shape), and a negative view (x.is_neg(): torch's lazy negation, e.g. the
    imaginary part of a conjugated complex view, is a flag on the tensor; DLPack carries no such
    flag and torch's own export passes the memory as it is, so the call would read, or write, the
    values negated)."""
    if x.is_nested:
        raise _error(field, "a nested torch tensor", "a strided tensor (one shape, C-contiguous)")
    if x.is_neg():
        raise _error(field, "a torch tensor with its negative bit set (x.is_neg(): a lazy negation, whose "
                     "memory holds the values un-negated)", "a tensor whose memory holds its values "
                     "(pass x.resolve_neg())")


def _host_array(field, x):
    """numpy view of `x`: a numpy array, any object with __dlpack__ on the host, or an array-like."""
    _refuse_masked(field, x)
    if isinstance(x, np.ndarray):
        return x
    if x is None:
        raise _error(field, "None", "an array")
    if hasattr(x, "__dlpack__"):
        if _is_torch(x):
            _refuse_lazy_torch(field, x)
        try:
            return np.from_dlpack(x)
        except Exception as e:  # a producer's own failure too (its __dlpack__ may raise anything)
            raise _error(field, type(x).__name__, f"a host (CPU) array readable through DLPack "
                         f"({type(e).__name__}: {e})") from None
    try:
        return np.asarray(x)
    except (TypeError, ValueError) as e:
        raise _error(field, type(x).__name__, f"an array ({e})") from None


def _typed_array(field, x, dtype, ndim, layout):
    """A host array of exactly `dtype` and `ndim` (no silent casts), as given: a view stays a view
    until _contiguous copies it, once the copy's bytes (_copy_bytes) have been counted."""
    a = _host_array(field, x)
    dtype = np.dtype(dtype)
    if a.dtype != dtype:
        raise _error(f"{field}.dtype", a.dtype, f"{dtype} {layout}")
    if a.ndim != ndim:
        raise _error(f"{field}.ndim", a.ndim, f"{ndim} {layout}")
    return a


def _copy_bytes(a):
    """Bytes _contiguous allocates for `a`: a view (a broadcast one describes petabytes in a few
    bytes) or a misaligned array (the library reads whole elements) is copied."""
    return 0 if a.flags.c_contiguous and a.flags.aligned else a.nbytes


def _contiguous(a):
    return np.require(a, requirements=["C_CONTIGUOUS", "ALIGNED"])


def _too_big_to_copy(field, a, dtype, what, kept=0):
    """Refuses copying (or scanning) `a` into `dtype` beyond the in-process limit, from its shape
    alone: a broadcast view describes petabytes in a few bytes, and copying or
    reading it would run out of memory, or run for hours, before any value is checked. kept:
    bytes per value that the call then holds beside the copy (e.g. its result)."""
    limit = _dcpmla.max_in_process_bytes
    nbytes = a.size * (max(a.dtype.itemsize, dtype.itemsize) + kept)
    if nbytes > limit:
        kind = "a non-contiguous view" if not a.flags.c_contiguous else "an array"
        kept_text = f" and the {kept}-byte result of each value" if kept else ""
        raise _error(field, f"{kind} of shape {a.shape}, dtype {a.dtype} ({nbytes / 2**30:.3g} GiB with its "
                     f"{what}{kept_text})", f"at most {limit / 2**30:.3g} GiB (pass a C-contiguous {dtype} array)")


def _index(a, flat):
    return ", ".join(str(int(i)) for i in np.unravel_index(flat, a.shape))


def _has_bool(x):
    """Whether nested lists / tuples `x` hold a bool (or a bool array), by the set of each
    sequence's element types: about as fast as numpy's own conversion of the list."""
    stack = [x]
    while stack:
        seq = stack.pop()
        types = set(map(type, seq))
        if not types.isdisjoint(_BOOLS):
            return True
        if types & {list, tuple, np.ndarray}:  # nested: look inside (ints alone are not walked)
            for v in seq:
                if type(v) in (list, tuple):
                    stack.append(v)
                elif type(v) is np.ndarray and v.dtype.kind == "b":
                    return True
    return False


def _rows_in_place(a):
    """Whether a 2-d (aligned) array's rows can be read in place at their pitch: each row's
    entries adjacent, rows apart in order without overlapping (a [:B, :W] slice of a wider
    table)."""
    rows, cols = a.shape
    return (cols <= 1 or a.strides[1] == a.itemsize) and (rows <= 1 or cols == 0 or a.strides[0] >= cols * a.itemsize)


def _int_array(field, x, dtype, layout, ndim=1, check_shape=None, kept=0, rows_in_place=False, max_cols=None):
    """A C-contiguous integer array of `ndim` dimensions, converted losslessly to `dtype`: no copy
    when it already is one (numpy, or a host tensor through DLPack); lists and other integer
    dtypes are converted, and a value that does not fit is named.

    check_shape(shape), when given, checks the extents (e.g. B <= max_batch) before anything is
    copied or scanned; beyond that a copy or scan larger than the in-process limit is refused,
    from the shape alone (with `kept` bytes per value the call then holds beside it, e.g. its
    result). For a 2-d array, rows_in_place also takes rows of `dtype` that lie apart as they
    are (_rows_in_place), and max_cols drops the columns past what the reader can use before
    anything is copied."""
    a = _host_array(field, x)
    if a.ndim != ndim:
        raise _error(f"{field}.ndim", a.ndim, f"{ndim} {layout}")
    if check_shape is not None:
        check_shape(a.shape)
    if isinstance(x, (list, tuple)) and (a.dtype.kind == "f" or (a.dtype.kind in "iu" and _has_bool(x))):
        # numpy read [True, 20] as [1, 20], and [3, 2**63] as float64: the values as given, where the
        # object path names a bool, a float or an int that does not fit.
        a = np.asarray(x, dtype=object)
    if max_cols is not None and a.shape[1] > max_cols:
        a = a[:, :max_cols]
    dtype = np.dtype(dtype)
    if a.dtype == dtype and a.flags.aligned and (a.flags.c_contiguous or (rows_in_place and _rows_in_place(a))):
        return a
    _too_big_to_copy(field, a, dtype, "copy" if a.dtype == dtype else "convert", kept)
    if a.dtype == dtype:
        return np.require(a, dtype, ["C_CONTIGUOUS", "ALIGNED"])
    info = np.iinfo(dtype)
    if a.size and a.dtype.kind == "O":
        # A list holding an int beyond int64 (or an object array): each value is checked as given.
        for flat, value in enumerate(a.flat):
            if isinstance(value, _BOOLS) or not isinstance(value, (numbers.Integral, np.integer)):
                raise _error(f"{field}[{_index(a, flat)}]", repr(value), f"an integer {layout}")
            if not info.min <= int(value) <= info.max:
                raise _error(f"{field}[{_index(a, flat)}]", int(value), f"a value that fits {dtype}")
        return np.array(a.tolist(), dtype=dtype).reshape(a.shape)
    if a.size and a.dtype.kind not in "iu":
        raise _error(f"{field}.dtype", a.dtype, f"an integer dtype {layout}")
    if a.size and (a.min() < info.min or a.max() > info.max):
        flat = int(np.flatnonzero((a < info.min) | (a > info.max))[0])
        raise _error(f"{field}[{_index(a, flat)}]", a.flat[flat], f"a value that fits {dtype}")
    return np.ascontiguousarray(a, dtype=dtype)


# numpy dtypes nanobind imports (DLPack's int, uint, float, complex, bool in the machine's byte
# order); anything else (object, structured, big-endian, strings, datetimes, ml_dtypes formats
# the library does not read) is refused here, naming the argument, rather than by nanobind's
# TypeError without one.
def _plain_dtype(d):
    return d.isbuiltin == 1 and d.kind in "biufc" and d.char not in "gG"


def _dtype_text(d):
    if d.hasobject:
        return f"{d} (Python objects)"
    if d.fields is not None:
        return f"{d} (a structured dtype)"
    if d.isbuiltin == 0 and not d.isnative:
        return f"{d.str} (non-native byte order)"
    return str(d)


def _native_array(field, x, expected, writable=False):
    """Checks what nanobind would refuse without naming `field`: for a numpy array its dtype
    (a plain numeric dtype in the machine's byte order, as `expected` says) and, for an array the
    call writes, that it is writable. Other producers are left to the native checks."""
    if not isinstance(x, np.ndarray):
        return x
    _refuse_masked(field, x)
    if not _plain_dtype(x.dtype):
        hint = " (use .astype(x.dtype.newbyteorder('=')))" if x.dtype.isbuiltin == 0 and not x.dtype.isnative \
            and x.dtype.fields is None else ""
        raise _error(f"{field}.dtype", _dtype_text(x.dtype), f"{expected}{hint}")
    if writable and not x.flags.writeable:
        raise _error(field, f"a read-only {x.dtype} array (flags.writeable is False)",
                     "a writable array: the call writes its result into it")
    return x


def _require_usable_cuda(field, value, instead):
    """Refuses CUDA (device="cuda", or a tensor in CUDA memory) here when no GPU is usable, before
    the CUDA runtime answers with its own error (e.g. "driver version is insufficient"), which
    names no argument; `instead` is what to pass. A module built without CUDA says so itself
    (the library's check)."""
    if _dcpmla.cuda_available and not _dcpmla.cuda_device_available():
        raise _error(field, value, f"{instead}: no usable CUDA device on this machine "
                     "(dcpmla.cuda_device_available() is False)")
