"""Bagua: PyTorch training acceleration, adopted one line at a time.

Example::

    import bagua
    bagua.init_process_group()          # reads the env that torchrun sets
    print(bagua.get_rank(), bagua.get_world_size())
"""

from . import algorithms, comm, data, optim, parallel
from . import checkpoint, comm_hooks
from . import _lightning_name
from .comm import (
    destroy_process_group,
    get_local_rank,
    get_local_size,
    get_rank,
    get_world_size,
    init_process_group,
    is_initialized,
)
from .parallel import AutotuneConfig, AutotuneResult, DistributedDataParallel, with_bagua

__version__ = "0.1.0"

_lightning_name.register_with_lightning()  # Trainer(strategy="bagua"), whichever of bagua and Lightning comes first

__all__ = [
    "AutotuneConfig", "AutotuneResult", "DistributedDataParallel", "algorithms", "checkpoint", "comm", "comm_hooks", "data", "optim", "parallel", "with_bagua", "destroy_process_group", "get_local_rank", "get_local_size", "get_rank",
    "get_world_size", "init_process_group", "is_initialized", "__version__",
]
