"""The original ``q_adam`` module: ``QAdamOptimizer`` and ``QAdamAlgorithm`` (the native ones;
``hierarchical`` defaults to True, as in the original).

Example::

    from bagua.torch_api.algorithms.q_adam import QAdamAlgorithm, QAdamOptimizer
    opt = QAdamOptimizer(model.parameters(), warmup_steps=100)
    model = model.with_bagua([opt], QAdamAlgorithm(opt))
"""

from ...algorithms import QAdamAlgorithm as _QAdam
from ...optim import QAdamOptimizer

__all__ = ["QAdamAlgorithm", "QAdamOptimizer"]


class QAdamAlgorithm(_QAdam):
    """``bagua.algorithms.QAdamAlgorithm``; ``hierarchical`` defaults to True."""

    def __init__(self, q_adam_optimizer: QAdamOptimizer, hierarchical: bool = True):
        super().__init__(q_adam_optimizer, hierarchical=hierarchical)
