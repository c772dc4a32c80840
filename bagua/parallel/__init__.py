"""The data-parallel wrapper that drives one Algorithm.

Example::

    model = bagua.parallel.DistributedDataParallel(model, [opt], algorithm="gradient_allreduce")
"""

from .ddp import DistributedDataParallel, with_bagua
from .state_sync import broadcast_module

__all__ = ["DistributedDataParallel", "broadcast_module", "with_bagua"]
