import logging
import os

import pytest
import redis

from bagua.data import CachedDataset
from bagua.data.stores import RedisStore, Store, StoreUnavailableError, stop_local_server
from tests.data.conftest import local_redis_pid
from tests.data.samples import SampleDataset, make_sample, same
from tests.harness import free_port, run_ranks


def _client(host: dict) -> redis.Redis:
    return redis.Redis(host=host["host"], port=host["port"])


def test_store_interface(redis_host):
    store = RedisStore(hosts=[redis_host])
    assert isinstance(store, Store)
    assert store.get("a") is None and store.num_keys() == 0
    store.set("a", b"1")
    store.mset({"b": b"2", "c": bytearray(b"3")})
    store.mset([("d", memoryview(b"4"))])
    assert store.mget(["a", "b", "c", "d", "zz"]) == [b"1", b"2", b"3", b"4", None]
    assert store.num_keys() == 4
    store.clear()
    assert store.num_keys() == 0
    store.close()
    store.close()


def test_bad_hosts_arguments(redis_host):
    with pytest.raises(ValueError, match="dict with 'host'"):
        RedisStore(hosts=["localhost:6379"])
    with pytest.raises(ValueError, match="cluster_mode=False uses one server"):
        RedisStore(hosts=[redis_host, {"host": "127.0.0.1", "port": 1}], cluster_mode=False)
    with pytest.raises(ValueError, match="twice"):
        RedisStore(hosts=[redis_host, dict(redis_host)])


def test_unreachable_at_construction_names_host_and_port(redis_host):
    port = free_port()  # nothing listens there
    with pytest.raises(StoreUnavailableError, match=f"127.0.0.1:{port}"):
        RedisStore(hosts=[redis_host, {"host": "127.0.0.1", "port": port}])


def test_sharding_puts_each_key_on_exactly_one_server(redis_servers):
    hosts = [redis_servers.start(), redis_servers.start()]
    store = RedisStore(hosts=hosts)
    keys = [f"k{i}" for i in range(1000)]
    store.mset({k: k.encode() for k in keys})
    clients = [_client(h) for h in hosts]
    on = [[bool(c.exists(k)) for c in clients] for k in keys]
    assert all(sum(flags) == 1 for flags in on)  # exactly one server per key
    assert all(on[i][store.node_index(k)] for i, k in enumerate(keys))
    share = sum(flags[0] for flags in on) / len(keys)
    assert 0.4 < share < 0.6, share
    assert store.num_keys() == 1000 == sum(c.dbsize() for c in clients)
    assert store.mget(keys) == [k.encode() for k in keys]  # one MGET per server
    # Stable: another store (in another process) maps every key to the same server.
    assert run_ranks(_node_indices, 1, hosts, keys[:200], init=False, timeout=60)[0] == \
        [store.node_index(k) for k in keys[:200]]
    # Rendezvous hashing: a third server takes about a third of the keys, the rest stay.
    third = RedisStore(hosts=hosts + [redis_servers.start()])
    moved = sum(store.node_index(k) != third.node_index(k) for k in keys)
    assert 250 < moved < 420, moved
    assert all(third.node_index(k) == 2 for k in keys if store.node_index(k) != third.node_index(k))
    store.close()
    third.close()


def _node_indices(rank, hosts, keys):
    store = RedisStore(hosts=hosts)
    try:
        return [store.node_index(k) for k in keys]
    finally:
        store.close()


def test_server_dying_mid_epoch_degrades_to_computing(redis_servers, caplog):
    hosts = [redis_servers.start(), redis_servers.start()]
    src = SampleDataset(64)
    ds = CachedDataset(src, backend="redis", hosts=hosts, dataset_name="d", writer_buffer_size=8,
                       socket_timeout=2.0, retry_interval=60.0)
    loader = lambda: __import__("torch").utils.data.DataLoader(ds, batch_size=8, collate_fn=list)  # noqa: E731
    for batch_start, batch in zip(range(0, 64, 8), loader()):
        assert all(same(s, make_sample(batch_start + j)) for j, s in enumerate(batch))
    assert ds.cache_loader.num_keys() == 64 and src.computed == 64
    dead = ds.cache_loader.store.node_index
    on_dead = sum(dead(ds.cache_loader.key(i)) == 1 for i in range(64))
    with caplog.at_level(logging.WARNING, logger="bagua.data"):
        for batch_start, batch in zip(range(0, 64, 8), loader()):
            if batch_start == 16:
                redis_servers.kill(hosts[1])  # mid-epoch
            assert all(same(s, make_sample(batch_start + j)) for j, s in enumerate(batch))
        for i in range(64):  # and per-sample reads
            assert same(ds[i], make_sample(i))
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and f"127.0.0.1:{hosts[1]['port']}" in warnings[0], warnings
    assert 64 + on_dead <= src.computed <= 64 + 2 * on_dead  # only the dead server's samples
    ds.close()


def test_single_get_per_sample_and_one_mget_per_batch(redis_host):
    src = SampleDataset(32)
    ds = CachedDataset(src, backend="redis", hosts=[redis_host], dataset_name="b", writer_buffer_size=100)
    for i in range(0, 32, 2):
        ds[i]
    ds.flush()
    client = _client(redis_host)
    client.config_resetstat()
    computed = src.computed
    out = ds.__getitems__(list(range(32)))
    assert all(same(s, make_sample(i)) for i, s in enumerate(out))
    stats = client.info("commandstats")
    assert stats["cmdstat_mget"]["calls"] == 1 and "cmdstat_get" not in stats
    assert src.computed - computed == 16  # only the misses
    ds.close()


def test_local_server_is_shared_capped_volatile_and_stopped_by_its_last_user(cache_dir):
    a = RedisStore(capacity_per_node=64 << 20)
    pid = local_redis_pid(cache_dir)
    assert pid is not None
    sock = a.hosts[0][len("unix:"):]
    assert oct(os.stat(sock).st_mode & 0o777) == "0o700"
    client = redis.Redis(unix_socket_path=sock)
    config = client.config_get("*")
    assert int(config["maxmemory"]) == 64 << 20 and config["maxmemory-policy"] == "allkeys-lru"
    assert config["save"] == "" and config["appendonly"] == "no" and config["port"] == "0"
    a.set("from-a", b"1")
    # Another process on the machine attaches to the same server and leaves it running.
    assert run_ranks(_use_local, 2, str(cache_dir), init=False, timeout=90) == [(pid, b"1")] * 2
    assert local_redis_pid(cache_dir) == pid
    b = RedisStore()
    assert b.get("from-a") == b"1"
    a.close()
    assert local_redis_pid(cache_dir) == pid  # b still uses it
    b.close()
    assert local_redis_pid(cache_dir) is None  # the last user stopped it
    client.close()
    assert stop_local_server(str(cache_dir)) is False


def _use_local(rank, cache_dir):
    os.environ["BAGUA_CACHE_DIR"] = cache_dir
    store = RedisStore()
    try:
        return local_redis_pid(cache_dir), store.get("from-a")
    finally:
        store.close()


def test_local_server_missing_binary_is_a_clear_error(cache_dir, monkeypatch):
    monkeypatch.setenv("BAGUA_REDIS_SERVER", str(cache_dir / "no-such-redis-server"))
    with pytest.raises(StoreUnavailableError, match="no-such-redis-server.*apt-get install redis-server"):
        RedisStore()


def test_server_refusing_writes_degrades_to_computing(redis_host, caplog):
    client = _client(redis_host)
    client.set("ballast", b"\0" * (3 << 20))
    client.config_set("maxmemory-policy", "noeviction")
    # full, whatever else the server frees meanwhile (the 3 MB query buffer of the ballast's SET
    # is freed after it: a limit just below the used memory then let writes through, now and then)
    client.config_set("maxmemory", 1 << 20)
    src = SampleDataset(60)
    ds = CachedDataset(src, backend="redis", hosts=[redis_host], writer_buffer_size=1)
    with caplog.at_level(logging.WARNING, logger="bagua.data"):
        for epoch in range(2):
            for i in range(60):
                assert same(ds[i], make_sample(i))
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "refused a write" in warnings[0] and "maxmemory" in warnings[0], warnings
    assert src.computed == 120 and ds.cache_loader.num_keys() == 1  # only the ballast
    ds.close()
