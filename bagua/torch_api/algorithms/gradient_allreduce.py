"""The original ``gradient_allreduce`` module: the native algorithm, the original's defaults
(``hierarchical=False``, ``average=True``, the same as the native ones)."""

from ...algorithms import GradientAllReduceAlgorithm

__all__ = ["GradientAllReduceAlgorithm"]
