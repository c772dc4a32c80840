"""The original ``bagua.torch_api.env``: rank and size helpers that work before ``init_process_group``.

Before the process group exists they read the variables torchrun sets (as the original did:
its examples call ``torch.cuda.set_device(bagua.get_local_rank())`` first); afterwards they
answer from the native process group, which read the same variables.

Example::

    import bagua.torch_api as bagua
    torch.cuda.set_device(bagua.get_local_rank())   # before init, from LOCAL_RANK
    bagua.init_process_group()
"""

from __future__ import annotations

import os
import socket

from .. import comm

__all__ = [
    "get_rank", "get_world_size", "get_local_rank", "get_local_size", "get_node_rank", "get_master_addr",
    "get_default_bucket_size", "find_free_network_port",
]


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {value!r}") from None


def get_world_size() -> int:
    """The number of processes (``WORLD_SIZE`` before init, default 1)."""
    return comm.get_world_size() if comm.is_initialized() else _env_int("WORLD_SIZE", 1)


def get_rank() -> int:
    """This process's global rank (``RANK`` before init, default 0)."""
    return comm.get_rank() if comm.is_initialized() else _env_int("RANK", 0)


def get_local_rank() -> int:
    """This process's rank on its machine (``LOCAL_RANK`` before init, default 0)."""
    return comm.get_local_rank() if comm.is_initialized() else _env_int("LOCAL_RANK", 0)


def get_local_size() -> int:
    """The number of processes on this machine (``LOCAL_WORLD_SIZE`` before init, default 1)."""
    return comm.get_local_size() if comm.is_initialized() else _env_int("LOCAL_WORLD_SIZE", 1)


def get_node_rank() -> int:
    """This machine's rank among the machines: torchrun's ``GROUP_RANK`` (``NODE_RANK`` otherwise)."""
    if "GROUP_RANK" in os.environ:
        return _env_int("GROUP_RANK", 0)
    return _env_int("NODE_RANK", 0)


def get_master_addr() -> str:
    """``MASTER_ADDR`` (default 127.0.0.1)."""
    return os.environ.get("MASTER_ADDR", "127.0.0.1")


def get_default_bucket_size() -> int:
    """``BAGUA_DEFAULT_BUCKET_SIZE`` in bytes (the original's default: 10 MiB)."""
    return _env_int("BAGUA_DEFAULT_BUCKET_SIZE", 10 * 1024**2)


def find_free_network_port() -> int:
    """A TCP port free on this machine now (for ``MASTER_PORT`` in single-machine scripts)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]
