"""CacheLoader: get-or-compute over a Store, with buffered writes that are never lost.

Keys are namespaced by ``dataset_name`` (length-prefixed, so two names can never produce the
same stored key), values are serialized with :mod:`bagua.data.serialization`. Computed values
wait in a buffer of ``writer_buffer_size`` entries and are written in one batch; the buffer is
flushed when full, on ``flush()``/``close()``, at interpreter exit, and when a DataLoader
worker (or any multiprocessing child) exits.

Example::

    from bagua.data import CacheLoader
    loader = CacheLoader(backend="lmdb", dataset_name="squares", path="/tmp/cache")
    loader.get(12, lambda k: k * k)   # computes 144 and caches it
    loader.get(12, lambda k: k * k)   # 144, read from the cache
    loader.close()
"""

from __future__ import annotations

import atexit
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


def _decode(data) -> Any:
    try:
        return loads(data)
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
        **store_kwargs: options of the store (``path``, ``capacity_bytes``, ``hosts``...).

    Attributes:
        store: the :class:`~bagua.data.stores.Store`.
    """

    def __init__(self, backend: Union[str, Store] = "lmdb", dataset_name: str = "",
                 writer_buffer_size: int = 1, **store_kwargs: Any):
        if not isinstance(dataset_name, str):
            raise TypeError(f"dataset_name must be a str, got {type(dataset_name).__name__}")
        if isinstance(writer_buffer_size, bool) or not isinstance(writer_buffer_size, int) or writer_buffer_size < 1:
            raise ValueError(f"writer_buffer_size must be an int >= 1, got {writer_buffer_size!r}")
        self.dataset_name = dataset_name
        self.writer_buffer_size = writer_buffer_size
        self.store: Store = create_store(backend, **store_kwargs)
        self._prefix = f"{len(dataset_name)}:{dataset_name}/"
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
            return loads(data)
        value = self.store.get_map(skey, _decode)
        if value is not None:
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
                out[pos] = loads(data)
        miss_pos: list[int] = []
        if ask_pos:
            found = self.store.mget_map([skeys[p] for p in ask_pos], _decode)
            for pos, value in zip(ask_pos, found):
                if value is None:
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
                    out[pos] = loads(computed[skeys[pos]])
        return out

    def _put(self, skey: str, value: Any, what: str, key: Hashable) -> bytes:
        data = dumps(value, describe=lambda: f"the sample at {what} {key!r} of dataset {self.dataset_name!r}")
        self._pending[skey] = data
        if len(self._pending) >= self.writer_buffer_size:
            self.flush()
        return data

    def flush(self) -> None:
        """Write every buffered value to the store now."""
        if self._pid != os.getpid() or not self._pending:
            return
        items, self._pending = self._pending, {}
        self.store.mset(items)

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
        return f"CacheLoader(dataset_name={self.dataset_name!r}, store={self.store!r})"


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
