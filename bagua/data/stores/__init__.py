"""Cache stores behind one interface (get/set/mget/mset/num_keys/clear/close).

``LmdbStore`` is the embedded default; ``RedisStore`` uses Redis servers (given, or one
local server per machine; ``start_redis_server`` starts one on a TCP port).
``create_store("lmdb", **kw)`` builds one by name.

Example::

    from bagua.data import stores
    store = stores.create_store("lmdb", path="/tmp/cache")
"""

from __future__ import annotations

from typing import Any, Union

from ._local_redis import start_redis_server, stop_local_server
from .lmdb_store import LmdbStore
from .redis_store import RedisStore
from .store import Store, StoreError, StorePathError, StoreUnavailableError, default_cache_dir

__all__ = [
    "Store", "LmdbStore", "RedisStore", "StoreError", "StorePathError", "StoreUnavailableError",
    "create_store", "default_cache_dir", "start_redis_server", "stop_local_server",
]

BACKENDS = {"lmdb": LmdbStore, "redis": RedisStore}


def create_store(backend: Union[str, Store] = "lmdb", **kwargs: Any) -> Store:
    """A store for ``backend`` ("lmdb" or "redis", or a Store to use as is) built with ``kwargs``."""
    if isinstance(backend, Store):
        if kwargs:
            raise ValueError(f"store options {sorted(kwargs)} cannot apply to an existing {backend!r}")
        return backend
    cls = BACKENDS.get(backend) if isinstance(backend, str) else None
    if cls is None:
        raise ValueError(f"backend must be one of {sorted(BACKENDS)} or a Store, got {backend!r}")
    return cls(**kwargs)
