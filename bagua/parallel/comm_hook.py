"""``register_comm_hook``: torch DDP's communication hooks on the gradient_allreduce path.

A hook is ``hook(state, bucket) -> torch.futures.Future[Tensor]``; it replaces the allreduce of
each gradient bucket (e.g. torch's ``default_hooks.fp16_compress_hook`` or PowerSGD). The
bucket it gets has torch's ``GradBucket`` methods (``buffer()``, ``index()``, ``is_last()``,
``gradients()``, ``parameters()``, ``set_buffer()``); the future's tensor becomes the bucket's
averaged gradients. Hooks run on the communication thread, in bucket order, as buckets fill.

Example::

    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    model = bagua.DistributedDataParallel(model, [opt])           # gradient_allreduce
    model.register_comm_hook(None, default_hooks.fp16_compress_hook)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch

from ..algorithms.gradient_allreduce import GradientAllReduceImpl
from ..comm import Bucket

if TYPE_CHECKING:
    from .ddp import DistributedDataParallel


class GradBucket:
    """What a torch communication hook reads: one bucket's flat gradients and its parameters."""

    def __init__(self, index: int, count: int, bucket: Bucket, parameters: list[torch.Tensor]):
        self._index, self._count, self._bucket, self._parameters = index, count, bucket, parameters
        self._buffer = bucket.flat

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._index == self._count - 1

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, tensor: torch.Tensor) -> None:
        self._buffer = tensor

    def gradients(self) -> list[torch.Tensor]:
        return list(self._bucket.views)

    def parameters(self) -> list[torch.Tensor]:
        return list(self._parameters)


def register(ddp: "DistributedDataParallel", state: Any, hook: Callable[[Any, GradBucket], Any]) -> None:
    """Make ``hook(state, bucket)`` communicate each of ``ddp``'s gradient buckets."""
    if not callable(hook):
        raise TypeError(f"hook must be callable as hook(state, bucket), got {type(hook).__name__}")
    impl = ddp.impl
    if type(impl) is not GradientAllReduceImpl or impl.compression is not None or impl.node_groups is not None:
        raise ValueError(
            f"register_comm_hook replaces the gradient allreduce of algorithm 'gradient_allreduce' "
            f"(flat, not hierarchical); {ddp.algorithm!r} communicates differently. Its hooks are its own."
        )
    if ddp._comm_hook is not None:
        raise RuntimeError("register_comm_hook can only be called once (as with torch DDP)")
    if ddp.step:
        raise RuntimeError("register_comm_hook must be called before the first training step")
    ddp._comm_hook = (state, hook)
    append_hook_ops(ddp)


def append_hook_ops(ddp: "DistributedDataParallel") -> None:
    """Make the registered hook the only op of each of ``ddp``'s buckets (again after a rebucket)."""
    state, hook = ddp._comm_hook
    for index, bucket in enumerate(ddp.buckets):
        params = [ddp.for_algorithms.parameter(name) for name in ddp.for_algorithms.names_in(bucket)]
        grad_bucket = GradBucket(index, len(ddp.buckets), bucket, params)
        bucket.clear_ops()
        bucket.append_op(_hook_op(state, hook, grad_bucket), f"comm_hook[{getattr(hook, '__name__', 'hook')}]")


def _hook_op(state: Any, hook: Callable, grad_bucket: GradBucket) -> Callable[[Bucket], None]:
    def run(bucket: Bucket) -> None:
        grad_bucket.set_buffer(bucket.flat)
        result = hook(state, grad_bucket).wait()
        result = result[0] if isinstance(result, (list, tuple)) else result
        if not isinstance(result, torch.Tensor) or result.numel() != bucket.flat.numel():
            raise TypeError(
                f"a communication hook must return a future of a tensor of the bucket's {bucket.flat.numel()} "
                f"elements, got {type(result).__name__}"
            )
        if result.data_ptr() != bucket.flat.data_ptr():
            bucket.flat.copy_(result.reshape(-1))

    return run
