"""CachedDataset: a map-style dataset whose samples are computed once and then read back.

Example::

    import bagua
    ds = bagua.data.CachedDataset(slow_ds, backend="lmdb", dataset_name="train")
    loader = torch.utils.data.DataLoader(ds, batch_size=64, num_workers=4)
    # epoch 1 computes and caches every sample; later epochs read them back
"""

from __future__ import annotations

import operator
from typing import Any, Sequence, Union

import torch.utils.data

from .cache_loader import CacheLoader
from .stores import Store

__all__ = ["CachedDataset"]


class CachedDataset(torch.utils.data.Dataset):
    """Wrap any map-style dataset with a cache.

    ``len(ds) == len(dataset)`` and ``ds[i]`` returns what ``dataset[i]`` returns: the same
    types and values (arrays and tensors bit for bit). ``ds.__getitems__(indices)``, which
    torch's DataLoader calls for each batch, reads all cached samples in one store round trip
    and computes only the missing ones (through ``dataset.__getitems__`` when it has one).

    Args:
        dataset: the map-style dataset to cache.
        backend: "lmdb" (default, embedded), "redis", or a Store.
        dataset_name: namespace in the store; give each dataset (and each transform of it)
            its own name, as datasets with the same name share entries.
        writer_buffer_size: computed samples written to the store per batch.
        **store_kwargs: options of the store (``path``, ``capacity_bytes``, ``hosts``...).

    Attributes:
        cache_loader: the :class:`CacheLoader` doing the work.
    """

    def __init__(self, dataset: Any, backend: Union[str, Store] = "lmdb", dataset_name: str = "",
                 writer_buffer_size: int = 20, **store_kwargs: Any):
        self.dataset = dataset
        self.cache_loader = CacheLoader(backend=backend, dataset_name=dataset_name,
                                        writer_buffer_size=writer_buffer_size, **store_kwargs)

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
