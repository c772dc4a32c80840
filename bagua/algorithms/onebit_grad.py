"""onebit_grad: gradient averaging at 1 bit per value, with error feedback, after an exact warm-up.

For the first ``warmup_steps`` steps each bucket is allreduced exactly (as ``gradient_allreduce``):
1-bit compression from the first step hurts convergence, while the gradients are large and change
fast. Afterwards each bucket goes through the ``sign1`` scatter-reduce-gather of ``bagua.comm``
with error feedback (1-bit Adam's two-stage scheme): every rank sends the sign of (gradient +
its residual) and one scale per 256 values (their root mean square), 28x fewer bytes than fp32; the
rank that reduces a chunk sends the sign of (average + its residual) back. Every rank ends backward
with identical gradients; what each step's rounding left out is sent in the next steps.

State, overflows and loss scaling: as ``bagua.algorithms.compressed_gradients`` says (the warm-up's
clock and each rank's residuals, saved per rank by checkpoints and carried by rebucketing; an
overflow on any rank skips the step on every rank and restarts the residuals).

Example::

    model = bagua.DistributedDataParallel(model, [opt], algorithm="onebit_grad", warmup_steps=100)
"""

from __future__ import annotations

import logging

from ..comm import BaguaProcessGroup
from ..comm.compression import Sign1
from .base import Algorithm, AlgorithmImpl, check_positive_int
from .compressed_gradients import CompressedGradientImpl

logger = logging.getLogger(__name__)


@Algorithm.register("onebit_grad")
class OneBitGradAlgorithm(Algorithm):
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
        self.codec = Sign1(block_size)  # checks block_size
        self.block_size = block_size

    def reify(self, process_group: BaguaProcessGroup) -> AlgorithmImpl:
        return CompressedGradientImpl(process_group, self.hierarchical, self.average, self.codec, error_feedback=True,
                                      warmup_steps=self.warmup_steps, name="onebit_grad", log=logger)
