"""The original ``bagua.torch_api.contrib.cache_loader``: ``CacheLoader`` with the original's
default backend, Redis, over ``bagua.data.CacheLoader``.

Example::

    from bagua.torch_api.contrib import CacheLoader
    loader = CacheLoader(backend="redis", hosts=None, capacity_per_node=10**9, dataset_name="squares")
    loader.get(12, lambda k: k * k)   # computed once, then read from the cache
"""

from __future__ import annotations

from typing import Any

from bagua import data
from bagua.data import stores

from .utils.redis_store import RedisStore

__all__ = ["CacheLoader"]


def _create_store(backend: str, **kwargs: Any) -> stores.Store:
    """The store for ``backend``: "redis" is :class:`~.utils.redis_store.RedisStore` (the original's
    ``hosts``, ``cluster_mode``, ``capacity_per_node``); "lmdb" the native embedded store."""
    if backend == "redis":
        return RedisStore(**kwargs)
    return stores.create_store(backend, **kwargs)


class CacheLoader(data.CacheLoader):
    """Get-or-compute over a key-value store: ``bagua.data.CacheLoader`` with the original's signature.

    Args:
        backend: "redis" (the original's only backend, and the default) or "lmdb".
        dataset_name: the namespace of this loader's keys; loaders with the same name share entries.
        writer_buffer_size: computed values written to the store per batch.
        trust_pickled_values: unpickle any type a cached value names (the original did, always);
            default: arrays, tensors, numbers, strings and containers only (see ``bagua.data``).
        **kwargs: options of the store: ``hosts``, ``cluster_mode``, ``capacity_per_node`` for Redis.

    Example::

        loader = CacheLoader(hosts=[{"host": "10.0.0.1", "port": "7000"}], dataset_name="test")
        value = loader.get(index, lambda i: items[i])
        loader.num_keys()
    """

    def __init__(self, backend: str = "redis", dataset_name: str = "", writer_buffer_size: int = 1,
                 trust_pickled_values: bool = False, **kwargs: Any):
        super().__init__(_create_store(backend, **kwargs), dataset_name, writer_buffer_size,
                         trust_pickled_values=trust_pickled_values)
        self.backend = backend
