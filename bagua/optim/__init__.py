"""Optimizers: QAdamOptimizer (for the qadam algorithm).

Example::

    opt = bagua.optim.QAdamOptimizer(model.parameters(), lr=1e-3, warmup_steps=100)
"""

from .qadam import QAdamOptimizer

__all__ = ["QAdamOptimizer"]
