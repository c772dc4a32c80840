"""Bagua-Net for any torch.distributed job: a torch backend named ``"bagua"`` that stripes.

A job that never uses bagua's wrapper (plain torch DDP, FSDP, the Hugging Face Trainer, its own
collectives) gets striped connections by naming this backend where it names ``"gloo"``::

    import bagua                                   # registers the backend "bagua" with torch
    torch.distributed.init_process_group("bagua")  # or dist.new_group(backend="bagua")

Every group made with it holds K Gloo process groups over the same ranks (K:
``StripeOptions(streams=...)`` given as ``pg_options``, else ``BAGUA_NET_NSTREAMS``, else 4),
each with connections of its own. A collective on a large CPU tensor is cut into
``min(K, bytes // BAGUA_NET_MIN_CHUNKSIZE)`` pieces (default 1 MiB), piece ``i`` issued on group
``i``, so it travels over several TCP flows at once: that is what helps where a cloud caps each
flow below the link (AWS: 5 Gbit/s a flow outside a placement group). Small messages stay one
operation on group 0. A group whose ranks share one machine (``LOCAL_WORLD_SIZE``, as torchrun
sets it) gets one Gloo group: nothing of it leaves the host. The cutting is ``stripes.py``'s, the
same as bagua's own collectives; results are laid out as torch lays them out, and an elementwise
op cut into pieces is the same op, so on two ranks the bits are torch's.

What each torch call does here (``tests/comm/test_striped_backend.py`` checks it against Gloo's
own results on the same inputs):

- ``all_reduce``, ``broadcast``, ``reduce``, ``send``/``recv``: contiguous pieces of the flat tensor.
- ``all_gather``, ``all_gather_into_tensor``, ``gather``: piece ``i`` of every rank's input on
  group ``i``, landing straight in its place in the output.
- ``reduce_scatter``, ``reduce_scatter_tensor``, ``scatter``: each rank's part cut alike.
- ``all_to_all_single``, ``all_to_all``: each sender-to-receiver part cut into pieces, piece ``i``
  of every part packed on group ``i``. Without split sizes every rank knows the message's size,
  so small ones stay one operation; with split sizes a rank does not know the others' sizes, so
  every such call uses all K groups (agreeing on fewer would cost a round trip).
- ``recv`` from any source: the first piece from any source, the rest from the rank that sent it.
- ``barrier``, object collectives (over CPU tensors), the ``*_coalesced`` calls and lists of
  several tensors: on group 0, as Gloo does them.
- CUDA tensors: NCCL (when torch has it), one communicator, with ``NCCL_SOCKET_NTHREADS`` and
  ``NCCL_NSOCKS_PERTHREAD`` set for K sockets per connection unless the user set either: NCCL
  stripes its own socket connections (that matters only without InfiniBand/RoCE).

Not here: ``monitored_barrier`` (torch allows it on ``"gloo"`` groups only) and torch's
functional collectives (``torch.distributed._functional_collectives``, used by DTensor and
compiled graphs), which call C++ backends directly.

Example::

    import bagua, torch.distributed as dist
    dist.init_process_group("bagua", pg_options=bagua.comm.StripeOptions(streams=8))
    model = torch.nn.parallel.DistributedDataParallel(model)   # its buckets over 8 connections
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from . import stripes

logger = logging.getLogger(__name__)

BACKEND_NAME = "bagua"
"""The name to give ``torch.distributed.init_process_group(backend=...)`` for striped connections (``"bagua"``)."""
DEFAULT_STREAMS = 4
_striped_in_process = [0]  # calls cut into pieces, over every "bagua" group of this process
_warned_unknown_machines: list = []  # one warning a process when LOCAL_WORLD_SIZE is missing


def striped_calls() -> int:
    """How many calls this process cut into pieces so far, over all its ``"bagua"`` groups: the
    way to see that a job stripes (0: every message was below the piece size, or one machine).

    Example::

        print(bagua.comm.striped_calls())   # after a few steps of torch DDP on the "bagua" backend
    """
    return _striped_in_process[0]


@dataclass(frozen=True)
class StripeOptions:
    """How a ``"bagua"`` group stripes; pass it as ``pg_options`` to ``init_process_group`` or
    ``new_group``. ``None`` takes the environment: ``BAGUA_NET_NSTREAMS`` (else 4),
    ``BAGUA_NET_MIN_CHUNKSIZE`` (else 1 MiB), ``LOCAL_WORLD_SIZE`` (the ranks per machine,
    laid out machine by machine as torchrun does; unset: one machine, so no stripes).

    Example::

        dist.new_group(backend="bagua", pg_options=StripeOptions(streams=8, local_world_size=1))
    """

    streams: Optional[int] = None
    min_chunk_bytes: Optional[int] = None
    local_world_size: Optional[int] = None

    def resolved(self) -> tuple[int, int, Optional[int]]:
        """``(streams, min_chunk_bytes, local_world_size)`` with the environment's defaults."""
        if self.streams is not None:
            streams = stripes.streams_setting(self.streams)
        elif os.environ.get(stripes.STREAMS_ENV):
            streams = stripes.streams_setting(None)
        else:
            streams = DEFAULT_STREAMS
        min_chunk = stripes.min_chunk_setting() if self.min_chunk_bytes is None else \
            stripes._positive_int("StripeOptions.min_chunk_bytes", self.min_chunk_bytes)
        local = self.local_world_size
        if local is None and os.environ.get("LOCAL_WORLD_SIZE"):
            local = os.environ["LOCAL_WORLD_SIZE"]
        local = None if local is None else stripes._positive_int("local_world_size (LOCAL_WORLD_SIZE)", local)
        return streams, min_chunk, local


@dataclass(frozen=True)
class _GlooLinks:
    """The Gloo groups of one ``"bagua"`` group, in the shape ``stripes.launch`` reads."""

    group: Any
    stripes: tuple
    size: int
    streams: int
    min_chunk: int
    backend: str = "gloo"


class _PiecesWork(dist.Work):
    """The pieces of one striped call, finished together (``then()`` after the last); a failure
    names its piece's group. ``get_future()`` (torch DDP's reducer asks for it) completes with
    ``result`` once every piece did."""

    def __init__(self, striped: stripes.StripedWork, result: Sequence[torch.Tensor] = ()):
        super().__init__()
        self._striped = striped
        self._result = list(result)
        self._lock = threading.Lock()

    def wait(self, timeout: Any = None) -> bool:
        with self._lock:
            self._striped.wait()
        return True

    def is_completed(self) -> bool:
        return self._striped.is_completed()

    def get_future(self) -> torch.futures.Future:
        pieces = torch.futures.collect_all([work.get_future() for work in self._striped.works])

        def finished(collected: torch.futures.Future) -> list:
            # On a Gloo thread, inside its work's completion: waiting for a work here deadlocks.
            futures = collected.value()
            for index, future in enumerate(futures):
                with stripes.named_stripe(stripes.stripe_label(index, len(futures))):
                    future.value()  # a piece's error
            with self._lock:
                self._striped.finish()
            return self._result

        return pieces.then(finished)


class _AnySourceWork(dist.Work):
    """``recv`` from any source over several groups: the first piece from whoever sends, then the
    other pieces from that rank, issued when the first has landed."""

    def __init__(self, first: Any, rest: Callable[[int], stripes.StripedWork]):
        super().__init__()
        self._first, self._rest, self._source = first, rest, -1
        self._lock = threading.Lock()

    def wait(self, timeout: Any = None) -> bool:
        with self._lock:
            if self._source < 0:
                with stripes.named_stripe("piece 0 (any source)"):
                    self._first.wait()
                self._source = self._first._source_rank()
                self._rest(self._source).wait()
        return True

    def is_completed(self) -> bool:
        return self._source >= 0

    def _source_rank(self) -> int:
        self.wait()
        return self._source


class StripedProcessGroup(dist.ProcessGroup):
    """A torch process group whose large CPU collectives travel over K Gloo groups at once.

    Made by torch through the registered backend (``init_process_group("bagua")``,
    ``new_group(backend="bagua")``); not meant to be built by hand.
    """

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: datetime.timedelta,
                 global_ranks: Sequence[int], options: StripeOptions, name: str = ""):
        super().__init__(rank, size)
        streams, min_chunk, local_size = options.resolved()
        ranks = list(global_ranks) or list(range(size))
        if local_size is None and size > 1 and not _warned_unknown_machines:
            _warned_unknown_machines.append(True)
            logger.warning(
                "bagua backend: LOCAL_WORLD_SIZE is not set, so the ranks' machines are unknown: its groups keep "
                "one connection set (set LOCAL_WORLD_SIZE as torchrun does, or pass "
                "StripeOptions(local_world_size=...))")
        count = 1 if local_size is None else stripes.stripe_count_for(ranks, local_size, streams)
        groups = tuple(
            dist.ProcessGroupGloo(dist.PrefixStore(f"bagua-stripe{i}/", store), rank, size, timeout)
            for i in range(count)
        )
        self._links = _GlooLinks(groups[0], groups[1:], size, count, min_chunk)
        self._nccl = _nccl_group(store, rank, size, timeout, ranks, name, streams)
        self._striped_calls = 0
        logger.debug("bagua backend: group of %d ranks %s, %d Gloo connection set(s)", size, ranks, count)

    # --- what torch asks of every process group -------------------------------------------

    def getBackendName(self) -> str:
        """``"bagua"`` (torch asks every process group its backend's name)."""
        return BACKEND_NAME

    def _get_backend_name(self) -> str:
        return BACKEND_NAME

    # torch names a group after making it; a Python group keeps the name itself (the C++ side
    # would ask its backends, and this group registers none).
    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    @property
    def group_name(self) -> str:
        return getattr(self, "_group_name", "")

    def _set_group_desc(self, desc: str) -> None:
        self._group_desc = desc

    @property
    def group_desc(self) -> str:
        return getattr(self, "_group_desc", "")

    @property
    def connections(self) -> int:
        """How many Gloo groups (sets of connections) a large message is spread over."""
        return self._links.streams

    @property
    def striped_calls(self) -> int:
        """How many calls on this group so far were cut into pieces."""
        return self._striped_calls

    def _count_striped(self) -> None:
        self._striped_calls += 1
        _striped_in_process[0] += 1

    def _for(self, tensors: Sequence[torch.Tensor]) -> Any:
        """The group that moves ``tensors`` as one operation: NCCL for CUDA tensors, else Gloo's first."""
        if any(t.is_cuda for t in tensors):
            if self._nccl is None:
                raise RuntimeError(
                    "the 'bagua' backend moves CUDA tensors with NCCL, which this torch build lacks; "
                    "move the tensors to the CPU or use a CUDA build of torch"
                )
            return self._nccl
        return self._links.group

    def _count(self, tensors: Sequence[torch.Tensor], nbytes: int) -> int:
        """Pieces for a call on ``tensors`` moving ``nbytes``: 1 unless all are dense, contiguous CPU tensors."""
        if not _plain(tensors):
            return 1
        return stripes.stripe_count(self._links, nbytes, "cpu")

    def _pieces(self, tensor: torch.Tensor, piece: Callable[[Any, slice], Any], count: int,
                numel: Optional[int] = None, result: Sequence[torch.Tensor] = ()) -> _PiecesWork:
        numel = tensor.numel() if numel is None else numel
        groups = stripes.stripe_groups(self._links, count)
        self._count_striped()
        return _PiecesWork(stripes.StripedWork(
            [piece(group, part) for group, part in zip(groups, stripes.spans(numel, count))]), result)

    # --- collectives --------------------------------------------------------------------------

    def _whole_or_pieces(self, tensors, whole: Callable[[], Any], piece: Callable[[Any, list], Any]):
        """``whole()`` (one operation), or ``piece(group, [part])`` on each piece of the single
        tensor of ``tensors`` where its size earns several: the elementwise calls."""
        count = self._count(tensors, tensors[0].nbytes) if len(tensors) == 1 else 1
        if count == 1:
            return whole()
        flat = tensors[0].view(-1)
        return self._pieces(flat, lambda g, part: piece(g, [flat[part]]), count, result=tensors)

    def allreduce(self, tensors, opts=None):
        opts = opts or dist.AllreduceOptions()
        return self._whole_or_pieces(tensors, lambda: self._for(tensors).allreduce(tensors, opts),
                                     lambda g, part: g.allreduce(part, opts))

    def broadcast(self, tensors, opts=None):
        opts = opts or dist.BroadcastOptions()
        return self._whole_or_pieces(tensors, lambda: self._for(tensors).broadcast(tensors, opts),
                                     lambda g, part: g.broadcast(part, opts))

    def reduce(self, tensors, opts=None):
        opts = opts or dist.ReduceOptions()
        return self._whole_or_pieces(tensors, lambda: self._for(tensors).reduce(tensors, opts),
                                     lambda g, part: g.reduce(part, opts))

    def allgather(self, output_lists, inputs, opts=None):
        opts = opts or dist.AllgatherOptions()
        count = self._count_with_lists(inputs, output_lists)
        if count == 1:
            return self._for(inputs).allgather(output_lists, inputs, opts)
        flat, rows = inputs[0].view(-1), [out.view(-1) for out in output_lists[0]]
        return self._pieces(flat, lambda g, part: g.allgather([[r[part] for r in rows]], [flat[part]], opts), count,
                            result=output_lists[0])

    def all_gather_single(self, output, input, opts=None):
        opts = opts or dist.AllgatherOptions()
        if self._count([output, input], input.nbytes) == 1:
            return self._for([input])._allgather_base(output, input, opts)
        return self.allgather([list(output.view(self.size(), -1))], [input.reshape(-1)], opts)

    def gather(self, output_lists, inputs, opts=None):
        opts = opts or dist.GatherOptions()
        count = self._count_with_lists(inputs, output_lists)
        if count == 1:
            return self._for(inputs).gather(output_lists, inputs, opts)
        flat = inputs[0].view(-1)
        rows = [out.view(-1) for out in output_lists[0]] if output_lists else None
        return self._pieces(
            flat, lambda g, part: g.gather([[r[part] for r in rows]] if rows else [], [flat[part]], opts), count)

    def _count_with_lists(self, singles, lists) -> int:
        """Pieces for a call on one tensor per rank (``singles``: the gather's input, the scatter's
        output) with one per peer on the other side (``lists``): by the single tensor's bytes,
        1 unless there is exactly one and every tensor may be cut."""
        listed = [t for per_peer in lists for t in per_peer]
        return self._count([*singles, *listed], singles[0].nbytes) if len(singles) == 1 else 1

    def scatter(self, outputs, input_lists, opts=None):
        opts = opts or dist.ScatterOptions()
        count = self._count_with_lists(outputs, input_lists)
        if count == 1:
            return self._for(outputs).scatter(outputs, input_lists, opts)
        flat = outputs[0].view(-1)
        parts = [t.view(-1) for t in input_lists[0]] if input_lists else None
        return self._pieces(
            flat, lambda g, part: g.scatter([flat[part]], [[p[part] for p in parts]] if parts else [], opts), count)

    def reduce_scatter(self, outputs, input_lists, opts=None):
        opts = opts or dist.ReduceScatterOptions()
        count = self._count_with_lists(outputs, input_lists)
        if count == 1:
            return self._for(outputs).reduce_scatter(outputs, input_lists, opts)
        flat, parts = outputs[0].view(-1), [t.view(-1) for t in input_lists[0]]
        return self._pieces(flat, lambda g, part: g.reduce_scatter([flat[part]], [[p[part] for p in parts]], opts),
                            count, result=outputs)

    def reduce_scatter_single(self, output, input, opts=None):
        opts = opts or dist.ReduceScatterOptions()
        if self._count([output, input], output.nbytes) == 1:
            return self._for([input])._reduce_scatter_base(output, input, opts)
        return self.reduce_scatter([output.view(-1)], [list(input.view(self.size(), -1))], opts)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        opts = opts or dist.AllToAllOptions()
        even = not output_split_sizes and not input_split_sizes
        if even and (input.dim() == 0 or input.shape[0] % self.size() != 0):
            count = 1  # Gloo's own error
        elif even:  # every rank moves as many bytes: all agree on the count
            count = self._count([output, input], input.nbytes)
        else:  # a rank does not know the others' sizes: only "all K groups" is agreed without a round trip
            count = self._links.streams if _plain([output, input]) else 1
        if count == 1:
            return self._for([input]).alltoall_base(output, input, output_split_sizes, input_split_sizes, opts)
        outputs = _parts(output, output_split_sizes, self.size())
        inputs = _parts(input, input_split_sizes, self.size())
        return self._alltoall(outputs, inputs, count, result=[output])

    def alltoall(self, output_tensors, input_tensors, opts=None):
        opts = opts or dist.AllToAllOptions()
        if self._links.streams == 1 or not _plain([*output_tensors, *input_tensors]):
            return self._for(input_tensors).alltoall(output_tensors, input_tensors, opts)
        return self._alltoall([t.view(-1) for t in output_tensors], [t.view(-1) for t in input_tensors],
                              self._links.streams, result=output_tensors)

    def _alltoall(self, outputs, inputs, count, result) -> _PiecesWork:
        def exchange(group, received, send, received_sizes, sent_sizes):
            return group.alltoall_base(received, send, received_sizes, sent_sizes, dist.AllToAllOptions())

        self._count_striped()
        return _PiecesWork(stripes.launch_alltoall(self._links, outputs, inputs, count, exchange), result)

    def send(self, tensors, dst, tag):
        return self._whole_or_pieces(tensors, lambda: self._for(tensors).send(tensors, dst, tag),
                                     lambda g, part: g.send(part, dst, tag))

    def recv(self, tensors, src, tag):
        return self._whole_or_pieces(tensors, lambda: self._for(tensors).recv(tensors, src, tag),
                                     lambda g, part: g.recv(part, src, tag))

    def recv_anysource(self, tensors, tag):
        count = self._count(tensors, tensors[0].nbytes) if len(tensors) == 1 else 1
        if count == 1:
            return self._for(tensors).recv_anysource(tensors, tag)
        flat = tensors[0].view(-1)
        groups, parts = stripes.stripe_groups(self._links, count), stripes.spans(flat.numel(), count)
        first = groups[0].recv_anysource([flat[parts[0]]], tag)
        self._count_striped()

        def rest(src: int) -> stripes.StripedWork:
            return stripes.StripedWork([g.recv([flat[p]], src, tag) for g, p in zip(groups[1:], parts[1:])])

        return _AnySourceWork(first, rest)

    def barrier(self, opts=None):
        return self._links.group.barrier(opts or dist.BarrierOptions())

    def allreduce_coalesced(self, tensors, opts=None):
        return self._for(tensors).allreduce_coalesced(tensors, opts or dist.AllreduceCoalescedOptions())

    def allgather_coalesced(self, output_lists, inputs, opts=None):
        return self._for(inputs).allgather_coalesced(output_lists, inputs, opts or dist.AllgatherOptions())

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        return self._for(inputs).allgather_into_tensor_coalesced(outputs, inputs, opts or dist.AllgatherOptions())

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        return self._for(inputs).reduce_scatter_tensor_coalesced(outputs, inputs, opts or dist.ReduceScatterOptions())

    # The names torch before 2.13 calls (the Gloo and NCCL backends still answer to them).
    _allgather_base = all_gather_single
    _reduce_scatter_base = reduce_scatter_single
    alltoall_base = all_to_all_single
    allgather_into_tensor_coalesced = all_gather_single_coalesced
    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def shutdown(self) -> None:
        for group in (self._links.group, *self._links.stripes, *([self._nccl] if self._nccl else [])):
            group.shutdown()


def _plain(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether every tensor is a dense, contiguous CPU tensor (what may be cut into pieces)."""
    return all(not (t.is_cuda or t.is_sparse) and t.is_contiguous() for t in tensors)


def _parts(tensor: torch.Tensor, split_sizes: Sequence[int], world: int) -> list[torch.Tensor]:
    """``tensor``'s flat parts along dim 0: ``split_sizes`` rows each, or ``world`` equal ones."""
    rows = list(split_sizes) if split_sizes else [tensor.shape[0] // world] * world
    row = tensor[0].numel() if tensor.dim() > 0 and tensor.shape[0] else 1
    return list(tensor.reshape(-1).split([r * row for r in rows]))


def _nccl_group(store, rank: int, size: int, timeout: datetime.timedelta, ranks: list[int], name: str,
                streams: int) -> Optional[Any]:
    """The NCCL group for this group's CUDA tensors (None without CUDA or NCCL); K sockets per
    NCCL connection (``stripes.nccl_socket_env``) unless the user set NCCL's own variables."""
    if not (torch.cuda.is_available() and dist.is_nccl_available()):
        return None
    chosen = stripes.nccl_socket_env(streams)
    if chosen:
        logger.info("bagua backend: %s for NCCL (read only where NCCL runs over sockets)",
                    " ".join(f"{k}={v}" for k, v in chosen.items()))
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    options.global_ranks_in_group = ranks
    options.group_name = name
    return dist.ProcessGroupNCCL(dist.PrefixStore("bagua-nccl/", store), rank, size, options)


def _create(backend_options: "dist._DistributedBackendOptions", pg_options: Any) -> StripedProcessGroup:
    """torch's constructor hook for the ``"bagua"`` backend (extended API)."""
    if pg_options is not None and not isinstance(pg_options, StripeOptions):
        raise TypeError(
            f"the 'bagua' backend takes pg_options=bagua.comm.StripeOptions(...), got {type(pg_options).__name__}"
        )
    return StripedProcessGroup(
        backend_options.store, backend_options.group_rank, backend_options.group_size, backend_options.timeout,
        backend_options.global_ranks_in_group, pg_options or StripeOptions(), str(backend_options.group_id or ""),
    )


def register() -> None:
    """Make ``"bagua"`` a torch.distributed backend name (done when bagua is imported; idempotent).

    Example::

        register(); torch.distributed.init_process_group("bagua")
    """
    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=["cpu", "cuda"])
