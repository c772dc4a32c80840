"""The original ``bagua.torch_api.contrib``: cached datasets, load-balanced samplers, the fused
optimizer and SyncBatchNorm, as the original spelled them, over ``bagua.data``, ``bagua.optim``
and ``bagua.parallel``.

What changed: the cache's store keys (a cache written by the original is not read back);
``RedisStore(hosts=None)`` uses one local server per machine on a Unix socket, not a TCP server
per node sharded across nodes; ``SyncBatchNorm`` also runs on the CPU.

Example::

    from bagua.torch_api.contrib import CachedDataset, LoadBalancingDistributedSampler, fuse_optimizer
    dataset = CachedDataset(dataset, backend="redis", dataset_name="train")
    optimizer = fuse_optimizer(torch.optim.Adam(model.parameters()))
"""

from .cache_loader import CacheLoader
from .cached_dataset import CachedDataset
from .fuse.optimizer import fuse_optimizer
from .load_balancing_data_loader import LoadBalancingDistributedBatchSampler, LoadBalancingDistributedSampler

__all__ = [
    "CacheLoader", "CachedDataset", "LoadBalancingDistributedBatchSampler", "LoadBalancingDistributedSampler",
    "fuse_optimizer",
]
