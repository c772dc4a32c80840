"""One local ``redis-server`` per machine (per cache directory), shared by every process.

The server listens only on a Unix socket with mode 0700 in the cache directory (so only this
user can reach it; no TCP port is opened), keeps everything in memory (no RDB or AOF files),
and is capped at a memory size with LRU eviction.

Lifetime: each process that attaches registers itself in ``<state dir>/users/``. When a user
detaches (``RedisStore.close()`` or interpreter exit), it drops its entry and any entries of
processes that no longer exist; the one that leaves none behind stops the server with
``SHUTDOWN NOSAVE``. A server whose users were all killed stays up until the next user on the
machine detaches; ``stop_local_server()`` stops it at once.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
from contextlib import contextmanager
from typing import Iterator, Optional

from .store import StoreUnavailableError, default_cache_dir

logger = logging.getLogger(__name__)

_START_TIMEOUT_S = 15.0


def state_dir(cache_dir: Optional[str] = None) -> str:
    return os.path.join(cache_dir or default_cache_dir(), "redis")


def socket_path(state: str) -> str:
    path = os.path.join(state, "redis.sock")
    if len(path) < 100:  # Unix socket paths are limited to 107 bytes
        return path
    digest = hashlib.blake2b(state.encode(), digest_size=8).hexdigest()
    return os.path.join(tempfile.gettempdir(), f"bagua-redis-{os.getuid()}-{digest}.sock")


@contextmanager
def _locked(state: str) -> Iterator[None]:
    os.makedirs(os.path.join(state, "users"), mode=0o700, exist_ok=True)
    fd = os.open(os.path.join(state, "lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _start_time(pid: int) -> Optional[str]:
    """The process's start time in clock ticks (tells a reused pid apart); None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        try:
            os.kill(pid, 0)
            return "?"
        except ProcessLookupError:
            return None
        except PermissionError:
            return "?"
    if fields[0] == "Z":
        return None
    return fields[19]


def _user_name() -> str:
    """A registration of one store: its process (pid and start time) and a unique token."""
    return f"{os.getpid()}-{_start_time(os.getpid())}-{os.urandom(6).hex()}"


def _live_users(state: str) -> list[str]:
    users_dir = os.path.join(state, "users")
    alive = []
    for name in os.listdir(users_dir):
        pid_s, _, rest = name.partition("-")
        started = rest.rpartition("-")[0]
        try:
            pid = int(pid_s)
        except ValueError:
            continue
        current = _start_time(pid)
        if current is not None and (started == "?" or current == "?" or current == started):
            alive.append(name)
        else:
            try:
                os.unlink(os.path.join(users_dir, name))
            except FileNotFoundError:
                pass
    return alive


def _ping(sock: str, timeout: float = 1.0) -> bool:
    import redis

    if not os.path.exists(sock):
        return False
    client = redis.Redis(unix_socket_path=sock, socket_timeout=timeout, socket_connect_timeout=timeout)
    try:
        return bool(client.ping())
    except (redis.exceptions.RedisError, OSError):
        return False
    finally:
        client.close()


def _spawn(state: str, sock: str, capacity_bytes: int) -> None:
    binary = os.environ.get("BAGUA_REDIS_SERVER") or shutil.which("redis-server")
    if not binary or not os.access(binary, os.X_OK):
        raise StoreUnavailableError(
            f"RedisStore(hosts=None) starts a local redis-server, but {binary or 'none on PATH'} is not "
            "an executable. Install it "
            "(`apt-get install redis-server`, or `make system-deps`), set BAGUA_REDIS_SERVER to its "
            "path, or pass hosts=[{'host': ..., 'port': ...}] of running servers."
        )
    try:
        os.unlink(sock)  # a stale socket from a server that died
    except FileNotFoundError:
        pass
    log = os.path.join(state, "redis.log")
    args = [
        binary, "--port", "0", "--unixsocket", sock, "--unixsocketperm", "700",
        "--maxmemory", str(capacity_bytes), "--maxmemory-policy", "allkeys-lru",
        "--save", "", "--appendonly", "no", "--dir", state, "--logfile", log,
        "--daemonize", "no", "--protected-mode", "yes",
    ]
    # Its own session: it outlives the process that started it, serving the others.
    proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + _START_TIMEOUT_S
    while time.monotonic() < deadline:
        if _ping(sock, timeout=0.5):
            logger.info("started redis-server (pid %d) on %s, maxmemory %d bytes", proc.pid, sock, capacity_bytes)
            return
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    if proc.poll() is None:
        proc.kill()
    tail = ""
    try:
        with open(log, errors="replace") as f:
            tail = "".join(f.readlines()[-5:]).strip()
    except OSError:
        pass
    raise StoreUnavailableError(
        f"the local redis-server ({binary}) did not become ready on {sock} within "
        f"{_START_TIMEOUT_S:.0f} s (exit code {proc.poll()}). Its log {log} ends with:\n{tail}"
    )


def attach(capacity_bytes: int, cache_dir: Optional[str] = None) -> tuple[str, str]:
    """Make sure the machine's server runs and register a user; return (socket, user)."""
    state = state_dir(cache_dir)
    sock = socket_path(state)
    user = _user_name()
    with _locked(state):
        if not _ping(sock):
            _spawn(state, sock, capacity_bytes)
        open(os.path.join(state, "users", user), "w").close()
    return sock, user


def detach(user: str, cache_dir: Optional[str] = None) -> bool:
    """Unregister ``user``; stop the server if no live user is left. True if stopped."""
    state = state_dir(cache_dir)
    with _locked(state):
        try:
            os.unlink(os.path.join(state, "users", user))
        except FileNotFoundError:
            pass
        if _live_users(state):
            return False
        return _shutdown(socket_path(state))


def _shutdown(sock: str) -> bool:
    import redis

    if not _ping(sock):
        return False
    client = redis.Redis(unix_socket_path=sock, socket_timeout=5)
    try:
        client.shutdown(nosave=True)
    except redis.exceptions.ConnectionError:
        pass  # the server closes the connection as it exits
    except redis.exceptions.RedisError as e:
        logger.warning("could not stop the local redis-server on %s: %s", sock, e)
        return False
    finally:
        client.close()
    deadline = time.monotonic() + 5
    while os.path.exists(sock) and time.monotonic() < deadline:
        time.sleep(0.02)
    return True


def stop_local_server(cache_dir: Optional[str] = None) -> bool:
    """Stop this machine's local cache server now, whoever uses it. True if one was running."""
    state = state_dir(cache_dir)
    with _locked(state):
        for name in os.listdir(os.path.join(state, "users")):
            os.unlink(os.path.join(state, "users", name))
        return _shutdown(socket_path(state))
