"""Optimizers: the generic fused optimizer (flat buffers + ``fuse_step``), Lion, and
QAdamOptimizer (for the qadam algorithm).

Example::

    >>> import torch, bagua.optim
    >>> model = torch.nn.Linear(8, 2)
    >>> opt = bagua.optim.fuse_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    >>> model(torch.randn(4, 8)).sum().backward()
    >>> opt.fuse_step()
"""

from .fused import FlattenWarning, fuse_optimizer, fused_update_count, is_fused_optimizer
from .lion import Lion
from .qadam import QAdamOptimizer

__all__ = ["FlattenWarning", "Lion", "QAdamOptimizer", "fuse_optimizer", "fused_update_count", "is_fused_optimizer"]
