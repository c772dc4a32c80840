"""Point-to-point messages in pieces, every receive posted before the first send.

Gloo sends a message only once the receiver has announced the matching receive, and that
announcement queues behind whatever the receiver is already sending: over a slow, busy link it
arrives late and the sender idles. Gloo's own alltoall and allgather post one message per peer
as they go, and on a 100 Mbit/s link behaved as if it were half-duplex (a 16 MB fp16
exchange: 1.42 s; the same bytes posted here: 0.85 s; ``benchmarks/comm/p2p_pieces.py`` times
the piece sizes). So messages travel in pieces of at most 512 KB, and a caller posts all its
receives first (``post_all(dist.irecv, ...)``), then its sends.

Example::

    landing = Requests(post_all(dist.irecv, lambda j: inbox[j], pg, pg.group, tag=7))
    sending = Requests(post_all(dist.isend, lambda j: outbox[j], pg, pg.group, tag=7))
    landing.wait(); sending.wait()
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from . import stripes

if TYPE_CHECKING:
    from .process_group import BaguaProcessGroup

PIECE_BYTES = 512 * 1024  #: the largest message on the wire
#: the tag of ``exchange`` (alltoall_v on Gloo); the compressed allreduce's tags are small
EXCHANGE_TAG = 1 << 20


class Requests:
    """Point-to-point requests in flight, finished together. ``wait()`` may be called again:
    Gloo's own send work must be waited on once only (a second wait blocks). A failure names
    ``where`` they travel (a stripe), if given."""

    def __init__(self, works: list, where: str = ""):
        self.works = works
        self.where = where
        self.done = False

    def wait(self) -> None:
        if not self.done:
            with stripes.named_stripe(self.where):
                for work in self.works:
                    work.wait()
            self.done = True

    def is_completed(self) -> bool:
        return self.done or all(work.is_completed() for work in self.works)


def pieces(tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``tensor`` (1-D) cut into messages of at most ``PIECE_BYTES``; none when it is empty."""
    if not tensor.numel():
        return ()  # an empty part: both ends know its size, nothing travels
    per_piece = max(1, PIECE_BYTES // tensor.element_size())
    return torch.split(tensor, per_piece)


def post(op: Callable, buffer: torch.Tensor, peer: int, group: Optional[dist.ProcessGroup], tag: int) -> list:
    """``op`` (``dist.isend`` or ``dist.irecv``) ``buffer`` to/from global rank ``peer`` in
    pieces over torch group ``group``, under message ``tag``; returns the works."""
    return [op(piece, peer, group=group, tag=tag) for piece in pieces(buffer)]


def post_all(
    op: Callable, buffer_for: Callable[[int], torch.Tensor], pg: "BaguaProcessGroup",
    group: Optional[dist.ProcessGroup], tag: int,
) -> list:
    """``post`` ``buffer_for(j)`` for every other member ``j`` of ``pg`` (group rank), over ``group``."""
    return [work for j, peer in enumerate(pg.ranks) if j != pg.rank for work in post(op, buffer_for(j), peer, group, tag)]


def exchange(pg: "BaguaProcessGroup", outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]) -> Requests:
    """An alltoall of flat parts: ``inputs[j]`` to group rank ``j``, ``outputs[j]`` from it (this
    rank's own part copied), receives posted first. Empty parts send nothing (a ring's exchange
    with its two neighbours costs nothing towards the other ranks).

    Example::

        exchange(pg, list(out.view(w, -1)), list(inp.view(w, -1))).wait()
    """
    outputs[pg.rank].copy_(inputs[pg.rank])
    works = post_all(dist.irecv, lambda j: outputs[j], pg, pg.group, EXCHANGE_TAG)
    works += post_all(dist.isend, lambda j: inputs[j], pg, pg.group, EXCHANGE_TAG)
    return Requests(works)
