"""RedisStore: a cache store on Redis servers, sharded by a stable hash.

With ``hosts=[{"host": ..., "port": ...}, ...]`` it uses those servers; in ``cluster_mode``
each key lives on exactly one of them, chosen by rendezvous hashing of the key (stable across
processes and machines; adding a server moves only about 1/n of the keys).

With ``hosts=None`` it uses one local ``redis-server`` per machine, started on first use and
shared by all ranks and jobs of this user on the machine (those with the same
``BAGUA_CACHE_DIR``): Unix socket only (mode 0700, no TCP port), memory-capped at
``capacity_per_node`` with LRU eviction, nothing persisted to disk. It is stopped
(``SHUTDOWN NOSAVE``) when the last process that created a RedisStore on it closes the store
or exits; ``store.shutdown()`` or ``bagua.data.stores.stop_local_server()`` stops it at once.
Keys are not sharded across machines in this mode: pass ``hosts`` for that.

Faults: a server unreachable at construction raises :class:`StoreUnavailableError` naming
``host:port``. A server that stops answering later is reported once; its keys read as misses
and writes to it are dropped (the cache computes those samples), and it is retried every
``retry_interval`` seconds.

Example::

    from bagua.data.stores import RedisStore
    store = RedisStore(hosts=[{"host": "10.0.0.1", "port": 6379}, {"host": "10.0.0.2", "port": 6379}])
    store.mset({"a": b"1", "b": b"2"}); store.mget(["a", "b"])
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
import weakref
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, TypeVar, Union

from ..._install import install_hint
from . import _local_redis
from .store import Store, StoreUnavailableError, Value, _WarnOnce

__all__ = ["RedisStore"]

logger = logging.getLogger(__name__)
T = TypeVar("T")
_M64 = (1 << 64) - 1


def _default_capacity() -> int:
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        total = 16 << 30
    return min(16 << 30, total // 4)


def _mix64(x: int) -> int:
    """splitmix64's finalizer: a well-spread 64-bit hash of a 64-bit int."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def _redis():
    try:
        import redis
    except ImportError as e:
        raise ImportError(f"RedisStore needs the redis client: {install_hint('redis')}, or pip install 'redis>=5'") from e
    return redis


class _Node:
    """One server: how to reach it and a label for messages."""

    def __init__(self, label: str, conn: dict):
        self.label = label
        self.conn = conn
        self.seed = int.from_bytes(hashlib.blake2b(label.encode(), digest_size=8).digest(), "little")


class RedisStore(Store):
    """A cache store on one or more Redis servers.

    Args:
        hosts: ``[{"host": ..., "port": ...}, ...]`` of running servers (extra keys such as
            ``password`` or ``db`` go to ``redis.Redis``), or None for the machine's local
            server (started if needed).
        cluster_mode: shard keys across ``hosts``; False uses a single server and then
            ``hosts`` must name exactly one.
        capacity_per_node: memory cap of a local server started by this store, in bytes
            (default: a quarter of RAM, at most 16 GiB); ignored with ``hosts``.
        socket_timeout: seconds to wait for a server before treating it as down.
        retry_interval: seconds before a server that failed is tried again.
        **kw: passed to ``redis.Redis`` for every server (e.g. ``password``).

    Raises:
        StoreUnavailableError: a server cannot be reached (the message names host:port) or
            the local one cannot be started.
    """

    def __init__(
        self,
        hosts: Optional[Sequence[Mapping[str, Any]]] = None,
        cluster_mode: bool = True,
        capacity_per_node: Optional[int] = None,
        socket_timeout: float = 5.0,
        retry_interval: float = 10.0,
        **kw: Any,
    ):
        _redis()
        self.cluster_mode = cluster_mode
        self.capacity_per_node = int(capacity_per_node) if capacity_per_node is not None else _default_capacity()
        self.socket_timeout = socket_timeout
        self.retry_interval = retry_interval
        self._kw = dict(kw)
        self._local = hosts is None
        self._cache_dir: Optional[str] = None
        if hosts is None:
            from .store import default_cache_dir

            self._cache_dir = default_cache_dir()
            sock, user = _local_redis.attach(self.capacity_per_node, self._cache_dir)
            # Detach on close(), when collected, or at exit: only in this process.
            self._detacher: Optional[weakref.finalize] = weakref.finalize(
                self, _detach_if_owner, os.getpid(), user, self._cache_dir)
            self._nodes = [_Node(f"unix:{sock}", {"unix_socket_path": sock})]
        else:
            self._detacher = None
            self._nodes = [self._parse_host(h) for h in hosts]
            if not self._nodes:
                raise ValueError("hosts must name at least one server, or be None for a local one")
            if not cluster_mode and len(self._nodes) > 1:
                raise ValueError(
                    f"cluster_mode=False uses one server, but hosts names {len(self._nodes)}; "
                    f"pass one host or cluster_mode=True to shard across them")
            if len({n.label for n in self._nodes}) != len(self._nodes):
                raise ValueError(f"hosts lists a server twice: {[n.label for n in self._nodes]}")
        self._clients: list = []
        self._pid: Optional[int] = None
        self._down_until: list[float] = []
        self._warn = _WarnOnce(logger)
        self._connect()
        for i, node in enumerate(self._nodes):
            try:
                self._clients[i].ping()
            except Exception as e:
                self.close()
                raise StoreUnavailableError(
                    f"cannot reach Redis at {node.label}: {type(e).__name__}: {e}. Start "
                    f"redis-server there, fix hosts=..., or pass hosts=None to use a local server."
                ) from e

    @staticmethod
    def _parse_host(h: Mapping[str, Any]) -> _Node:
        if not isinstance(h, Mapping) or "host" not in h:
            raise ValueError(f"each entry of hosts must be a dict with 'host' (and 'port'), got {h!r}")
        conn = dict(h)
        conn["port"] = int(conn.get("port", 6379))
        return _Node(f"{conn['host']}:{conn['port']}", conn)

    # -- connections, per process ---------------------------------------------------------

    def _connect(self) -> None:
        redis = _redis()
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        kw = dict(socket_timeout=self.socket_timeout, socket_connect_timeout=min(self.socket_timeout, 2.0),
                  retry=Retry(NoBackoff(), 0))
        kw.update(self._kw)
        self._clients = [redis.Redis(**{**kw, **node.conn}) for node in self._nodes]
        self._down_until = [0.0] * len(self._nodes)
        self._pid = os.getpid()

    def _here(self) -> None:
        if self._pid != os.getpid():
            self._warn = _WarnOnce(logger)
            self._connect()  # forked or unpickled: fresh sockets, never the parent's

    def _close_clients(self) -> None:
        for c in self._clients:
            try:
                c.close()
            except Exception:
                logger.debug("closing a Redis client failed", exc_info=True)
        self._clients = []

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state.update(_clients=[], _pid=None, _down_until=[], _warn=None, _detacher=None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._warn = _WarnOnce(logger)

    # -- sharding and fault handling ------------------------------------------------------

    def node_index(self, key: str) -> int:
        """Which server (index into hosts) holds ``key``: the same in every process."""
        if len(self._nodes) == 1:
            return 0
        h = int.from_bytes(hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest(), "little")
        best, best_score = 0, -1
        for i, node in enumerate(self._nodes):
            score = _mix64(h ^ node.seed)
            if score > best_score:
                best, best_score = i, score
        return best

    def _up(self, i: int) -> bool:
        return self._down_until[i] <= time.monotonic()

    def _failed(self, i: int, e: Exception, doing: str) -> None:
        self._down_until[i] = time.monotonic() + self.retry_interval
        self._warn(f"down:{i}", (
            f"Redis at {self._nodes[i].label} failed while {doing} ({type(e).__name__}: {e}); "
            f"its samples are computed instead of read from the cache, and writes to it are "
            f"dropped. Retrying it every {self.retry_interval:g} s."))

    def _call(self, i: int, doing: str, fn: Callable[[Any], T], default: T) -> T:
        if not self._up(i):
            return default
        redis = _redis()
        try:
            return fn(self._clients[i])
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError,
                redis.exceptions.BusyLoadingError) as e:
            self._failed(i, e, doing)
            return default
        except redis.exceptions.ResponseError as e:
            if doing != "writing":
                raise
            # e.g. "OOM command not allowed" from a server with maxmemory and no eviction
            self._warn(f"refused:{i}", (
                f"Redis at {self._nodes[i].label} refused a write ({e}); samples it does not "
                f"take are computed again when needed. Give it more memory or an eviction "
                f"policy (maxmemory-policy allkeys-lru)."))
            return default

    # -- the Store interface -----------------------------------------------------------------

    def get(self, key: str) -> Optional[bytes]:
        self._here()
        i = self.node_index(key)
        return self._call(i, "reading", lambda c: c.get(key), None)

    def mget(self, keys: Sequence[str]) -> list[Optional[bytes]]:
        self._here()
        keys = list(keys)
        if not keys:
            return []
        if len(self._nodes) == 1:
            return self._call(0, "reading", lambda c: c.mget(keys), [None] * len(keys))
        groups: dict[int, list[int]] = {}
        for pos, k in enumerate(keys):
            groups.setdefault(self.node_index(k), []).append(pos)
        out: list[Optional[bytes]] = [None] * len(keys)
        for i, positions in groups.items():
            ks = [keys[p] for p in positions]
            values = self._call(i, "reading", lambda c, ks=ks: c.mget(ks), [None] * len(ks))
            for p, v in zip(positions, values):
                out[p] = v
        return out

    def mget_map(self, keys: Sequence[str], fn: Callable[[Value], T]) -> list[Optional[T]]:
        values: list = self.mget(keys)
        for i, v in enumerate(values):
            if v is not None:
                values[i] = None  # drop each raw value as it is decoded: its memory gets reused
                values[i] = fn(v)
        return values

    def set(self, key: str, value: Value) -> None:
        self._here()
        i = self.node_index(key)
        self._call(i, "writing", lambda c: c.set(key, bytes(value) if isinstance(value, memoryview) else value), None)

    def mset(self, items: Union[Mapping[str, Value], Iterable[tuple[str, Value]]]) -> None:
        self._here()
        pairs = items.items() if isinstance(items, Mapping) else items
        groups: dict[int, dict[str, Value]] = {}
        for k, v in pairs:
            groups.setdefault(self.node_index(k), {})[k] = bytes(v) if isinstance(v, memoryview) else v
        for i, mapping in groups.items():
            self._call(i, "writing", lambda c, m=mapping: c.mset(m), None)

    def num_keys(self) -> int:
        self._here()
        return sum(self._call(i, "counting keys", lambda c: c.dbsize(), 0) for i in range(len(self._nodes)))

    def clear(self) -> None:
        self._here()
        for i in range(len(self._nodes)):
            self._call(i, "clearing", lambda c: c.flushdb(), None)

    def status(self) -> bool:
        """True when every server of this store answers now."""
        self._here()
        return all(self._call(i, "pinging", lambda c: bool(c.ping()), False) for i in range(len(self._nodes)))

    def shutdown(self) -> None:
        """Close this store and stop the local server (``hosts=None``) at once, for every process
        using it. Servers given in ``hosts`` were not started by this store: they keep running
        (a warning says so)."""
        self.close()
        if self._local:
            _local_redis.stop_local_server(self._cache_dir)
        else:
            logger.warning("RedisStore.shutdown() leaves the servers given in hosts running: %s", self.hosts)

    def close(self) -> None:
        if self._pid == os.getpid():
            self._close_clients()
        self._pid = None
        if self._detacher is not None:
            self._detacher()

    @property
    def hosts(self) -> list[str]:
        """Labels (``host:port``, or ``unix:<socket>`` for the local server) of the servers."""
        return [n.label for n in self._nodes]

    def __repr__(self) -> str:
        return f"RedisStore(hosts={self.hosts}, cluster_mode={self.cluster_mode})"


def _detach_if_owner(pid: int, user: str, cache_dir: Optional[str]) -> None:
    if os.getpid() == pid:
        try:
            _local_redis.detach(user, cache_dir)
        except Exception:
            logger.warning("releasing the local redis-server failed", exc_info=True)
