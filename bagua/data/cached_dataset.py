"""CachedDataset: a map-style dataset whose samples are computed once and then read back.

The cache outlives the run (an LMDB directory, a Redis server), and it knows what filled it:
every value is stamped with the fingerprint of the dataset (class, source, length), its
transforms (qualified name, source or repr) and the user's ``version`` (see
:mod:`bagua.data.fingerprint`). Built again with the same code, the dataset reuses the cache, and
rank 0 logs one line saying where and how to start fresh; with a changed transform (or
``version``) the old values are never served: each is a miss, recomputed and overwritten in place
when read (the store keeps one value per sample, not one per transform), and rank 0 logs one
line saying so.

Example::

    import bagua
    ds = bagua.data.CachedDataset(slow_ds, backend="lmdb", dataset_name="train")
    loader = torch.utils.data.DataLoader(ds, batch_size=64, num_workers=4)
    # epoch 1 computes and caches every sample; later epochs read them back
"""

from __future__ import annotations

import logging
import operator
import os
from typing import Any, Sequence, Union

import torch.utils.data

from ..comm import get_rank, is_initialized
from .cache_loader import CacheLoader
from .fingerprint import dataset_fingerprint
from .stores import Store

__all__ = ["CachedDataset"]

logger = logging.getLogger(__name__)
_PROBES = 16  # samples looked up at construction to tell a reused cache from a stale one


class CachedDataset(torch.utils.data.Dataset):
    """Wrap any map-style dataset with a cache.

    ``len(ds) == len(dataset)`` and ``ds[i]`` returns what ``dataset[i]`` returns: the same
    types and values (arrays and tensors bit for bit). ``ds.__getitems__(indices)``, which
    torch's DataLoader calls for each batch, reads all cached samples in one store round trip
    and computes only the missing ones (through ``dataset.__getitems__`` when it has one).

    Args:
        dataset: the map-style dataset to cache.
        backend: "lmdb" (default, embedded), "redis", or a Store.
        dataset_name: namespace in the store: datasets with different names never share
            entries. One name serves one dataset at a time: a changed transform or ``version``
            replaces the values as they are read.
        writer_buffer_size: computed samples written to the store per batch.
        version: part of the fingerprint, for what it cannot see (data files that changed, a
            global a transform reads): a new version starts afresh.
        trust_pickled_values: unpickle any type a cached sample names (say, PIL images or your
            own classes), which runs code chosen by whoever wrote it into the store: only when
            every writer of the cache is trusted. Default: samples made of arrays, tensors,
            numbers, strings, bytes and lists/tuples/dicts of them; a value naming anything
            else raises :class:`~bagua.data.serialization.UntrustedValueError` naming it.
        **store_kwargs: the options of the backend's store. ``"lmdb"``
            (:class:`~bagua.data.stores.lmdb_store.LmdbStore`): ``path``, the cache directory
            (default ``$BAGUA_CACHE_DIR/lmdb``, else ``~/.cache/bagua/lmdb``), and
            ``capacity_bytes``, the most it holds. ``"redis"``
            (:class:`~bagua.data.stores.redis_store.RedisStore`): ``hosts`` (None: a local
            server, started if needed), ``cluster_mode``, ``capacity_per_node``,
            ``socket_timeout``, ``retry_interval``, and ``redis.Redis`` options such as
            ``password``. An option the store does not take is a ``TypeError`` naming it.

    Attributes:
        cache_loader: the :class:`CacheLoader` doing the work.
        fingerprint: the :class:`~bagua.data.fingerprint.Fingerprint` its values are stamped with.

    Example::

        ds = CachedDataset(ImageFolder(root, transform=augment), dataset_name="train",
                           version="2024-06 images")   # the files changed: a new version
        ds.fingerprint.summary   # "version='2024-06 images', torchvision...ImageFolder (1281167 samples), ..."
    """

    def __init__(self, dataset: Any, backend: Union[str, Store] = "lmdb", dataset_name: str = "",
                 writer_buffer_size: int = 20, version: str = "", trust_pickled_values: bool = False,
                 **store_kwargs: Any):
        self.dataset = dataset
        self.fingerprint = dataset_fingerprint(dataset, version)
        self.cache_loader = CacheLoader(backend=backend, dataset_name=dataset_name,
                                        writer_buffer_size=writer_buffer_size,
                                        fingerprint=self.fingerprint.digest,
                                        trust_pickled_values=trust_pickled_values, **store_kwargs)
        if (get_rank() if is_initialized() else int(os.environ.get("RANK", "0"))) == 0:
            self._report_cache()

    def _report_cache(self) -> None:
        """One line on rank 0 when the store already holds samples of this name: reused, or stale."""
        n = len(self.dataset)
        if not n:
            return
        current, stale = self.cache_loader.count_cached(range(0, n, -(-n // _PROBES)))
        loader, fp = self.cache_loader, self.fingerprint
        if stale:
            logger.warning(
                "CachedDataset %r: %s holds samples made by another dataset, transform or version; "
                "this one is %s (fingerprint %s): each stale sample is recomputed and overwritten when read",
                loader.dataset_name, loader.store, fp.summary, fp.digest)
        elif current:
            logger.info(
                "CachedDataset %r: reusing the cache in %s (%d entries in the store; fingerprint %s: %s); "
                "to start fresh pass version='<new>' or clear it with ds.cache_loader.store.clear()",
                loader.dataset_name, loader.store, loader.store.num_keys(), fp.digest, fp.summary)

    def __len__(self) -> int:
        return len(self.dataset)

    def _index(self, index: Any) -> Any:
        try:
            i = operator.index(index)
        except TypeError:
            return index  # a non-integer key of a dict-like dataset
        return i + len(self.dataset) if i < 0 else i

    def _load(self, indices: list) -> list:
        getitems = getattr(self.dataset, "__getitems__", None)
        if getitems is not None and len(indices) > 1:
            return list(getitems(indices))
        return [self.dataset[i] for i in indices]

    def _load_one(self, index: Any) -> Any:
        return self.dataset[index]

    def __getitem__(self, index: Any) -> Any:
        if type(index) is not int or index < 0:
            index = self._index(index)
        return self.cache_loader._get_one(index, self._load_one, "index")

    def __getitems__(self, indices: Sequence[Any]) -> list:
        return self.cache_loader._get_many([self._index(i) for i in indices], self._load, "index")

    def flush(self) -> None:
        """Write buffered samples to the store now."""
        self.cache_loader.flush()

    def close(self) -> None:
        """Flush and close the store."""
        self.cache_loader.close()

    def __repr__(self) -> str:
        return f"CachedDataset({self.dataset!r}, {self.cache_loader!r})"
