"""bytegrad: gradient averaging with every byte on the wire 8-bit compressed.

Each bucket is allreduced by the MinMaxUInt8 scatter-reduce-gather of ``bagua.comm``: about
4x fewer bytes than fp32, every rank ends with identical gradients, each within the codec's
quantization error of the exact average. ``hierarchical=True`` reduces exactly within each
node and compresses only across nodes.

Options that trade bytes for accuracy: ``block_size`` (values per min/max pair: smaller blocks
round a block's small values on a finer grid, which matters under Adam, whose step divides each
coordinate's error by its own small sqrt(v)), and ``error_feedback`` (each rank keeps what the
rounding left out and sends it in the next steps, as ``onebit_grad`` does; its residuals are
then per-rank state, in checkpoints).

Gradients that overflow (NaN or Inf, e.g. under a loss scale grown too large) on any rank come
out non-finite on every rank, in the codec blocks that held them: ``torch.amp.GradScaler`` then
skips the step on every rank and lowers its scale. (The codec's per-block min and max mark such
a block, so the finite case costs nothing extra.)

Example::

    model = bagua.DistributedDataParallel(model, [opt], algorithm="bytegrad")
    model = bagua.DistributedDataParallel(model, [opt], algorithm="bytegrad", block_size=256, error_feedback=True)
"""

from __future__ import annotations

import logging

from ..comm import BaguaProcessGroup
from ..comm.compression import MinMaxUInt8
from .base import Algorithm, AlgorithmImpl
from .compressed_gradients import CompressedGradientImpl, WireCodec
from .gradient_allreduce import GradientAllReduceAlgorithm, GradientAllReduceImpl

logger = logging.getLogger(__name__)


@Algorithm.register("bytegrad")
class ByteGradAlgorithm(WireCodec, GradientAllReduceAlgorithm):
    """Gradient averaging compressed to 8 bits per value (MinMaxUInt8, per-block min and max).

    Args:
        hierarchical: exact reduction within nodes, compressed across node leaders.
        average: average the gradients (default) or sum them.
        block_size: values per (min, max) pair, a power of two (default 1024: 8 bytes of header
            per 1024 bytes of codes).
        error_feedback: keep what each step's rounding left out and send it in the next steps
            (per-rank residuals, saved by checkpoints and carried by rebucketing).
    """

    def __init__(self, hierarchical: bool = False, average: bool = True, block_size: int = 1024,
                 error_feedback: bool = False):
        super().__init__(hierarchical, average)
        self._codec = MinMaxUInt8(block_size)  # checks block_size
        self.block_size = block_size
        self.error_feedback = bool(error_feedback)

    def reify(self, process_group: BaguaProcessGroup) -> AlgorithmImpl:
        if self.error_feedback:
            return CompressedGradientImpl(process_group, self.hierarchical, self.average, self._codec, warmup_steps=0,
                                          name="bytegrad", log=logger)
        return GradientAllReduceImpl(process_group, self.hierarchical, self.average, self._codec)
