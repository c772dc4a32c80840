"""CacheLoader: get-or-compute over a Store, with buffered writes that are never lost.

Keys are namespaced by ``dataset_name`` (length-prefixed, so two names can never produce the
same stored key), values are serialized with :mod:`bagua.data.serialization` and stamped with the
loader's ``fingerprint`` (8 bytes): a value stamped with another fingerprint (written by another
dataset, transform or version under the same name) is a miss, recomputed and overwritten, so the
store holds at most one value per key and never serves a stale one. Values are unpickled only
as arrays, tensors, numbers, strings and containers unless ``trust_pickled_values=True``.
Computed values wait in a buffer of ``writer_buffer_size`` entries and are written in one batch;
the buffer is flushed when full, on ``flush()``/``close()``, at interpreter exit, and when a
DataLoader worker (or any multiprocessing child) exits.

Example::

    from bagua.data import CacheLoader
    loader = CacheLoader(backend="lmdb", dataset_name="squares", path="/tmp/cache")
    loader.get(12, lambda k: k * k)   # computes 144 and caches it
    loader.get(12, lambda k: k * k)   # 144, read from the cache
    loader.close()
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import logging
import multiprocessing.util
import operator
import os
import weakref
from os import getpid as _getpid
from typing import Any, Callable, Hashable, Optional, Sequence, Union

from .serialization import CorruptValueError, dumps, loads
from .stores import Store, create_store
from .stores.store import _WarnOnce

__all__ = ["CacheLoader"]

logger = logging.getLogger(__name__)

_CORRUPT = object()
_STALE = object()  # a value stamped with another fingerprint
_STAMP_BYTES = 8


def _stamp(fingerprint: str) -> bytes:
    return hashlib.blake2b(fingerprint.encode(), digest_size=_STAMP_BYTES).digest()


def _decode(data, stamp: bytes, trust_pickled: bool) -> Any:
    view = memoryview(data)
    if view[:_STAMP_BYTES] != stamp:
        return _STALE
    try:
        return loads(view[_STAMP_BYTES:], trust_pickled=trust_pickled)
    except CorruptValueError as e:
        return (_CORRUPT, str(e))


def _key_str(key: Hashable) -> str:
    if isinstance(key, str):
        return "s" + key
    try:
        return str(operator.index(key))  # ints, numpy ints, 0-d integer tensors
    except TypeError:
        return "r" + repr(key)


class CacheLoader:
    """Get-or-compute over a cache store.

    Args:
        backend: "lmdb" (default), "redis", or a :class:`~bagua.data.stores.Store`.
        dataset_name: namespace of this loader's keys; loaders with different names never
            see each other's entries, loaders with the same name share them.
        writer_buffer_size: computed values written per batch (>= 1).
        fingerprint: what computes the values (``CachedDataset`` sets it from the dataset, its
            transforms and ``version``): values written under another fingerprint are misses.
        trust_pickled_values: unpickle any type a stored value names, which runs code chosen by
            whoever wrote it; only when every writer of the store is trusted. Default: only
            arrays, tensors, numbers, strings and containers of them; a value naming anything
            else raises :class:`~bagua.data.serialization.UntrustedValueError`.
        **store_kwargs: options of the store (``path``, ``capacity_bytes``, ``hosts``...).

    Attributes:
        store: the :class:`~bagua.data.stores.Store`.
    """

    def __init__(self, backend: Union[str, Store] = "lmdb", dataset_name: str = "",
                 writer_buffer_size: int = 1, fingerprint: str = "", trust_pickled_values: bool = False,
                 **store_kwargs: Any):
        for what, value in (("dataset_name", dataset_name), ("fingerprint", fingerprint)):
            if not isinstance(value, str):
                raise TypeError(f"{what} must be a str, got {type(value).__name__}")
        if isinstance(writer_buffer_size, bool) or not isinstance(writer_buffer_size, int) or writer_buffer_size < 1:
            raise ValueError(f"writer_buffer_size must be an int >= 1, got {writer_buffer_size!r}")
        self.dataset_name = dataset_name
        self.writer_buffer_size = writer_buffer_size
        self.trust_pickled_values = bool(trust_pickled_values)
        self.store: Store = create_store(backend, **store_kwargs)
        self._prefix = f"{len(dataset_name)}:{dataset_name}/"
        self.fingerprint = fingerprint
        self._stamp = _stamp(fingerprint)
        self._decode = functools.partial(_decode, stamp=self._stamp, trust_pickled=self.trust_pickled_values)
        self._pending: dict[str, bytes] = {}
        self._pid = os.getpid()
        self._warn = _WarnOnce(logger)
        _track(self)

    # -- per-process state ------------------------------------------------------------------

    def _here(self) -> None:
        if self._pid != os.getpid():
            # A forked copy: what the parent buffered is the parent's to write.
            self._pending = {}
            self._warn = _WarnOnce(logger)
            self._pid = os.getpid()
            _track(self)

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state.update(_pending={}, _warn=None, _pid=None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._warn = _WarnOnce(logger)
        self._pid = os.getpid()
        _track(self)

    # -- the API ----------------------------------------------------------------------------

    def key(self, key: Hashable) -> str:
        """The store key under which ``key`` of this dataset is cached."""
        return self._prefix + _key_str(key)

    def get(self, key: Hashable, load_fn: Callable[[Any], Any]) -> Any:
        """The cached value of ``key``; on a miss, ``load_fn(key)``, cached and returned.

        Raises:
            SerializationError: the computed value cannot be serialized (names key and type).
        """
        return self._get_one(key, load_fn, "key")

    def get_many(self, keys: Sequence[Hashable], load_fn: Callable[[Any], Any]) -> list:
        """``[get(k, load_fn) for k in keys]`` with all hits read in one store round trip."""
        return self._get_many(list(keys), lambda miss: [load_fn(k) for k in miss], "key")

    def _get_one(self, key: Hashable, load_fn: Callable[[Any], Any], what: str) -> Any:
        if self._pid != _getpid():
            self._here()
        skey = self._prefix + (str(key) if type(key) is int else _key_str(key))
        data = self._pending.get(skey)
        if data is not None:
            return loads(data, trust_pickled=self.trust_pickled_values)
        value = self.store.get_map(skey, self._decode)
        if value is not None and value is not _STALE:
            if type(value) is not tuple or len(value) != 2 or value[0] is not _CORRUPT:
                return value
            self._corrupt(what, key, value[1])
        value = load_fn(key)
        self._put(skey, value, what, key)
        return value

    def _corrupt(self, what: str, key: Hashable, reason: str) -> None:
        self._warn("corrupt", (
            f"cached value for {what} {key!r} of dataset {self.dataset_name!r} cannot be decoded "
            f"({reason}); recomputing and overwriting it (further undecodable values in this "
            f"process are repaired without a warning)."))

    def _get_many(self, keys: list, load_many: Callable[[list], list], what: str) -> list:
        self._here()
        prefix = self._prefix
        skeys = [prefix + (str(k) if type(k) is int else _key_str(k)) for k in keys]
        out: list = [None] * len(keys)
        ask_pos: list[int] = []
        pending = self._pending
        for pos, sk in enumerate(skeys):
            data = pending.get(sk)
            if data is None:
                ask_pos.append(pos)
            else:
                out[pos] = loads(data, trust_pickled=self.trust_pickled_values)
        miss_pos: list[int] = []
        if ask_pos:
            found = self.store.mget_map([skeys[p] for p in ask_pos], self._decode)
            for pos, value in zip(ask_pos, found):
                if value is None or value is _STALE:
                    miss_pos.append(pos)
                elif type(value) is tuple and len(value) == 2 and value[0] is _CORRUPT:
                    self._corrupt(what, keys[pos], value[1])
                    miss_pos.append(pos)
                else:
                    out[pos] = value
        if miss_pos:
            # Compute each distinct missing key once.
            first: dict[str, int] = {}
            for pos in miss_pos:
                first.setdefault(skeys[pos], pos)
            uniq = list(first.values())
            values = load_many([keys[p] for p in uniq])
            if len(values) != len(uniq):
                raise RuntimeError(f"loading {len(uniq)} samples returned {len(values)} values")
            computed = {}
            for pos, value in zip(uniq, values):
                computed[skeys[pos]] = self._put(skeys[pos], value, what, keys[pos])
                out[pos] = value
            for pos in miss_pos:
                if out[pos] is None:  # a repeated index: its own copy, as a hit would be
                    out[pos] = loads(computed[skeys[pos]], trust_pickled=self.trust_pickled_values)
        return out

    def _put(self, skey: str, value: Any, what: str, key: Hashable) -> bytes:
        data = dumps(value, describe=lambda: f"the sample at {what} {key!r} of dataset {self.dataset_name!r}",
                     trust_pickled=self.trust_pickled_values)
        self._pending[skey] = data
        if len(self._pending) >= self.writer_buffer_size:
            self.flush()
        return data

    def flush(self) -> None:
        """Write every buffered value to the store now."""
        if self._pid != os.getpid() or not self._pending:
            return
        items, self._pending = self._pending, {}
        stamp = self._stamp
        self.store.mset({key: stamp + data for key, data in items.items()})

    def count_cached(self, keys: Sequence[Hashable]) -> tuple[int, int]:
        """Of ``keys``, how many the store holds under this loader's fingerprint and how many
        under another (stale: recomputed when read), in one round trip.

        Example::

            current, stale = loader.count_cached(range(0, 1000, 100))
        """
        self._here()
        stamps = self.store.mget_map([self.key(k) for k in keys], lambda data: bytes(data[:_STAMP_BYTES]))
        current = sum(s == self._stamp for s in stamps)
        return current, sum(s is not None for s in stamps) - current

    def num_keys(self) -> int:
        """Keys in the whole store (all datasets in it), after flushing this loader's buffer."""
        self.flush()
        return self.store.num_keys()

    def close(self) -> None:
        """Flush buffered values and close the store. Idempotent."""
        try:
            self.flush()
        finally:
            self.store.close()

    def __repr__(self) -> str:
        return f"CacheLoader(dataset_name={self.dataset_name!r}, fingerprint={self.fingerprint!r}, store={self.store!r})"


# -- flushing at exit ---------------------------------------------------------------------

_loaders: "weakref.WeakSet[CacheLoader]" = weakref.WeakSet()
_hooked_pid: Optional[int] = None


def _flush_all() -> None:
    for loader in list(_loaders):
        try:
            loader.flush()
        except Exception:
            logger.warning("flushing cached samples of %r at exit failed", loader, exc_info=True)


def _track(loader: CacheLoader) -> None:
    """Remember ``loader`` so its buffer is flushed when this process exits."""
    global _hooked_pid
    _loaders.add(loader)
    if _hooked_pid != os.getpid():
        _hooked_pid = os.getpid()
        atexit.register(_flush_all)
        # multiprocessing children (DataLoader workers) leave through os._exit and skip atexit,
        # but run the finalizers registered in them first.
        multiprocessing.util.Finalize(None, _flush_all, exitpriority=100)
