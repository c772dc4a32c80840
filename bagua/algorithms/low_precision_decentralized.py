"""low_precision_decentralized: decentralized SGD on a ring where only 8-bit differences travel.

The update is DCD-PSGD (Tang, Gan, Zhang, Zhang, Liu: "Communication Compression for
Decentralized Training", NeurIPS 2018) on a ring. Every rank i keeps exact replicas
x̂_j of its neighbours' weights (and x̂_i, its own weights as the neighbours know them);
they stay exact because every rank applies the very same decoded messages. On a
communication step (every ``communication_interval`` steps):

1. after backward, before the optimizer:  x ← w_i·x + Σ_j w_j·x̂_j  (ring mixing; w = 1/3 for
   self, left and right; 1/2 and 1/2 with two ranks),
2. the optimizer applies the local gradient g_i(x_t):  x_{t+½} = mix − lr·g_i(x_t),
3. z = x_{t+½} − x̂_i is MinMaxUInt8-encoded and sent to both neighbours; every rank decodes
   C(z) and sets x ← x̂_i + C(z), x̂_i ← x, and x̂_j ← x̂_j + C(z_j) for each neighbour j.

Between communication steps the optimizer trains locally; the next communication step sends
the whole drift since the last one. With ``hierarchical=True`` the ranks of a node average
exactly (before mixing and after the optimizer step) and the node leaders form the ring.

Example::

    model = bagua.DistributedDataParallel(model, [opt], algorithm="low_precision_decentralized")
"""

from __future__ import annotations

import torch

from ..comm import (
    BaguaProcessGroup, Bucket, ReduceOp, allreduce, alltoall_v, broadcast, get_inter_node_group,
    get_intra_node_group, get_local_rank,
)
from ..comm.compression import MinMaxUInt8, Payload
from .base import Algorithm, AlgorithmImpl, WeightCommunicationImpl, check_positive_int
from .gradient_allreduce import check_hierarchical_group


def ring_neighbours(rank: int, size: int) -> list[int]:
    """Group ranks of ``rank``'s ring neighbours, without repeats (one with two ranks)."""
    return sorted({(rank - 1) % size, (rank + 1) % size} - {rank})


class _RingState:
    """Replicas for one bucket: this rank's weights as the neighbours know them, and theirs."""

    def __init__(self, flat: torch.Tensor, neighbours: list[int]):
        self.own = flat.clone()
        self.peers = {j: flat.clone() for j in neighbours}


class LowPrecisionDecentralizedImpl(WeightCommunicationImpl):
    def __init__(self, process_group: BaguaProcessGroup, hierarchical: bool, interval: int):
        super().__init__(process_group, interval)
        if hierarchical:
            check_hierarchical_group(process_group)
        self.hierarchical = hierarchical
        self.ring = get_inter_node_group() if hierarchical else process_group
        self.in_ring = not hierarchical or get_local_rank() == 0
        self.neighbours = ring_neighbours(self.ring.rank, self.ring.size) if self.ring.size > 1 else []
        self.weight = 1.0 / (1 + len(self.neighbours))
        self.codec = MinMaxUInt8()
        self._states: dict[int, _RingState] = {}

    def init_operations(self, ddp, bucket: Bucket) -> None:
        self._states[id(bucket)] = _RingState(bucket.flat, self.neighbours)

    @torch.no_grad()
    def on_backward_end(self, ddp) -> None:
        if not self.communicating:
            return
        for bucket in ddp.buckets:
            self._node_average(bucket.flat)
            if self.in_ring and self.neighbours:
                state = self._states[id(bucket)]
                mixed = bucket.flat * self.weight
                for j in self.neighbours:
                    mixed.add_(state.peers[j] * self.weight)
                bucket.flat.copy_(mixed)

    @torch.no_grad()
    def on_optimizer_step_post(self, ddp) -> None:
        if not self.communicating:
            return
        for bucket in ddp.buckets:
            self._node_average(bucket.flat)
            if self.in_ring and self.neighbours:
                self._exchange(bucket)
            if self.hierarchical:
                intra = get_intra_node_group()
                broadcast(bucket.flat, src=intra.ranks[0], group=intra)
        self.communicating = False

    def _node_average(self, flat: torch.Tensor) -> None:
        if self.hierarchical:
            allreduce(flat, op=ReduceOp.AVG, group=get_intra_node_group())

    def _exchange(self, bucket: Bucket) -> None:
        state = self._states[id(bucket)]
        mine = self.codec.encode(bucket.flat - state.own)
        wire = mine.data.numel()
        splits = [wire if j in self.neighbours else 0 for j in range(self.ring.size)]
        received = alltoall_v(mine.data.repeat(len(self.neighbours)), splits, splits, group=self.ring)
        state.own.add_(self.codec.decode(mine))
        bucket.flat.copy_(state.own)
        for k, j in enumerate(self.neighbours):
            theirs = Payload(received[k * wire:(k + 1) * wire], mine.shape, mine.dtype)
            state.peers[j].add_(self.codec.decode(theirs))


@Algorithm.register("low_precision_decentralized")
class LowPrecisionDecentralizedAlgorithm(Algorithm):
    """Decentralized SGD on a ring with 8-bit compressed weight differences (DCD-PSGD).

    Args:
        hierarchical: average exactly within nodes; the ring connects node leaders.
        communication_interval: communicate every this many steps.
    """

    def __init__(self, hierarchical: bool = False, communication_interval: int = 1):
        check_positive_int("communication_interval", communication_interval)
        self.hierarchical = bool(hierarchical)
        self.communication_interval = communication_interval

    def reify(self, process_group: BaguaProcessGroup) -> AlgorithmImpl:
        return LowPrecisionDecentralizedImpl(process_group, self.hierarchical, self.communication_interval)
