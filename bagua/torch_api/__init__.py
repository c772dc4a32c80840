"""The original Bagua's API (``import bagua.torch_api as bagua``), as a thin layer over bagua.

Code written for the original Bagua 0.9 runs unchanged, except that it may now run on the CPU
(Gloo) as well as on GPUs (NCCL). Every name here translates to the native API (``bagua``,
``bagua.comm``, ``bagua.parallel``, ...); ``docs/migrating_from_bagua.md`` lists what is
identical and what changed.

Example::

    import bagua.torch_api as bagua
    from bagua.torch_api.algorithms import gradient_allreduce

    bagua.init_process_group()
    model = model.with_bagua([optimizer], gradient_allreduce.GradientAllReduceAlgorithm())
"""

from . import algorithms, checkpoint, communication, contrib, data_parallel, env, utils
from .communication import (
    ReduceOp,
    allgather,
    allgather_inplace,
    allreduce,
    allreduce_inplace,
    alltoall,
    alltoall_inplace,
    alltoall_v,
    alltoall_v_inplace,
    barrier,
    broadcast,
    gather,
    gather_inplace,
    get_backend,
    init_process_group,
    recv,
    reduce,
    reduce_inplace,
    reduce_scatter,
    reduce_scatter_inplace,
    scatter,
    scatter_inplace,
    send,
)
from .distributed import BaguaModule  # adds with_bagua & co. to torch.nn.Module
from .env import get_local_rank, get_local_size, get_rank, get_world_size

__all__ = [
    "BaguaModule", "ReduceOp", "algorithms", "allgather", "allgather_inplace", "allreduce", "allreduce_inplace",
    "alltoall", "alltoall_inplace", "alltoall_v", "alltoall_v_inplace", "barrier", "broadcast", "checkpoint",
    "communication", "contrib", "data_parallel", "env", "gather", "gather_inplace", "get_backend", "get_local_rank",
    "get_local_size", "get_rank", "get_world_size", "init_process_group", "recv", "reduce", "reduce_inplace",
    "reduce_scatter", "reduce_scatter_inplace", "scatter", "scatter_inplace", "send", "utils",
]
