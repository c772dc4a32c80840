"""The original ``bagua.torch_api.data_parallel``."""

from .distributed import DistributedDataParallel

__all__ = ["DistributedDataParallel"]
