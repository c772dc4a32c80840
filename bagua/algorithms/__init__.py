"""Distributed algorithms behind ``bagua.DistributedDataParallel``, and the API to write new ones.

Example::

    from bagua.algorithms import Algorithm, registered_names
    print(registered_names())   # ['async', 'bytegrad', 'decentralized', ...]
    algo = Algorithm.init("decentralized", peer_selection_mode="shift_one")
"""

from .async_model_average import AsyncModelAverageAlgorithm
from .base import Algorithm, AlgorithmImpl, registered_names
from .bytegrad import ByteGradAlgorithm
from .decentralized import DecentralizedAlgorithm
from .gradient_allreduce import GradientAllReduceAlgorithm
from .low_precision_decentralized import LowPrecisionDecentralizedAlgorithm
from .onebit_grad import OneBitGradAlgorithm
from .q_adam import QAdamAlgorithm
from .tunable import Tunable, powers_of_two

__all__ = [
    "Algorithm", "AlgorithmImpl", "AsyncModelAverageAlgorithm", "ByteGradAlgorithm", "DecentralizedAlgorithm",
    "GradientAllReduceAlgorithm", "LowPrecisionDecentralizedAlgorithm", "OneBitGradAlgorithm", "QAdamAlgorithm", "Tunable", "powers_of_two", "registered_names",
]
