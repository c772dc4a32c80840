"""The communication core: process groups, collectives, compression, buckets, engine.

Everything distributed in Bagua goes through this package (built on torch.distributed:
NCCL for CUDA tensors, Gloo for CPU tensors).

Example::

    import bagua, torch
    bagua.init_process_group()
    t = torch.ones(1000)
    bagua.comm.allreduce(t, op=bagua.comm.ReduceOp.AVG, compression="minmax_uint8")
"""

from .bucket import Bucket
from .collectives import (
    CollectiveError,
    Handle,
    ReduceOp,
    allgather,
    allreduce,
    alltoall,
    as_reduce_op,
    alltoall_v,
    barrier,
    broadcast,
    gather,
    recv,
    reduce,
    reduce_scatter,
    scatter,
    send,
)
from .compressed import compressed_allreduce
from .compression import BF16, CODEC_NAMES, FP16, Codec, MinMaxUInt8, Payload, Sign1, get_codec
from .engine import Engine, EngineError, in_background
from .error_feedback import ErrorFeedback
from .objects import allgather_object, broadcast_object
from .process_group import (
    BaguaProcessGroup,
    NodeGroups,
    at_teardown,
    NotInitializedError,
    destroy_process_group,
    from_torch_group,
    get_default_group,
    get_inter_node_group,
    get_intra_node_group,
    get_local_rank,
    get_local_size,
    get_rank,
    get_world_size,
    init_process_group,
    is_initialized,
    new_group,
    new_node_groups,
)
from .striped_backend import BACKEND_NAME as STRIPED_BACKEND
from .striped_backend import StripedProcessGroup, StripeOptions, striped_calls
from .striped_backend import register as _register_striped_backend
from .traffic import bytes_sent, reset_traffic, traffic_by_kind

_register_striped_backend()  # torch.distributed.init_process_group("bagua") from here on

__all__ = [
    "BF16", "CODEC_NAMES", "at_teardown", "FP16", "BaguaProcessGroup", "Bucket", "Codec", "CollectiveError",
    "Engine", "EngineError", "ErrorFeedback", "in_background", "Handle", "MinMaxUInt8", "NotInitializedError", "Payload", "ReduceOp",
    "allgather", "allgather_object", "allreduce", "alltoall", "alltoall_v", "as_reduce_op", "barrier", "broadcast", "broadcast_object", "bytes_sent",
    "compressed_allreduce", "destroy_process_group", "from_torch_group", "gather", "get_codec", "get_default_group",
    "get_inter_node_group", "get_intra_node_group", "get_local_rank", "get_local_size", "get_rank",
    "get_world_size", "init_process_group", "is_initialized", "new_group", "new_node_groups", "NodeGroups", "recv", "reduce",
    "reduce_scatter", "reset_traffic", "scatter", "send", "Sign1", "STRIPED_BACKEND", "StripedProcessGroup", "StripeOptions", "striped_calls", "traffic_by_kind",
]
