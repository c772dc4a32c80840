"""bytegrad: gradient averaging with every byte on the wire 8-bit compressed.

Each bucket is allreduced by the MinMaxUInt8 scatter-reduce-gather of ``bagua.comm``: about
4x fewer bytes than fp32, every rank ends with identical gradients, each within the codec's
quantization error of the exact average. ``hierarchical=True`` reduces exactly within each
node and compresses only across nodes.

Example::

    model = bagua.DistributedDataParallel(model, [opt], algorithm="bytegrad")
"""

from __future__ import annotations

from ..comm import BaguaProcessGroup
from .base import Algorithm, AlgorithmImpl
from .gradient_allreduce import GradientAllReduceImpl


@Algorithm.register("bytegrad")
class ByteGradAlgorithm(Algorithm):
    """Gradient averaging compressed to 8 bits per value (MinMaxUInt8, per-chunk min and max).

    Args:
        hierarchical: exact reduction within nodes, compressed across node leaders.
        average: average the gradients (default) or sum them.
    """

    def __init__(self, hierarchical: bool = False, average: bool = True):
        self.hierarchical = bool(hierarchical)
        self.average = bool(average)

    def reify(self, process_group: BaguaProcessGroup) -> AlgorithmImpl:
        return GradientAllReduceImpl(process_group, self.hierarchical, self.average, compression="minmax_uint8")
