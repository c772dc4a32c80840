"""The original ``bagua.torch_api.contrib.sync_batchnorm``: ``SyncBatchNorm`` is
``bagua.parallel.SyncBatchNorm``, which also runs on the CPU (the original needed CUDA).

``SyncBatchNorm(num_features, eps=1e-5, momentum=0.1, affine=True, track_running_stats=True)``
as the original, plus torch's ``process_group``; ``SyncBatchNorm.convert_sync_batchnorm(module)``
replaces every ``BatchNorm*d`` (call it before ``with_bagua``).

Example::

    from bagua.torch_api.contrib.sync_batchnorm import SyncBatchNorm
    model = SyncBatchNorm.convert_sync_batchnorm(model)
    model = model.with_bagua([optimizer], GradientAllReduceAlgorithm())
"""

from bagua.parallel.sync_batchnorm import SyncBatchNorm

__all__ = ["SyncBatchNorm"]
