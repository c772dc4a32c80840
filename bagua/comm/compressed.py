"""Compressed allreduce: scatter-reduce-gather over encoded chunks.

Each rank splits its tensor into ``world`` chunks and encodes each one; chunk ``j`` goes to
rank ``j`` (an alltoall); rank ``j`` decodes what it got, reduces it in fp32, encodes the
result, and sends it to every rank (an allgather), which decodes them all. Every byte on the
wire is encoded (MinMaxUInt8: ~1 byte per element instead of 4), and since every rank decodes
the same gathered bytes — its own chunk included — all ranks end with bit-identical results.

Speed on slow links: the tensor is cut into segments of 1M elements, each reduced this way on
its own and pipelined (while one segment's results travel, the next one is decoded, reduced
and encoded); both exchanges are tagged point-to-point messages of at most 512 KB, and every
receive is posted before the first send (see ``_Segment``). With Gloo's own alltoall and allgather a 16 MB fp16
allreduce over a 100 Mbit/s link took 1.42 s, as if the link were half-duplex; posted in
pieces 0.85 s; MinMaxUInt8, pieces and segments: 0.43 s against 1.41 s for fp32
(benchmarks/RESULTS.md; ``benchmarks/p2p_pieces.py`` times piece sizes). On a group with
stripes (``streams=K``) segment ``k`` travels on stripe ``k % s``, ``s`` being the stripe count
of the tensor's size (``stripes.py``); the segments, and so the result, are the same for any K.

NaN or Inf on any rank travels through the encoding as a marker (MinMaxUInt8: a NaN min/max,
which the codec computes anyway), so every rank decodes the same non-finite values. By default
every rank then raises the same ``ValueError`` instead of one rank raising and the others
hanging; ``nonfinite="propagate"`` returns them instead, at no cost (the wrapper's gradient
allreduce does this, so that a loss scaler sees the overflow on every rank and skips the step).

Example::

    bagua.comm.allreduce(grad, op="avg", compression="minmax_uint8")
"""

from __future__ import annotations

import zlib
from typing import Callable, Optional, Union

import torch
import torch.distributed as dist

from . import stripes, traffic
from .collectives import Handle, ReduceOp, _named_errors, _op_code, _prepare, _run, _done, as_reduce_op
from .compression import Codec, Payload, get_codec
from .process_group import BaguaProcessGroup

_REDUCERS = {
    ReduceOp.SUM: lambda x: x.sum(dim=0),
    ReduceOp.AVG: lambda x: x.mean(dim=0),
    ReduceOp.MIN: lambda x: x.amin(dim=0),
    ReduceOp.MAX: lambda x: x.amax(dim=0),
    ReduceOp.PRODUCT: lambda x: x.prod(dim=0),
}
_PIECE_BYTES = 512 * 1024
_SEGMENT_ELEMS = 1 << 20


class _Requests:
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


def _pieces(tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
    per_piece = max(1, _PIECE_BYTES // tensor.element_size())
    return torch.split(tensor, per_piece)


def _post(post: Callable, buffer: torch.Tensor, peer: int, group: Optional[dist.ProcessGroup], tag: int) -> list:
    """``post`` (``dist.isend`` or ``dist.irecv``) ``buffer`` to/from global rank ``peer`` in
    pieces over torch group ``group``, under message ``tag``; returns the works."""
    return [post(piece, peer, group=group, tag=tag) for piece in _pieces(buffer)]


def _post_all(
    post: Callable, buffer_for: Callable[[int], torch.Tensor], pg: BaguaProcessGroup, group: Optional[dist.ProcessGroup], tag: int
) -> list:
    """``_post`` ``buffer_for(j)`` for every other member ``j`` of ``pg`` (group rank), over ``group``."""
    return [work for j, peer in enumerate(pg.ranks) if j != pg.rank for work in _post(post, buffer_for(j), peer, group, tag)]


def _decode_rows(codec: Codec, wire: torch.Tensor, rows: int, chunk: int, out: torch.Tensor) -> torch.Tensor:
    """Decode ``rows`` payloads laid end to end in ``wire`` into the rows of ``out`` [rows, chunk]."""
    for j, data in enumerate(wire.view(rows, -1)):
        codec.decode(Payload(data, torch.Size([chunk]), out.dtype), out=out[j])
    return out


def compressed_allreduce(
    tensor: torch.Tensor,
    op: Union[ReduceOp, str] = ReduceOp.AVG,
    codec: Union[str, Codec] = "minmax_uint8",
    group: Optional[BaguaProcessGroup] = None,
    async_op: bool = False,
    *,
    nonfinite: str = "raise",
) -> Optional[Handle]:
    """Allreduce ``tensor`` in place with every transmitted byte encoded by ``codec``.

    With ``async_op=True`` the first exchange runs in the background; the reduction and the
    second exchange run in ``Handle.wait()``.

    Args:
        nonfinite: when any rank's input holds NaN or Inf: ``"raise"`` a ValueError on every
            rank, or ``"propagate"``: every rank gets the same result, non-finite (NaN, or Inf
            with the cast codecs) wherever a rank had NaN or Inf in the same codec block
            (MinMaxUInt8: the same 1024 elements of a rank's chunk), finite elsewhere. For
            callers that check for overflow themselves, e.g. before a loss scaler's step.

    Example::

        h = compressed_allreduce(grad, op="avg", codec="fp16", async_op=True)
        h.wait()
    """
    op = as_reduce_op(op)
    codec = get_codec(codec)
    check_nonfinite_choice(nonfinite)
    if isinstance(tensor, torch.Tensor) and not tensor.is_floating_point():
        raise TypeError(f"compressed allreduce needs a floating-point tensor, got {tensor.dtype}")
    what, pg = _prepare(
        f"allreduce[{codec.name}]", tensor, group, op=_op_code(op),
        root=zlib.crc32(repr(codec).encode()) & 0x7FFFFFFF, kind="compressed_allreduce",
    )
    w, n = pg.size, tensor.numel()
    if w == 1 or n == 0:
        return _done(what, None, async_op)

    flat = tensor.reshape(-1)
    # Segments are reduced independently and pipelined: while one segment's results travel,
    # the next one's are decoded, reduced and encoded, and the link never idles between phases.
    count = stripes.stripe_count(pg, tensor.nbytes, tensor.device.type)
    groups = stripes.stripe_groups(pg, count)
    segments = [
        _Segment(part, codec, pg, tag=2 * k, group=groups[k % count], where=stripes.stripe_label(k % count, count))
        for k, part in enumerate(torch.split(flat, _SEGMENT_ELEMS))
    ]
    for seg in segments:
        seg.send_chunks()
    traffic.record("compressed_allreduce", sum(2 * (w - 1) * seg.send[0].nbytes for seg in segments))

    def finish() -> None:
        with _named_errors(what):
            for seg in segments:
                seg.reduce_and_share(_REDUCERS[op])
            result = torch.cat([seg.result() for seg in segments])
        if nonfinite == "raise":
            raise_if_nonfinite(what, result)
        tensor.copy_(result.view_as(tensor))

    return _run(what, lambda: _Requests([seg.phase1 for seg in segments]), finish, async_op)


def check_nonfinite_choice(nonfinite: object) -> None:
    """Raise a ValueError unless ``nonfinite`` is ``"raise"`` or ``"propagate"``."""
    if nonfinite not in ("raise", "propagate"):
        raise ValueError(f"nonfinite must be 'raise' or 'propagate', got {nonfinite!r}")


def raise_if_nonfinite(what: str, result: torch.Tensor) -> None:
    """The error of a compressed allreduce (``what``) whose ``result`` holds NaN or Inf."""
    if not torch.isfinite(result).all():
        raise ValueError(
            f"{what}: the input holds NaN or Inf on at least one rank; the result would be "
            f"garbage. Check for a diverging loss (lower the learning rate, clip gradients, "
            f"or use a loss scaler with fp16)."
        )


class _Segment:
    """One stretch of the tensor, scatter-reduce-gathered on its own.

    Gloo sends a message only once the receiver has announced the matching receive, and that
    announcement queues behind whatever the receiver is already sending: over a slow, busy
    link it arrives late and the sender idles. So every receive of both phases is posted first
    (``__init__``); then ``send_chunks`` encodes the chunks and sends each to its rank (phase 1),
    ``reduce_and_share`` reduces this rank's chunk and sends the result to every rank
    (phase 2), and ``result`` decodes all of them. Its messages travel over torch group
    ``group`` (one of ``pg``'s stripes), which ``where`` names in errors."""

    def __init__(
        self, part: torch.Tensor, codec: Codec, pg: BaguaProcessGroup, tag: int, group: Optional[dist.ProcessGroup], where: str
    ):
        w, n = pg.size, part.numel()
        self.codec, self.pg, self.n, self.tag, self.group = codec, pg, n, tag, group
        self.chunk = -(-n // w)
        if n < w * self.chunk:  # repeat the last value: padding never widens a chunk's range
            part = torch.cat([part, part[-1:].expand(w * self.chunk - n)])
        self.rows = part.view(w, self.chunk)
        wire_len = codec.wire_numel(self.chunk)
        self.send = torch.empty((w, wire_len), dtype=codec.wire_dtype, device=part.device)
        self.received = torch.empty_like(self.send)
        self.gathered = torch.empty_like(self.send)
        self.phase1 = _Requests(_post_all(dist.irecv, lambda j: self.received[j], pg, group, tag), where)
        self.phase2 = _Requests(_post_all(dist.irecv, lambda j: self.gathered[j], pg, group, tag + 1), where)

    def send_chunks(self) -> None:
        rank = self.pg.rank
        for j in [j for j in range(self.pg.size) if j != rank] + [rank]:  # what leaves first is encoded first
            self.send[j].copy_(self.codec.encode(self.rows[j], check_finite=False).data)
            if j != rank:
                self.phase1.works += _post(dist.isend, self.send[j], self.pg.ranks[j], self.group, self.tag)
        self.received[rank].copy_(self.send[rank])

    def reduce_and_share(self, reduce: Callable[[torch.Tensor], torch.Tensor]) -> None:
        w = self.pg.size
        self.phase1.wait()
        self.parts = torch.empty((w, self.chunk), dtype=torch.float32, device=self.send.device)
        reduced = reduce(_decode_rows(self.codec, self.received, w, self.chunk, self.parts))
        mine = self.codec.encode(reduced, check_finite=False).data.contiguous()
        self.gathered[self.pg.rank].copy_(mine)
        self.phase2.works += _post_all(dist.isend, lambda _: mine, self.pg, self.group, self.tag + 1)

    def result(self) -> torch.Tensor:
        self.phase2.wait()
        return _decode_rows(self.codec, self.gathered, self.pg.size, self.chunk, self.parts).view(-1)[: self.n]


__all__ = ["compressed_allreduce"]
