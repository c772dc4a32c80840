"""The original ``bytegrad`` module: the native algorithm with the original's default
``hierarchical=True`` (the native default is False).

Example::

    from bagua.torch_api.algorithms import bytegrad
    model = model.with_bagua([opt], bytegrad.ByteGradAlgorithm())
"""

from ...algorithms import ByteGradAlgorithm as _ByteGrad

__all__ = ["ByteGradAlgorithm"]


class ByteGradAlgorithm(_ByteGrad):
    """``bagua.algorithms.ByteGradAlgorithm``; ``hierarchical`` defaults to True, as in the original."""

    def __init__(self, hierarchical: bool = True, average: bool = True):
        super().__init__(hierarchical=hierarchical, average=average)
