"""start_redis_server (a server on a TCP port), RedisStore.status() and RedisStore.shutdown()."""

from __future__ import annotations

import logging

import pytest
import redis

from bagua.data.stores import RedisStore, StoreUnavailableError, start_redis_server
from tests.data.conftest import local_redis_pid
from tests.harness import free_port


@pytest.fixture
def tcp_port(cache_dir):
    """A free port; whatever server ends up on it is stopped at teardown."""
    port = free_port()
    yield port
    client = redis.Redis(port=port, password="secret-pw", retry=None)
    try:
        client.shutdown(nosave=True)
    except redis.exceptions.ConnectionError:
        pass  # stopped by the test, or the server closed the connection as it exited
    finally:
        client.close()


def test_started_server_serves_a_store_capped_and_outlives_shutdown(tcp_port, caplog):
    pid = start_redis_server(tcp_port, 10_000_000)
    client = redis.Redis(port=tcp_port)
    assert int(client.info("server")["process_id"]) == pid
    config = client.config_get("max*")
    assert config["maxmemory"] == "10000000" and config["maxmemory-policy"] == "allkeys-lru"
    assert client.config_get("save")["save"] == ""
    store = RedisStore(hosts=[{"host": "127.0.0.1", "port": tcp_port}])
    store.set("k", b"v")
    assert store.status() is True
    with caplog.at_level(logging.WARNING):
        store.shutdown()  # not this store's server: left running
    assert "leaves the servers given in hosts running" in caplog.text
    assert client.get("k") == b"v"

    other = RedisStore(hosts=[{"host": "127.0.0.1", "port": tcp_port}])
    redis.Redis(port=tcp_port, retry=None).shutdown(nosave=True)
    assert other.status() is False
    other.close()
    client.close()


def test_extra_args_come_last(tcp_port):
    start_redis_server(tcp_port, 10_000_000, ["--requirepass", "secret-pw", "--maxmemory-policy", "allkeys-random"])
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis(port=tcp_port, retry=None).ping()
    assert redis.Redis(port=tcp_port, password="secret-pw").config_get("maxmemory-policy") == {
        "maxmemory-policy": "allkeys-random"}


def test_a_taken_port_is_a_clear_error(tcp_port):
    start_redis_server(tcp_port, 10_000_000)
    with pytest.raises(StoreUnavailableError, match=f"did not become ready on port {tcp_port}"):
        start_redis_server(tcp_port, 10_000_000)  # the first server answers there, not this one


def test_shutdown_stops_the_local_server_for_everyone(cache_dir):
    store = RedisStore(capacity_per_node=10_000_000)
    other = RedisStore(capacity_per_node=10_000_000)  # another user of the same server
    assert store.status() and local_redis_pid(cache_dir) is not None
    store.shutdown()
    assert local_redis_pid(cache_dir) is None
    assert other.status() is False
    other.close()
