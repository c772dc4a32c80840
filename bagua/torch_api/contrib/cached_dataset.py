"""The original ``bagua.torch_api.contrib.cached_dataset``: ``CachedDataset`` with the original's
default backend, Redis, over ``bagua.data.CachedDataset``.

Example::

    from bagua.torch_api.contrib import CachedDataset
    dataset = CachedDataset(dataset, backend="redis", dataset_name="train", capacity_per_node=10**9)
    loader = torch.utils.data.DataLoader(dataset, batch_size=32)
"""

from __future__ import annotations

from typing import Any

from bagua import data

from .cache_loader import _create_store

__all__ = ["CachedDataset"]


class CachedDataset(data.CachedDataset):
    """A dataset whose samples are computed once, then read from a store: ``bagua.data.CachedDataset``
    with the original's signature.

    Args:
        dataset: the map-style dataset to cache.
        backend: "redis" (the original's only backend, and the default) or "lmdb".
        dataset_name: the namespace of this dataset's keys.
        writer_buffer_size: computed samples written to the store per batch.
        trust_pickled_values: unpickle any type a cached value names (the original did, always);
            default: arrays, tensors, numbers, strings and containers only (see ``bagua.data``).
        **kwargs: options of the store: ``hosts``, ``cluster_mode``, ``capacity_per_node`` for Redis.

    Example::

        cached = CachedDataset(dataset, backend="redis", dataset_name="ds")
        cached[0] == dataset[0]; cached.cache_loader.num_keys()
    """

    def __init__(self, dataset: Any, backend: str = "redis", dataset_name: str = "", writer_buffer_size: int = 20,
                 trust_pickled_values: bool = False, **kwargs: Any):
        super().__init__(dataset, _create_store(backend, **kwargs), dataset_name, writer_buffer_size,
                         trust_pickled_values=trust_pickled_values)
