"""The original ``bagua.torch_api.contrib.utils.redis_store``: ``RedisStore`` and
``start_redis_server_cli``, over ``bagua.data.stores``.

Differences from the original: ``hosts=None`` uses one local redis-server per machine (started
on first use, on a Unix socket, stopped when its last user exits) instead of a TCP server per
node whose addresses the nodes exchanged: each machine caches on its own. Servers started by
``start_redis_server_cli`` keep Redis's protected mode (without a password they accept
connections from this machine only); pass ``"--requirepass <secret>"`` to serve other machines.

Example::

    from bagua.torch_api.contrib.utils.redis_store import RedisStore
    hosts = [{"host": "10.0.0.1", "port": "7000"}, {"host": "10.0.0.2", "port": "7000"}]
    store = RedisStore(hosts=hosts, cluster_mode=True)
    store.set("key", b"value"); store.status()
"""

from __future__ import annotations

import shlex
from typing import Dict, List, Optional

from bagua.data import stores

from ...env import get_node_rank

__all__ = ["RedisStore"]


class RedisStore(stores.RedisStore):
    """A cache store on Redis servers: ``bagua.data.stores.RedisStore`` with the original's signature.

    Args:
        hosts: ``[{"host": ..., "port": ...}, ...]`` of running servers, or None for this machine's
            local server (started if needed).
        cluster_mode: True shards keys across ``hosts``; False makes the ranks of node ``n`` use
            ``hosts[n % len(hosts)]`` alone (as the original).
        capacity_per_node: memory cap in bytes of a local server this store starts (the
            original's default, 100 GiB); an already running one keeps its own.

    Example::

        store = RedisStore(hosts=None, cluster_mode=False, capacity_per_node=10_000_000)
        store.mset({"a": b"1"}); store.mget(["a", "b"])    # [b"1", None]
    """

    def __init__(
        self,
        hosts: Optional[List[Dict[str, str]]] = None,
        cluster_mode: bool = True,
        capacity_per_node: int = 107_374_182_400,
    ):
        if hosts is not None and not cluster_mode and len(hosts) > 1:
            hosts = [hosts[get_node_rank() % len(hosts)]]
        super().__init__(hosts=hosts, cluster_mode=cluster_mode, capacity_per_node=capacity_per_node)


def start_redis_server_cli(port: int, capacity: int, *args: str) -> None:
    """Start a redis-server on TCP ``port`` with ``capacity`` bytes of memory; returns once it answers.

    ``args`` are extra redis-server options as the original took them, one option with its
    value per string (``"--cluster-config-file nodes7000.conf"``). The server outlives this
    process; stop it with ``redis.Redis(port=port).shutdown(nosave=True)``.

    Example::

        start_redis_server_cli(7000, 10_000_000)
        store = RedisStore(hosts=[{"host": "127.0.0.1", "port": 7000}])
    """
    stores.start_redis_server(port, capacity, [token for arg in args for token in shlex.split(arg)])
