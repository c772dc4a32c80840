"""The original ``bagua.torch_api.communication``: process groups, communicators and collectives.

A thin layer over :mod:`bagua.comm` with the original's names, signatures and defaults:

- ``new_group(ranks)`` makes a :class:`BaguaProcessGroup` whose ``get_global_communicator()``,
  ``get_intra_node_communicator()`` and ``get_inter_node_communicator()`` give *communicators*;
  every collective takes one as ``comm=`` (default: the global communicator of the group made by
  ``init_process_group``), and its ``src``/``dst`` are ranks *in that communicator*
  (``comm.rank()``, ``comm.nranks()``), as in the original.
- On a rank outside a communicator, ``get_*_communicator()`` returns
  ``CommMember.NON_COMM_MEMBER``, and a collective given it returns at once, doing nothing (the
  original's contract: every rank may run the same code). Asking it for ``rank()`` is an error.
- Out-of-place forms ``(send_tensor, recv_tensor, ...)`` write into ``recv_tensor``; ``*_inplace``
  forms work in the tensor itself. Sizes count elements, as the original did (an allgather of
  ``[100]`` on 2 ranks fills a ``[2, 100]`` or a ``[200]`` tensor); tensors must be contiguous.
- ``ReduceOp`` is the original's IntEnum; ``torch.distributed.ReduceOp`` values work too. The
  bitwise ops (``BOR``, ``BAND``, ``BXOR``) have no counterpart in ``bagua.comm`` and are errors.
- Importing this module gives ``torch.distributed.ProcessGroup`` the original's ``bagua_patch()``,
  ``bagua_pg`` and ``bagua_get_{global,intra_node,inter_node}_communicator()``.

The original ran each collective on a CUDA side stream and synchronized with it before
returning. Here there is no side stream: each collective has completed when it returns (for
CUDA tensors, as far as the current stream is concerned), on CPU (Gloo) and GPU (NCCL) alike,
and the ``stream`` arguments are accepted and ignored.

Example::

    import bagua.torch_api as bagua
    bagua.init_process_group()
    send = torch.full((4,), float(bagua.get_rank())); recv = torch.zeros(4)
    bagua.allreduce(send, recv, op=bagua.ReduceOp.AVG)
    odd = bagua.communication.new_group([r for r in range(bagua.get_world_size()) if r % 2])
    bagua.allreduce_inplace(send, comm=odd.get_global_communicator())   # even ranks: no-op
"""

from __future__ import annotations

import enum
from typing import Any, Callable, Optional, Sequence

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from .. import comm as native
from .communicators import (  # noqa: F401  (the private names: the original's tests reach them here)
    BaguaProcessGroup,
    CommMember,
    Communicator,
    CommunicatorArg,
    _get_default_group,
    _rank_not_in_group,
    _require_init,
    _torch_to_bagua_pg_map,
    from_torch_group,
    get_backend,
    init_process_group,
    is_initialized,
    new_group,
)

# fmt: off
__all__ = [
    "BaguaProcessGroup", "CommMember", "Communicator", "ReduceOp", "allgather", "allgather_inplace", "allreduce",
    "allreduce_coalesced_inplace", "allreduce_inplace", "alltoall", "alltoall_inplace", "alltoall_v",
    "alltoall_v_inplace", "barrier", "broadcast", "broadcast_coalesced", "broadcast_object", "from_torch_group",
    "gather", "gather_inplace", "get_backend", "init_process_group", "is_initialized", "new_group", "recv", "reduce",
    "reduce_inplace", "reduce_scatter", "reduce_scatter_inplace", "scatter", "scatter_inplace", "send",
]
# fmt: on


class ReduceOp(enum.IntEnum):
    """The original's reduction operations (its integer values kept)."""

    SUM = 0
    PRODUCT = 1
    MIN = 2
    MAX = 3
    BOR = 7
    BAND = 8
    BXOR = 9
    AVG = 10


_NATIVE_OPS = {
    ReduceOp.SUM: native.ReduceOp.SUM,
    ReduceOp.PRODUCT: native.ReduceOp.PRODUCT,
    ReduceOp.MIN: native.ReduceOp.MIN,
    ReduceOp.MAX: native.ReduceOp.MAX,
    ReduceOp.AVG: native.ReduceOp.AVG,
}


def _native_op(op: Any, what: str) -> native.ReduceOp:
    """``bagua.comm.ReduceOp`` for the original's ``ReduceOp`` (or its int), a torch op or a name."""
    supported = ", ".join(f"ReduceOp.{o.name}" for o in _NATIVE_OPS)
    if isinstance(op, int) and not isinstance(op, bool):
        try:
            op = ReduceOp(op)
        except ValueError:
            raise ValueError(f"{what}: op={op!r} is no ReduceOp value; use one of {supported}") from None
        if op not in _NATIVE_OPS:
            raise ValueError(f"{what}: ReduceOp.{op.name} (a bitwise reduction) is not supported by bagua.comm; "
                             f"use one of {supported}")
        return _NATIVE_OPS[op]
    try:
        return native.as_reduce_op(op)
    except ValueError:
        raise ValueError(f"{what}: unsupported op {op!r}; use one of {supported} "
                         f"(or the same ops of torch.distributed.ReduceOp)") from None


# -- helpers of the collectives ---------------------------------------------------------------

def _group_of(comm: CommunicatorArg, what: str) -> Optional[native.BaguaProcessGroup]:
    """The ``bagua.comm`` group behind ``comm``; None when this rank is not in it."""
    if comm is CommMember.NON_COMM_MEMBER:
        return None
    if comm is None or comm is CommMember.WORLD:
        _require_init(what)
        return _get_default_group().native
    if isinstance(comm, Communicator):
        return comm.group
    hint = "; pass group.get_global_communicator()" if isinstance(comm, BaguaProcessGroup) else ""
    raise TypeError(
        f"{what}: comm must be a communicator (from group.get_global_communicator() or its node "
        f"variants) or None for the default group, got {type(comm).__name__}{hint}"
    )


def _flat(tensor: Any, name: str, what: str) -> torch.Tensor:
    """``tensor`` as a 1-D view (the original's collectives saw flat buffers)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what}: {name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided or not tensor.is_contiguous():
        raise ValueError(f"{what}: {name} must be a dense contiguous tensor; pass tensor.contiguous() "
                         f"(and copy the result back for in-place calls)")
    return tensor.view(-1)


def _expect_size(what: str, name: str, tensor: torch.Tensor, numel: int, rule: str) -> None:
    if tensor.numel() != numel:
        raise ValueError(f"{what}: {name} has {tensor.numel()} elements, but must have {rule} ({numel})")


def _same_dtype(what: str, send: torch.Tensor, recv: torch.Tensor) -> None:
    if send.dtype != recv.dtype:
        raise TypeError(f"{what}: recv_tensor is {recv.dtype} but send_tensor is {send.dtype}; they must match")


def _pair(send_tensor: Any, recv_tensor: Any, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    send, recv = _flat(send_tensor, "send_tensor", what), _flat(recv_tensor, "recv_tensor", what)
    _same_dtype(what, send, recv)
    return send, recv


def _divisible(what: str, name: str, tensor: torch.Tensor, group: native.BaguaProcessGroup) -> int:
    if tensor.numel() % group.size:
        raise ValueError(
            f"{what}: {name} has {tensor.numel()} elements, which comm.nranks() ({group.size}) must divide"
        )
    return tensor.numel() // group.size


def _global_rank(group: native.BaguaProcessGroup, rank: Any, name: str, what: str) -> int:
    """The global rank of ``rank``, a rank of the communicator (as the original's src/dst were)."""
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < group.size:
        raise ValueError(f"{what}: {name} must be a rank of the communicator, in [0, {group.size}), got {rank!r}")
    return group.ranks[rank]


def _count(what: str, count: Any) -> int:
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise ValueError(f"{what}: count must be a non-negative int (elements per rank), got {count!r}")
    return count


# -- point to point, broadcast, barrier -----------------------------------------------------

def send(tensor: torch.Tensor, dst: int, comm: CommunicatorArg = None) -> None:
    """Send ``tensor`` to rank ``dst`` of the communicator, which ``recv``s as many elements."""
    what = "bagua.torch_api.send"
    group = _group_of(comm, what)
    if group is not None:
        native.send(_flat(tensor, "tensor", what), _global_rank(group, dst, "dst", what), group=group)


def recv(tensor: torch.Tensor, src: int, comm: CommunicatorArg = None) -> None:
    """Receive into ``tensor`` what rank ``src`` of the communicator ``send``s."""
    what = "bagua.torch_api.recv"
    group = _group_of(comm, what)
    if group is not None:
        native.recv(_flat(tensor, "tensor", what), _global_rank(group, src, "src", what), group=group)


def broadcast(tensor: torch.Tensor, src: int = 0, comm: CommunicatorArg = None) -> None:
    """Copy rank ``src``'s ``tensor`` into ``tensor`` on every rank (same element count everywhere)."""
    what = "bagua.torch_api.broadcast"
    group = _group_of(comm, what)
    if group is not None:
        native.broadcast(_flat(tensor, "tensor", what), _global_rank(group, src, "src", what), group=group)


def broadcast_object(obj: Any, src: int = 0, comm: CommunicatorArg = None) -> Any:
    """Rank ``src``'s ``obj`` (anything ``torch.save`` can write) on every rank; a rank outside
    the communicator gets its own ``obj`` back.

    Example::

        state = broadcast_object(optimizer.state_dict(), 0)
    """
    what = "bagua.torch_api.broadcast_object"
    group = _group_of(comm, what)
    if group is None:
        return obj
    return native.broadcast_object(obj, _global_rank(group, src, "src", what), group=group)


def _coalesced(tensors: Sequence[torch.Tensor], run: Callable[[torch.Tensor], None], what: str) -> None:
    """Run ``run`` on one flat copy of ``tensors`` and copy the result back into them."""
    tensors = list(tensors)
    if not tensors:
        return
    for t in tensors:
        _flat(t, "every tensor", what)
    if len({(t.dtype, t.device) for t in tensors}) > 1:
        raise TypeError(f"{what}: the tensors must share one dtype and device (they travel as one flat buffer)")
    flat = _flatten_dense_tensors(tensors)
    run(flat)
    for tensor, synced in zip(tensors, _unflatten_dense_tensors(flat, tensors)):
        tensor.copy_(synced)


def broadcast_coalesced(tensors: Sequence[torch.Tensor], src: int = 0, comm: CommunicatorArg = None) -> None:
    """``broadcast`` of several tensors of one dtype in one message."""
    what = "bagua.torch_api.broadcast_coalesced"
    group = _group_of(comm, what)
    if group is not None:
        root = _global_rank(group, src, "src", what)
        _coalesced(tensors, lambda flat: native.broadcast(flat, root, group=group), what)


def barrier(comm: CommunicatorArg = None) -> None:
    """Wait until every rank of the communicator has called it."""
    group = _group_of(comm, "bagua.torch_api.barrier")
    if group is not None:
        native.barrier(group=group)


# -- reductions ---------------------------------------------------------------------------------

def allreduce(send_tensor: torch.Tensor, recv_tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM,
              comm: CommunicatorArg = None) -> None:
    """Reduce ``send_tensor`` across ranks into ``recv_tensor`` (as many elements) on every rank.

    Example::

        allreduce(grad, averaged, op=ReduceOp.AVG)
    """
    what = "bagua.torch_api.allreduce"
    group = _group_of(comm, what)
    if group is None:
        return
    send, recv = _pair(send_tensor, recv_tensor, what)
    _expect_size(what, "recv_tensor", recv, send.numel(), "as many as send_tensor")
    recv.copy_(send)
    native.allreduce(recv, _native_op(op, what), group=group)


def allreduce_inplace(tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, comm: CommunicatorArg = None) -> None:
    """The in-place ``allreduce``."""
    what = "bagua.torch_api.allreduce_inplace"
    group = _group_of(comm, what)
    if group is not None:
        native.allreduce(_flat(tensor, "tensor", what), _native_op(op, what), group=group)


def allreduce_coalesced_inplace(tensors: Sequence[torch.Tensor], op: ReduceOp = ReduceOp.SUM,
                                comm: CommunicatorArg = None) -> None:
    """``allreduce_inplace`` of several tensors of one dtype in one message."""
    what = "bagua.torch_api.allreduce_coalesced_inplace"
    group = _group_of(comm, what)
    if group is not None:
        native_op = _native_op(op, what)
        _coalesced(tensors, lambda flat: native.allreduce(flat, native_op, group=group), what)


def reduce(send_tensor: torch.Tensor, recv_tensor: torch.Tensor, dst: int, op: ReduceOp = ReduceOp.SUM,
           comm: CommunicatorArg = None) -> None:
    """Reduce ``send_tensor`` across ranks into ``recv_tensor`` (as many elements) of rank ``dst``;
    elsewhere ``recv_tensor`` is left alone."""
    what = "bagua.torch_api.reduce"
    group = _group_of(comm, what)
    if group is None:
        return
    send, recv = _pair(send_tensor, recv_tensor, what)
    _expect_size(what, "recv_tensor", recv, send.numel(), "as many as send_tensor")
    root, native_op = _global_rank(group, dst, "dst", what), _native_op(op, what)
    if group.rank == dst:
        recv.copy_(send)
        native.reduce(recv, root, native_op, group=group)
    else:
        native.reduce(send, root, native_op, group=group)  # leaves send_tensor unchanged


def reduce_inplace(tensor: torch.Tensor, dst: int, op: ReduceOp = ReduceOp.SUM, comm: CommunicatorArg = None) -> None:
    """The in-place ``reduce``: ``tensor`` holds the result on ``dst`` and is unchanged elsewhere."""
    what = "bagua.torch_api.reduce_inplace"
    group = _group_of(comm, what)
    if group is not None:
        native.reduce(_flat(tensor, "tensor", what), _global_rank(group, dst, "dst", what), _native_op(op, what),
                      group=group)


def reduce_scatter(send_tensor: torch.Tensor, recv_tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM,
                   comm: CommunicatorArg = None) -> None:
    """Reduce ``send_tensor`` (``nranks`` times the elements of ``recv_tensor``) across ranks;
    rank ``i`` gets part ``i`` of the result in ``recv_tensor``."""
    what = "bagua.torch_api.reduce_scatter"
    group = _group_of(comm, what)
    if group is None:
        return
    send, recv = _pair(send_tensor, recv_tensor, what)
    _expect_size(what, "send_tensor", send, group.size * recv.numel(), "comm.nranks() times recv_tensor's")
    recv.copy_(native.reduce_scatter(send, _native_op(op, what), group=group))


def reduce_scatter_inplace(tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, comm: CommunicatorArg = None) -> None:
    """The in-place ``reduce_scatter``: this rank's part of the result goes to the first
    ``numel / nranks`` elements of ``tensor`` (MPI_Reduce_scatter_block's in-place layout, which
    the original's Aluminum backend followed); the other elements keep their input values."""
    what = "bagua.torch_api.reduce_scatter_inplace"
    group = _group_of(comm, what)
    if group is None:
        return
    flat = _flat(tensor, "tensor", what)
    count = _divisible(what, "tensor", flat, group)
    flat[:count].copy_(native.reduce_scatter(flat, _native_op(op, what), group=group))


# -- gathers and scatters ------------------------------------------------------------------------

def allgather(send_tensor: torch.Tensor, recv_tensor: torch.Tensor, comm: CommunicatorArg = None) -> None:
    """Every rank's ``send_tensor``, in rank order, in ``recv_tensor`` (``nranks`` times the elements)."""
    what = "bagua.torch_api.allgather"
    group = _group_of(comm, what)
    if group is None:
        return
    send, recv = _pair(send_tensor, recv_tensor, what)
    _expect_size(what, "recv_tensor", recv, group.size * send.numel(), "comm.nranks() times send_tensor's")
    recv.copy_(native.allgather(send, group=group))


def allgather_inplace(tensor: torch.Tensor, comm: CommunicatorArg = None) -> None:
    """The in-place ``allgather``: rank ``i`` contributes part ``i`` of ``tensor`` (``nranks`` equal parts)."""
    what = "bagua.torch_api.allgather_inplace"
    group = _group_of(comm, what)
    if group is None:
        return
    flat = _flat(tensor, "tensor", what)
    _divisible(what, "tensor", flat, group)
    flat.copy_(native.allgather(flat.view(group.size, -1)[group.rank], group=group))


def gather(send_tensor: torch.Tensor, recv_tensor: torch.Tensor, dst: int, comm: CommunicatorArg = None) -> None:
    """Every rank's ``send_tensor``, in rank order, in ``recv_tensor`` (``nranks`` times the
    elements) of rank ``dst``; elsewhere ``recv_tensor`` is left alone."""
    what = "bagua.torch_api.gather"
    group = _group_of(comm, what)
    if group is None:
        return
    send, recv = _pair(send_tensor, recv_tensor, what)
    _expect_size(what, "recv_tensor", recv, group.size * send.numel(), "comm.nranks() times send_tensor's")
    gathered = native.gather(send, _global_rank(group, dst, "dst", what), group=group)
    if gathered is not None:
        recv.copy_(gathered)


def gather_inplace(tensor: torch.Tensor, count: int, dst: int, comm: CommunicatorArg = None) -> None:
    """The in-place ``gather`` of ``count`` elements per rank: on ``dst``, ``tensor`` has
    ``nranks * count`` elements and its own part already at part ``dst``; elsewhere ``count``."""
    what = "bagua.torch_api.gather_inplace"
    group = _group_of(comm, what)
    if group is None:
        return
    flat, count, root = _flat(tensor, "tensor", what), _count(what, count), _global_rank(group, dst, "dst", what)
    is_dst = group.rank == dst
    _expect_size(what, "tensor", flat, group.size * count if is_dst else count,
                 "nranks * count on dst" if is_dst else "count off dst")
    gathered = native.gather(flat.view(group.size, count)[dst] if is_dst else flat, root, group=group)
    if gathered is not None:
        flat.copy_(gathered)


def scatter(send_tensor: torch.Tensor, recv_tensor: torch.Tensor, src: int, comm: CommunicatorArg = None) -> None:
    """Part ``i`` of rank ``src``'s ``send_tensor`` (``nranks`` times the elements of
    ``recv_tensor``, on every rank; read on ``src`` only) into ``recv_tensor`` of rank ``i``."""
    what = "bagua.torch_api.scatter"
    group = _group_of(comm, what)
    if group is None:
        return
    send, recv = _pair(send_tensor, recv_tensor, what)
    _expect_size(what, "send_tensor", send, group.size * recv.numel(), "comm.nranks() times recv_tensor's")
    recv.copy_(native.scatter(send, _global_rank(group, src, "src", what), group=group))


def scatter_inplace(tensor: torch.Tensor, count: int, src: int, comm: CommunicatorArg = None) -> None:
    """The in-place ``scatter`` of ``count`` elements per rank: on ``src``, ``tensor`` has
    ``nranks * count`` elements (its own part stays at part ``src``); elsewhere ``count``, overwritten."""
    what = "bagua.torch_api.scatter_inplace"
    group = _group_of(comm, what)
    if group is None:
        return
    flat, count, root = _flat(tensor, "tensor", what), _count(what, count), _global_rank(group, src, "src", what)
    is_src = group.rank == src
    _expect_size(what, "tensor", flat, group.size * count if is_src else count,
                 "nranks * count on src" if is_src else "count off src")
    mine = native.scatter(flat if is_src else flat.new_empty(group.size * count), root, group=group)
    if not is_src:
        flat.copy_(mine)


# -- all to all --------------------------------------------------------------------------------

def alltoall(send_tensor: torch.Tensor, recv_tensor: torch.Tensor, comm: CommunicatorArg = None) -> None:
    """Part ``j`` of ``send_tensor`` (``nranks`` equal parts) goes to rank ``j``; ``recv_tensor``
    (as many elements) holds, in rank order, the parts every rank sent here."""
    what = "bagua.torch_api.alltoall"
    group = _group_of(comm, what)
    if group is None:
        return
    send, recv = _pair(send_tensor, recv_tensor, what)
    _expect_size(what, "recv_tensor", recv, send.numel(), "as many as send_tensor")
    _divisible(what, "send_tensor", send, group)
    recv.copy_(native.alltoall(send, group=group))


def alltoall_inplace(tensor: torch.Tensor, comm: CommunicatorArg = None) -> None:
    """The in-place ``alltoall``."""
    what = "bagua.torch_api.alltoall_inplace"
    group = _group_of(comm, what)
    if group is None:
        return
    flat = _flat(tensor, "tensor", what)
    _divisible(what, "tensor", flat, group)
    flat.copy_(native.alltoall(flat, group=group))


def _per_rank(what: str, name: str, values: Sequence[int], group: native.BaguaProcessGroup) -> list[int]:
    """The first ``nranks`` entries of ``values`` (the original read that many), non-negative ints."""
    values = list(values)[: group.size]
    if len(values) < group.size or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ValueError(
            f"{what}: {name} must hold a non-negative int for each of the {group.size} ranks, got {values!r}"
        )
    return values


def _exchange_v(what: str, send: torch.Tensor, send_counts: Sequence[int], send_displs: Sequence[int],
                recv: torch.Tensor, recv_counts: Sequence[int], recv_displs: Sequence[int],
                group: native.BaguaProcessGroup) -> None:
    """MPI_Alltoallv on flat tensors: ``send_counts[j]`` elements from ``send_displs[j]`` go to
    rank ``j``; what rank ``j`` sends here lands at ``recv_displs[j]`` (``recv_counts[j]`` elements)."""
    parts = {}
    sides = (("send", send, send_counts, send_displs), ("recv", recv, recv_counts, recv_displs))
    for side, tensor, counts, displs in sides:
        counts = _per_rank(what, f"{side}_counts", counts, group)
        displs = _per_rank(what, f"{side}_displs", displs, group)
        for j, (count, displ) in enumerate(zip(counts, displs)):
            if displ + count > tensor.numel():
                raise ValueError(f"{what}: {side}_counts[{j}]={count} elements from {side}_displs[{j}]={displ} run "
                                 f"past the end of the {side} tensor ({tensor.numel()} elements)")
        parts[side] = [tensor[d:d + c] for c, d in zip(counts, displs)]
    received = native.alltoall_v(torch.cat(parts["send"]), [p.numel() for p in parts["send"]],
                                 [p.numel() for p in parts["recv"]], group=group)
    for target, piece in zip(parts["recv"], received.split([p.numel() for p in parts["recv"]])):
        target.copy_(piece)


def alltoall_v(send_tensor: torch.Tensor, send_counts: Sequence[int], send_displs: Sequence[int],
               recv_tensor: torch.Tensor, recv_counts: Sequence[int], recv_displs: Sequence[int],
               comm: CommunicatorArg = None) -> None:
    """``alltoall`` with a size and an offset per rank (MPI_Alltoallv, in elements):
    ``send_counts[j]`` elements of ``send_tensor`` from ``send_displs[j]`` go to rank ``j``; the
    ``recv_counts[j]`` elements rank ``j`` sends here land in ``recv_tensor`` at ``recv_displs[j]``
    (elements no count covers are left alone). Rank ``j``'s ``send_counts[i]`` must equal rank
    ``i``'s ``recv_counts[j]``.

    Example::

        # 2 ranks: keep 1 element, send the other 2 to the peer, receive the peer's 2 at offset 2
        alltoall_v(x, [1, 2], [0, 1], y, [1, 2], [0, 2]) if rank == 0 else ...
    """
    what = "bagua.torch_api.alltoall_v"
    group = _group_of(comm, what)
    if group is not None:
        send, recv = _pair(send_tensor, recv_tensor, what)
        _exchange_v(what, send, send_counts, send_displs, recv, recv_counts, recv_displs, group)


def alltoall_v_inplace(tensor: torch.Tensor, counts: Sequence[int], displs: Sequence[int],
                       comm: CommunicatorArg = None) -> None:
    """The in-place ``alltoall_v``: ``counts[j]`` elements at ``displs[j]`` go to rank ``j`` and
    are replaced by the ``counts[j]`` elements rank ``j`` sends here."""
    what = "bagua.torch_api.alltoall_v_inplace"
    group = _group_of(comm, what)
    if group is not None:
        flat = _flat(tensor, "tensor", what)
        _exchange_v(what, flat, counts, displs, flat, counts, displs, group)
