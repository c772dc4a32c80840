"""One local ``redis-server`` per machine (per cache directory), shared by every process; and
``start_redis_server`` for a server on a TCP port (for ``RedisStore(hosts=...)``).

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
from typing import Iterator, Optional, Sequence

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


def _client(timeout: float, **conn):
    """A client that fails at once: redis-py's default retries (with backoff) would add seconds to
    every probe of a server that is not up yet, and to every SHUTDOWN (the server hangs up)."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    return redis.Redis(socket_timeout=timeout, socket_connect_timeout=timeout, retry=Retry(NoBackoff(), 0), **conn)


def _server_pid(timeout: float = 1.0, **conn) -> Optional[int]:
    """The pid of the redis-server answering at ``conn`` (``unix_socket_path`` or host/port); 0 when
    one answers but wants a password; None when none answers."""
    import redis

    if "unix_socket_path" in conn and not os.path.exists(conn["unix_socket_path"]):
        return None
    client = _client(timeout, **conn)
    try:
        return int(client.info("server")["process_id"])
    except redis.exceptions.AuthenticationError:
        return 0
    except redis.exceptions.ResponseError as e:
        return 0 if "NOAUTH" in str(e) else None
    except (redis.exceptions.RedisError, OSError):
        return None
    finally:
        client.close()


def _ping(sock: str, timeout: float = 1.0) -> bool:
    return _server_pid(timeout, unix_socket_path=sock) is not None


def _binary(what: str) -> str:
    binary = os.environ.get("BAGUA_REDIS_SERVER") or shutil.which("redis-server")
    if not binary or not os.access(binary, os.X_OK):
        raise StoreUnavailableError(
            f"{what} starts a redis-server, but {binary or 'none on PATH'} is not an executable. Install it "
            "(`apt-get install redis-server`, or `make system-deps`), set BAGUA_REDIS_SERVER to its "
            "path, or pass hosts=[{'host': ..., 'port': ...}] of running servers."
        )
    return binary


def _launch(args: list[str], log: str, where: str, **conn) -> int:
    """Start a redis-server in a session of its own (it outlives this process) and wait until it
    answers at ``conn``; return its pid."""
    proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + _START_TIMEOUT_S
    while time.monotonic() < deadline:
        pid = _server_pid(0.5, **conn)
        if pid == proc.pid or (pid == 0 and proc.poll() is None):  # it, not another server already there
            return proc.pid
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
        f"redis-server ({args[0]}) did not become ready on {where} within {_START_TIMEOUT_S:.0f} s "
        f"(exit code {proc.poll()}). Its log {log} ends with:\n{tail}"
    )


def _spawn(state: str, sock: str, capacity_bytes: int) -> None:
    binary = _binary("RedisStore(hosts=None)")
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
    pid = _launch(args, log, sock, unix_socket_path=sock)
    logger.info("started redis-server (pid %d) on %s, maxmemory %d bytes", pid, sock, capacity_bytes)


def start_redis_server(port: int, capacity_bytes: int, extra_args: Sequence[str] = (),
                       cache_dir: Optional[str] = None) -> int:
    """Start a ``redis-server`` on TCP ``port`` and return its pid once it answers.

    Memory-capped at ``capacity_bytes`` with LRU eviction, nothing persisted to disk, in a session
    of its own (it outlives this process; stop it with ``SHUTDOWN NOSAVE``, e.g.
    ``redis.Redis(port=port).shutdown(nosave=True)``). Redis's protection applies: without a
    password it accepts connections from this machine only; ``extra_args`` (redis-server options,
    e.g. ``["--requirepass", secret]``) come last and override the defaults.

    Raises:
        StoreUnavailableError: no redis-server binary, or it did not start (e.g. the port is taken).

    Example::

        pid = start_redis_server(7000, 4 << 30)
        store = RedisStore(hosts=[{"host": "127.0.0.1", "port": 7000}])
    """
    binary = _binary("start_redis_server")
    state = os.path.join(cache_dir or default_cache_dir(), "redis-tcp")
    os.makedirs(state, mode=0o700, exist_ok=True)
    log = os.path.join(state, f"{int(port)}.log")
    args = [
        binary, "--port", str(int(port)), "--maxmemory", str(int(capacity_bytes)),
        "--maxmemory-policy", "allkeys-lru", "--save", "", "--appendonly", "no", "--dir", state,
        "--logfile", log, "--daemonize", "no", *extra_args,
    ]
    pid = _launch(args, log, f"port {port}", host="127.0.0.1", port=int(port))
    logger.info("started redis-server (pid %d) on port %d, maxmemory %d bytes", pid, port, capacity_bytes)
    return pid


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
    client = _client(5, unix_socket_path=sock)
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
