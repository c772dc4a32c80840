"""Fixtures for the cache tests: a private cache directory and real redis-server processes."""

from __future__ import annotations

import os
import shutil
import subprocess
import time

import pytest

from tests.harness import free_port


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """A private BAGUA_CACHE_DIR (so local Redis servers and LMDB files are per test)."""
    d = tmp_path / "cache"
    d.mkdir()
    monkeypatch.setenv("BAGUA_CACHE_DIR", str(d))
    yield d
    # A test must not leave the local redis-server of its cache dir running.
    pid = local_redis_pid(d)
    if pid is not None:
        from bagua.data.stores import stop_local_server

        stop_local_server(str(d))
        pytest.fail(f"the test left the local redis-server (pid {pid}) running")


def _redis_binary() -> str:
    binary = shutil.which("redis-server")
    if not binary:
        pytest.fail("redis-server is not installed; run `make system-deps` (apt-get install redis-server)")
    return binary


class RedisServers:
    """Starts real redis-server processes on free localhost ports; stops them at teardown."""

    def __init__(self, tmp_path):
        self.tmp_path = tmp_path
        self.procs: list[subprocess.Popen] = []

    def start(self) -> dict:
        import redis

        port = free_port()
        d = self.tmp_path / f"redis-{port}"
        d.mkdir()
        proc = subprocess.Popen(
            [_redis_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(d), "--logfile", str(d / "log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.procs.append(proc)
        client = redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=0.5)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.exceptions.ConnectionError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    pytest.fail(f"redis-server on port {port} did not start")
                time.sleep(0.02)
        client.close()
        return {"host": "127.0.0.1", "port": port}

    def kill(self, host: dict) -> None:
        for proc in self.procs:
            if f"--port {host['port']} " in " ".join(proc.args) + " ":
                proc.kill()
                proc.wait(5)

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(5)


@pytest.fixture
def redis_servers(tmp_path):
    servers = RedisServers(tmp_path)
    yield servers
    servers.stop_all()


@pytest.fixture
def redis_host(redis_servers):
    return redis_servers.start()


def local_redis_pid(cache_dir) -> int | None:
    """pid of the local server of ``cache_dir`` if it answers, else None."""
    import redis

    from bagua.data.stores import _local_redis

    sock = _local_redis.socket_path(_local_redis.state_dir(str(cache_dir)))
    if not os.path.exists(sock):
        return None
    client = redis.Redis(unix_socket_path=sock, socket_timeout=2)
    try:
        return int(client.info("server")["process_id"])
    except redis.exceptions.ConnectionError:
        return None
    finally:
        client.close()


@pytest.fixture(params=["lmdb", "redis"])
def backend(request, tmp_path, redis_servers):
    """(backend, store kwargs) for a store of each kind, private to the test: an LMDB directory,
    or a real redis-server; it outlives each CachedDataset built on it."""
    if request.param == "lmdb":
        return "lmdb", {"path": str(tmp_path / "lmdb")}
    return "redis", {"hosts": [redis_servers.start()]}
