"""The original ``bagua.torch_api.contrib.utils.store``: the ``Store`` base class, which is
``bagua.data.stores.Store`` (get/set/mget/mset/num_keys/clear, plus close).

Not here: the original's ``ClusterStore`` (sharding over a list of stores); sharding is part of
``RedisStore`` itself (pass several ``hosts``).

Example::

    from bagua.torch_api.contrib.utils.store import Store
    assert isinstance(RedisStore(hosts=None), Store)
"""

from bagua.data.stores import Store

__all__ = ["Store"]
