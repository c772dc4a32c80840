"""The Store interface that every cache backend implements, and its errors.

A store maps string keys to byte values. ``CacheLoader`` namespaces keys per dataset and
serializes values; a store only moves bytes.

Example::

    from bagua.data.stores import LmdbStore
    store = LmdbStore(path="/tmp/my-cache")
    store.mset({"a": b"1", "b": b"2"})
    assert store.mget(["a", "b", "zzz"]) == [b"1", b"2", None]
    store.close()
"""

from __future__ import annotations

import abc
import logging
import os
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, TypeVar, Union

__all__ = ["Store", "StoreError", "StoreUnavailableError", "StorePathError", "default_cache_dir"]

T = TypeVar("T")
Value = Union[bytes, bytearray, memoryview]


class StoreError(RuntimeError):
    """A cache store failed in a way the caller must know about."""


class StoreUnavailableError(StoreError):
    """A store's server cannot be reached (or started)."""


class StorePathError(StoreError):
    """A store's path cannot be used: not writable, not a directory, or on a full disk."""


def default_cache_dir() -> str:
    """Where caches live: ``$BAGUA_CACHE_DIR``, else ``$XDG_CACHE_HOME/bagua``, else ``~/.cache/bagua``."""
    explicit = os.environ.get("BAGUA_CACHE_DIR")
    if explicit:
        return os.path.abspath(os.path.expanduser(explicit))
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(os.path.abspath(base), "bagua")


class _WarnOnce:
    """Log each distinct degraded condition once per object and process."""

    def __init__(self, logger: logging.Logger):
        self._logger = logger
        self._seen: set[str] = set()

    def __call__(self, what: str, message: str) -> None:
        if what not in self._seen:
            self._seen.add(what)
            self._logger.warning(message)

    def reset(self) -> None:
        self._seen.clear()


class Store(abc.ABC):
    """Byte values under string keys. Implementations must be picklable (for spawned
    DataLoader workers) and usable after ``fork``; handles are (re)opened per process."""

    @abc.abstractmethod
    def get(self, key: str) -> Optional[bytes]:
        """The value under ``key``, or None when absent."""

    @abc.abstractmethod
    def set(self, key: str, value: Value) -> None:
        """Store ``value`` under ``key`` (overwrites)."""

    @abc.abstractmethod
    def mget(self, keys: Sequence[str]) -> list[Optional[bytes]]:
        """Values of ``keys`` in one round trip, None for absent ones."""

    @abc.abstractmethod
    def mset(self, items: Union[Mapping[str, Value], Iterable[tuple[str, Value]]]) -> None:
        """Store many values in one round trip."""

    @abc.abstractmethod
    def num_keys(self) -> int:
        """How many keys the whole store holds (all datasets together)."""

    @abc.abstractmethod
    def clear(self) -> None:
        """Remove every key from the store."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release this process's handles. Idempotent."""

    def get_map(self, key: str, fn: Callable[[Value], T]) -> Optional[T]:
        """``fn(get(key))``, or None when absent; ``fn`` as in :meth:`mget_map`."""
        v = self.get(key)
        return None if v is None else fn(v)

    def mget_map(self, keys: Sequence[str], fn: Callable[[Value], T]) -> list[Optional[T]]:
        """``[fn(v) for v in mget(keys)]`` (None stays None), in one round trip.

        ``fn`` may receive a buffer valid only during the call (LMDB hands out zero-copy
        views of its memory map), so it must copy what it keeps.
        """
        return [None if v is None else fn(v) for v in self.mget(keys)]

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
