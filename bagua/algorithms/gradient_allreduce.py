"""gradient_allreduce: every rank ends backward holding the average (or sum) of all gradients.

Buckets are launched as they fill during backward, in the same order on every rank, and
allreduced while the rest of backward runs. ``hierarchical=True`` reduces within each node,
allreduces among node leaders and broadcasts within the node: the same result, with only
one rank per machine on the inter-node links.

Example::

    model = bagua.DistributedDataParallel(model, [opt], GradientAllReduceAlgorithm(hierarchical=True))
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from ..comm import (
    BaguaProcessGroup, Bucket, ErrorFeedback, Handle, NodeGroups, ReduceOp, allreduce, compressed_allreduce,
    get_default_group, new_node_groups,
)
from ..comm.compressed import SEGMENT_ELEMS
from ..comm.compression import Codec, get_codec
from ..comm.hierarchical import hierarchical_allreduce
from ..comm.process_group import get_local_size
from .base import Algorithm, AlgorithmImpl
from .tunable import Tunable, powers_of_two

#: segment sizes (elements) the autotuner tries for a compressed allreduce
SEGMENT_SIZES = powers_of_two(1 << 16, 1 << 22)


def allreduce_bucket(bucket: Bucket, process_group: BaguaProcessGroup, op: ReduceOp,
                     node_groups: Optional[NodeGroups] = None, compression: Optional[Union[str, Codec]] = None,
                     segment_elems: int = SEGMENT_ELEMS, error_feedback: Optional[ErrorFeedback] = None,
                     ) -> Optional[Handle]:
    """``allreduce_flat`` of ``bucket``'s flat buffer, its tensors beginning at the bucket's offsets.

    Example::

        bucket.append_op(lambda b: allreduce_bucket(b, group, ReduceOp.AVG, compression="minmax_uint8"))
    """
    return allreduce_flat(bucket.flat, bucket.offsets, process_group, op, node_groups, compression, segment_elems,
                          error_feedback)


def allreduce_flat(flat: torch.Tensor, starts: Sequence[int], process_group: BaguaProcessGroup, op: ReduceOp,
                   node_groups: Optional[NodeGroups] = None, compression: Optional[Union[str, Codec]] = None,
                   segment_elems: int = SEGMENT_ELEMS, error_feedback: Optional[ErrorFeedback] = None,
                   ) -> Optional[Handle]:
    """Allreduce the flat buffer of several tensors (beginning at ``starts``) now: flat, or
    hierarchical over ``node_groups``; exact (returns the collective's handle) or compressed (with
    ``error_feedback``'s residuals, if given). A compressed one quantizes each tensor on its own
    blocks, so neither the buffer's other tensors nor ``segment_elems`` (the pipelining of the
    compressed allreduce) change its result: a wrapper bucket and a torch DDP bucket holding a
    tensor give it the same bits.

    NaN and Inf come out on every rank, compressed or not (as an exact allreduce gives them), so
    that a loss scaler (``torch.amp.GradScaler``) sees an overflow on any rank and skips the step
    on all of them.

    Example::

        allreduce_flat(bucket.buffer(), offsets, group, ReduceOp.AVG, compression="sign1", error_feedback=state)
    """
    if node_groups is not None:
        return hierarchical_allreduce(flat, op=op, compression=compression, groups=node_groups,
                                      nonfinite="propagate", starts=starts, segment_elems=segment_elems,
                                      error_feedback=error_feedback)
    if compression is not None:
        return compressed_allreduce(flat, op=op, codec=compression, group=process_group, nonfinite="propagate",
                                    starts=starts, segment_elems=segment_elems, error_feedback=error_feedback)
    return allreduce(flat, op=op, group=process_group, async_op=True)


def append_gradient_allreduce(
    bucket: Bucket,
    process_group: BaguaProcessGroup,
    average: bool,
    node_groups: Optional[NodeGroups] = None,
    compression: Optional[Union[str, Codec]] = None,
    segment_elems: int = SEGMENT_ELEMS,
) -> None:
    """Append to ``bucket`` an ``allreduce_bucket`` of its flat buffer, averaged or summed (an
    exact flat one as the bucket's own allreduce, which the engine launches without a hand-off)."""
    op = ReduceOp.AVG if average else ReduceOp.SUM
    if node_groups is None and compression is None:
        bucket.append_allreduce(op=op, group=process_group)
        return
    kind = "hierarchical_allreduce" if node_groups is not None else "allreduce"
    bucket.append_op(lambda b: allreduce_bucket(b, process_group, op, node_groups, compression, segment_elems),
                     f"{kind}[{get_codec(compression).name if compression is not None else 'exact'}]")


def hierarchical_node_groups(process_group: BaguaProcessGroup) -> NodeGroups:
    """Private node communicators for a hierarchical algorithm over ``process_group``, which
    must hold the whole job (the node groups span it)."""
    if process_group.ranks != get_default_group().ranks:
        raise ValueError(
            f"hierarchical=True needs the global process group (the node groups span the whole job), "
            f"got a group of ranks {list(process_group.ranks)}; use hierarchical=False for subgroups"
        )
    return new_node_groups()


class GradientAllReduceImpl(AlgorithmImpl):
    """Tunable (results unchanged): the bucket size; exact: ``hierarchical`` on jobs of several
    nodes with several ranks each (the same sums, grouped by node); compressed: the segment size
    (``segment_elems``). A compressed ``hierarchical`` is not tunable: it reduces exactly within
    nodes, which changes what is quantized."""

    supports_join = True  # a step is the buckets' allreduces: a rank out of data shadows them with zeros

    def __init__(self, process_group: BaguaProcessGroup, hierarchical: bool, average: bool,
                 compression: Optional[Union[str, Codec]] = None):
        super().__init__(process_group)
        self.node_groups = hierarchical_node_groups(process_group) if hierarchical else None
        self._spare_node_groups = self.node_groups  # kept while the tuner switches hierarchical off
        self.average, self.compression = average, compression
        self.segment_elems = SEGMENT_ELEMS

    def init_operations(self, ddp, bucket: Bucket) -> None:
        append_gradient_allreduce(bucket, self.process_group, self.average, self.node_groups, self.compression,
                                  self.segment_elems)

    def tunables(self, ddp) -> dict[str, Tunable]:
        space = super().tunables(ddp)
        if self.compression is not None:
            space["segment_elems"] = Tunable(SEGMENT_SIZES, self.segment_elems)
        elif self._hierarchy_matters():
            space["hierarchical"] = Tunable((False, True), self.node_groups is not None)
        return space

    def _hierarchy_matters(self) -> bool:
        """Several nodes of several ranks, and this group is the whole job."""
        world = get_default_group()
        return self.process_group.ranks == world.ranks and 1 < get_local_size() < world.size

    def set_tunable(self, ddp, name: str, value: object) -> None:
        if name == "segment_elems" and self.compression is not None:
            self.segment_elems = int(value)
        elif name == "hierarchical" and self.compression is None:
            if value and self._spare_node_groups is None:  # every rank applies it at the same step
                self._spare_node_groups = hierarchical_node_groups(self.process_group)
            self.node_groups = self._spare_node_groups if value else None
        else:
            super().set_tunable(ddp, name, value)


@Algorithm.register("gradient_allreduce")
class GradientAllReduceAlgorithm(Algorithm):
    """Exact gradient averaging (the algorithm of torch DDP and Horovod).

    Args:
        hierarchical: reduce within nodes first, then across node leaders.
        average: average the gradients (default) or sum them.
    """

    def __init__(self, hierarchical: bool = False, average: bool = True):
        self.hierarchical = bool(hierarchical)
        self.average = bool(average)

    def reify(self, process_group: BaguaProcessGroup) -> AlgorithmImpl:
        return GradientAllReduceImpl(process_group, self.hierarchical, self.average)
