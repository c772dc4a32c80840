"""The data-parallel wrapper that drives one Algorithm, and SyncBatchNorm.

Example::

    model = bagua.parallel.convert_sync_batchnorm(model)   # BatchNorm over every rank's batch
    model = bagua.parallel.DistributedDataParallel(model, [opt], algorithm="gradient_allreduce")
"""

from .autotune import AutotuneConfig, AutotuneResult
from .ddp import DistributedDataParallel, with_bagua
from .state_sync import broadcast_module
from .sync_batchnorm import SyncBatchNorm, convert_sync_batchnorm

__all__ = ["AutotuneConfig", "AutotuneResult", "DistributedDataParallel", "SyncBatchNorm", "broadcast_module", "convert_sync_batchnorm", "with_bagua"]
