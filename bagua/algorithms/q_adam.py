"""qadam: Adam with allreduced gradients during warm-up, then 8-bit compressed momentum.

During ``QAdamOptimizer``'s warm-up every bucket of gradients is allreduced exactly during
backward, so the optimizer is plain data-parallel Adam. Afterwards nothing is communicated in
backward: the gradients stay local, and whatever the loop does to them before the step (clipping,
GradScaler's unscaling, accumulation over micro-batches) is what the momentum sees.
``QAdamOptimizer.step`` updates the local momentum m ← β1·m + (1−β1)·(g + wd·x) and calls this
algorithm's communicator (``optimizer.momentum_communicator``), which averages the momentum
across ranks MinMaxUInt8-compressed (one buffer per dtype and device, the same layout on every
rank); then the optimizer applies ``lr · m̂ / (sqrt(v̂) + eps)``. All ranks apply the same
averaged momentum, so they stay identical.

The momentum is averaged as m / (sqrt(v̂) + eps): the frozen variance is identical on all ranks,
so this is the same average, and the 8-bit rounding then stays small next to each coordinate's
own update (compressing m itself, coordinates with a small variance got rounding noise of the
block's large momenta divided by their small sqrt(v): it diverged within a few steps on a
10M-parameter MLP). It goes through a scratch buffer, so the momentum tensors stay the
optimizer's own (``load_state_dict`` and ``fuse_optimizer`` may replace or move them).

Example::

    opt = bagua.optim.QAdamOptimizer(model.parameters(), lr=1e-3, warmup_steps=100)
    model = bagua.DistributedDataParallel(model, [opt], bagua.algorithms.QAdamAlgorithm(opt))
"""

from __future__ import annotations

import torch

from ..comm import BaguaProcessGroup, Bucket, ReduceOp, allreduce
from ..comm.compressed import SEGMENT_ELEMS, compressed_allreduce
from ..comm.hierarchical import hierarchical_allreduce
from ..optim.qadam import QAdamOptimizer
from .base import Algorithm, AlgorithmImpl
from .gradient_allreduce import SEGMENT_SIZES, append_gradient_allreduce, hierarchical_node_groups
from .tunable import Tunable

COMPRESSION = "minmax_uint8"


class QAdamImpl(AlgorithmImpl):
    """The wrapper's hooks (warm-up: gradient allreduce) and the optimizer's ``MomentumCommunicator``."""

    def __init__(self, process_group: BaguaProcessGroup, optimizer: QAdamOptimizer, hierarchical: bool):
        super().__init__(process_group)
        self.node_groups = hierarchical_node_groups(process_group) if hierarchical else None
        self.optimizer = optimizer
        # per dtype and device: the parameters with their param groups, and a scratch buffer
        self._momentum_buffers: list[tuple[list[tuple[torch.Tensor, dict]], torch.Tensor]] = []
        self._covered: set[int] = set()  # ids of those parameters
        self.segment_elems = SEGMENT_ELEMS  # of the compressed momentum allreduce
        optimizer.momentum_communicator = self  # the wrapper built last wins; close() detaches it

    # --- the wrapper's hooks ------------------------------------------------------------------
    def tensors_to_communicate(self, ddp) -> list:
        groups = {id(p): g for g in self.optimizer.param_groups for p in g["params"]}
        named = list(reversed(ddp.named_trainable_parameters))
        missing = [name for name, p in named if id(p) not in groups]
        if missing:
            raise ValueError(f"QAdamAlgorithm: parameters {missing[:5]} are not in the QAdamOptimizer it was given")
        # The momentum is averaged in one buffer per dtype and device, in this order whatever the
        # gradient buckets are (fuse_optimizer changes those), so the 8-bit blocks are the same.
        layouts: dict[tuple, list[tuple[torch.Tensor, dict]]] = {}
        for _, p in named:
            layouts.setdefault((p.dtype, p.device), []).append((p, groups[id(p)]))
        self._momentum_buffers = [
            (params, torch.empty(sum(p.numel() for p, _ in params), dtype=dtype, device=device))
            for (dtype, device), params in layouts.items()
        ]
        self._covered = {id(p) for _, p in named}
        return super().tensors_to_communicate(ddp)

    def init_operations(self, ddp, bucket: Bucket) -> None:
        append_gradient_allreduce(bucket, self.process_group, average=True, node_groups=self.node_groups)

    def tunables(self, ddp) -> dict[str, Tunable]:
        """The bucket size (warm-up's gradient buckets) and the segment size of the momentum's
        compressed allreduce, whose buffers do not follow the buckets."""
        return {**super().tunables(ddp), "segment_elems": Tunable(SEGMENT_SIZES, self.segment_elems)}

    def set_tunable(self, ddp, name: str, value: object) -> None:
        if name == "segment_elems":
            self.segment_elems = int(value)
        else:
            super().set_tunable(ddp, name, value)

    def ready_on_backward(self, ddp) -> bool:
        # the optimizer's step count: the same for every backward of one step (accumulation)
        return self.optimizer.in_warmup

    def close(self, ddp) -> None:
        if self.optimizer.momentum_communicator is self:
            self.optimizer.momentum_communicator = None

    # --- MomentumCommunicator (called by QAdamOptimizer.step after warm-up) -----------------------
    def any_rank(self, flag: bool) -> bool:
        verdict = torch.tensor([float(flag)])
        allreduce(verdict, op=ReduceOp.MAX, group=self.process_group)
        return bool(verdict.item())

    def covers(self, p: torch.Tensor) -> bool:
        return id(p) in self._covered

    @torch.no_grad()
    def average_momentum(self) -> None:
        state = self.optimizer.state
        for params, scratch in self._momentum_buffers:
            views, offset = [], 0
            for p, group in params:
                m = state[p]["exp_avg"]
                denom = self.optimizer.denominator(p, group)
                view = scratch[offset : offset + m.numel()].view(m.shape)
                torch.div(m, denom, out=view)
                views.append((m, denom, view))
                offset += m.numel()
            if self.node_groups is not None:
                hierarchical_allreduce(scratch, op=ReduceOp.AVG, compression=COMPRESSION, groups=self.node_groups,
                                       segment_elems=self.segment_elems)
            else:
                compressed_allreduce(scratch, op=ReduceOp.AVG, codec=COMPRESSION, group=self.process_group,
                                     segment_elems=self.segment_elems)
            for m, denom, view in views:
                torch.mul(view, denom, out=m)


@Algorithm.register("qadam")
class QAdamAlgorithm(Algorithm):
    """QAdam: exact gradient averaging during warm-up, then compressed momentum averaging in
    ``QAdamOptimizer.step`` (see the module docstring and ``bagua.optim.QAdamOptimizer``).

    Args:
        q_adam_optimizer: the ``bagua.optim.QAdamOptimizer`` that steps the model. The wrapper
            attaches to it until ``close()`` (one at a time: the one built last).
        hierarchical: exact within nodes, compressed across node leaders.

    Example::

        opt = bagua.optim.QAdamOptimizer(model.parameters(), lr=1e-3, warmup_steps=100)
        model = bagua.DistributedDataParallel(model, [opt], QAdamAlgorithm(opt))
        model = bagua.DistributedDataParallel(model, [opt], "qadam", hierarchical=True)   # the same, by name
    """

    optimizer_class = QAdamOptimizer  # by name: the wrapper's one QAdamOptimizer

    def __init__(self, q_adam_optimizer: QAdamOptimizer, hierarchical: bool = False):
        if not isinstance(q_adam_optimizer, QAdamOptimizer):
            raise TypeError(
                f"QAdamAlgorithm needs a bagua.optim.QAdamOptimizer, got {type(q_adam_optimizer).__name__}"
            )
        self.optimizer = q_adam_optimizer
        self.hierarchical = bool(hierarchical)

    def reify(self, process_group: BaguaProcessGroup) -> AlgorithmImpl:
        return QAdamImpl(process_group, self.optimizer, self.hierarchical)
