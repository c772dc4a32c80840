"""Hierarchical allreduce: reduce within each node, allreduce among node leaders, broadcast back.

Only the node leaders (local rank 0) talk across machines, so the slow inter-node links carry
one message per node instead of one per rank. The result equals a flat allreduce (up to float
rounding, and up to the codec's error when the inter-node step is compressed).

Example::

    bagua.init_process_group()
    hierarchical_allreduce(grads, op="avg")                               # exact
    hierarchical_allreduce(grads, op="avg", compression="minmax_uint8")   # compressed across nodes
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from .checks import describe
from .collectives import ReduceOp, allreduce, as_reduce_op, broadcast, reduce
from .compressed import SEGMENT_ELEMS, check_nonfinite_choice, compressed_allreduce, raise_if_nonfinite
from .compression import Codec, get_codec
from .error_feedback import ErrorFeedback
from .process_group import NodeGroups, get_inter_node_group, get_intra_node_group, get_local_rank


def hierarchical_allreduce(
    tensor: torch.Tensor,
    op: Union[ReduceOp, str] = ReduceOp.AVG,
    compression: Optional[Union[str, Codec]] = None,
    nonfinite: str = "raise",
    groups: Optional[NodeGroups] = None,
    starts: Sequence[int] = (),
    segment_elems: int = SEGMENT_ELEMS,
    error_feedback: Optional[ErrorFeedback] = None,
) -> None:
    """Allreduce ``tensor`` in place over all ranks in three steps (SUM or AVG).

    Args:
        tensor: the same shape and dtype on every rank.
        op: ``SUM`` or ``AVG``.
        compression: codec for the inter-node step (the intra-node steps stay exact).
        nonfinite: with ``compression``, when a rank's input holds NaN or Inf: ``"raise"`` a
            ValueError on every rank, or ``"propagate"`` the non-finite values to every rank
            (see ``compressed_allreduce``). Exact steps always propagate them.
        groups: the node communicators to use (default: the job's, from ``init_process_group``;
            ``bagua.comm.new_node_groups()`` makes private ones).
        starts, segment_elems: how the compressed step cuts its codec blocks and segments (see
            ``compressed_allreduce``).
        error_feedback: the compressed step's residuals (see ``compressed_allreduce``); only node
            leaders use theirs.
    """
    op = as_reduce_op(op)
    if op not in (ReduceOp.SUM, ReduceOp.AVG):
        raise ValueError(f"hierarchical_allreduce supports SUM and AVG, got {op.name}")
    check_nonfinite_choice(nonfinite)
    if groups is None:
        groups = NodeGroups(get_intra_node_group(), get_inter_node_group(), get_local_rank() == 0)
    intra, inter = groups.intra, groups.inter
    leader = intra.ranks[0]
    reduce(tensor, dst=leader, op=ReduceOp.SUM, group=intra)
    if groups.is_leader:
        if compression is None:
            allreduce(tensor, op=op, group=inter)
        else:  # non-finite values reach every rank first: the leaders alone raising would hang the others
            compressed_allreduce(tensor, op=op, codec=compression, group=inter, nonfinite="propagate",
                                 starts=starts, segment_elems=segment_elems, error_feedback=error_feedback)
        if op == ReduceOp.AVG and intra.size > 1:
            tensor.div_(intra.size)
    broadcast(tensor, src=leader, group=intra)
    if compression is not None and nonfinite == "raise" and inter.size > 1:
        what = f"bagua.comm.hierarchical_allreduce[{get_codec(compression).name}]({describe(tensor)})"
        raise_if_nonfinite(what, tensor)


__all__ = ["hierarchical_allreduce"]
