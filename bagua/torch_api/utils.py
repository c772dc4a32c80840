"""The original ``bagua.torch_api.utils``: flattening helpers.

Example::

    from bagua.torch_api.utils import flatten, unflatten
    flat = flatten([a, b])
    a2, b2 = unflatten(flat, [a, b])
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.distributed
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

__all__ = [
    "apply_flattened_call", "apply_flattened_call_all", "check_contiguous", "flatten", "get_flattened_tensor",
    "unflatten",
]

flatten = _flatten_dense_tensors
"""``flatten(tensors)``: one contiguous 1-D tensor holding ``tensors`` (of one dtype) back to back."""
unflatten = _unflatten_dense_tensors
"""``unflatten(flat, tensors)``: tensors shaped as ``tensors``, in order, holding ``flat``'s values."""


def apply_flattened_call(bucket: list[torch.Tensor], call: Callable, extra_args: Optional[Sequence] = None) -> None:
    """Run ``call(flat, *extra_args)`` on one flat copy of the tensors, then copy the result back
    into them. As in the original, when ``call`` is ``torch.distributed.all_reduce`` the sum is
    divided by the world size (an average).

    Example::

        apply_flattened_call(grads, torch.distributed.all_reduce)   # grads averaged in one message
    """
    flat = flatten(bucket)
    call(flat, *(extra_args or ()))
    if call is torch.distributed.all_reduce:
        flat /= torch.distributed.get_world_size()
    for tensor, result in zip(bucket, unflatten(flat, bucket)):
        tensor.copy_(result)


def apply_flattened_call_all(tensors: list[torch.Tensor], call: Callable) -> None:
    """``apply_flattened_call`` once per tensor type (dtype and device) among ``tensors``."""
    by_type: dict[str, list[torch.Tensor]] = {}
    for t in tensors:
        by_type.setdefault(t.type(), []).append(t)
    for same_type in by_type.values():
        apply_flattened_call(same_type, call)


def check_contiguous(tensors: list[torch.Tensor]) -> bool:
    """Whether the tensors lie back to back in memory, in order (views of one flat buffer)."""
    end = None
    for t in tensors:
        if end is not None and t.data_ptr() != end:
            return False
        end = t.data_ptr() + t.numel() * t.element_size()
    return True


def get_flattened_tensor(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """A new flat tensor holding the tensors' values in order (None for no tensors)."""
    return flatten([t.reshape(-1) for t in tensors]) if tensors else None
