"""Bytes on the wire: what each collective makes this rank send.

Counts are the bytes a rank injects under bandwidth-optimal (ring / pairwise) algorithms,
for a message of ``n`` bytes in a group of ``w`` ranks:

==================  =============================================
allreduce           ``2 (w-1)/w * n``
reduce_scatter      ``(w-1)/w * n``       (n: the whole input)
alltoall            ``(w-1)/w * n``       (alltoall_v: what leaves for other ranks)
allgather           ``(w-1) * n``         (n: this rank's input)
broadcast           ``n`` on the source, 0 elsewhere
reduce / gather     ``n`` off the destination, 0 on it
scatter             ``(w-1)/w * n`` on the source
send                ``n``
==================  =============================================

Example::

    before = bagua.comm.bytes_sent()
    bagua.comm.allreduce(t)
    print(bagua.comm.bytes_sent() - before)       # 2 * (w - 1) / w * t.nbytes
"""

from __future__ import annotations

import threading
from collections import Counter

_lock = threading.Lock()
_sent: Counter = Counter()


def record(kind: str, nbytes: float) -> None:
    """Add ``nbytes`` sent by collective ``kind`` to this process's counters."""
    if nbytes:
        with _lock:
            _sent[kind] += int(round(nbytes))


def bytes_sent(kind: str | None = None) -> int:
    """Bytes this process has sent so far, in all collectives or in one ``kind``."""
    with _lock:
        return _sent[kind] if kind is not None else sum(_sent.values())


def traffic_by_kind() -> dict[str, int]:
    """A copy of the per-collective byte counters."""
    with _lock:
        return dict(_sent)


def reset_traffic() -> None:
    """Set every counter back to zero."""
    with _lock:
        _sent.clear()


def ring_fraction(world_size: int) -> float:
    """``(w-1)/w``: the share of a message that leaves each rank in a ring step."""
    return (world_size - 1) / world_size if world_size > 0 else 0.0
