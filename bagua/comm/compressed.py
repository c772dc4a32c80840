"""Compressed allreduce: scatter-reduce-gather over encoded chunks.

Each rank splits its tensor into ``world`` chunks and encodes each one; chunk ``j`` goes to
rank ``j`` (an alltoall); rank ``j`` decodes what it got, reduces it in fp32, encodes the
result, and sends it to every rank (an allgather), which decodes them all. Every byte on the
wire is encoded (MinMaxUInt8: ~1 byte per element instead of 4), and since every rank decodes
the same gathered bytes — its own chunk included — all ranks end with bit-identical results.

Where the codec's blocks lie does not depend on how the work is cut: blocks run from the start
of each member (``starts``: a bucket's tensors) and chunks and segments are cut on block
boundaries (``BlockLayout``). A block's result is then a function of that block on every rank
alone, so the bucket size, the segment size and the stripe count never change a result
(which is what lets ``DistributedDataParallel.rebucket`` and the autotuner change them mid-run).

Speed on slow links: the tensor is cut into segments of about 1M elements, each reduced this way on
its own and pipelined (while one segment's results travel, the next one is decoded, reduced
and encoded); both exchanges are tagged point-to-point messages of ``p2p``'s pieces, every
receive posted before the first send (see ``_Segment``): a 16 MB allreduce over a 100 Mbit/s
link, MinMaxUInt8, 0.43 s against 1.41 s for fp32 (benchmarks/RESULTS.md). On a group with
stripes (``streams=K``) segment ``k`` travels on stripe ``k % s``, ``s`` being the stripe count
of the tensor's size (``stripes.py``); the segments, and so the result, are the same for any K.

NaN or Inf on any rank travels through the encoding as a marker (MinMaxUInt8: a NaN min/max,
which the codec computes anyway), so every rank decodes the same non-finite values. By default
every rank then raises the same ``ValueError`` instead of one rank raising and the others
hanging; ``nonfinite="propagate"`` returns them instead, at no cost (the wrapper's gradient
allreduce does this, so that a loss scaler sees the overflow on every rank and skips the step).

With ``error_feedback`` (an :class:`~bagua.comm.error_feedback.ErrorFeedback` its caller keeps
per buffer) every rank adds its residual before encoding and keeps what the encoding left out, and
each chunk's reducer does the same before re-encoding its result: 1-bit Adam's two-stage
compressed allreduce, which lets the ``sign1`` codec (1 bit per value) train.

Example::

    bagua.comm.allreduce(grad, op="avg", compression="minmax_uint8")
    compressed_allreduce(grad, op="avg", codec="sign1", error_feedback=state)   # state = ErrorFeedback()
"""

from __future__ import annotations

import bisect
import zlib
from typing import Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist

from . import stripes, traffic
from .p2p import Requests, post, post_all
from .collectives import Handle, ReduceOp, _done, _named_errors, _op_code, _prepare, _run, as_reduce_op
from .compression import Codec, Payload, get_codec
from .error_feedback import ErrorFeedback
from .process_group import BaguaProcessGroup
from .host_staging import through_host

_REDUCERS = {
    ReduceOp.SUM: lambda x: x.sum(dim=0),
    ReduceOp.AVG: lambda x: x.mean(dim=0),
    ReduceOp.MIN: lambda x: x.amin(dim=0),
    ReduceOp.MAX: lambda x: x.amax(dim=0),
    ReduceOp.PRODUCT: lambda x: x.prod(dim=0),
}
SEGMENT_ELEMS = 1 << 20  #: default elements per pipelined segment


class _Arrivals:
    """A compressed allreduce's work in flight: its segments' chunks on their way to their
    reducers. ``wait()`` blocks on nothing: ``finish`` waits for each segment's chunks as it
    reduces them, so a segment's reduced chunk leaves while later segments' chunks still arrive
    (waiting for all of them first left the link idle for a reduction per bucket)."""

    def __init__(self, segments: list["_Segment"]):
        self.segments = segments

    def wait(self) -> None:
        return None

    def is_completed(self) -> bool:
        return all(seg.phase1.is_completed() for seg in self.segments)


@through_host(write_back=True)
def compressed_allreduce(
    tensor: torch.Tensor,
    op: Union[ReduceOp, str] = ReduceOp.AVG,
    codec: Union[str, Codec] = "minmax_uint8",
    group: Optional[BaguaProcessGroup] = None,
    async_op: bool = False,
    *,
    nonfinite: str = "raise",
    starts: Sequence[int] = (),
    segment_elems: int = SEGMENT_ELEMS,
    error_feedback: Optional[ErrorFeedback] = None,
) -> Optional[Handle]:
    """Allreduce ``tensor`` in place with every transmitted byte encoded by ``codec``.

    With ``async_op=True`` the first exchange runs in the background; the reduction and the
    second exchange run in ``Handle.wait()``.

    Args:
        nonfinite: when any rank's input holds NaN or Inf: ``"raise"`` a ValueError on every
            rank, or ``"propagate"``: every rank gets the same result, non-finite (NaN, or Inf
            with the cast codecs) wherever a rank had NaN or Inf in the same codec block
            (MinMaxUInt8: the same 1024 elements of a member), finite elsewhere. For
            callers that check for overflow themselves, e.g. before a loss scaler's step.
        starts: element offsets in the flattened tensor where a member begins (the tensors of
            a bucket): codec blocks restart at each member and never straddle two, so each
            member's result depends on that member alone, never on what else shares the call.
        segment_elems: elements per pipelined segment (rounded up to whole codec blocks); the
            result does not depend on it.
        error_feedback: this buffer's :class:`~bagua.comm.error_feedback.ErrorFeedback` (SUM or
            AVG only): the residuals of the last calls are added before encoding and the new ones
            kept (on the workers and on each chunk's reducer); a non-finite result resets them on
            every rank. Every rank passes its own, for the same buffer at every call.

    Example::

        h = compressed_allreduce(grad, op="avg", codec="fp16", async_op=True)
        h.wait()
        compressed_allreduce(grad, op="avg", codec="sign1", error_feedback=state)   # 1 bit per value
    """
    op = as_reduce_op(op)
    codec = get_codec(codec)
    check_nonfinite_choice(nonfinite)
    if error_feedback is not None and (not isinstance(error_feedback, ErrorFeedback) or op not in (ReduceOp.SUM, ReduceOp.AVG)):
        raise ValueError(
            f"error_feedback needs a bagua.comm.ErrorFeedback and op SUM or AVG (its residuals add up), "
            f"got {type(error_feedback).__name__} with op {op.name}"
        )
    if isinstance(tensor, torch.Tensor) and not tensor.is_floating_point():
        raise TypeError(f"compressed allreduce needs a floating-point tensor, got {tensor.dtype}")
    if isinstance(segment_elems, bool) or not isinstance(segment_elems, int) or segment_elems < 1:
        raise ValueError(f"segment_elems must be a positive integer, got {segment_elems!r}")
    n = tensor.numel() if isinstance(tensor, torch.Tensor) else 0
    layout = BlockLayout(n, starts, codec.block_size)
    what, pg = _prepare(
        f"allreduce[{codec.name}]", tensor, group, op=_op_code(op),
        root=zlib.crc32(repr((codec, layout.starts)).encode()) & 0x7FFFFFFF, kind="compressed_allreduce",
    )
    w = pg.size
    if w == 1 or n == 0:
        return _done(what, None, async_op)

    flat = tensor.reshape(-1)
    cuts = [(a, b, layout.chunks(a, b, w)) for a, b in layout.segments(segment_elems)]
    residuals = None
    if error_feedback is not None:
        with _named_errors(what):
            residuals = error_feedback.prepare(
                n, flat.device, (tuple(pg.ranks), codec.block_size, tuple(layout.starts), tuple((a, b) for a, b, _ in cuts)),
                [piece for _, _, chunks in cuts for piece in chunks[pg.rank]], pg,
            )  # fmt: skip
    # Segments are reduced independently and pipelined: while one segment's results travel,
    # the next one's are decoded, reduced and encoded, and the link never idles between phases.
    count = stripes.stripe_count(pg, tensor.nbytes, tensor.device.type)
    groups = stripes.stripe_groups(pg, count)
    with _named_errors(what):  # posting fails at once when a peer is already gone
        segments = [
            _Segment(flat, chunks, codec, pg, tag=2 * k, group=groups[k % count],
                     where=stripes.stripe_label(k % count, count), residuals=residuals)
            for k, (_, _, chunks) in enumerate(cuts)
        ]
        for seg in segments:
            seg.send_chunks()
    traffic.record("compressed_allreduce", sum(seg.wire_bytes_sent() for seg in segments))

    # every chunk is encoded by now: a float32 tensor may take the results as they are decoded,
    # unless an error must leave it as it was
    in_place = nonfinite == "propagate" and tensor.dtype == torch.float32 and tensor.is_contiguous()

    def finish() -> None:
        with _named_errors(what):
            result = flat if in_place else torch.empty(n, dtype=torch.float32, device=tensor.device)
            for seg in segments:
                seg.reduce_and_share(_REDUCERS[op])
            for seg in segments:
                seg.result_into(result)
        if error_feedback is not None and not all_finite(result):
            error_feedback.reset()  # the same result on every rank: every rank resets
        if nonfinite == "raise":
            raise_if_nonfinite(what, result)
        if not in_place:
            tensor.copy_(result.view_as(tensor))

    return _run(what, lambda: _Arrivals(segments), finish, async_op)


class BlockLayout:
    """Where a codec's blocks lie in a flat tensor of ``n`` elements whose members begin at
    ``starts``: from each member's start, every ``block`` elements, the member's last block
    possibly shorter. Segments and chunks are cut on block boundaries only, so a block is
    always encoded whole, and every rank cuts alike.

    Example::

        BlockLayout(10, [0, 3], block=4).chunks(0, 10, 2)   # [[(0, 3)], [(3, 7), (7, 10)]]
    """

    def __init__(self, n: int, starts: Sequence[int], block: int):
        bad = [s for s in starts if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < max(n, 1)]
        if bad:
            raise ValueError(f"starts must be element offsets in [0, {n}), got {bad[:3]}")
        self.n, self.block = n, block
        self.starts = sorted({0, *starts})
        self._ends = self.starts[1:] + [n]

    def snap(self, p: int) -> int:
        """The first block boundary at or after element ``p``."""
        if p >= self.n:
            return self.n
        i = bisect.bisect_right(self.starts, p) - 1
        start = self.starts[i]
        return min(start + -(-(p - start) // self.block) * self.block, self._ends[i])

    def segments(self, size: int) -> list[tuple[int, int]]:
        """Consecutive ``(begin, end)`` stretches of about ``size`` elements, on block boundaries."""
        bounds = [0]
        while bounds[-1] < self.n:
            bounds.append(self.snap(bounds[-1] + size))
        return list(zip(bounds, bounds[1:]))

    def chunks(self, a: int, b: int, parts: int) -> list[list[tuple[int, int]]]:
        """``[a, b)`` cut on block boundaries into ``parts`` chunks of about equal size (some may
        be empty), each chunk as its pieces: ``(begin, end)`` stretches within one member."""
        cuts = [a]
        for j in range(1, parts):
            cuts.append(max(cuts[-1], min(b, self.snap(a + (b - a) * j // parts))))
        cuts.append(b)
        return [self.pieces(lo, hi) for lo, hi in zip(cuts, cuts[1:])]

    def pieces(self, a: int, b: int) -> list[tuple[int, int]]:
        """``[a, b)`` as stretches that each lie within one member."""
        out = []
        i = bisect.bisect_right(self.starts, a) - 1
        while a < b:
            end = min(b, self._ends[i])
            out.append((a, end))
            a, i = end, i + 1
        return out


def check_nonfinite_choice(nonfinite: object) -> None:
    """Raise a ValueError unless ``nonfinite`` is ``"raise"`` or ``"propagate"``."""
    if nonfinite not in ("raise", "propagate"):
        raise ValueError(f"nonfinite must be 'raise' or 'propagate', got {nonfinite!r}")


def all_finite(t: torch.Tensor) -> bool:
    """Whether ``t`` holds no NaN and no Inf: its sum is finite (one cheap pass: torch's
    ``isfinite`` is ~15x slower on CPU), or, when the sum overflowed, every element is."""
    return bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())


def raise_if_nonfinite(what: str, result: torch.Tensor) -> None:
    """The error of a compressed allreduce (``what``) whose ``result`` holds NaN or Inf."""
    if not all_finite(result):
        raise ValueError(
            f"{what}: the input holds NaN or Inf on at least one rank; the result would be "
            f"garbage. Check for a diverging loss (lower the learning rate, clip gradients, "
            f"or use a loss scaler with fp16)."
        )


class _Chunk:
    """One rank's share of a segment, as the codec sees it: a stream of whole blocks. Each piece
    (a stretch within one member) gives its whole blocks, in order (the bodies); then each piece's
    short last block (its tail) follows, padded to a whole block by repeating its last value,
    which changes no block's min or max; a codec whose header would change (sign1's mean |x|) is
    told the tails' real lengths. So a chunk is one encode and one decode however many tensors it
    holds, and each block is the block it would be if its tensor were sent alone.

    The padding does not travel: a payload is the codec's header and then the codes in element
    order (as all of ``compression``'s codecs lay it out, ``code_numel(n)`` wire elements for n
    elements: n, or n / 8 for sign bits), and the padding's codes are dropped before sending and
    rebuilt on arrival as copies of the tail's last code (so they decode to its last value, and a
    reduced tail stays within its block's range)."""

    def __init__(self, pieces: list[tuple[int, int]], codec: Codec, device: torch.device):
        block, units = codec.block_size, codec.code_numel
        self.numel = sum(e - a for a, e in pieces)
        self.bodies: list[tuple[int, int]] = []
        tails = []
        for a, e in pieces:
            cut = a + (e - a) // block * block
            if cut > a:
                self.bodies.append((a, cut))
            if e > cut:
                tails.append((cut, e))
        self.body_numel = sum(b - a for a, b in self.bodies)
        self.tails = len(tails)
        self.stream_numel = self.body_numel + self.tails * block
        self.full_wire_numel = codec.wire_numel(self.stream_numel) if self.stream_numel else 0
        header = self.full_wire_numel - units(self.stream_numel)
        self.codes_start = header + units(self.body_numel)  # where the tails' codes begin
        # what travels: the header, the bodies' codes and the codes of the tails' real elements
        self.wire_numel = self.codes_start + sum(units(e - a) for a, e in tails)
        if tails:
            starts = torch.tensor([a for a, _ in tails])[:, None]
            lengths = torch.tensor([e - a for a, e in tails])
            self.tail_lengths = lengths
            k = torch.arange(block)[None, :]
            valid = k < lengths[:, None]
            last = torch.minimum(k, lengths[:, None] - 1)  # a padded row repeats its last real element
            self.tail_source = (starts + last).reshape(-1).to(device)
            self.tail_valid = valid.reshape(-1).nonzero().squeeze(1).to(device)  # the rows' real elements
            self.tail_dest = (starts + k)[valid].to(device)  # where those go in the flat tensor
            # the same on the codes: a row of units(block) codes, of which units(length) travel
            codes = torch.tensor([units(int(n)) for n in lengths])[:, None]
            u = torch.arange(units(block))[None, :]
            self.tail_codes_valid = (u < codes).reshape(-1).nonzero().squeeze(1).to(device)
            offsets = torch.cumsum(codes, 0) - codes  # each tail's first code among the sent ones
            self.tail_code_source = (offsets + torch.minimum(u, codes - 1)).reshape(-1).to(device)

    def whole_slice(self) -> Optional[tuple[int, int]]:
        """The chunk's stretch when its stream is that stretch as it is (one body, no tail)."""
        return self.bodies[0] if len(self.bodies) == 1 and not self.tails else None

    def gather(self, flat: torch.Tensor) -> torch.Tensor:
        """The chunk's stream, read from the flat tensor."""
        whole = self.whole_slice()
        if whole is not None:
            return flat[whole[0]:whole[1]]
        parts = [flat[a:b] for a, b in self.bodies]
        if self.tails:
            parts.append(flat.take(self.tail_source))
        return torch.cat(parts)

    def scatter(self, stream: torch.Tensor, out: torch.Tensor) -> None:
        """Write a stream's real elements to their places in the flat tensor ``out``."""
        offset = 0
        for a, b in self.bodies:
            out[a:b].copy_(stream[offset:offset + b - a])
            offset += b - a
        if self.tails:
            out.index_copy_(0, self.tail_dest, stream[self.body_numel:].index_select(0, self.tail_valid))

    def encode(self, codec: Codec, stream: torch.Tensor, out: torch.Tensor) -> None:
        """Encode the stream into ``out`` (``wire_numel`` elements: no padding)."""
        full = codec.encode(stream, check_finite=False, tail_lengths=self.tail_lengths if self.tails else None).data
        if not self.tails:
            out.copy_(full)
            return
        out[:self.codes_start].copy_(full[:self.codes_start])
        out[self.codes_start:].copy_(full[self.codes_start:].index_select(0, self.tail_codes_valid))

    def decode(self, codec: Codec, wire: torch.Tensor, out: torch.Tensor) -> None:
        """Decode what ``encode`` sent into the stream ``out``."""
        if self.tails:
            full = wire.new_empty(self.full_wire_numel)
            full[:self.codes_start].copy_(wire[:self.codes_start])
            full[self.codes_start:].copy_(wire[self.codes_start:].take(self.tail_code_source))
            wire = full
        codec.decode(Payload(wire, torch.Size([self.stream_numel]), out.dtype), out=out)

    def encode_with_feedback(self, codec: Codec, stream: torch.Tensor, residual: torch.Tensor, out: torch.Tensor) -> None:
        """Encode ``stream`` plus its residual (read from the flat ``residual``) into ``out``, and
        keep what the encoding left out as the new residual (in place where the chunk is one
        stretch)."""
        whole = self.whole_slice()
        compensated = residual[whole[0]:whole[1]] if whole is not None else self.gather(residual)
        compensated.add_(stream)
        self.encode(codec, compensated, out)
        sent = torch.empty_like(compensated)
        self.decode(codec, out, sent)
        compensated.sub_(sent)
        if whole is None:
            self.scatter(compensated, residual)


class _Segment:
    """One stretch of the tensor, scatter-reduce-gathered on its own.

    Gloo sends a message only once the receiver has announced the matching receive, and that
    announcement queues behind whatever the receiver is already sending: over a slow, busy
    link it arrives late and the sender idles. So every receive of both phases is posted first
    (``__init__``); then ``send_chunks`` encodes the chunks and sends each to its rank (phase 1),
    ``reduce_and_share`` reduces this rank's chunk and sends the result to every rank
    (phase 2), and ``result_into`` decodes all of them. Its messages travel over torch group
    ``group`` (one of ``pg``'s stripes), which ``where`` names in errors."""

    def __init__(
        self, flat: torch.Tensor, chunks: list[list[tuple[int, int]]], codec: Codec, pg: BaguaProcessGroup,
        tag: int, group: Optional[dist.ProcessGroup], where: str,
        residuals: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
    ):
        self.flat, self.codec, self.pg, self.tag, self.group = flat, codec, pg, tag, group
        self.residuals = residuals  # error feedback: (worker, server), flat like the tensor
        self.chunks = [_Chunk(pieces, codec, flat.device) for pieces in chunks]
        mine = self.chunks[pg.rank]

        def wire(numel: int) -> torch.Tensor:
            return torch.empty(numel, dtype=codec.wire_dtype, device=flat.device)

        self.send = [wire(chunk.wire_numel) for chunk in self.chunks]        # my encoding of chunk j, for rank j
        self.received = wire(pg.size * mine.wire_numel).view(pg.size, mine.wire_numel)    # every rank's encoding of my chunk
        self.gathered = [wire(chunk.wire_numel) for chunk in self.chunks]    # chunk j reduced, from rank j
        self.phase1 = Requests(post_all(dist.irecv, lambda j: self.received[j], pg, group, tag), where)
        self.phase2 = Requests(post_all(dist.irecv, lambda j: self.gathered[j], pg, group, tag + 1), where)

    def wire_bytes_sent(self) -> int:
        """What this rank sends for this segment, both phases."""
        rank, item = self.pg.rank, self.send[0].element_size()
        others = sum(c.wire_numel for j, c in enumerate(self.chunks) if j != rank)
        return item * (others + (self.pg.size - 1) * self.chunks[rank].wire_numel)

    def send_chunks(self) -> None:
        rank = self.pg.rank
        for j in [j for j in range(self.pg.size) if j != rank] + [rank]:  # what leaves first is encoded first
            chunk = self.chunks[j]
            if chunk.stream_numel:
                self._encode(chunk, chunk.gather(self.flat), self.send[j], worker=True)
            if j != rank:
                self.phase1.works += post(dist.isend, self.send[j], self.pg.ranks[j], self.group, self.tag)
        self.received[rank].copy_(self.send[rank])

    def reduce_and_share(self, reduce: Callable[[torch.Tensor], torch.Tensor]) -> None:
        w, chunk = self.pg.size, self.chunks[self.pg.rank]
        self.phase1.wait()
        if not chunk.numel:
            return
        parts = torch.empty((w, chunk.stream_numel), dtype=torch.float32, device=self.flat.device)
        for j in range(w):
            chunk.decode(self.codec, self.received[j], parts[j])
        mine = self.gathered[self.pg.rank]
        self._encode(chunk, reduce(parts), mine, worker=False)
        self.phase2.works += post_all(dist.isend, lambda _: mine, self.pg, self.group, self.tag + 1)

    def _encode(self, chunk: _Chunk, stream: torch.Tensor, out: torch.Tensor, worker: bool) -> None:
        """Encode a stream this rank sends: a chunk of its input (``worker``) or the chunk it
        reduced; with error feedback, compensated by (and updating) that side's residual."""
        if self.residuals is None:
            chunk.encode(self.codec, stream, out)
        else:
            chunk.encode_with_feedback(self.codec, stream, self.residuals[0 if worker else 1], out)

    def result_into(self, result: torch.Tensor) -> None:
        """Decode every rank's reduced chunk into ``result`` (the whole flat tensor)."""
        self.phase2.wait()
        for chunk, wire in zip(self.chunks, self.gathered):
            if not chunk.numel:
                continue
            whole = chunk.whole_slice()
            if whole is not None:
                chunk.decode(self.codec, wire, result[whole[0]:whole[1]])
            else:
                stream = torch.empty(chunk.stream_numel, dtype=torch.float32, device=result.device)
                chunk.decode(self.codec, wire, stream)
                chunk.scatter(stream, result)


__all__ = ["BlockLayout", "ErrorFeedback", "SEGMENT_ELEMS", "compressed_allreduce"]
