"""Compressed gradient averaging with error feedback after an exact warm-up: what ``onebit_grad``
and ``bytegrad(error_feedback=True)`` run.

For the first ``warmup_steps`` steps each bucket is allreduced exactly (as ``gradient_allreduce``).
Afterwards each bucket goes through the codec's scatter-reduce-gather (``bagua.comm.compressed_allreduce``),
with error feedback (1-bit Adam's two-stage scheme, ``bagua.comm.ErrorFeedback``): every
rank encodes gradient + its residual, the rank that reduces a chunk encodes average + its residual,
and what each step's rounding left out is sent in the next steps. Every rank ends backward with
identical gradients.

State (``state_dict()``, saved per rank by ``bagua.checkpoint``, carried by ``ddp.rebucket`` and
autotuning per parameter, the same fused or not): the count of steps communicated (the warm-up's
clock), each rank's worker residuals and the server residuals of the elements it reduces. The gradients, and so the weights, are bit-identical on every rank; no
residual is (a worker residual follows its rank's gradients, a server residual lives on its
element's reducer only).

Gradients that overflow (GradScaler's inf/NaN step) on any rank come out non-finite on every rank,
in the codec blocks that held them, so every rank's scaler skips the step; the residuals then
restart at zero on every rank (under a loss scaler they are in scaled units: after the scale's
back-off they would count double). A loss scale that grows (every ``growth_interval`` steps) makes
the residuals count half, once: bounded, and corrected by the feedback itself.

Example::

    impl = CompressedGradientImpl(group, hierarchical=False, average=True, codec=Sign1(), warmup_steps=100,
                                  name="onebit_grad", log=logger)
"""

from __future__ import annotations

import logging

from ..comm import BaguaProcessGroup, Bucket, ReduceOp
from ..comm.compression import Codec
from .base import Carry
from .gradient_allreduce import GradientAllReduceImpl, allreduce_bucket
from .residuals import BucketResiduals


class WireCodec:
    """For an algorithm whose gradients travel through one codec (``self._codec``, private so that
    the algorithm's repr is its constructor's arguments): that codec, read-only
    (``bagua.comm_hooks`` sends through the same one)."""

    _codec: Codec

    @property
    def codec(self) -> Codec:
        """The codec of every byte sent after any warm-up."""
        return self._codec


class CompressedGradientImpl(GradientAllReduceImpl):
    """The warm-up's exact allreduce, then ``codec`` with error feedback, per bucket.

    Args:
        process_group, hierarchical, average: as ``GradientAllReduceImpl``.
        codec: the codec of the steps after warm-up.
        warmup_steps: steps allreduced exactly first.
        name: the algorithm's name, for warnings; log: its module's logger.
    """

    state_per_rank = True  # residuals: checkpoints keep every rank's state

    def __init__(self, process_group: BaguaProcessGroup, hierarchical: bool, average: bool, codec: Codec,
                 warmup_steps: int, name: str, log: logging.Logger):
        super().__init__(process_group, hierarchical, average, compression=codec)
        self.warmup_steps = warmup_steps
        self.steps = 0  # synced backwards communicated so far (also the shadow ones of join())
        self.residuals = BucketResiduals(name, process_group, log)  # per bucket

    @property
    def in_warmup(self) -> bool:
        """Whether this step's buckets are allreduced exactly (the same on every rank)."""
        return self.steps < self.warmup_steps

    def init_operations(self, ddp, bucket: Bucket) -> None:
        feedback = self.residuals.attach(id(bucket), ddp.for_algorithms.names_in(bucket), bucket.offsets, bucket.numels)
        op = ReduceOp.AVG if self.average else ReduceOp.SUM
        codec = self.compression

        def run(b: Bucket):
            if self.in_warmup:
                return allreduce_bucket(b, self.process_group, op, self.node_groups)
            return allreduce_bucket(b, self.process_group, op, self.node_groups, codec, self.segment_elems, feedback)

        bucket.append_op(run, f"allreduce[exact warm-up, then {codec.name} with error feedback]")

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
        every rank) restarts them at zero, with a warning; so does bytegrad's state without error
        feedback (no steps either: it has no warm-up)."""
        self.steps = int(state.get("steps", 0))
        self.residuals.load_state_dict(state)


__all__ = ["CompressedGradientImpl", "WireCodec"]
