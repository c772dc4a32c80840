"""CUDA tensors on a Gloo group cross through host memory.

Gloo moves host memory only: torch stages CUDA tensors for a few of its collectives (allreduce,
broadcast) and hands the device pointer straight to the transport for the rest (send/recv,
alltoall, gather...), which crashes or corrupts. Every ``bagua.comm`` collective is therefore
wrapped with :func:`through_host`: when its group moves CUDA tensors with Gloo (``backend="gloo"``
on a machine with GPUs, or two ranks sharing one GPU, which NCCL refuses), the collective runs
on a host copy of the tensor, and the result (in place, returned, or both) is copied back to the
tensor's device when the collective finishes. Groups whose CUDA tensors go to NCCL are untouched.

The copies run on the current CUDA stream (the engine's side stream during backward), so they
are ordered after whatever produced the tensor there and before whatever the stream does next.

Example::

    @through_host(write_back=True)
    def allreduce(tensor, op=..., group=None, async_op=False): ...
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

import torch


def moves_cuda_with_gloo(pg: Any) -> bool:
    """Whether ``pg`` (a BaguaProcessGroup) sends CUDA tensors through Gloo."""
    return pg.backend_for("cuda") == "gloo"


def through_host(*, write_back: bool) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorate a collective whose first argument is its tensor (and which takes ``group`` and
    ``async_op``): on a group that moves CUDA tensors with Gloo it runs on a host copy.

    Args:
        write_back: the collective writes into its tensor (allreduce, broadcast, recv...): the
            host copy's values are copied back into the CUDA tensor when it finishes. A tensor it
            returns is always moved to the input's device.
    """

    def decorate(collective: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(collective)
        first = next(iter(signature.parameters))

        @functools.wraps(collective)
        def run(tensor, *args, **kwargs):
            if not (isinstance(tensor, torch.Tensor) and tensor.is_cuda):
                return collective(tensor, *args, **kwargs)
            from .collectives import Handle, _group

            bound = signature.bind(tensor, *args, **kwargs)
            if not moves_cuda_with_gloo(_group(bound.arguments.get("group"))):
                return collective(tensor, *args, **kwargs)
            async_op = bool(bound.arguments.get("async_op", False))
            host = tensor.detach().to("cpu")
            bound.arguments[first] = host
            bound.arguments["async_op"] = True
            inner = collective(*bound.args, **bound.kwargs)

            def finish() -> Any:
                result = inner.wait()
                if write_back:
                    tensor.copy_(host)
                return result.to(tensor.device) if isinstance(result, torch.Tensor) else result

            handle = Handle(f"{collective.__name__} (through host memory)", inner, finish)
            return handle if async_op else handle.wait()

        return run

    return decorate
