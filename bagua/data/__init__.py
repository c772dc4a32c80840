"""Data loading acceleration: cached datasets (LMDB embedded, Redis) and load-balanced samplers.

``CachedDataset`` wraps any map-style dataset: the first epoch computes each sample and stores
it, later epochs read it back (one store round trip per DataLoader batch). ``CacheLoader`` is
the get-or-compute underneath; ``stores`` holds the backends (``LmdbStore``, ``RedisStore``)
behind one interface. ``LoadBalancingDistributedSampler`` gives every rank the same amount of
work per step when samples differ in cost; ``LoadBalancingDistributedBatchSampler`` batches
samples of similar cost. ``ElasticDistributedSampler`` is torch's ``DistributedSampler``, plus the
resuming all three samplers share: ``state_dict()``/``load_state_dict()`` resume mid-epoch, at the
same world size exactly where each rank stopped, at another one with the samples not consumed yet
dealt to the new ranks. ``ResumableDataLoader`` is a DataLoader that tells its sampler how much the
loop received (with worker processes, the sampler alone counts prefetched batches too).

Example::

    import bagua.data
    ds = bagua.data.CachedDataset(slow_ds, backend="lmdb", dataset_name="train-224px")
    ds = bagua.data.CachedDataset(slow_ds, backend="redis", dataset_name="train-224px",
                                  hosts=[{"host": "10.0.0.5", "port": 6379}])
    sampler = bagua.data.LoadBalancingDistributedSampler(ds, complexities=lengths)
    loader = bagua.data.ResumableDataLoader(ds, batch_size=32, sampler=sampler, num_workers=4)
    sampler.load_state_dict(saved_state)     # resume mid-epoch, also at another world size

Faults degrade instead of failing where the cache is only an accelerator: a full cache or
disk, a Redis server that dies, or a stored value that no longer decodes each log one warning,
and the affected samples are computed (and, where possible, stored again). Errors the user must
fix are raised with the thing that was wrong: an unserializable sample (index and type), an
unusable cache path, an unreachable Redis server (host:port), a stored value naming a type the
cache does not unpickle unless ``trust_pickled_values=True`` (the type: decoding a value runs no
code chosen by whoever can write to the store).
"""

from . import stores
from .cache_loader import CacheLoader
from .cached_dataset import CachedDataset
from .elastic_sampler import ElasticDistributedSampler
from .load_balancing_sampler import LoadBalancingDistributedBatchSampler, LoadBalancingDistributedSampler
from .resumable_loader import ResumableDataLoader

__all__ = [
    "CacheLoader", "CachedDataset", "ElasticDistributedSampler", "LoadBalancingDistributedBatchSampler",
    "LoadBalancingDistributedSampler", "ResumableDataLoader", "stores",
]
