"""onebit_grad: gradient averaging at 1 bit per value, with error feedback, after an exact warm-up.

For the first ``warmup_steps`` steps each bucket is allreduced exactly (as ``gradient_allreduce``):
1-bit compression from the first step hurts convergence, while the gradients are large and change
fast. Afterwards each bucket goes through the ``sign1`` scatter-reduce-gather of ``bagua.comm``
with error feedback (1-bit Adam's two-stage scheme): every rank sends the sign of (gradient +
its residual) and one scale per 256 values (their root mean square), 28x fewer bytes than fp32; the
rank that reduces a chunk sends the sign of (average + its residual) back. Every rank ends backward
with identical gradients; what each step's rounding left out is sent in the next steps.

State (``state_dict()``, saved per rank by ``bagua.checkpoint``, carried by ``ddp.rebucket`` and
autotuning per parameter, the same fused or not): the count of steps communicated (the warm-up's
clock), each rank's worker residuals and the server residuals of the elements it reduces. The
gradients, and so the weights, are bit-identical on every rank; no residual is (a worker residual
follows its rank's gradients, a server residual lives on its element's reducer only).

Gradients that overflow (GradScaler's inf/NaN step) on any rank come out non-finite on every rank,
in the codec blocks that held them, so every rank's scaler skips the step; the residuals then
restart at zero on every rank (under a loss scaler they are in scaled units: after the scale's
back-off they would count double). A loss scale that grows (every ``growth_interval`` steps) makes
the residuals count half, once: bounded, and corrected by the feedback itself.

Example::

    model = bagua.DistributedDataParallel(model, [opt], algorithm="onebit_grad", warmup_steps=100)
"""

from __future__ import annotations

import logging

import torch

from ..comm import BaguaProcessGroup, Bucket, ErrorFeedback, ReduceOp
from .base import Algorithm, AlgorithmImpl, Carry, check_positive_int
from .gradient_allreduce import GradientAllReduceImpl, allreduce_bucket

logger = logging.getLogger(__name__)

CODEC = "sign1"


class OneBitGradImpl(GradientAllReduceImpl):
    """The warm-up's exact allreduce, then sign1 with error feedback, per bucket."""

    state_per_rank = True  # residuals: checkpoints keep every rank's state

    def __init__(self, process_group: BaguaProcessGroup, hierarchical: bool, average: bool, warmup_steps: int):
        super().__init__(process_group, hierarchical, average, compression=CODEC)
        self.warmup_steps = warmup_steps
        self.steps = 0  # synced backwards communicated so far (also the shadow ones of join())
        self._feedback: dict[int, ErrorFeedback] = {}  # per bucket (id)
        self._members: dict[int, list[tuple[str, int, int]]] = {}  # per bucket: (name, offset, numel)

    @property
    def in_warmup(self) -> bool:
        """Whether this step's buckets are allreduced exactly (the same on every rank)."""
        return self.steps < self.warmup_steps

    def init_operations(self, ddp, bucket: Bucket) -> None:
        feedback = self._feedback.setdefault(id(bucket), ErrorFeedback())
        self._members[id(bucket)] = list(zip(ddp.for_algorithms.names_in(bucket), bucket.offsets, bucket.numels))
        op = ReduceOp.AVG if self.average else ReduceOp.SUM

        def run(b: Bucket):
            if self.in_warmup:
                return allreduce_bucket(b, self.process_group, op, self.node_groups)
            return allreduce_bucket(b, self.process_group, op, self.node_groups, CODEC, self.segment_elems, feedback)

        bucket.append_op(run, f"allreduce[exact warm-up, then {CODEC} with error feedback]")

    def on_backward_end(self, ddp) -> None:
        self.steps += 1

    def on_rebucket(self, ddp, carry: Carry) -> None:
        """The residuals move to the new buckets tensor by tensor (the server residuals to their
        new reducers at the next step)."""
        new = {id(b) for b in ddp.buckets}
        old = {key: (self._feedback.pop(key), self._members.pop(key)) for key in list(self._feedback) if key not in new}
        kept = [fb.worker for fb, _ in old.values() if fb.worker is not None]
        if not kept:
            return  # nothing kept yet (the warm-up), on every rank alike

        def flat(fb: ErrorFeedback, members: list, side: str) -> torch.Tensor:
            t = getattr(fb, side)
            return t if t is not None else kept[0].new_zeros(sum(numel for _, _, numel in members))

        worker, server = (carry({key: flat(fb, members, side) for key, (fb, members) in old.items()})
                          for side in ("worker", "server"))
        for key in new:
            self._feedback[key].load_state_dict({"worker": worker[key], "server": server[key]})

    def state_dict(self) -> dict:
        """The steps communicated, and this rank's residuals per parameter name (its own: they
        differ across ranks), with the rank and world size they belong to."""
        worker, server = {}, {}
        for key, fb in self._feedback.items():
            if fb.worker is None:
                continue
            for name, offset, numel in self._members[key]:
                worker[name] = fb.worker[offset:offset + numel].clone()
                server[name] = fb.server[offset:offset + numel].clone()
        return {"steps": self.steps, "rank": self.process_group.rank, "world_size": self.process_group.size,
                "worker": worker, "server": server}

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()``: the residuals of this rank's own state (every rank loads its
        own, as ``bagua.checkpoint`` does); a state of another rank or world size (one file for
        every rank) restarts them at zero, with a warning."""
        self.steps = int(state["steps"])
        mine = (state["rank"], state["world_size"]) == (self.process_group.rank, self.process_group.size)
        if not mine and state["worker"]:
            logger.warning(
                "onebit_grad: the checkpoint holds the error-feedback residuals of rank %d of %d, this is rank %d of "
                "%d: the residuals restart at zero (save every rank's state, as bagua.checkpoint does, to keep them)",
                state["rank"], state["world_size"], self.process_group.rank, self.process_group.size)
        for key, fb in self._feedback.items():
            members = self._members[key]
            if mine and members and all(name in state["worker"] for name, _, _ in members):
                fb.load_state_dict({side: self._flat(members, state[side]) for side in ("worker", "server")})
            else:
                fb.reset()
            fb.mark_moved()  # every rank alike, whatever it loaded: the next step hands the server residuals over

    @staticmethod
    def _flat(members: list[tuple[str, int, int]], per_name: dict[str, torch.Tensor]) -> torch.Tensor:
        """A bucket's flat residuals from per-parameter ones (members in bucket order: a fused
        optimizer's buffer may hold them in another order)."""
        flat = torch.empty(sum(numel for _, _, numel in members), dtype=torch.float32)
        for name, offset, numel in members:
            flat[offset:offset + numel] = per_name[name].reshape(-1)
        return flat


@Algorithm.register("onebit_grad")
class OneBitGradAlgorithm(Algorithm):
    """Gradient averaging at 1 bit per value (sign1, error feedback) after an exact warm-up.

    Args:
        warmup_steps: steps whose gradients are allreduced exactly first (default 100).
        hierarchical: exact reduction within nodes, 1-bit across node leaders.
        average: average the gradients (default) or sum them.

    Example::

        model = bagua.DistributedDataParallel(model, [opt], algorithm="onebit_grad", warmup_steps=50)
    """

    def __init__(self, warmup_steps: int = 100, hierarchical: bool = False, average: bool = True):
        check_positive_int("warmup_steps", warmup_steps, minimum=0)
        self.warmup_steps = warmup_steps
        self.hierarchical = bool(hierarchical)
        self.average = bool(average)

    def reify(self, process_group: BaguaProcessGroup) -> AlgorithmImpl:
        return OneBitGradImpl(process_group, self.hierarchical, self.average, self.warmup_steps)
