"""Fast, checked serialization of cached samples.

``dumps(obj) -> bytes`` and ``loads(data) -> obj``. A sample that is a lone NumPy array or
dense tensor is stored as a small header plus its raw bytes; any other picklable sample goes
through pickle protocol 5, with every array and dense tensor inside it as a raw out-of-band
buffer. Either way there is no per-element work: one memory copy each way. A tensor is stored
by value: one on a GPU comes back on the CPU, as DataLoader samples do (move it in the training
loop). Each value carries a 64-bit xxh3 checksum, so a truncated or corrupted value raises
:class:`CorruptValueError` instead of decoding to garbage.

Decoded arrays and tensors own their memory and are writable. Dtype, shape, values (bit for
bit) and ``requires_grad`` are preserved; non-contiguous inputs come back contiguous.

Decoding runs no code named by the bytes: whoever can write to a shared cache (a Redis server,
an LMDB directory) must not be able to run code in the processes that read it. The unpickler
rebuilds only containers (tuple, list, dict, set, frozenset, OrderedDict, defaultdict, Counter,
deque), numbers (Python's and NumPy's scalars), strings, bytes, NumPy arrays and dtypes, and
torch tensors (dense, of any dtype; Parameters), dtypes, sizes and devices. Any other global
raises :class:`UntrustedValueError` naming it, unless ``loads(..., trust_pickled=True)``
(``CachedDataset(..., trust_pickled_values=True)``) asks for full unpickling.

Example::

    >>> import numpy as np
    >>> from bagua.data.serialization import dumps, loads
    >>> a = np.arange(6, dtype=np.float32).reshape(2, 3)
    >>> b = loads(dumps(a))
    >>> bool((a == b).all()), b.dtype, b.shape
    (True, dtype('float32'), (2, 3))
"""

from __future__ import annotations

import collections
import copyreg
import io
import pickle
import struct
import threading
import types
from typing import Any, Callable, Optional, Union

import numpy as np
import torch
import xxhash

__all__ = ["dumps", "loads", "SerializationError", "CorruptValueError", "UntrustedValueError"]

_MAGIC = b"BGC2"
# magic, kind, flags, number of out-of-band buffers, and the xxh3-64 of everything after this
# header, seeded with kind, flags and buffer count so that those are checked too
_HEAD = struct.Struct("<4sBBHQ")
_KIND_PICKLE, _KIND_NDARRAY, _KIND_TENSOR = 0, 1, 2
# kinds 1 and 2 (a lone array or tensor, the usual cached sample) skip pickle altogether:
# ndim, fortran order (arrays) or requires_grad (tensors), length of the dtype name
_ARRAY_META = struct.Struct("<BBH")
_FLAG_FOREIGN_BUFFERS = 1  # buffers from reducers other than ours: copy before unpickling
_hash = xxhash.xxh3_64_intdigest


def _seed(kind: int, flags: int, nbuf: int) -> int:
    return kind | flags << 8 | nbuf << 16


Buffer = Union[bytes, bytearray, memoryview]


class SerializationError(TypeError):
    """A sample could not be serialized for the cache."""


class CorruptValueError(ValueError):
    """A stored value is truncated, corrupted or otherwise cannot be decoded."""


class UntrustedValueError(ValueError):
    """A stored value names a global that only full unpickling (``trust_pickled``) would load."""


# ---- reducers: arrays and tensors as raw buffers ------------------------------------------

_TORCH_DTYPES: dict[str, torch.dtype] = {}
_NP_DTYPES: dict[Any, np.dtype] = {}
_NUMPY_OF_TORCH: dict[torch.dtype, np.dtype] = {
    torch.bool: np.dtype(np.bool_), torch.uint8: np.dtype(np.uint8), torch.int8: np.dtype(np.int8),
    torch.int16: np.dtype(np.int16), torch.int32: np.dtype(np.int32), torch.int64: np.dtype(np.int64),
    torch.float16: np.dtype(np.float16), torch.float32: np.dtype(np.float32),
    torch.float64: np.dtype(np.float64), torch.complex64: np.dtype(np.complex64),
    torch.complex128: np.dtype(np.complex128),
}


def _rebuild_ndarray(buf: Buffer, dtype: Union[str, np.dtype], shape: tuple, fortran: bool) -> np.ndarray:
    if type(dtype) is str:  # the common case, sent as its short string ("<f4")
        dt = _NP_DTYPES.get(dtype)
        if dt is None:
            dt = _NP_DTYPES[dtype] = np.dtype(dtype)
        dtype = dt
    return np.frombuffer(buf, dtype=dtype).copy().reshape(shape, order="F" if fortran else "C")


def _reduce_ndarray(a: np.ndarray):
    if a.dtype.hasobject:  # object arrays hold references; pickle them in-band
        return a.__reduce__()
    fortran = a.flags.f_contiguous and not a.flags.c_contiguous
    if not (a.flags.c_contiguous or fortran):
        a = np.ascontiguousarray(a)
    flat = a.reshape(-1, order="F" if fortran else "C").view(np.uint8)
    dt = a.dtype
    simple = dt.fields is None and dt.subdtype is None and dt.metadata is None
    return _rebuild_ndarray, (_OwnBuffer(flat), dt.str if simple else dt, a.shape, fortran)


def _rebuild_tensor(buf: Buffer, dtype_name: str, shape: tuple, requires_grad: bool) -> torch.Tensor:
    dtype = _TORCH_DTYPES.get(dtype_name)
    if dtype is None:
        dtype = getattr(torch, dtype_name, None)
        if not isinstance(dtype, torch.dtype):  # the name comes from the stored bytes
            raise ValueError(f"{dtype_name!r} is not a torch dtype")
        _TORCH_DTYPES[dtype_name] = dtype
    np_dtype = _NUMPY_OF_TORCH.get(dtype)
    if len(buf) == 0:
        out = torch.empty(shape, dtype=dtype)
    elif np_dtype is not None:
        out = torch.from_numpy(np.frombuffer(buf, dtype=np_dtype).copy().reshape(shape))
    else:  # no NumPy equivalent (bfloat16, float8...): let torch read the bytes
        out = torch.frombuffer(bytearray(buf), dtype=dtype).reshape(shape)
    if requires_grad:
        out.requires_grad_(True)
    return out


def _plain_tensor(t: torch.Tensor) -> bool:
    """A dense tensor that is only its values, on any device (stored by value, read back on the
    CPU: the cache holds values, not devices)."""
    return (
        t.layout == torch.strided
        and not t.is_quantized
        and not t.__dict__
        and not any(getattr(t, "names", None) or ())
    )


def _on_cpu(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values, contiguous, in CPU memory."""
    data = t.detach().resolve_conj().resolve_neg().contiguous()
    return data if data.device.type == "cpu" else data.cpu()


def _reduce_tensor(t: torch.Tensor):
    if not _plain_tensor(t):
        return t.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
    try:
        data = _on_cpu(t)
        raw = data.view(-1).view(torch.uint8).numpy() if data.numel() else np.empty(0, np.uint8)
    except (RuntimeError, TypeError):  # exotic dtypes without a byte view: torch's own pickling
        return t.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
    return _rebuild_tensor, (_OwnBuffer(raw), str(t.dtype)[len("torch."):], tuple(t.shape), t.requires_grad)


_own = threading.local()  # ids of the PickleBuffers our reducers made during this dumps()


def _OwnBuffer(array: np.ndarray) -> pickle.PickleBuffer:
    """A PickleBuffer whose rebuild function (ours) copies it, so it may point anywhere."""
    pb = pickle.PickleBuffer(array)
    ids = getattr(_own, "ids", None)
    if ids is not None:
        ids.add(id(pb))
    return pb


_DISPATCH = copyreg.dispatch_table.copy()
_DISPATCH[np.ndarray] = _reduce_ndarray
_DISPATCH[torch.Tensor] = _reduce_tensor


# ---- what a value may name: decoding imports and calls nothing else ------------------------

_safe: dict[tuple[str, str], Any] = {}


def _safe_globals() -> dict[tuple[str, str], Any]:
    """(module, name) -> object: every global a value may name without ``trust_pickled``."""
    if _safe:
        return _safe
    allowed: list[Any] = [
        _rebuild_ndarray, _rebuild_tensor,
        complex, set, frozenset, slice, range, list, dict, tuple, int, float, bool, str,  # bytes: opcodes
        collections.OrderedDict, collections.defaultdict, collections.Counter, collections.deque,
        np.ndarray, np.memmap, np.dtype, torch.Size, torch.device, torch._utils._rebuild_parameter,
    ]
    table = {(obj.__module__, obj.__qualname__): obj for obj in allowed}
    # NumPy's rebuild functions, also as spelled in values written under NumPy 1.x (numpy.core)
    for fn in (np.zeros(0).__reduce__()[0], np.float32(0).__reduce__()[0]):  # _reconstruct, scalar
        for module in (fn.__module__, fn.__module__.replace("numpy._core", "numpy.core")):
            table[module, fn.__name__] = fn
    for name, value in vars(torch).items():
        if isinstance(value, torch.dtype):
            table["torch", name] = value
    _safe.update(table)
    return _safe


def _refusal(what: str, module: str, name: str) -> "UntrustedValueError":
    return UntrustedValueError(
        f"{what} names {module}.{name}, which the cache does not unpickle unless told to: unpickling "
        f"can run code chosen by whoever wrote the value into the store. Return samples made of arrays, "
        f"tensors, numbers, strings and lists/tuples/dicts of them, or, if you trust every writer of this "
        f"cache, pass CachedDataset(..., trust_pickled_values=True) (CacheLoader(..., trust_pickled_values=True))"
    )


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        obj = _safe_globals().get((module, name))
        if obj is None:  # refused before anything is imported
            raise _refusal("a cached value", module, name)
        return obj


class _Pickler(pickle.Pickler):
    dispatch_table = _DISPATCH


class _CheckingPickler(_Pickler):
    """Refuses, as it writes them, the classes and functions that ``loads`` would refuse, so a
    sample of another type fails when first cached, not when first read back."""

    describe: Optional[Callable[[], str]] = None

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, (type, types.FunctionType, types.BuiltinFunctionType)):
            module, name = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
            if (module, name) not in _safe_globals():
                raise _refusal(self.describe() if self.describe is not None else "the sample", str(module), str(name))
        return NotImplemented


_LENGTHS: dict[int, struct.Struct] = {}


def _lengths_struct(nbuf: int) -> struct.Struct:
    st = _LENGTHS.get(nbuf)
    if st is None:
        st = _LENGTHS[nbuf] = struct.Struct(f"<{nbuf + 1}Q")
    return st


# ---- public API ---------------------------------------------------------------------------


def dumps(obj: Any, *, describe: Optional[Callable[[], str]] = None, trust_pickled: bool = False) -> bytes:
    """Serialize ``obj`` into one checked byte string.

    Args:
        obj: any picklable object; arrays and dense tensors anywhere inside it are fast.
        describe: returns a description of ``obj`` (e.g. "index 5 of dataset 'train'") for
            the error message.
        trust_pickled: allow classes and functions that only ``loads(..., trust_pickled=True)``
            decodes (see the module's docstring).

    Raises:
        SerializationError: ``obj`` cannot be pickled; the message names its type.
        UntrustedValueError: ``obj`` holds such a class or function (without ``trust_pickled``).
    """
    t = type(obj)
    if t is np.ndarray and not obj.dtype.hasobject:
        fast = _dump_ndarray(obj)
        if fast is not None:
            return fast
    elif t is torch.Tensor and _plain_tensor(obj) and obj.dtype in _NUMPY_OF_TORCH:
        return _dump_tensor(obj)
    buffers: list[pickle.PickleBuffer] = []
    stream = io.BytesIO()
    own: set[int] = set()
    _own.ids = own
    try:
        pickler = (_Pickler if trust_pickled else _CheckingPickler)(stream, protocol=5, buffer_callback=buffers.append)
        pickler.describe = describe
        pickler.dump(obj)
    except UntrustedValueError:
        raise
    except Exception as e:  # pickle raises many types (PicklingError, TypeError, AttributeError...)
        what = describe() if describe is not None else "sample"
        raise SerializationError(
            f"cannot serialize {what} of type {type(obj).__module__}.{type(obj).__qualname__} "
            f"for the cache: {type(e).__name__}: {e}. Return picklable values from the dataset "
            f"(tensors, arrays, numbers, strings, lists/dicts/tuples of them)."
        ) from e
    finally:
        _own.ids = None
    flags = 0
    views = []
    for b in buffers:
        if id(b) not in own:
            flags |= _FLAG_FOREIGN_BUFFERS
        views.append(b.raw())
    pickled = stream.getbuffer()
    lengths = _lengths_struct(len(views)).pack(len(pickled), *(v.nbytes for v in views))
    h = xxhash.xxh3_64(seed=_seed(_KIND_PICKLE, flags, len(views)))
    h.update(lengths)
    h.update(pickled)
    for v in views:
        h.update(v)
    head = _HEAD.pack(_MAGIC, _KIND_PICKLE, flags, len(views), h.intdigest())
    return b"".join([head, lengths, pickled, *views])


def _shape_struct(ndim: int) -> struct.Struct:
    st = _SHAPES.get(ndim)
    if st is None:
        st = _SHAPES[ndim] = struct.Struct(f"<{ndim}q")
    return st


_SHAPES: dict[int, struct.Struct] = {}


def _dump_raw(kind: int, flag: int, shape: tuple, dtype_name: bytes, flat: np.ndarray) -> bytes:
    meta = _ARRAY_META.pack(len(shape), flag, len(dtype_name)) + _shape_struct(len(shape)).pack(*shape) + dtype_name
    h = xxhash.xxh3_64(seed=_seed(kind, 0, 0))
    h.update(meta)
    h.update(flat)
    return b"".join([_HEAD.pack(_MAGIC, kind, 0, 0, h.intdigest()), meta, flat])


def _dump_ndarray(a: np.ndarray) -> Optional[bytes]:
    dt = a.dtype
    if dt.fields is not None or dt.subdtype is not None or dt.metadata is not None:
        return None
    fortran = a.flags.f_contiguous and not a.flags.c_contiguous
    if not (a.flags.c_contiguous or fortran):
        a = np.ascontiguousarray(a)
    flat = a.reshape(-1, order="F" if fortran else "C").view(np.uint8)
    return _dump_raw(_KIND_NDARRAY, int(fortran), a.shape, dt.str.encode("ascii"), flat)


def _dump_tensor(t: torch.Tensor) -> bytes:
    data = _on_cpu(t)
    flat = data.view(-1).view(torch.uint8).numpy() if data.numel() else np.empty(0, np.uint8)
    return _dump_raw(_KIND_TENSOR, int(t.requires_grad), tuple(t.shape), str(t.dtype)[6:].encode("ascii"), flat)


_SPECS: dict[bytes, tuple] = {}  # header bytes of a lone array/tensor -> how to rebuild it
_SMALL = 128 << 10  # below this, hash the stored bytes in one call before copying


def _spec(kind: int, meta: bytes) -> tuple:
    """(NumPy dtype, shape, order, requires_grad or None for arrays) from a value's header."""
    spec = _SPECS.get(meta)
    if spec is not None:
        return spec
    ndim, flag, name_len = _ARRAY_META.unpack_from(meta, 0)
    shape = _shape_struct(ndim).unpack_from(meta, _ARRAY_META.size)
    name = meta[_ARRAY_META.size + 8 * ndim:].decode("ascii")
    if len(name) != name_len:
        raise ValueError("header length mismatch")
    if kind == _KIND_NDARRAY:
        dtype = np.dtype(name)
        if dtype.hasobject:
            raise ValueError(f"object dtype {dtype}")
        spec = (dtype, shape, "F" if flag else "C", None)
    else:
        torch_dtype = getattr(torch, name)
        if not isinstance(torch_dtype, torch.dtype):
            raise ValueError(f"{name!r} is not a torch dtype")
        spec = (_NUMPY_OF_TORCH[torch_dtype], shape, "C", bool(flag))
    if len(_SPECS) < 4096:
        _SPECS[meta] = spec
    return spec


def _load_raw(kind: int, mv: memoryview, checksum: int) -> Any:
    """A lone array or tensor. Small payloads are hashed in one call, then copied; large ones
    are copied first and hashed from the copy, which is then in cache (one pass over the
    source memory instead of two)."""
    ndim, _, name_len = _ARRAY_META.unpack_from(mv, _HEAD.size)
    end = _HEAD.size + _ARRAY_META.size + 8 * ndim + name_len
    dtype, shape, order, requires_grad = _spec(kind, bytes(mv[_HEAD.size:end]))
    if mv.nbytes < _SMALL:
        if _hash(mv[_HEAD.size:], _seed(kind, 0, 0)) != checksum:
            raise _ChecksumMismatch()
        flat = np.frombuffer(mv, dtype=dtype, offset=end).copy()
    else:
        flat = np.frombuffer(mv, dtype=dtype, offset=end).copy()
        h = xxhash.xxh3_64(seed=_seed(kind, 0, 0))
        h.update(mv[_HEAD.size:end])
        h.update(flat)
        if h.intdigest() != checksum:
            raise _ChecksumMismatch()
    if len(shape) != 1:
        flat = flat.reshape(shape) if order == "C" else flat.reshape(shape, order="F")
    if requires_grad is None:
        return flat
    out = torch.from_numpy(flat)
    if requires_grad:
        out.requires_grad_(True)
    return out


class _ChecksumMismatch(Exception):
    pass


def loads(data: Buffer, *, trust_pickled: bool = False) -> Any:
    """Decode a value made by :func:`dumps`.

    ``data`` may be a memoryview into memory that is only valid during the call (an LMDB
    read transaction): nothing decoded refers to it afterwards. ``trust_pickled``: unpickle
    whatever the value names (runs code chosen by its writer), not only the types listed in
    this module's docstring.

    Raises:
        CorruptValueError: ``data`` is truncated, corrupted, not made by :func:`dumps`, or
            names a class that can no longer be imported.
        UntrustedValueError: ``data`` names a global outside that list (without ``trust_pickled``).
    """
    mv = memoryview(data)
    if mv.ndim != 1 or mv.itemsize != 1:
        mv = mv.cast("B")
    n = mv.nbytes
    if n < _HEAD.size:
        raise CorruptValueError(f"value too short to decode ({n} bytes)")
    magic, kind, flags, nbuf, checksum = _HEAD.unpack_from(mv, 0)
    if magic != _MAGIC:
        raise CorruptValueError(f"value does not start with the cache format's magic bytes (got {bytes(magic)!r})")
    if kind != _KIND_PICKLE and flags == 0 and nbuf == 0:
        # Verified inside, after copying; anything odd before that is corruption too.
        try:
            return _load_raw(kind, mv, checksum)
        except _ChecksumMismatch:
            pass
        except Exception as e:  # garbage metadata can raise nearly anything (even SyntaxError)
            if _hash(mv[_HEAD.size:], _seed(kind, flags, nbuf)) == checksum:  # intact, yet undecodable
                raise CorruptValueError(f"cannot decode an array value: {type(e).__name__}: {e}") from e
        raise CorruptValueError(f"checksum mismatch in a {n}-byte value (truncated or corrupted)")
    if _hash(mv[_HEAD.size:], _seed(kind, flags, nbuf)) != checksum:
        raise CorruptValueError(f"checksum mismatch in a {n}-byte value (truncated or corrupted)")
    if kind != _KIND_PICKLE:
        raise CorruptValueError(f"unknown value kind {kind} with flags {flags} and {nbuf} buffers")
    off = _HEAD.size + 8 * (nbuf + 1)
    lengths = _lengths_struct(nbuf).unpack_from(mv, _HEAD.size)
    if off + sum(lengths) != n:
        raise CorruptValueError(f"value lengths do not add up ({off + sum(lengths)} != {n} bytes)")
    pickled = mv[off:off + lengths[0]]
    off += lengths[0]
    bufs: list[Buffer] = []
    for length in lengths[1:]:
        piece = mv[off:off + length]
        bufs.append(bytearray(piece) if flags & _FLAG_FOREIGN_BUFFERS else piece)
        off += length
    try:
        if trust_pickled:
            return pickle.loads(pickled, buffers=bufs)
        return _RestrictedUnpickler(io.BytesIO(pickled), buffers=bufs).load()
    except UntrustedValueError:
        raise
    except Exception as e:
        raise CorruptValueError(f"cannot unpickle value: {type(e).__name__}: {e}") from e
