"""onebit_grad: gradient averaging at 1 bit per value, with error feedback, after an exact warm-up.

For the first ``warmup_steps`` steps each bucket is allreduced exactly (as ``gradient_allreduce``):
1-bit compression from the first step hurts convergence, while the gradients are large and change
fast. Afterwards each bucket goes through the ``sign1`` scatter-reduce-gather of ``bagua.comm``
with error feedback (1-bit Adam's two-stage scheme): every rank sends the sign of (gradient +
its residual) and one scale per 256 values (their root mean square), 28x fewer bytes than fp32; the
rank that reduces a chunk sends the sign of (average + its residual) back. Every rank ends backward
with identical gradients; what each step's rounding left out is sent in the next steps.

With an optimizer that divides each coordinate by its own running root mean square (Adam,
AdamW, RMSprop, ...) 1-bit gradients lose accuracy: each decoded value is +-its block's root mean
square, so the optimizer's second moment sees the block's mean square, not the coordinate's, and a
coordinate with small gradients among large ones barely moves. On the LM of
``docs/convergence.md`` (AdamW) it ended far above torch DDP's loss, where qadam with ``bits=1``
(the same codec and error feedback on Adam's momentum, the variance learnt from 8-bit steps) did
not; wrapping such an optimizer warns once and says so. With SGD and momentum the error feedback
gives back what the rounding left out.

State, overflows and loss scaling: as ``bagua.algorithms.compressed_gradients`` says (the warm-up's
clock and each rank's residuals, saved per rank by checkpoints and carried by rebucketing; an
overflow on any rank skips the step on every rank and restarts the residuals).

Example::

    model = bagua.DistributedDataParallel(model, [opt], algorithm="onebit_grad", warmup_steps=100)
"""

from __future__ import annotations

import logging

import torch

from ..comm import BaguaProcessGroup
from ..comm.compression import Sign1
from .base import Algorithm, AlgorithmImpl, check_positive_int
from .compressed_gradients import CompressedGradientImpl, WireCodec

logger = logging.getLogger(__name__)


#: optimizers that divide each coordinate by its own running root mean square of gradients
PER_COORDINATE_SCALED = (torch.optim.Adam, torch.optim.AdamW, torch.optim.NAdam, torch.optim.RAdam, torch.optim.Adamax,
                         torch.optim.Adagrad, torch.optim.RMSprop)


class OneBitGradImpl(CompressedGradientImpl):
    """``CompressedGradientImpl`` with sign1, warning once when it feeds an Adam-like optimizer."""

    def on_wrapped(self, ddp) -> None:
        scaled = sorted({type(opt).__name__ for opt in ddp.optimizers if isinstance(opt, PER_COORDINATE_SCALED)})
        if scaled and self.process_group.rank == 0:
            logger.warning(
                "onebit_grad feeds 1-bit gradients to %s, which divides each coordinate by its own gradients' root mean "
                "square: it sees each 1-bit block's instead and loses accuracy (on our LM it ended far above torch "
                "DDP's loss; docs/convergence.md). For Adam, algorithm='qadam' with bits=1 sends as few bytes and "
                "reached DDP's loss; onebit_grad suits SGD", ", ".join(scaled))
        super().on_wrapped(ddp)


@Algorithm.register("onebit_grad")
class OneBitGradAlgorithm(WireCodec, Algorithm):
    """Gradient averaging at 1 bit per value (sign1, error feedback) after an exact warm-up.

    Args:
        warmup_steps: steps whose gradients are allreduced exactly first (default 100).
        hierarchical: exact reduction within nodes, 1-bit across node leaders.
        average: average the gradients (default) or sum them.
        block_size: values per scale of the sign1 codec (a power of two >= 8; default 256:
            4 bytes of scale per 32 bytes of signs). Smaller blocks follow the gradients'
            magnitudes more closely for more bytes.

    Example::

        model = bagua.DistributedDataParallel(model, [opt], algorithm="onebit_grad", warmup_steps=50)
    """

    def __init__(self, warmup_steps: int = 100, hierarchical: bool = False, average: bool = True,
                 block_size: int = 256):
        check_positive_int("warmup_steps", warmup_steps, minimum=0)
        self.warmup_steps = warmup_steps
        self.hierarchical = bool(hierarchical)
        self.average = bool(average)
        self._codec = Sign1(block_size)  # checks block_size
        self.block_size = block_size

    def reify(self, process_group: BaguaProcessGroup) -> AlgorithmImpl:
        return OneBitGradImpl(process_group, self.hierarchical, self.average, self._codec, warmup_steps=self.warmup_steps,
                              name="onebit_grad", log=logger)
