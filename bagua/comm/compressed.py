"""Compressed allreduce: scatter-reduce-gather over encoded chunks.

Each rank splits its tensor into ``world`` chunks and encodes each one; chunk ``j`` goes to
rank ``j`` (an alltoall); rank ``j`` decodes what it got, reduces it in fp32, encodes the
result, and sends it to every rank (an allgather), which decodes them all. Both exchanges are
posted as point-to-point messages of at most 512 KB, sends and receives interleaved, all at
once: with Gloo's alltoall and allgather, a 16 MB fp16 allreduce over a 100 Mbit/s link took
1.42 s, as if the link were half-duplex; posted this way, 0.85 s (benchmarks/RESULTS.md;
``benchmarks/p2p_pieces.py`` times piece sizes). Every byte on the wire is encoded (MinMaxUInt8: ~1 byte per element
instead of 4), and since every rank decodes the same gathered bytes — its own chunk
included — all ranks end with bit-identical results.

NaN or Inf on any rank travels through the encoding as a marker, so every rank raises
the same ``ValueError`` at the end instead of one rank raising and the others hanging.

Example::

    bagua.comm.allreduce(grad, op="avg", compression="minmax_uint8")
"""

from __future__ import annotations

import itertools
import zlib
from typing import Callable, Optional, Union

import torch
import torch.distributed as dist

from . import traffic
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


class _Requests:
    """Point-to-point requests in flight, finished together."""

    def __init__(self, works: list):
        self.works = works

    def wait(self) -> None:
        for work in self.works:
            work.wait()

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self.works)


def _pieces(tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
    per_piece = max(1, _PIECE_BYTES // tensor.element_size())
    return torch.split(tensor, per_piece)


def _exchange(pg: BaguaProcessGroup, outgoing: Callable[[int], torch.Tensor], incoming: Callable[[int], torch.Tensor]) -> _Requests:
    """Post, for every other member ``j`` of ``pg`` (group rank), sends of ``outgoing(j)`` to it
    and receives of ``incoming(j)`` from it, in pieces, all at once."""
    ops = []
    for j, peer in enumerate(pg.ranks):
        if j == pg.rank:
            continue
        sends = [dist.P2POp(dist.isend, piece, peer, group=pg.group) for piece in _pieces(outgoing(j))]
        recvs = [dist.P2POp(dist.irecv, piece, peer, group=pg.group) for piece in _pieces(incoming(j))]
        # interleaved, so both directions of the link carry data from the first piece on
        ops += [op for pair in itertools.zip_longest(sends, recvs) for op in pair if op is not None]
    return _Requests(dist.batch_isend_irecv(ops) if ops else [])


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
) -> Optional[Handle]:
    """Allreduce ``tensor`` in place with every transmitted byte encoded by ``codec``.

    With ``async_op=True`` the alltoall runs in the background; the reduction and the
    allgather run in ``Handle.wait()``.

    Example::

        h = compressed_allreduce(grad, op="avg", codec="fp16", async_op=True)
        h.wait()
    """
    op = as_reduce_op(op)
    codec = get_codec(codec)
    if isinstance(tensor, torch.Tensor) and not tensor.is_floating_point():
        raise TypeError(f"compressed allreduce needs a floating-point tensor, got {tensor.dtype}")
    what, pg = _prepare(
        f"allreduce[{codec.name}]", tensor, group, op=_op_code(op),
        root=zlib.crc32(repr(codec).encode()) & 0x7FFFFFFF, kind="compressed_allreduce",
    )
    w, n = pg.size, tensor.numel()
    if w == 1 or n == 0:
        return _done(what, None, async_op)

    chunk = -(-n // w)
    flat = tensor.reshape(-1)
    if n < w * chunk:  # repeat the last value: padding never widens a chunk's range
        flat = torch.cat([flat, flat[-1:].expand(w * chunk - n)])
    wire_len = codec.wire_numel(chunk)
    send = torch.empty((w, wire_len), dtype=codec.wire_dtype, device=tensor.device)
    for j, part in enumerate(flat.view(w, chunk)):
        send[j].copy_(codec.encode(part, check_finite=False).data)
    received = torch.empty_like(send)
    traffic.record("compressed_allreduce", 2 * (w - 1) * send[0].nbytes)

    def finish() -> None:
        parts = torch.empty((w, chunk), dtype=torch.float32, device=tensor.device)
        reduced = _REDUCERS[op](_decode_rows(codec, received, w, chunk, parts))
        mine = codec.encode(reduced, check_finite=False).data.contiguous()
        gathered = torch.empty((w, wire_len), dtype=codec.wire_dtype, device=tensor.device)
        gathered[pg.rank].copy_(mine)
        with _named_errors(what):
            _exchange(pg, lambda j: mine, lambda j: gathered[j]).wait()
        result = _decode_rows(codec, gathered, w, chunk, parts).view(-1)[:n]
        if not torch.isfinite(result).all():
            raise ValueError(
                f"{what}: the input holds NaN or Inf on at least one rank; the result would be "
                f"garbage. Check for a diverging loss (lower the learning rate, clip gradients, "
                f"or use a loss scaler with fp16)."
            )
        tensor.copy_(result.view_as(tensor))

    received[pg.rank].copy_(send[pg.rank])
    return _run(what, lambda: _exchange(pg, lambda j: send[j], lambda j: received[j]), finish, async_op)


__all__ = ["compressed_allreduce"]
