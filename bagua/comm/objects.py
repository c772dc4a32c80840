"""Collectives of Python objects (anything ``torch.save`` can write), over the tensor collectives.

Example::

    state = bagua.comm.broadcast_object(opt.state_dict() if rank == 0 else None, src=0)
    everyone = bagua.comm.allgather_object(torch.get_rng_state())
"""

from __future__ import annotations

import io
from typing import Any, Optional

import torch
import torch.distributed as dist

from . import checks
from .collectives import _group, allgather, broadcast
from .process_group import BaguaProcessGroup


def broadcast_object(obj: Any, src: int = 0, group: Optional[BaguaProcessGroup] = None) -> Any:
    """``src``'s ``obj`` on every rank (anything ``torch.save`` can write: tensors come back on
    the CPU). Every rank calls it; ``obj`` is read on ``src`` only.

    Example::

        state = bagua.comm.broadcast_object(opt.state_dict() if rank == 0 else None, src=0)
    """
    pg = _group(group)
    checks.check_root("bagua.comm.broadcast_object", src, pg, "src")
    if pg.size == 1:
        return obj
    if dist.get_rank() == src:
        payload = _serialized(obj)
        size = torch.tensor([payload.numel()], dtype=torch.int64)
    else:
        size = torch.zeros(1, dtype=torch.int64)
    broadcast(size, src=src, group=pg)
    if dist.get_rank() != src:
        payload = torch.empty(int(size), dtype=torch.uint8)
    broadcast(payload, src=src, group=pg)
    return obj if dist.get_rank() == src else _deserialized(payload)


def allgather_object(obj: Any, group: Optional[BaguaProcessGroup] = None) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank (anything ``torch.save`` can write;
    tensors come back on the CPU). Every rank calls it.

    Example::

        states = bagua.comm.allgather_object(torch.get_rng_state())   # one per rank
    """
    pg = _group(group)
    if pg.size == 1:
        return [obj]
    payload = _serialized(obj)
    sizes = allgather(torch.tensor([payload.numel()], dtype=torch.int64), group=pg)
    padded = torch.zeros(int(sizes.max()), dtype=torch.uint8)
    padded[: payload.numel()] = payload
    gathered = allgather(padded, group=pg).view(pg.size, -1)
    return [_deserialized(row[: int(n)]) for row, n in zip(gathered, sizes)]


def _serialized(obj: Any) -> torch.Tensor:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def _deserialized(payload: torch.Tensor) -> Any:
    return torch.load(io.BytesIO(payload.numpy().tobytes()), map_location="cpu", weights_only=False)
