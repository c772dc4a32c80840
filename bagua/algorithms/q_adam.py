"""qadam: Adam with allreduced gradients during warm-up, then 8-bit compressed momentum.

During ``QAdamOptimizer``'s warm-up every bucket of gradients is allreduced exactly, so the
optimizer is plain data-parallel Adam. Afterwards the variance is frozen, and each bucket's op
updates the local momentum from the local gradient (m ← β1·m + (1−β1)·(g + wd·x)) and averages
it across ranks MinMaxUInt8-compressed, as m / (sqrt(v̂) + eps): the variance is identical on
all ranks, so this is the same average, and the 8-bit rounding then stays small next to each
coordinate's own update (compressing m itself, coordinates with a small variance got
rounding noise of the block's large momenta divided by their small sqrt(v): it diverged within
a few steps on a 10M-parameter MLP). The optimizer then applies ``lr · m̂ / (sqrt(v̂) + eps)``. All ranks apply the same averaged momentum, so they stay in step.

Example::

    opt = bagua.optim.QAdamOptimizer(model.parameters(), lr=1e-3, warmup_steps=100)
    model = bagua.DistributedDataParallel(model, [opt], bagua.algorithms.QAdamAlgorithm(opt))
"""

from __future__ import annotations

import torch

from ..comm import BaguaProcessGroup, Bucket, ReduceOp, allreduce
from ..comm.hierarchical import hierarchical_allreduce
from ..optim.qadam import QAdamOptimizer
from .base import Algorithm, AlgorithmImpl
from .gradient_allreduce import check_hierarchical_group

COMPRESSION = "minmax_uint8"


class QAdamImpl(AlgorithmImpl):
    def __init__(self, process_group: BaguaProcessGroup, optimizer: QAdamOptimizer, hierarchical: bool):
        super().__init__(process_group)
        if hierarchical:
            check_hierarchical_group(process_group)
        self.optimizer, self.hierarchical = optimizer, hierarchical
        optimizer.momentum_from_algorithm = True

    def _allreduce(self, flat: torch.Tensor, compression) -> None:
        if self.hierarchical:
            hierarchical_allreduce(flat, op=ReduceOp.AVG, compression=compression)
        else:
            allreduce(flat, op=ReduceOp.AVG, group=self.process_group, compression=compression)

    def init_operations(self, ddp, bucket: Bucket) -> None:
        params = [ddp.named_parameter(name) for name in ddp.names_in(bucket)]
        groups = {id(p): g for g in self.optimizer.param_groups for p in g["params"]}
        missing = [name for name, p in zip(ddp.names_in(bucket), params) if id(p) not in groups]
        if missing:
            raise ValueError(f"QAdamAlgorithm: parameters {missing[:5]} are not in the QAdamOptimizer it was given")
        # the momentum tensors become views of one flat buffer, aligned with the gradient bucket
        momentum = Bucket([self.optimizer.state[p]["exp_avg"] for p in params], name=f"{bucket.name}.exp_avg")

        frozen: list[torch.Tensor] = []  # the frozen denominators of the bucket, once known

        @torch.no_grad()
        def communicate(b: Bucket) -> None:
            if self.optimizer.in_warmup:
                self._allreduce(b.flat, None)
                return
            if not frozen:
                frozen.append(torch.cat([self.optimizer.denominator(p, groups[id(p)]).reshape(-1) for p in params]))
            for p, m in zip(params, momentum.tensors):
                group = groups[id(p)]
                beta1 = group["betas"][0]
                m.mul_(beta1).add_(QAdamOptimizer.momentum_input(p, group), alpha=1 - beta1)
            # Averaged in the preconditioned space m / (sqrt(v) + eps): v is the same on every rank,
            # so the average is the same, and the codec's rounding is relative to the update itself
            # rather than to the momentum of the block's largest coordinates.
            momentum.flat.div_(frozen[0])
            self._allreduce(momentum.flat, COMPRESSION)
            momentum.flat.mul_(frozen[0])

        bucket.append_op(communicate, "qadam")


@Algorithm.register("qadam")
class QAdamAlgorithm(Algorithm):
    """QAdam: exact gradient averaging during warm-up, then compressed momentum averaging.

    Args:
        q_adam_optimizer: the ``bagua.optim.QAdamOptimizer`` that steps the model.
        hierarchical: exact within nodes, compressed across node leaders.
    """

    def __init__(self, q_adam_optimizer: QAdamOptimizer, hierarchical: bool = False):
        if not isinstance(q_adam_optimizer, QAdamOptimizer):
            raise TypeError(
                f"QAdamAlgorithm needs a bagua.optim.QAdamOptimizer, got {type(q_adam_optimizer).__name__}"
            )
        self.optimizer = q_adam_optimizer
        self.hierarchical = bool(hierarchical)

    def reify(self, process_group: BaguaProcessGroup) -> AlgorithmImpl:
        return QAdamImpl(process_group, self.optimizer, self.hierarchical)
