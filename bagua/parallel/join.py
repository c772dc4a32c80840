"""``ddp.join()``: training on uneven inputs, as torch DDP's ``join`` does.

Every training step starts with a tiny allreduce of "still training" flags. A rank whose data
ran out (it left the ``with`` block) keeps answering those rounds with "done" and shadows each
step the others take: its buckets join theirs with zero gradients, and it takes part in the
unused-parameter and buffer messages, so no collective waits for it. Gradients are divided by
the initial world size (torch's default) or, with ``divide_by_initial_world_size=False``, by
the number of ranks still training. When every rank is done, all take the parameters, buffers
and optimizer state of the last rank that trained (torch syncs parameters only; the optimizer
state of the ranks that stopped early would otherwise lag). Supported by the algorithms whose
whole step is the buckets' ops during backward (gradient_allreduce, bytegrad).

Example::

    with model.join():
        for x, y in my_shard:        # shards of different lengths
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Iterator

import torch

from .. import comm
from ..comm.checks import trusted
from . import unused_parameters
from .state_sync import broadcast_tensors, sync_optimizer_states

if TYPE_CHECKING:
    from .ddp import DistributedDataParallel


class JoinState:
    """Which ranks still train, as agreed in the last round."""

    def __init__(self, ddp: "DistributedDataParallel", divide_by_initial_world_size: bool, throw_on_early_termination: bool):
        self.ddp = ddp
        self.group = ddp.comm_group
        self.divide_by_initial_world_size = divide_by_initial_world_size
        self.throw = throw_on_early_termination
        self.active = [True] * self.group.size
        self.previous = list(self.active)

    def notify_active(self) -> None:
        """This rank takes a training step (called at its training forward)."""
        self._round(True)

    def _round(self, active: bool) -> list[bool]:
        flags = torch.zeros(self.group.size, dtype=torch.int32)
        flags[self.group.rank] = int(active)
        with trusted():  # every rank calls this at the same point of every step
            comm.allreduce(flags, op=comm.ReduceOp.SUM, group=self.group)
        self.previous, self.active = self.active, [bool(f) for f in flags.tolist()]
        if self.throw and not all(self.active):
            done = [r for r, a in zip(self.group.ranks, self.active) if not a]
            raise RuntimeError(
                f"ranks {done} ran out of inputs (join(throw_on_early_termination=True)); every rank "
                f"stops here. Give every rank the same number of batches, or leave throw_on_early_termination False"
            )
        return self.active

    def authoritative_rank(self) -> int:
        """The rank whose buffers every rank takes: the first one still training."""
        return next(r for r, a in zip(self.group.ranks, self.active) if a)

    def scale_gradients(self) -> None:
        """With ``divide_by_initial_world_size=False``, average over the ranks still training."""
        training = sum(self.active)
        if self.divide_by_initial_world_size or training == self.group.size or not getattr(self.ddp.impl, "average", False):
            return
        with torch.no_grad():
            for bucket in self.ddp.buckets:
                bucket.flat.mul_(self.group.size / training)

    def _shadow_step(self) -> None:
        """One step of the others: zero gradients into every bucket, then what ends a synced step."""
        ddp = self.ddp
        with torch.no_grad():
            for bucket in ddp.buckets:
                bucket.flat.zero_()
        ddp._buffers_sent = False
        ddp._start_buffer_broadcast()
        ddp.for_algorithms.communicate_all()
        if ddp.find_unused_parameters:  # this rank used nothing: the others' use decides
            unused_parameters.adopt_averaged_gradients(ddp, list(ddp._slot), [])
        ddp._finish_synced_step()

    def shadow_until_everyone_is_done(self) -> None:
        """This rank's data ran out: shadow the others' steps, then take the last one's state."""
        while any(self._round(False)):
            self._shadow_step()
        last = next(r for r, a in zip(self.group.ranks, self.previous) if a)
        broadcast_tensors(self.ddp._synced_parameters() + self.ddp._synced_buffers(), self.group, last)
        sync_optimizer_states(self.ddp.optimizers, self.group, last)


@contextlib.contextmanager
def join(
    ddp: "DistributedDataParallel", divide_by_initial_world_size: bool, enable: bool, throw_on_early_termination: bool
) -> Iterator[None]:
    """The context of ``ddp.join()`` (see the module docstring)."""
    if not enable:
        yield
        return
    if not ddp.impl.supports_join:
        raise ValueError(
            f"join() shadows gradient buckets, and {ddp.algorithm!r} communicates otherwise (weights, momentum "
            f"or in the background); give every rank the same number of batches (e.g. drop_last, or "
            f"bagua.data.LoadBalancingDistributedSampler, which yields the same count on every rank)"
        )
    if ddp._join is not None:
        raise RuntimeError("join() contexts of one model cannot be nested")
    ddp._join = JoinState(ddp, divide_by_initial_world_size, throw_on_early_termination)
    try:
        yield
        ddp._join.shadow_until_everyone_is_done()
    finally:
        ddp._join = None
