"""Striped collectives: one large message spread over several connections (``streams=K``).

Clouds cap a single TCP flow far below the NIC's rate (AWS: 5 Gbit/s outside a placement
group). With ``bagua.init_process_group(streams=K)`` (or ``BAGUA_NET_NSTREAMS=K``) every
Bagua group whose ranks span several machines holds K-1 extra torch groups over the same ranks,
its *stripes* (stripe 0 is the group itself), created at the same point on every rank. A group
within one machine gets none: its traffic never leaves the host, no flow is capped there, and
concurrent pieces only contend for the cores (on loopback, 2 MB in two 1 MB pieces took 1.74x
as long as one message on this project's 2-core machine). Each torch group has connections of
its own, so a message cut into pieces, piece ``i`` issued async on stripe ``i``, travels over
K flows at once; one handle waits for all. A collective on ``n`` bytes uses
``min(K, n // min_chunk)`` stripes, at least one (``BAGUA_NET_MIN_CHUNKSIZE``, default
1 MiB): small messages stay one operation, every piece is at least ``min_chunk``.

Explicit groups, never Gloo's implicit contexts (several ``GLOO_SOCKET_IFNAME`` devices, picked
by ``tag % K``): the agreement check's tiny allgather takes a tag between data ops and shifts
which connection each piece lands on. Here the check runs once per public call, on stripe 0.

How each collective is cut (the result's layout is the unstriped one):

- allreduce, broadcast, reduce, send/recv: contiguous chunks of the flat tensor, chunk ``i``
  on stripe ``i``. The ops are elementwise, so this is exact; on 2 ranks bitwise the same.
- allgather, gather: every rank cuts its input into the same chunks; stripe ``i`` gathers
  chunk ``i`` of every rank straight into its place in the output (a list of views).
- scatter, reduce_scatter: each rank's part of the input is cut alike; stripe ``i`` moves
  chunk ``i`` of every part into chunk ``i`` of the output.
- alltoall, alltoall_v: each sender-to-receiver part is cut into pieces; stripe ``i``
  carries piece ``i`` of every part. Gloo's list ``all_to_all`` refuses unequal sizes (and
  took 2x longer than ``all_to_all_single`` for 64 MB here), so each stripe's pieces are
  packed into one buffer, moved with ``all_to_all_single`` and copied into place. The stripe
  count of an alltoall_v comes from the largest input of any rank, which every rank learns
  from the agreement table (gathered once per call, also when checks are off).
- compressed allreduce: segment ``k`` on stripe ``k % s`` (``compressed.py``); the segments,
  and so the result, do not depend on K.
- barrier: stripe 0.

Only tensors that Gloo moves are striped. CUDA tensors under NCCL use one communicator (several
NCCL communicators used at once need careful ordering or deadlock, NCCL's docs warn); NCCL
spreads a connection over several sockets itself through ``NCCL_SOCKET_NTHREADS`` and
``NCCL_NSOCKS_PERTHREAD``, which ``nccl_socket_env`` sets. That matters only where NCCL runs
over sockets (no InfiniBand/RoCE).

Example::

    bagua.init_process_group(streams=4)          # or BAGUA_NET_NSTREAMS=4 in the environment
    bagua.comm.allreduce(torch.ones(16 << 20))   # 64 MB: four 16 MB pieces over four groups
"""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING, Any, Callable, Iterator, MutableMapping, Optional, Sequence

import torch
import torch.distributed as dist

if TYPE_CHECKING:  # process_group imports this module
    from .process_group import BaguaProcessGroup

STREAMS_ENV = "BAGUA_NET_NSTREAMS"
MIN_CHUNK_ENV = "BAGUA_NET_MIN_CHUNKSIZE"
MAX_STREAMS = 64  # NCCL's cap on sockets per connection; each Gloo stripe also costs a thread per peer
DEFAULT_MIN_CHUNK_BYTES = 1 << 20
NCCL_THREADS_ENV = "NCCL_SOCKET_NTHREADS"
NCCL_SOCKETS_ENV = "NCCL_NSOCKS_PERTHREAD"


def _positive_int(name: str, value: object, upper: Optional[int] = None) -> int:
    """``value`` (an int, or an integer string from the environment) as an int in [1, upper]."""
    if isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            raise ValueError(f"{name} must be a positive integer, got {value!r}") from None
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be a positive integer, got {value!r}")
    if value < 1 or (upper is not None and value > upper):
        limit = f"in [1, {upper}]" if upper is not None else "at least 1"
        raise ValueError(f"{name} must be {limit}, got {value}")
    return value


def streams_setting(streams: Optional[int]) -> int:
    """K: the ``streams`` argument, else ``BAGUA_NET_NSTREAMS``, else 1.

    Example::

        streams_setting(None)   # 1 unless BAGUA_NET_NSTREAMS is set
    """
    if streams is not None:
        return _positive_int("bagua.init_process_group: streams", streams, MAX_STREAMS)
    return _positive_int(f"environment variable {STREAMS_ENV}", os.environ.get(STREAMS_ENV, "1"), MAX_STREAMS)


def min_chunk_setting() -> int:
    """The smallest piece in bytes: ``BAGUA_NET_MIN_CHUNKSIZE``, else 1 MiB.

    Example::

        min_chunk_setting()     # 1048576
    """
    value = os.environ.get(MIN_CHUNK_ENV, str(DEFAULT_MIN_CHUNK_BYTES))
    return _positive_int(f"environment variable {MIN_CHUNK_ENV}", value)


def nccl_socket_env(streams: int, environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Give NCCL ``streams`` sockets per connection, unless the user set either variable.

    ``min(K, 4)`` threads with ``ceil(K / threads)`` sockets each (NCCL allows 16 threads and 64
    sockets per connection). Call it before the first NCCL communicator exists; NCCL reads them
    only for its socket transport (no InfiniBand/RoCE). Returns what it set.

    Example::

        nccl_socket_env(8, env)   # {'NCCL_SOCKET_NTHREADS': '4', 'NCCL_NSOCKS_PERTHREAD': '2'}
    """
    if streams <= 1 or NCCL_THREADS_ENV in environ or NCCL_SOCKETS_ENV in environ:
        return {}
    threads = min(streams, 4)
    chosen = {NCCL_THREADS_ENV: str(threads), NCCL_SOCKETS_ENV: str(-(-streams // threads))}
    environ.update(chosen)
    return chosen


def stripe_count_for(ranks: Sequence[int], local_size: int, streams: int) -> int:
    """How many stripes a group over global ``ranks`` gets: ``streams`` when they span several
    machines (``local_size`` ranks per machine, laid out machine by machine), else 1.

    Example::

        stripe_count_for([0, 1], local_size=2, streams=4)   # 1: one machine
        stripe_count_for([0, 2], local_size=2, streams=4)   # 4
    """
    return streams if len({r // local_size for r in ranks}) > 1 else 1


def _moved_by_gloo(backend: str, device_type: str) -> bool:
    """Whether ``backend`` (``"gloo"``, ``"cpu:gloo,cuda:nccl"``, ...) moves ``device_type`` tensors with Gloo."""
    for part in backend.lower().split(","):
        device, _, name = part.rpartition(":")
        if device in ("", device_type) and name == "gloo":
            return True
    return False


def can_stripe(pg: "BaguaProcessGroup", device_type: str) -> bool:
    """Whether collectives of ``device_type`` tensors on group ``pg`` may use several stripes."""
    return bool(pg.stripes) and pg.size > 1 and _moved_by_gloo(pg.backend, device_type)


def stripe_count(pg: "BaguaProcessGroup", nbytes: int, device_type: str) -> int:
    """How many stripes a collective on ``nbytes`` bytes uses: ``min(K, nbytes // min_chunk)``, at
    least 1 (K: the group's stripes in use, ``pg.streams``)."""
    if not can_stripe(pg, device_type):
        return 1
    return max(1, min(pg.streams, nbytes // pg.min_chunk))


def stripe_groups(pg: "BaguaProcessGroup", count: int) -> list:
    """The torch groups of the first ``count`` stripes of ``pg`` (stripe 0: ``pg.group``)."""
    return [pg.group, *pg.stripes][:count]


def spans(numel: int, count: int) -> list[slice]:
    """``count`` contiguous slices covering ``range(numel)``, sizes differing by at most one.

    Example::

        spans(10, 3)    # [slice(0, 4), slice(4, 7), slice(7, 10)]
    """
    base, extra = divmod(numel, count)
    bounds = [0]
    for i in range(count):
        bounds.append(bounds[-1] + base + (1 if i < extra else 0))
    return [slice(a, b) for a, b in zip(bounds, bounds[1:])]


def stripe_label(index: int, count: int) -> str:
    """How errors name stripe ``index`` of ``count`` (nothing for a single one)."""
    return f"stripe {index} of {count}" if count > 1 else ""


@contextlib.contextmanager
def named_stripe(label: str) -> Iterator[None]:
    """Prefix a torch failure inside the block (a timeout, a lost peer) with ``label``.

    Example::

        with named_stripe(stripe_label(2, 4)):
            work.wait()              # RuntimeError("stripe 2 of 4: Timed out ...")
    """
    try:
        yield
    except RuntimeError as error:
        if not label:
            raise
        raise RuntimeError(f"{label}: {error}") from error


class StripedWork:
    """Works in flight, one per stripe, finished together (then ``then()``, if given); a failure
    names its stripe. ``wait()`` may be called again (Gloo's send work must be waited on once only)."""

    def __init__(self, works: Sequence[Any], then: Optional[Callable[[], None]] = None):
        self.works = list(works)
        self.then = then
        self.done = False

    def wait(self) -> None:
        if not self.done:
            for index, work in enumerate(self.works):
                with named_stripe(stripe_label(index, len(self.works))):
                    work.wait()
            self.finish()

    def finish(self) -> None:
        """Run ``then()`` once, the works known complete (by ``wait()``, or from their futures)."""
        if not self.done:
            if self.then is not None:
                self.then()
            self.done = True

    def is_completed(self) -> bool:
        return self.done or all(work.is_completed() for work in self.works)


def launch(
    pg: "BaguaProcessGroup",
    tensor: torch.Tensor,
    piece: Callable[[Any, slice], Any],
    *,
    whole: Optional[Callable[[], Any]] = None,
    numel: Optional[int] = None,
    nbytes: Optional[int] = None,
) -> Any:
    """Issue a collective on ``tensor`` over as many stripes as its size earns.

    ``piece(group, part)`` issues the op on ``part`` (a slice of ``numel`` elements, default
    the tensor's) over torch group ``group`` and returns its work. On one stripe, ``whole()``
    is issued instead (default: ``piece`` over everything on ``pg.group``). ``nbytes`` (default
    the tensor's) decides the count. Returns a work with ``wait()`` and ``is_completed()``.

    Example::

        flat = t.view(-1)
        work = launch(pg, t, lambda g, part: dist.all_reduce(flat[part], group=g, async_op=True))
    """
    numel = tensor.numel() if numel is None else numel
    count = stripe_count(pg, tensor.nbytes if nbytes is None else nbytes, tensor.device.type)
    if count == 1:
        return whole() if whole is not None else piece(pg.group, slice(0, numel))
    return StripedWork([piece(group, part) for group, part in zip(stripe_groups(pg, count), spans(numel, count))])


def launch_alltoall(
    pg: "BaguaProcessGroup", outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], count: int,
    exchange: Optional[Callable[..., Any]] = None,
) -> StripedWork:
    """An alltoall of flat parts (``inputs[j]`` to group rank ``j``, ``outputs[j]`` from it)
    over ``count`` stripes: piece ``i`` of every part, packed, on stripe ``i``. Both ends cut a
    part alike from its length. Waiting for the returned work unpacks the pieces into ``outputs``.
    ``exchange(group, received, send, received_sizes, sent_sizes)`` moves one stripe's pieces
    (default ``torch.distributed.all_to_all_single`` on ``group``).

    Example::

        launch_alltoall(pg, list(out.view(w, -1)), list(inp.view(w, -1)), count=4).wait()
    """
    if exchange is None:
        def exchange(group, received, send, received_sizes, sent_sizes):
            return dist.all_to_all_single(received, send, received_sizes, sent_sizes, group=group, async_op=True)

    def cut(part: torch.Tensor) -> list[torch.Tensor]:
        return [part[piece] for piece in spans(part.numel(), count)]

    sent_pieces, landing_pieces = [cut(p) for p in inputs], [cut(p) for p in outputs]
    works, unpack = [], []
    for i, group in enumerate(stripe_groups(pg, count)):
        sent, landing = [pieces[i] for pieces in sent_pieces], [pieces[i] for pieces in landing_pieces]
        send = torch.cat(sent)
        received = send.new_empty(sum(p.numel() for p in landing))
        works.append(exchange(group, received, send, [p.numel() for p in landing], [p.numel() for p in sent]))
        unpack.append((received, landing))

    def finish() -> None:
        for received, landing in unpack:
            for target, piece in zip(landing, received.split([p.numel() for p in landing])):
                target.copy_(piece)

    return StripedWork(works, then=finish)
