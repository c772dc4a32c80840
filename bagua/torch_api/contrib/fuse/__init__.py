"""The original ``bagua.torch_api.contrib.fuse``: see :mod:`.optimizer`.

Example::

    from bagua.torch_api.contrib.fuse.optimizer import fuse_optimizer
"""
