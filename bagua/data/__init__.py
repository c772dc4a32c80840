"""Data loading acceleration: cached datasets (LMDB embedded, Redis) and load-balanced samplers.

``CachedDataset`` wraps any map-style dataset: the first epoch computes each sample and stores
it, later epochs read it back (one store round trip per DataLoader batch). ``CacheLoader`` is
the get-or-compute underneath; ``stores`` holds the backends (``LmdbStore``, ``RedisStore``)
behind one interface. ``LoadBalancingDistributedSampler`` gives every rank the same amount of
work per step when samples differ in cost; ``LoadBalancingDistributedBatchSampler`` batches
samples of similar cost.

Example::

    import bagua.data
    ds = bagua.data.CachedDataset(slow_ds, backend="lmdb", dataset_name="train-224px")
    ds = bagua.data.CachedDataset(slow_ds, backend="redis", dataset_name="train-224px",
                                  hosts=[{"host": "10.0.0.5", "port": 6379}])
    sampler = bagua.data.LoadBalancingDistributedSampler(ds, complexities=lengths)

Faults degrade instead of failing where the cache is only an accelerator: a full cache or
disk, a Redis server that dies, or a stored value that no longer decodes each log one warning,
and the affected samples are computed (and, where possible, stored again). Errors the user must
fix are raised with the thing that was wrong: an unserializable sample (index and type), an
unusable cache path, an unreachable Redis server (host:port).
"""

from . import stores
from .cache_loader import CacheLoader
from .cached_dataset import CachedDataset
from .load_balancing_sampler import LoadBalancingDistributedBatchSampler, LoadBalancingDistributedSampler

__all__ = [
    "CacheLoader", "CachedDataset", "LoadBalancingDistributedBatchSampler", "LoadBalancingDistributedSampler", "stores",
]
