"""The data-parallel wrapper that drives one Algorithm.

Example::

    model = bagua.parallel.DistributedDataParallel(model, [opt], algorithm="gradient_allreduce")
"""

from .ddp import DistributedDataParallel, with_bagua

__all__ = ["DistributedDataParallel", "with_bagua"]
