"""decentralized: average the weights with peers instead of the gradients with everyone.

On a communication step (every ``communication_interval`` steps) the weights x_t at the start
of forward are sent to the peers while forward and backward run; after backward the weights
are replaced by the peer average, and the optimizer then applies the local gradient:

    x_{t+1} = avg_peers(x_t) - lr * g_i(x_t)

(Lian et al., "Can Decentralized Algorithms Outperform Centralized Algorithms?", NeurIPS 2017.)
Peer modes: ``"all"`` averages over every rank; ``"shift_one"`` pairs ranks up, a different
peer each communication step (needs an even number of ranks). With ``hierarchical=True`` the
ranks of a node first average exactly among themselves, the node leaders run the peer
exchange among nodes, and the result is broadcast within each node.

Example::

    algo = DecentralizedAlgorithm(peer_selection_mode="shift_one", communication_interval=2)
    model = bagua.DistributedDataParallel(model, [opt], algo)
"""

from __future__ import annotations

import torch

from ..comm import BaguaProcessGroup, Bucket, ReduceOp, allreduce, broadcast, recv, send
from .base import Algorithm, AlgorithmImpl, WeightCommunicationImpl, check_choice, check_positive_int
from .gradient_allreduce import hierarchical_node_groups

PEER_SELECTION_MODES = ("all", "shift_one")


def shift_one_peer(rank: int, size: int, step: int) -> int:
    """The peer of ``rank`` among ``size`` ranks (even) at communication step ``step``.

    Ranks below size/2 pair with ones above it; the pairing shifts by one every step, so
    after size/2 steps every rank met every rank of the other half.
    """
    half = size // 2
    if rank < half:
        return (step + rank) % ((size + 1) // 2) + half
    return (rank - half - step) % half


def check_shift_one(size: int, what: str = "ranks") -> None:
    if size % 2:
        raise ValueError(
            f"peer_selection_mode='shift_one' pairs {what} up and needs an even number of them, got {size}; "
            f"use peer_selection_mode='all' or an even world size"
        )


def peer_average(tensor: torch.Tensor, group: BaguaProcessGroup, mode: str, comm_step: int) -> None:
    """Average ``tensor`` in place with the peers of this rank in ``group`` (mode all / shift_one)."""
    if group.size == 1:
        return
    if mode == "all":
        allreduce(tensor, op=ReduceOp.AVG, group=group)
        return
    peer = group.ranks[shift_one_peer(group.rank, group.size, comm_step)]
    theirs = torch.empty_like(tensor)
    handle = send(tensor, dst=peer, async_op=True, group=group)
    recv(theirs, src=peer, group=group)
    handle.wait()
    tensor.add_(theirs).mul_(0.5)


class DecentralizedImpl(WeightCommunicationImpl):
    def __init__(self, process_group: BaguaProcessGroup, hierarchical: bool, mode: str, interval: int):
        super().__init__(process_group, interval)
        self.node_groups = hierarchical_node_groups(process_group) if hierarchical else None
        self.peers = self.node_groups.inter if hierarchical else process_group
        if mode == "shift_one":
            check_shift_one(self.peers.size, "nodes" if hierarchical else "ranks")
        self.mode = mode
        self.comm_steps = 0
        self._averaged: dict[int, torch.Tensor] = {}

    def init_operations(self, ddp, bucket: Bucket) -> None:
        def average_weights(b: Bucket) -> None:
            x = self._averaged.get(id(b))
            if x is None:
                x = self._averaged[id(b)] = torch.empty_like(b.flat)
            x.copy_(b.flat)  # the weights at the start of this step's forward
            if self.node_groups is not None:
                intra = self.node_groups.intra
                allreduce(x, op=ReduceOp.AVG, group=intra)
                if self.node_groups.is_leader:
                    peer_average(x, self.peers, self.mode, self.comm_steps)
                broadcast(x, src=intra.ranks[0], group=intra)
            else:
                peer_average(x, self.peers, self.mode, self.comm_steps)

        bucket.append_op(average_weights, f"decentralized[{self.mode}]")

    def peer_weight(self, bucket: Bucket) -> torch.Tensor:
        """``bucket``'s weights as averaged with the peers at the last communication step (what
        replaced the weights before that step's optimizer update; the original Bagua's
        ``bucket._peer_weight``); before the first communication step, the weights themselves.

        Example::

            averaged = ddp.impl.peer_weight(ddp.buckets[0])
        """
        return self._averaged.get(id(bucket), bucket.flat)

    def on_rebucket(self, ddp, carry) -> None:
        """The last averaged weights (``peer_weight``) move to the new buckets."""
        if self._averaged:
            self._averaged = carry(self._averaged)

    def on_forward_pre(self, ddp) -> None:
        super().on_forward_pre(ddp)
        if self.communicating:
            ddp.for_algorithms.mark_all_ready()  # the ops copy the weights, then exchange while forward runs

    def state_dict(self) -> dict:
        return {"comm_steps": self.comm_steps}  # shift_one's peer schedule

    def load_state_dict(self, state: dict) -> None:
        self.comm_steps = int(state["comm_steps"])

    def on_backward_end(self, ddp) -> None:
        if not self.communicating:
            return
        with torch.no_grad():
            for bucket in ddp.buckets:
                bucket.flat.copy_(self._averaged[id(bucket)])
        self.comm_steps += 1
        self.communicating = False


@Algorithm.register("decentralized")
class DecentralizedAlgorithm(Algorithm):
    """Decentralized SGD: weights averaged with peers, overlapped with forward and backward.

    Args:
        hierarchical: average exactly within nodes; peers are other nodes.
        peer_selection_mode: ``"all"`` or ``"shift_one"`` (even number of ranks).
        communication_interval: communicate every this many steps.
    """

    def __init__(self, hierarchical: bool = False, peer_selection_mode: str = "all", communication_interval: int = 1):
        check_choice("peer_selection_mode", peer_selection_mode, PEER_SELECTION_MODES)
        check_positive_int("communication_interval", communication_interval)
        self.hierarchical = bool(hierarchical)
        self.peer_selection_mode = peer_selection_mode
        self.communication_interval = communication_interval

    def reify(self, process_group: BaguaProcessGroup) -> AlgorithmImpl:
        return DecentralizedImpl(process_group, self.hierarchical, self.peer_selection_mode, self.communication_interval)
