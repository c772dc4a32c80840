"""LmdbStore: the embedded default cache store, an LMDB environment in a directory.

Readers and writers in any number of processes on one machine (DataLoader workers started by
fork or spawn, several ranks, several jobs) can use the same directory at once: LMDB
serializes writers and lets readers proceed without locks.

Capacity: ``capacity_bytes`` is LMDB's map size, a sparse reservation that costs no disk
until used. When it is reached, or when a write fails because the disk filled up, the store
logs one warning and stops adding entries; reads keep serving everything already cached and
``CacheLoader`` computes the rest, so training goes on with correct samples. Nothing is
evicted: ``clear()`` or a larger ``capacity_bytes`` makes room again.

Example::

    from bagua.data.stores import LmdbStore
    store = LmdbStore(path="/tmp/cache", capacity_bytes=1 << 30)
    store.set("k", b"v")
    assert store.get("k") == b"v"
    store.close()
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import shutil
import threading
from os import getpid as _getpid
from typing import Callable, Iterable, Mapping, Optional, Sequence, TypeVar, Union

import lmdb

from .store import Store, StorePathError, Value, _WarnOnce, default_cache_dir

__all__ = ["LmdbStore"]

logger = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_CAPACITY_BYTES = 32 << 30
_MAX_READERS = 2048
_MIN_FREE_BYTES = 1 << 20  # below this a disk counts as full when a store is created
# LMDB's lock file: a 128-byte header, then one 64-byte slot per reader (x86-64 and arm64).
_LOCK_HEADER, _READER_SLOT = 128, 64

# Every transaction in this process runs under _txn_lock. Before fork() we take that lock (so
# no transaction is live) and close every environment: a child never inherits one (LMDB must
# not be used across fork, and py-lmdb refuses to open a path twice in one process). Parent
# and child reopen lazily on their next use.
_txn_lock = threading.RLock()
_envs: dict[str, "_EnvEntry"] = {}


class _EnvEntry:
    __slots__ = ("env", "users", "map_size")

    def __init__(self, map_size: int):
        self.env: Optional[lmdb.Environment] = None
        self.users = 0
        self.map_size = map_size


def _before_fork() -> None:
    _txn_lock.acquire()
    for path, entry in _envs.items():
        if entry.env is not None:
            try:
                entry.env.close()
            except lmdb.Error:
                logger.warning("closing the LMDB cache at %s before fork failed", path, exc_info=True)
            entry.env = None


def _after_fork_in_parent() -> None:
    _txn_lock.release()


def _after_fork_in_child() -> None:
    global _txn_lock
    _txn_lock = threading.RLock()


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                    after_in_child=_after_fork_in_child)


def _prepare_dir(path: str) -> None:
    """Create the directory and make sure LMDB can safely map its lock file there."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise StorePathError(
            f"cannot create the LMDB cache directory {path!r}: {e.strerror or e}. "
            f"Pass a writable path=..., or set BAGUA_CACHE_DIR to a writable directory."
        ) from e
    if not os.access(path, os.W_OK | os.X_OK):
        raise StorePathError(
            f"the LMDB cache directory {path!r} is not writable by this user. "
            f"Pass a writable path=..., or set BAGUA_CACHE_DIR to a writable directory."
        )
    free = shutil.disk_usage(path).free
    if free < _MIN_FREE_BYTES:
        raise StorePathError(
            f"the LMDB cache directory {path!r} is on a full disk ({free} bytes free). "
            f"Free some space there, or point path=... / BAGUA_CACHE_DIR at another disk."
        )
    # LMDB maps the lock file and writes reader slots into it; on a disk that fills up
    # later, touching a page of it that has no block yet kills the process with SIGBUS.
    # Allocating every block now (without truncating: others may be using it) prevents that.
    lock_path = os.path.join(path, "lock.mdb")
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise StorePathError(f"cannot create the LMDB lock file {lock_path!r}: {e.strerror or e}. "
                             f"Pass a writable path=... or set BAGUA_CACHE_DIR.") from e
    try:
        size = max(os.fstat(fd).st_size, _LOCK_HEADER + _READER_SLOT * _MAX_READERS)
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise StorePathError(
                f"no space to create the LMDB cache in {path!r} ({e.strerror}). Free some "
                f"space there, or point path=... / BAGUA_CACHE_DIR at another disk."
            ) from e
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise StorePathError(f"cannot prepare the LMDB lock file {lock_path!r}: {e.strerror or e}") from e
    finally:
        os.close(fd)


def _open_env(path: str, map_size: int) -> "lmdb.Environment":
    _prepare_dir(path)
    try:
        env = lmdb.open(
            path, map_size=map_size, subdir=True, max_readers=_MAX_READERS, max_spare_txns=1,
            readahead=False, meminit=False, sync=False, metasync=False, lock=True,
        )
    except lmdb.Error as e:
        raise StorePathError(
            f"cannot open the LMDB cache at {path!r}: {e}. Check that the directory is "
            f"writable and its disk is not full, or pass another path=... / set BAGUA_CACHE_DIR."
        ) from e
    env.reader_check()  # free reader slots left by processes that died
    return env


def _env(path: str, map_size: int) -> "lmdb.Environment":
    """This process's environment for ``path``, opened on first use (call under _txn_lock)."""
    entry = _envs.get(path)
    if entry is None:
        entry = _envs[path] = _EnvEntry(map_size)
    if entry.env is None:
        entry.map_size = max(entry.map_size, map_size)
        entry.env = _open_env(path, entry.map_size)
    elif map_size > entry.map_size:
        entry.env.set_mapsize(map_size)
        entry.map_size = map_size
    return entry.env


def _acquire_env(path: str, map_size: int) -> None:
    with _txn_lock:
        _env(path, map_size)
        _envs[path].users += 1


def _release_env(path: str) -> None:
    with _txn_lock:
        entry = _envs.get(path)
        if entry is None:
            return
        entry.users -= 1
        if entry.users <= 0:
            if entry.env is not None:
                try:
                    entry.env.sync(True)
                except lmdb.Error:
                    logger.warning("flushing the LMDB cache at %s to disk failed", path, exc_info=True)
                entry.env.close()
            del _envs[path]


class LmdbStore(Store):
    """A cache store in an LMDB environment (a directory with ``data.mdb`` and ``lock.mdb``).

    Args:
        path: the directory; default ``<cache dir>/lmdb`` where the cache dir is
            ``$BAGUA_CACHE_DIR``, else ``~/.cache/bagua``.
        capacity_bytes: the most data the cache may hold (LMDB map size). When reached, the
            store warns once and stops adding entries; reads go on.

    Raises:
        StorePathError: the path cannot be created or written, or its disk is full; the
            message names the path.

    Example::

        store = LmdbStore("/tmp/cache", capacity_bytes=8 << 30)
        store.mset({"a": b"1"}); store.mget(["a", "b"])  # [b"1", None]
    """

    def __init__(self, path: Optional[str] = None, capacity_bytes: int = DEFAULT_CAPACITY_BYTES):
        if not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be a positive int, got {capacity_bytes!r}")
        if path is None:
            path = os.path.join(default_cache_dir(), "lmdb")
        self.path = os.path.realpath(os.path.abspath(os.path.expanduser(os.fspath(path))))
        self.capacity_bytes = capacity_bytes
        self._pid: Optional[int] = None
        self._full = False
        self._warn = _WarnOnce(logger)
        self._open()  # surface path errors now, not in the first DataLoader worker

    # -- process-local handle -----------------------------------------------------------

    def _open(self) -> None:
        _acquire_env(self.path, self.capacity_bytes)
        self._pid = os.getpid()

    def _here(self) -> None:
        if self._pid != os.getpid():  # unpickled, forked, or closed: (re)join this process's env
            if self._pid is not None:
                self._full = False
                self._warn = _WarnOnce(logger)
            self._open()

    def __getstate__(self) -> dict:
        return {"path": self.path, "capacity_bytes": self.capacity_bytes}

    def __setstate__(self, state: dict) -> None:
        self.path, self.capacity_bytes = state["path"], state["capacity_bytes"]
        self._pid, self._full, self._warn = None, False, _WarnOnce(logger)

    @staticmethod
    def _key(key: str) -> bytes:
        k = key.encode("utf-8")
        if len(k) > 500:  # LMDB keys are at most 511 bytes: long keys go by their digest
            k = b"\x00#" + hashlib.blake2b(k, digest_size=32).digest()
        return k

    # -- reads ------------------------------------------------------------------------------

    def _read(self, fn: Callable[["lmdb.Transaction"], T]) -> T:
        self._here()
        checked_readers = False
        while True:
            with _txn_lock:
                env = _env(self.path, self.capacity_bytes)
                try:
                    with env.begin(buffers=True) as txn:
                        return fn(txn)
                except lmdb.MapResizedError:  # another process grew the map: adopt its size
                    env.set_mapsize(0)
                except lmdb.ReadersFullError:
                    if checked_readers:
                        raise
                    checked_readers = True
                    env.reader_check()  # free slots of dead processes, then try once more

    def get(self, key: str) -> Optional[bytes]:
        k = self._key(key)
        return self._read(lambda txn: _to_bytes(txn.get(k)))

    def mget(self, keys: Sequence[str]) -> list[Optional[bytes]]:
        ks = [self._key(k) for k in keys]
        return self._read(lambda txn: [_to_bytes(txn.get(k)) for k in ks])

    def get_map(self, key: str, fn: Callable[[Value], T]) -> Optional[T]:
        # The per-sample hot path: the same as _read, without its generality.
        if self._pid != _getpid():
            self._here()
        k = key.encode("utf-8")
        if len(k) > 500:
            k = self._key(key)
        with _txn_lock:
            entry = _envs.get(self.path)
            env = entry.env if entry is not None else None
            if env is not None:
                try:
                    txn = env.begin(buffers=True)
                except (lmdb.MapResizedError, lmdb.ReadersFullError):
                    pass  # the general path handles these
                else:
                    try:
                        v = txn.get(k)
                        return None if v is None else fn(v)
                    finally:
                        txn.abort()
        return self._read(lambda txn: _apply(txn.get(k), fn))

    def mget_map(self, keys: Sequence[str], fn: Callable[[Value], T]) -> list[Optional[T]]:
        ks = [self._key(k) for k in keys]

        def read(txn):
            out = []
            for k in ks:
                v = txn.get(k)
                out.append(None if v is None else fn(v))
            return out

        return self._read(read)

    def num_keys(self) -> int:
        return self._read(lambda txn: txn.stat()["entries"])

    # -- writes -----------------------------------------------------------------------------

    def set(self, key: str, value: Value) -> None:
        self.mset(((key, value),))

    def mset(self, items: Union[Mapping[str, Value], Iterable[tuple[str, Value]]]) -> None:
        pairs = [(self._key(k), v) for k, v in (items.items() if isinstance(items, Mapping) else items)]
        if not pairs or self._full:
            return
        self._here()
        while True:
            try:
                with _txn_lock:
                    env = _env(self.path, self.capacity_bytes)
                    try:
                        with env.begin(write=True) as txn:
                            for k, v in pairs:
                                txn.put(k, v)
                        return
                    except lmdb.MapResizedError:
                        env.set_mapsize(0)
                        continue
            except lmdb.MapFullError:
                self._full = True
                self._warn("full", (
                    f"LMDB cache at {self.path} reached its capacity of {self.capacity_bytes} "
                    f"bytes: new samples are computed but no longer cached; cached ones are still "
                    f"served. Pass a larger capacity_bytes or clear() the cache to cache more."))
                return
            except lmdb.Error as e:
                # A write that fails for lack of disk space surfaces as EIO at commit.
                self._full = True
                free = shutil.disk_usage(self.path).free
                cause = "its disk is full" if free < _MIN_FREE_BYTES + sum(len(v) for _, v in pairs) else str(e)
                self._warn("write", (
                    f"cannot write to the LMDB cache at {self.path} ({cause}; {free} bytes free): "
                    f"new samples are computed but no longer cached; cached ones are still "
                    f"served. Free disk space or move the cache (path=..., BAGUA_CACHE_DIR)."))
                return

    def clear(self) -> None:
        self._here()
        with _txn_lock:
            env = _env(self.path, self.capacity_bytes)
            db = env.open_db()  # the main database
            with env.begin(write=True) as txn:
                txn.drop(db, delete=False)
        self._full = False
        self._warn.reset()

    def close(self) -> None:
        if self._pid == os.getpid():
            _release_env(self.path)
        self._pid = None

    def __repr__(self) -> str:
        return f"LmdbStore(path={self.path!r}, capacity_bytes={self.capacity_bytes})"


def _apply(v, fn):
    return None if v is None else fn(v)


def _to_bytes(v) -> Optional[bytes]:
    return None if v is None else bytes(v)
