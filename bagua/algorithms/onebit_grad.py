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

from ..comm import BaguaProcessGroup, Bucket, ReduceOp
from .base import Algorithm, AlgorithmImpl, Carry, check_positive_int
from .gradient_allreduce import GradientAllReduceImpl, allreduce_bucket
from .residuals import BucketResiduals

logger = logging.getLogger(__name__)

CODEC = "sign1"


class OneBitGradImpl(GradientAllReduceImpl):
    """The warm-up's exact allreduce, then sign1 with error feedback, per bucket."""

    state_per_rank = True  # residuals: checkpoints keep every rank's state

    def __init__(self, process_group: BaguaProcessGroup, hierarchical: bool, average: bool, warmup_steps: int):
        super().__init__(process_group, hierarchical, average, compression=CODEC)
        self.warmup_steps = warmup_steps
        self.steps = 0  # synced backwards communicated so far (also the shadow ones of join())
        self.residuals = BucketResiduals("onebit_grad", process_group, logger)  # per bucket

    @property
    def in_warmup(self) -> bool:
        """Whether this step's buckets are allreduced exactly (the same on every rank)."""
        return self.steps < self.warmup_steps

    def init_operations(self, ddp, bucket: Bucket) -> None:
        feedback = self.residuals.attach(id(bucket), ddp.for_algorithms.names_in(bucket), bucket.offsets, bucket.numels)
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
        self.residuals.rebucketed(id(b) for b in ddp.buckets)

    def state_dict(self) -> dict:
        """The steps communicated, and this rank's residuals per parameter name (its own: they
        differ across ranks), with the rank and world size they belong to."""
        return {"steps": self.steps, **self.residuals.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()``: the residuals of this rank's own state (every rank loads its
        own, as ``bagua.checkpoint`` does); a state of another rank or world size (one file for
        every rank) restarts them at zero, with a warning."""
        self.steps = int(state["steps"])
        self.residuals.load_state_dict(state)


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
