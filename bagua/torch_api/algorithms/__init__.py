"""The original ``bagua.torch_api.algorithms``: the six algorithms under their original module
paths and defaults, registered in ``GlobalAlgorithmRegistry`` under the original names.

Example::

    from bagua.torch_api.algorithms import gradient_allreduce, Algorithm
    algo = gradient_allreduce.GradientAllReduceAlgorithm()
    algo = Algorithm.init("decentralized", peer_selection_mode="shift_one")
"""

from . import async_model_average, bytegrad, decentralized, gradient_allreduce, q_adam
from .base import Algorithm, AlgorithmImpl, GlobalAlgorithmRegistry

__all__ = ["Algorithm", "AlgorithmImpl", "GlobalAlgorithmRegistry"]

for _name, _algorithm, _description in (
    ("gradient_allreduce", gradient_allreduce.GradientAllReduceAlgorithm, "Gradient AllReduce Algorithm"),
    ("bytegrad", bytegrad.ByteGradAlgorithm, "ByteGrad Algorithm"),
    ("decentralized", decentralized.DecentralizedAlgorithm, "Decentralized SGD Algorithm"),
    ("low_precision_decentralized", decentralized.LowPrecisionDecentralizedAlgorithm,
     "Low Precision Decentralized SGD Algorithm"),
    ("qadam", q_adam.QAdamAlgorithm, "QAdam Algorithm"),
    ("async", async_model_average.AsyncModelAverageAlgorithm, "Asynchronous Model Average Algorithm"),
):
    GlobalAlgorithmRegistry.register(_name, _algorithm, description=_description)
