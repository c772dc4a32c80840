"""bytegrad: gradient averaging with every byte on the wire 8-bit compressed.

Each bucket is allreduced by the MinMaxUInt8 scatter-reduce-gather of ``bagua.comm``: about
4x fewer bytes than fp32, every rank ends with identical gradients, each within the codec's
quantization error of the exact average. ``hierarchical=True`` reduces exactly within each
node and compresses only across nodes.

Gradients that overflow (NaN or Inf, e.g. under a loss scale grown too large) on any rank come
out non-finite on every rank, in the codec blocks that held them: ``torch.amp.GradScaler`` then
skips the step on every rank and lowers its scale. (The codec's per-block min and max mark such
a block, so the finite case costs nothing extra.)

Example::

    model = bagua.DistributedDataParallel(model, [opt], algorithm="bytegrad")
"""

from __future__ import annotations

from .base import Algorithm
from .gradient_allreduce import GradientAllReduceAlgorithm


@Algorithm.register("bytegrad")
class ByteGradAlgorithm(GradientAllReduceAlgorithm):
    """Gradient averaging compressed to 8 bits per value (MinMaxUInt8, per-chunk min and max).

    Args:
        hierarchical: exact reduction within nodes, compressed across node leaders.
        average: average the gradients (default) or sum them.
    """

    _compression = "minmax_uint8"
