"""The original ``decentralized`` module: decentralized and low-precision decentralized SGD,
the native algorithms with the original's default ``hierarchical=True``.

Example::

    from bagua.torch_api.algorithms import decentralized
    model = model.with_bagua([opt], decentralized.DecentralizedAlgorithm(peer_selection_mode="shift_one"))
"""

from ...algorithms import DecentralizedAlgorithm as _Decentralized
from ...algorithms import LowPrecisionDecentralizedAlgorithm as _LowPrecisionDecentralized

__all__ = ["DecentralizedAlgorithm", "LowPrecisionDecentralizedAlgorithm"]


class DecentralizedAlgorithm(_Decentralized):
    """``bagua.algorithms.DecentralizedAlgorithm``; ``hierarchical`` defaults to True."""

    def __init__(self, hierarchical: bool = True, peer_selection_mode: str = "all", communication_interval: int = 1):
        super().__init__(hierarchical=hierarchical, peer_selection_mode=peer_selection_mode,
                         communication_interval=communication_interval)


class LowPrecisionDecentralizedAlgorithm(_LowPrecisionDecentralized):
    """``bagua.algorithms.LowPrecisionDecentralizedAlgorithm``; ``hierarchical`` defaults to True."""

    def __init__(self, hierarchical: bool = True, communication_interval: int = 1):
        super().__init__(hierarchical=hierarchical, communication_interval=communication_interval)
