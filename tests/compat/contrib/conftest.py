"""Infrastructure for the ported contrib tests (the original's test files stay as they were).

Each test gets a private ``BAGUA_CACHE_DIR``, so ``RedisStore(hosts=None)`` starts a local
redis-server of its own there, and leaves nothing behind: every redis-server whose directory lies
in that cache dir is stopped afterwards (the original tests never close their stores), and a
process group or environment variables a test set up in this process (``setup_bagua_env`` of
test_fused_optimizer initializes bagua in the pytest process itself) are undone.

Example::

    def test_redis(self):
        store = RedisStore(hosts=None)      # a server in this test's own cache dir
"""

from __future__ import annotations

import gc
import os
import signal

import pytest

import bagua
from bagua.data.stores import stop_local_server


def _redis_servers_under(directory: str) -> list[int]:
    """pids of the redis-server processes started with a ``--dir`` inside ``directory``."""
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                args = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if args and os.path.basename(args[0]).startswith("redis-server") and any(
                a.startswith(directory) for a in args):
            pids.append(int(name))
    return pids


@pytest.fixture(autouse=True)
def isolated_bagua_state(tmp_path):
    cache_dir = str(tmp_path / "bagua-cache")
    saved_env = dict(os.environ)
    os.environ["BAGUA_CACHE_DIR"] = cache_dir
    was_initialized = bagua.is_initialized()
    yield
    if bagua.is_initialized() and not was_initialized:
        bagua.destroy_process_group()
    os.environ.clear()
    os.environ.update(saved_env)
    gc.collect()  # stores the test dropped detach from the local server now
    if os.path.isdir(cache_dir):
        stop_local_server(cache_dir)
        for pid in _redis_servers_under(cache_dir):
            os.kill(pid, signal.SIGKILL)
