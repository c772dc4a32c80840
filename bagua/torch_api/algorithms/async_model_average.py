"""The original ``async_model_average`` module: the native algorithm (same defaults).

``model.bagua_algorithm.abort(model)`` / ``.resume(model)`` take the module that ``with_bagua``
returned, or the ``DistributedDataParallel``, as in the original.
"""

from ...algorithms import AsyncModelAverageAlgorithm

__all__ = ["AsyncModelAverageAlgorithm"]
