"""The original ``bagua.torch_api.contrib.utils``: the key-value stores behind the cache.

Example::

    from bagua.torch_api.contrib.utils.redis_store import RedisStore
    store = RedisStore(hosts=None, capacity_per_node=10**9)
"""

__all__ = ["redis_store", "store"]
