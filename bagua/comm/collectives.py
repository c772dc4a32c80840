"""MPI-style collectives over a Bagua process group, sync or async.

Every function takes ``group`` (default: all ranks) and ``async_op``. With
``async_op=True`` it returns a :class:`Handle`; ``handle.wait()`` blocks until the
operation is done and returns its result. Ranks (``src``, ``dst``) are global ranks.
Large messages on a group with stripes (``init_process_group(streams=K)``) are cut into
pieces that travel over K connections at once (``stripes.py``); results are laid out alike.

Example::

    t = torch.ones(10) * bagua.get_rank()
    bagua.comm.allreduce(t, op=bagua.comm.ReduceOp.AVG)          # in place
    h = bagua.comm.allgather(t, async_op=True)
    everything = h.wait()                                         # [world * 10]
"""

from __future__ import annotations

import enum
import math
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist

from . import checks, p2p, stripes, traffic
from ._torch_compat import all_gather_flat, reduce_scatter_flat
from .host_staging import through_host
from .process_group import BaguaProcessGroup, _collective_checks_enabled, get_default_group


class CollectiveError(RuntimeError):
    """A collective failed or timed out; the message names the operation, the rank, and the
    stripe when the message was cut over several."""


class ReduceOp(enum.Enum):
    """How a reducing collective combines the ranks' values."""

    SUM = "sum"
    AVG = "avg"
    MIN = "min"
    MAX = "max"
    PRODUCT = "product"


_TORCH_OPS = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.MIN: dist.ReduceOp.MIN,
    ReduceOp.MAX: dist.ReduceOp.MAX,
    ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT,
}


def as_reduce_op(op: Union[ReduceOp, str, Any]) -> ReduceOp:
    """``ReduceOp`` from itself, its name (``"avg"``) or torch's ``torch.distributed.ReduceOp``
    value; a clear error for anything else."""
    if isinstance(op, ReduceOp):
        return op
    if isinstance(op, str):
        for candidate in ReduceOp:
            if op.lower() == candidate.value:
                return candidate
    for candidate, torch_op in (*_TORCH_OPS.items(), (ReduceOp.AVG, dist.ReduceOp.AVG)):
        if isinstance(op, type(torch_op)) and op == torch_op:
            return candidate
    raise ValueError(f"unknown reduce op {op!r}; use one of {[o.name for o in ReduceOp]}")


class Handle:
    """A collective in flight. ``wait()`` finishes it and returns its result (or None).

    Example::

        h = bagua.comm.allreduce(t, async_op=True)
        ...                                      # overlap other work
        h.wait()
    """

    def __init__(self, what: str, work: Any = None, finish: Optional[Callable[[], Any]] = None):
        self._what = what
        self._work = work
        self._finish = finish
        self._done = False
        self._result: Any = None

    def is_completed(self) -> bool:
        """Whether ``wait()`` would return without blocking on the network."""
        return self._done or self._work is None or self._work.is_completed()

    def wait(self) -> Any:
        """Block until done; return the collective's result. Re-raises its error."""
        if not self._done:
            with _named_errors(self._what):
                if self._work is not None:
                    self._work.wait()
                if self._finish is not None:
                    self._result = self._finish()
            self._done = True
        return self._result


class _named_errors:
    """Re-raise torch.distributed failures as CollectiveError naming the operation."""

    def __init__(self, what: str):
        self.what = what

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc is not None and isinstance(exc, RuntimeError) and not isinstance(exc, CollectiveError):
            rank = dist.get_rank() if dist.is_initialized() else "?"
            raise CollectiveError(f"{self.what} failed on rank {rank}: {exc}") from exc
        return False


def _group(group: Optional[BaguaProcessGroup]) -> BaguaProcessGroup:
    if group is None:
        return get_default_group()
    if not group.is_member:
        raise ValueError(
            f"rank {dist.get_rank()} is not a member of group {list(group.ranks)}: only its members run "
            f"collectives on it (check group.is_member first)"
        )
    return group


def _run(what: str, launch: Callable[[], Any], finish: Optional[Callable[[], Any]], async_op: bool) -> Any:
    """Launch a torch collective (async under the hood) and finish it now or in ``Handle.wait()``."""
    with _named_errors(what):
        work = launch()
    handle = Handle(what, work, finish)
    return handle if async_op else handle.wait()


def _done(what: str, result: Any, async_op: bool) -> Any:
    handle = Handle(what, None, lambda: result)
    return handle if async_op else handle.wait()


def _prepare(
    name: str,
    tensor: torch.Tensor,
    group: Optional[BaguaProcessGroup],
    *,
    op: int = -1,
    root: int = -1,
    splits: Sequence[int] = (),
    kind: Optional[str] = None,
    agree: bool = True,
) -> tuple[str, BaguaProcessGroup]:
    """Validate locally and (if enabled, and ``agree``) across ranks; return the op's description and group."""
    pg = _group(group)
    what = f"bagua.comm.{name}({checks.describe(tensor) if isinstance(tensor, torch.Tensor) else '?'})"
    checks.check_tensor(what, tensor, pg)
    if agree and pg.size > 1 and _collective_checks_enabled() and not checks.is_trusted():
        with _named_errors(what):
            checks.check_agreement(what, kind or name, tensor, pg, op=op, root=root, splits=splits)
    return what, pg


def _op_code(op: ReduceOp) -> int:
    return list(ReduceOp).index(op)


def _check_avg_dtype(what: str, tensor: torch.Tensor, op: ReduceOp) -> None:
    if op is ReduceOp.AVG and not tensor.is_floating_point():
        raise TypeError(f"{what}: ReduceOp.AVG needs a floating-point tensor, got {tensor.dtype}")


def _torch_reduce(op: ReduceOp, pg: BaguaProcessGroup) -> tuple[Any, Optional[int]]:
    """The torch op to run, and the divisor to apply afterwards (AVG as SUM / n off NCCL)."""
    if op is ReduceOp.AVG:
        if pg.backend == "nccl":
            return dist.ReduceOp.AVG, None
        return dist.ReduceOp.SUM, pg.size
    return _TORCH_OPS[op], None


def _divide_in_place(tensor: torch.Tensor, divisor: int) -> Callable[[], None]:
    def finish() -> None:
        tensor.div_(divisor)

    return finish


@through_host(write_back=True)
def allreduce(
    tensor: torch.Tensor,
    op: Union[ReduceOp, str] = ReduceOp.SUM,
    group: Optional[BaguaProcessGroup] = None,
    async_op: bool = False,
    compression: Optional[Any] = None,
) -> Optional[Handle]:
    """Reduce ``tensor`` across ranks, in place; every rank ends with the same result.

    Args:
        tensor: any shape; fp32, fp16, bf16 (or other dtypes without compression).
        op: a ``ReduceOp`` or its name.
        compression: ``None`` for exact, or a codec (``"fp16"``, ``"bf16"``,
            ``"minmax_uint8"`` or a ``bagua.comm.compression.Codec``): then every byte on
            the wire is encoded (scatter-reduce-gather), see ``compressed_allreduce``.

    Example::

        bagua.comm.allreduce(grad, op="avg", compression="minmax_uint8")
    """
    op = as_reduce_op(op)
    if compression is not None:
        from .compressed import compressed_allreduce

        return compressed_allreduce(tensor, op=op, codec=compression, group=group, async_op=async_op)
    what, pg = _prepare("allreduce", tensor, group, op=_op_code(op))
    _check_avg_dtype(what, tensor, op)
    if pg.size == 1:
        return _done(what, None, async_op)
    torch_op, divisor = _torch_reduce(op, pg)
    traffic.record("allreduce", 2 * traffic.ring_fraction(pg.size) * tensor.nbytes)
    finish = _divide_in_place(tensor, divisor) if divisor else None
    flat = tensor.view(-1)
    return _run(
        what,
        lambda: stripes.launch(pg, tensor, lambda g, part: dist.all_reduce(flat[part], torch_op, group=g, async_op=True)),
        finish,
        async_op,
    )


@through_host(write_back=False)
def allgather(
    input: torch.Tensor, group: Optional[BaguaProcessGroup] = None, async_op: bool = False
) -> Union[torch.Tensor, Handle]:
    """Every rank's ``input`` concatenated in rank order along dim 0 (same shape on every rank).

    Example::

        out = bagua.comm.allgather(torch.tensor([rank]))     # tensor([0, 1, ..., w-1])
    """
    what, pg = _prepare("allgather", input, group)
    if input.dim() == 0:
        raise ValueError(f"{what}: input must have at least one dimension; use input.reshape(1)")
    output = input.new_empty((pg.size * input.shape[0], *input.shape[1:]))
    if pg.size == 1:
        return _done(what, output.copy_(input), async_op)
    traffic.record("allgather", (pg.size - 1) * input.nbytes)
    flat, rows = input.view(-1), output.view(pg.size, input.numel())  # rows[r]: rank r's input
    return _run(
        what,
        lambda: stripes.launch(
            pg, input,
            lambda g, part: dist.all_gather([row[part] for row in rows], flat[part], group=g, async_op=True),
            whole=lambda: all_gather_flat(output, input, group=pg.group, async_op=True),
        ),
        lambda: output,
        async_op,
    )


@through_host(write_back=False)
def alltoall(
    input: torch.Tensor, group: Optional[BaguaProcessGroup] = None, async_op: bool = False
) -> Union[torch.Tensor, Handle]:
    """Split ``input`` into ``world`` equal parts along dim 0; part j goes to rank j.

    The output holds, in rank order, the part every rank sent to this one. Use
    ``alltoall_v`` for unequal parts.

    Example::

        out = bagua.comm.alltoall(torch.arange(w) + 10 * rank)   # out[j] == 10 * j + rank
    """
    what, pg = _prepare("alltoall", input, group)
    if input.dim() == 0 or input.shape[0] % pg.size != 0:
        raise ValueError(
            f"{what}: dim 0 ({input.shape[0] if input.dim() else 'scalar'}) must be divisible by "
            f"the group size {pg.size}; use alltoall_v for unequal splits"
        )
    output = torch.empty_like(input)
    if pg.size == 1:
        return _done(what, output.copy_(input), async_op)
    traffic.record("alltoall", traffic.ring_fraction(pg.size) * input.nbytes)
    count = stripes.stripe_count(pg, input.nbytes, input.device.type)
    if count > 1:
        parts = input.numel() // pg.size
        outputs, inputs = list(output.view(pg.size, parts)), list(input.view(pg.size, parts))
        return _run(what, lambda: stripes.launch_alltoall(pg, outputs, inputs, count), lambda: output, async_op)
    if input.device.type == "cpu":  # Gloo's own alltoall leaves a slow link half idle (``p2p``)
        parts = input.numel() // pg.size
        outputs, inputs = list(output.view(pg.size, parts)), list(input.view(pg.size, parts))
        return _run(what, lambda: p2p.exchange(pg, outputs, inputs), lambda: output, async_op)
    return _run(
        what,
        lambda: dist.all_to_all_single(output, input, group=pg.group, async_op=True),
        lambda: output,
        async_op,
    )


@through_host(write_back=False)
def alltoall_v(
    input: torch.Tensor,
    input_splits: Sequence[int],
    output_splits: Sequence[int],
    group: Optional[BaguaProcessGroup] = None,
    async_op: bool = False,
) -> Union[torch.Tensor, Handle]:
    """Like ``alltoall`` with explicit sizes: ``input_splits[j]`` rows go to rank j,
    ``output_splits[j]`` rows come from rank j (they must match the sender's split).

    Example::

        # rank 0 sends 1 row to itself and 2 to rank 1; rank 1 sends 2 to rank 0, 1 to itself
        out = bagua.comm.alltoall_v(x, [1, 2], [1, 2]) if rank == 0 else bagua.comm.alltoall_v(x, [2, 1], [2, 1])
    """
    pg = _group(group)
    name = f"bagua.comm.alltoall_v({checks.describe(input) if isinstance(input, torch.Tensor) else '?'})"
    ins = checks.check_splits(name, input_splits, pg, "input_splits")
    outs = checks.check_splits(name, output_splits, pg, "output_splits")
    checks.check_tensor(name, input, pg, "input")
    if input.dim() == 0 or sum(ins) != input.shape[0]:
        raise ValueError(f"{name}: input_splits sum to {sum(ins)} but input has {input.shape[0] if input.dim() else 0} rows")
    striped = stripes.can_stripe(pg, input.device.type)
    what, pg = _prepare("alltoall_v", input, group, splits=ins + outs, agree=not striped)
    output = input.new_empty((sum(outs), *input.shape[1:]))
    if pg.size == 1:
        return _done(what, output.copy_(input), async_op)
    row_elems = math.prod(input.shape[1:])
    traffic.record("alltoall_v", (sum(ins) - ins[pg.rank]) * row_elems * input.element_size())
    if striped:
        # The stripe count must be the same everywhere: size it by the largest input of any rank,
        # from the agreement table (gathered once per call, also when checks are off).
        with _named_errors(what):
            everyone = checks.check_agreement(what, "alltoall_v", input, pg, splits=ins + outs)
        largest = max(sum(splits[:pg.size]) for splits in everyone) * row_elems * input.element_size()
        count = stripes.stripe_count(pg, largest, input.device.type)
        if count > 1:
            outputs = output.view(-1).split([n * row_elems for n in outs])
            inputs = input.view(-1).split([n * row_elems for n in ins])
            return _run(what, lambda: stripes.launch_alltoall(pg, outputs, inputs, count), lambda: output, async_op)
    if input.device.type == "cpu":  # Gloo's own alltoall leaves a slow link half idle (``p2p``)
        outputs = output.view(-1).split([n * row_elems for n in outs])
        inputs = input.view(-1).split([n * row_elems for n in ins])
        return _run(what, lambda: p2p.exchange(pg, outputs, inputs), lambda: output, async_op)
    return _run(
        what,
        lambda: dist.all_to_all_single(output, input, outs, ins, group=pg.group, async_op=True),
        lambda: output,
        async_op,
    )


@through_host(write_back=False)
def reduce_scatter(
    input: torch.Tensor,
    op: Union[ReduceOp, str] = ReduceOp.SUM,
    group: Optional[BaguaProcessGroup] = None,
    async_op: bool = False,
) -> Union[torch.Tensor, Handle]:
    """Reduce ``input`` across ranks and keep this rank's part of the result.

    Rank ``r`` (its index in the group) gets part ``r`` of
    ``torch.tensor_split(reduced, world, dim=0)``, so dim 0 need not divide evenly.

    Example::

        mine = bagua.comm.reduce_scatter(torch.ones(10), op="sum")   # 10/w rows, each w
    """
    op = as_reduce_op(op)
    what, pg = _prepare("reduce_scatter", input, group, op=_op_code(op))
    _check_avg_dtype(what, input, op)
    if input.dim() == 0:
        raise ValueError(f"{what}: input must have at least one dimension")
    w, rows = pg.size, input.shape[0]
    if w == 1:
        return _done(what, input.clone(), async_op)
    per = -(-rows // w)  # ceil
    mine = rows // w + (1 if pg.rank < rows % w else 0)  # the size tensor_split gives part `rank`
    if rows % w == 0:
        padded = input
    else:  # give every part the same number of rows; the padding rows are dropped afterwards
        padded = input.new_zeros((w * per, *input.shape[1:]))
        for r, part in enumerate(input.tensor_split(w)):
            padded[r * per:r * per + part.shape[0]] = part
    output = input.new_empty((per, *input.shape[1:]))
    torch_op, divisor = _torch_reduce(op, pg)
    traffic.record("reduce_scatter", traffic.ring_fraction(w) * padded.nbytes)

    def finish() -> torch.Tensor:
        result = output[:mine]
        return result.div_(divisor) if divisor else result

    flat, parts = output.view(-1), padded.view(w, output.numel())  # parts[r]: what rank r reduces
    return _run(
        what,
        lambda: stripes.launch(
            pg, padded,
            lambda g, part: dist.reduce_scatter(flat[part], [p[part] for p in parts], torch_op, group=g, async_op=True),
            whole=lambda: reduce_scatter_flat(output, padded, torch_op, group=pg.group, async_op=True),
            numel=flat.numel(),
        ),
        finish,
        async_op,
    )


@through_host(write_back=True)
def broadcast(
    tensor: torch.Tensor, src: int = 0, group: Optional[BaguaProcessGroup] = None, async_op: bool = False
) -> Optional[Handle]:
    """Copy ``tensor`` from global rank ``src`` to every rank, in place.

    Example::

        bagua.comm.broadcast(weights, src=0)
    """
    pg = _group(group)
    checks.check_root("bagua.comm.broadcast", src, pg, "src")
    what, pg = _prepare("broadcast", tensor, pg, root=src)
    if pg.size == 1:
        return _done(what, None, async_op)
    traffic.record("broadcast", tensor.nbytes if dist.get_rank() == src else 0)
    flat = tensor.view(-1)
    return _run(
        what,
        lambda: stripes.launch(pg, tensor, lambda g, part: dist.broadcast(flat[part], src, group=g, async_op=True)),
        None,
        async_op,
    )


@through_host(write_back=True)
def reduce(
    tensor: torch.Tensor,
    dst: int = 0,
    op: Union[ReduceOp, str] = ReduceOp.SUM,
    group: Optional[BaguaProcessGroup] = None,
    async_op: bool = False,
) -> Optional[Handle]:
    """Reduce ``tensor`` across ranks into global rank ``dst`` (in place there).

    On every other rank ``tensor`` is left unchanged.

    Example::

        bagua.comm.reduce(loss_sum, dst=0, op="sum")
    """
    op = as_reduce_op(op)
    pg = _group(group)
    checks.check_root("bagua.comm.reduce", dst, pg, "dst")
    what, pg = _prepare("reduce", tensor, pg, op=_op_code(op), root=dst)
    _check_avg_dtype(what, tensor, op)
    if pg.size == 1:
        return _done(what, None, async_op)
    torch_op, divisor = _torch_reduce(op, pg)
    is_dst = dist.get_rank() == dst
    # Gloo uses non-root buffers as scratch space: reduce a copy there.
    work_tensor = tensor if is_dst else tensor.clone()
    traffic.record("reduce", 0 if is_dst else tensor.nbytes)
    finish = _divide_in_place(tensor, divisor) if (divisor and is_dst) else None
    flat = work_tensor.view(-1)
    return _run(
        what,
        lambda: stripes.launch(pg, tensor, lambda g, part: dist.reduce(flat[part], dst, torch_op, group=g, async_op=True)),
        finish,
        async_op,
    )


@through_host(write_back=False)
def gather(
    input: torch.Tensor, dst: int = 0, group: Optional[BaguaProcessGroup] = None, async_op: bool = False
) -> Union[Optional[torch.Tensor], Handle]:
    """Every rank's ``input`` concatenated in rank order along dim 0, on ``dst``; None elsewhere.

    Example::

        everything = bagua.comm.gather(preds, dst=0)    # None on ranks other than 0
    """
    pg = _group(group)
    checks.check_root("bagua.comm.gather", dst, pg, "dst")
    what, pg = _prepare("gather", input, pg, root=dst)
    if input.dim() == 0:
        raise ValueError(f"{what}: input must have at least one dimension; use input.reshape(1)")
    is_dst = dist.get_rank() == dst
    output = input.new_empty((pg.size * input.shape[0], *input.shape[1:])) if is_dst else None
    if pg.size == 1:
        return _done(what, output.copy_(input), async_op)
    rows = output.view(pg.size, input.numel()) if is_dst else None  # rows[r]: rank r's input
    traffic.record("gather", 0 if is_dst else input.nbytes)
    flat = input.view(-1)
    return _run(
        what,
        lambda: stripes.launch(
            pg, input,
            lambda g, part: dist.gather(flat[part], [row[part] for row in rows] if is_dst else None, dst=dst, group=g, async_op=True),
        ),
        lambda: output,
        async_op,
    )


@through_host(write_back=False)
def scatter(
    input: torch.Tensor, src: int = 0, group: Optional[BaguaProcessGroup] = None, async_op: bool = False
) -> Union[torch.Tensor, Handle]:
    """Split ``src``'s ``input`` into ``world`` equal parts along dim 0; rank j gets part j.

    Every rank passes a tensor of the same shape and dtype; only ``src``'s values are read.

    Example::

        mine = bagua.comm.scatter(work if rank == 0 else torch.empty_like(work), src=0)
    """
    pg = _group(group)
    checks.check_root("bagua.comm.scatter", src, pg, "src")
    what, pg = _prepare("scatter", input, pg, root=src)
    if input.dim() == 0 or input.shape[0] % pg.size != 0:
        raise ValueError(f"{what}: dim 0 must be divisible by the group size {pg.size}")
    output = input.new_empty((input.shape[0] // pg.size, *input.shape[1:]))
    if pg.size == 1:
        return _done(what, output.copy_(input), async_op)
    is_src = dist.get_rank() == src
    rows = input.view(pg.size, output.numel())  # rows[j]: what rank j gets
    traffic.record("scatter", traffic.ring_fraction(pg.size) * input.nbytes if is_src else 0)
    flat = output.view(-1)
    return _run(
        what,
        lambda: stripes.launch(
            pg, input,
            lambda g, part: dist.scatter(flat[part], [row[part] for row in rows] if is_src else None, src=src, group=g, async_op=True),
            numel=flat.numel(),
        ),
        lambda: output,
        async_op,
    )


def _check_peer(what: str, peer: int, name: str) -> None:
    world = dist.get_world_size()
    if not isinstance(peer, int) or isinstance(peer, bool) or not 0 <= peer < world:
        raise ValueError(f"{what}: {name} must be a global rank in [0, {world}), got {peer!r}")
    if peer == dist.get_rank():
        raise ValueError(f"{what}: {name} is this rank ({peer}); a rank cannot send to itself")


def _point_to_point_group(what: str, tensor: object, group: Optional[BaguaProcessGroup], peer: int, name: str) -> BaguaProcessGroup:
    pg = _group(group)
    checks.check_tensor(what, tensor, pg)
    _check_peer(what, peer, name)
    if peer not in pg.ranks or dist.get_rank() not in pg.ranks:
        raise ValueError(f"{what}: this rank and {name} must both be in the group (ranks {list(pg.ranks)})")
    return pg


@through_host(write_back=False)
def send(
    tensor: torch.Tensor, dst: int, async_op: bool = False, group: Optional[BaguaProcessGroup] = None
) -> Optional[Handle]:
    """Send ``tensor`` to global rank ``dst`` (which must ``recv`` a tensor of the same size),
    over ``group`` (default: all ranks; both ends must be in it).

    Example::

        bagua.comm.send(t, dst=1) if rank == 0 else bagua.comm.recv(t, src=0)
    """
    what = f"bagua.comm.send({checks.describe(tensor) if isinstance(tensor, torch.Tensor) else '?'} to {dst})"
    pg = _point_to_point_group(what, tensor, group, dst, "dst")
    traffic.record("send", tensor.nbytes)
    flat = tensor.view(-1)
    return _run(what, lambda: stripes.launch(pg, tensor, lambda g, part: dist.isend(flat[part], dst, group=g)), None, async_op)


@through_host(write_back=True)
def recv(
    tensor: torch.Tensor, src: int, async_op: bool = False, group: Optional[BaguaProcessGroup] = None
) -> Optional[Handle]:
    """Receive into ``tensor`` from global rank ``src``, in place, over ``group`` (default: all ranks).

    Example::

        buf = torch.empty(10); bagua.comm.recv(buf, src=0)
    """
    what = f"bagua.comm.recv({checks.describe(tensor) if isinstance(tensor, torch.Tensor) else '?'} from {src})"
    pg = _point_to_point_group(what, tensor, group, src, "src")
    flat = tensor.view(-1)  # cut as the sender cuts a tensor of this size
    return _run(what, lambda: stripes.launch(pg, tensor, lambda g, part: dist.irecv(flat[part], src, group=g)), None, async_op)


def barrier(group: Optional[BaguaProcessGroup] = None, async_op: bool = False) -> Optional[Handle]:
    """Wait until every rank of the group has reached this call.

    Example::

        bagua.comm.barrier()
    """
    pg = _group(group)
    what = "bagua.comm.barrier()"
    if pg.size == 1:
        return _done(what, None, async_op)
    return _run(what, lambda: dist.barrier(group=pg.group, async_op=True), None, async_op)
