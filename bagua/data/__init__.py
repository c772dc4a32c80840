"""Data loading acceleration: cached datasets over LMDB or Redis stores.

Example::

    import bagua.data
    ds = bagua.data.CachedDataset(ds, backend="lmdb", dataset_name="train")
"""

from . import stores
from .cache_loader import CacheLoader
from .cached_dataset import CachedDataset

__all__ = ["CachedDataset", "CacheLoader", "stores"]
