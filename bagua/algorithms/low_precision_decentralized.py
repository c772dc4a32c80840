"""low_precision_decentralized: decentralized SGD on a ring where only 8-bit differences travel.

The update is DCD-PSGD (Tang, Gan, Zhang, Zhang, Liu: "Communication Compression for
Decentralized Training", NeurIPS 2018) on a ring, as the original Bagua runs it. Every rank i
keeps exact replicas x̂_j of its ring neighbours' weights and x̂_i of its own (its weights as the
neighbours know them); they stay exact because every rank applies the very same decoded
messages. A communication step (every ``communication_interval`` steps) runs after the optimizer
step, which has turned the weights into x_{t+½} = x_t − lr·g_i(x_t):

1. z = x_{t+½} + ⅓·x̂_left + ⅓·x̂_right − ⁵⁄₃·x̂_i
     = (x_{t+½} − x̂_i) + (⅓·(x̂_left + x̂_i + x̂_right) − x̂_i):
   the local progress since the last communication plus the ring mixing's correction,
2. z is MinMaxUInt8-encoded and sent to both neighbours; every rank decodes C(z) and sets
   x̂_i ← x̂_i + C(z), x ← x̂_i, and x̂_j ← x̂_j + C(z_j) for each neighbour j.

The weights are ⅓ for self, left and right; with two ranks left and right are the same rank,
which then counts ⅔. Between communication steps the optimizer trains locally and the next
communication step sends that progress whole. With ``hierarchical=True`` the ranks of a node
average exactly after the optimizer step, the node leaders form the ring, and each leader
broadcasts the result within its node.

The replicas are taken exactly (full precision, one exchange with the neighbours) at the first
training step, and again at the first step after the weights were changed outside a step
(``on_weights_loaded``, which the wrapper calls after ``load_state_dict``).

Example::

    model = bagua.DistributedDataParallel(model, [opt], algorithm="low_precision_decentralized")
"""

from __future__ import annotations

import torch

from ..comm import BaguaProcessGroup, Bucket, ReduceOp, allreduce, alltoall_v, broadcast, checks
from ..comm.compression import MinMaxUInt8, Payload
from .base import Algorithm, AlgorithmImpl, WeightCommunicationImpl, check_positive_int
from .gradient_allreduce import hierarchical_node_groups

_MIX = 1.0 / 3.0  # the ring's mixing weight of self, left and right


def ring_neighbours(rank: int, size: int) -> list[int]:
    """Group ranks of ``rank``'s ring neighbours, without repeats (one with two ranks)."""
    return sorted({(rank - 1) % size, (rank + 1) % size} - {rank})


class _RingState:
    """Replicas for one bucket: this rank's weights as the neighbours know them (``own``), and
    theirs (``peers``, by group rank)."""

    def __init__(self, own: torch.Tensor, peers: dict[int, torch.Tensor]):
        self.own = own
        self.peers = peers


class LowPrecisionDecentralizedImpl(WeightCommunicationImpl):
    needs_optimizers = True  # the replicas follow the optimizer's steps; without one they never move

    def __init__(self, process_group: BaguaProcessGroup, hierarchical: bool, interval: int):
        super().__init__(process_group, interval)
        self.node_groups = hierarchical_node_groups(process_group) if hierarchical else None
        self.ring = self.node_groups.inter if hierarchical else process_group
        self.in_ring = not hierarchical or self.node_groups.is_leader
        rank, size = self.ring.rank, self.ring.size
        self.neighbours = ring_neighbours(rank, size) if self.in_ring else []
        # left then right; with two ranks both are the other rank
        self.sides = [(rank - 1) % size, (rank + 1) % size] if self.neighbours else []
        self.codec = MinMaxUInt8()
        self._states: dict[int, _RingState] = {}
        self._stale = True  # replicas are taken at the first step

    def on_weights_loaded(self, ddp) -> None:
        """The weights changed outside a step (a checkpoint was loaded): take the replicas anew,
        exactly, at the next training step. Called on every rank.

        Example::

            model.load_state_dict(checkpoint)
            ddp.impl.on_weights_loaded(ddp)
        """
        self._stale = True

    def tunables(self, ddp) -> dict:
        """Nothing: the 8-bit blocks run over each bucket's flat weights (as in the original
        Bagua, whose reference results the tests reproduce), so the bucket size changes them."""
        return {}

    def on_rebucket(self, ddp, carry) -> None:
        """The replicas move to the new buckets, value for value (nothing is taken anew)."""
        if not self._states:
            return
        own = carry({key: state.own for key, state in self._states.items()})
        peers = {j: carry({key: state.peers[j] for key, state in self._states.items()}) for j in self.neighbours}
        self._states = {key: _RingState(own[key], {j: peers[j][key] for j in self.neighbours}) for key in own}

    def replicas(self, bucket: Bucket) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's replicas for ``bucket``: its own weights as its neighbours know them (x̂_i),
        its left and its right neighbour's weights (the original Bagua's ``bucket._weight``,
        ``_left_peer_weight`` and ``_right_peer_weight``). Before the first training step, and on
        a rank that exchanges with no one (a ring of one; not a node leader under
        ``hierarchical=True``), no one holds a replica of anyone: all three are the weights.

        Example::

            own, left, right = ddp.impl.replicas(ddp.buckets[0])
        """
        state = self._states.get(id(bucket))
        if state is None:
            return bucket.flat, bucket.flat, bucket.flat
        left, right = self.sides
        return state.own, state.peers[left], state.peers[right]

    def on_forward_pre(self, ddp) -> None:
        if self.communicating:  # the last communication step's optimizer step was skipped or raised
            self._communicate(ddp)
        super().on_forward_pre(ddp)
        if self._stale:
            self._take_replicas(ddp)
            self._stale = False

    @torch.no_grad()
    def _take_replicas(self, ddp) -> None:
        """Replicas = the current weights: this rank's own, and its neighbours' (full precision)."""
        if not self.neighbours:
            return
        for bucket in ddp.buckets:
            received = self._swap(bucket.flat)
            n = bucket.flat.numel()
            self._states[id(bucket)] = _RingState(
                bucket.flat.clone(), {j: received[k * n:(k + 1) * n].clone() for k, j in enumerate(self.neighbours)}
            )

    def on_optimizer_step_post(self, ddp) -> None:
        if self.communicating:
            self._communicate(ddp)

    @torch.no_grad()
    def _communicate(self, ddp) -> None:
        """The communication step's exchange: after the optimizer step, or at the next training
        forward when this rank's step did not happen (GradScaler skipped it, or it raised), so
        every rank still exchanges once per communication step and nobody waits forever."""
        self.communicating = False
        with checks.trusted():  # the engine verified the buckets alike on every rank; every rank is here
            self._exchange_buckets(ddp)

    def _exchange_buckets(self, ddp) -> None:
        for bucket in ddp.buckets:
            if self.node_groups is not None:
                allreduce(bucket.flat, op=ReduceOp.AVG, group=self.node_groups.intra)
            if self.neighbours:
                self._exchange(bucket)
            if self.node_groups is not None:
                intra = self.node_groups.intra
                broadcast(bucket.flat, src=intra.ranks[0], group=intra)

    def _swap(self, data: torch.Tensor) -> torch.Tensor:
        """Send ``data`` (1-D) to each neighbour; return theirs, end to end in ``self.neighbours`` order."""
        n = data.numel()
        splits = [n if j in self.neighbours else 0 for j in range(self.ring.size)]
        return alltoall_v(data.repeat(len(self.neighbours)), splits, splits, group=self.ring)

    def _exchange(self, bucket: Bucket) -> None:
        state = self._states[id(bucket)]
        # z = (x - x̂_i) + (mixed replicas - x̂_i), each term rounded as the original's reference
        # rounds it (z += ⅓·x̂_left; z += ⅓·x̂_right; z -= ⁵⁄₃·x̂_i): a fused multiply-add rounds once,
        # and a difference in the last bit can move an 8-bit code by a whole level
        z, term = bucket.flat.clone(), torch.empty_like(bucket.flat)
        for j in self.sides:
            z.add_(torch.mul(state.peers[j], _MIX, out=term))
        z.sub_(torch.mul(state.own, 2.0 - _MIX, out=term))
        mine = self.codec.encode(z)
        received = self._swap(mine.data)
        wire = mine.data.numel()
        state.own.add_(self.codec.decode(mine))
        bucket.flat.copy_(state.own)
        for k, j in enumerate(self.neighbours):
            theirs = Payload(received[k * wire:(k + 1) * wire], mine.shape, mine.dtype)
            state.peers[j].add_(self.codec.decode(theirs))


@Algorithm.register("low_precision_decentralized")
class LowPrecisionDecentralizedAlgorithm(Algorithm):
    """Decentralized SGD on a ring with 8-bit compressed weight differences (DCD-PSGD).

    Needs the optimizers at wrap time (``DistributedDataParallel(model, [opt], ...)``): it
    communicates after each of their steps.

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
