"""torch DDP's constructor arguments, read with torch's meaning for ``bagua.DistributedDataParallel``.

A torch DDP user swaps the class and keeps the arguments: each one either means what it means
in torch (``device_ids``, ``bucket_cap_mb``, ``broadcast_buffers``, ...), is a performance hint
with nothing to change here (``gradient_as_bucket_view``: gradients always are bucket views;
``static_graph``; ``batched_grad_copy``), or cannot apply and is a clear error naming why.

Example::

    options, rest = torch_options(model, None, None, {"device_ids": [0], "bucket_cap_mb": 50})
    options.bucket_size_bytes        # 52428800; rest: {} (what is not torch DDP's: the algorithm's options)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from .. import comm

DEFAULT_BUCKET_SIZE_BYTES = 25 * 1024 * 1024  # torch DDP's default

# accepted with torch's meaning; nothing to do for them here (see the module docstring)
_HINTS = {"gradient_as_bucket_view": False, "static_graph": False, "check_reduction": False, "batched_grad_copy": False, "dim": 0}
# torch features that have no counterpart here: (default, why, what to do instead)
_UNSUPPORTED = {
    "delay_all_reduce_named_params": (None, "buckets are launched in order as backward fills them", "leave it out"),
    "param_to_hook_all_reduce": (None, "buckets are launched in order as backward fills them", "leave it out"),
    "mixed_precision": (None, "parameters are communicated in their own dtype", "use torch.autocast, or bf16 parameters"),
    "device_mesh": (None, "the ranks come from process_group", "pass process_group"),
    "bucket_cap_mb_list": (None, "buckets share one size", "use bucket_cap_mb"),
    "skip_all_reduce_unused_params": (False, "unused parameters are communicated as zeros so every rank issues the same buckets", "leave it False"),
}


@dataclass(frozen=True)
class TorchOptions:
    """The options the wrapper acts on, after reading torch DDP's arguments."""

    bucket_size_bytes: int
    broadcast_buffers: bool      # every step ends with the first rank's buffers
    init_sync_buffers: bool      # buffers are part of the wrap-time broadcast
    device: Optional[torch.device]  # inputs are moved there before forward (torch's device_ids)


def torch_options(
    module: torch.nn.Module,
    bucket_size_bytes: Optional[int],
    broadcast_buffers: Optional[bool],
    kwargs: dict,
) -> tuple[TorchOptions, dict[str, Any]]:
    """Read the wrapper's and torch DDP's arguments into ``TorchOptions``; clear errors for
    arguments that cannot apply. The keyword arguments that are not torch DDP's come back as
    they are (the algorithm's options)."""
    kwargs = dict(kwargs)
    for name, default in _HINTS.items():
        kwargs.pop(name, default)
    for name, (default, why, instead) in _UNSUPPORTED.items():
        value = kwargs.pop(name, default)
        if value != default:
            raise ValueError(f"bagua.DistributedDataParallel does not support {name}={value!r}: {why}; {instead}")
    bucket_cap_mb = kwargs.pop("bucket_cap_mb", None)
    forward_sync_buffers = kwargs.pop("forward_sync_buffers", None)
    device = _device(module, kwargs.pop("device_ids", None), kwargs.pop("output_device", None))
    return TorchOptions(
        bucket_size_bytes=_bucket_size(bucket_size_bytes, bucket_cap_mb),
        broadcast_buffers=bool(forward_sync_buffers if forward_sync_buffers is not None
                               else (broadcast_buffers if broadcast_buffers is not None else True)),
        init_sync_buffers=forward_sync_buffers is not None or broadcast_buffers is not False,
        device=device,
    ), kwargs


def _bucket_size(bucket_size_bytes: Optional[int], bucket_cap_mb: Optional[float]) -> int:
    if bucket_size_bytes is not None and bucket_cap_mb is not None:
        raise ValueError("pass bucket_size_bytes or torch's bucket_cap_mb, not both")
    if bucket_cap_mb is not None:
        if not isinstance(bucket_cap_mb, (int, float)) or isinstance(bucket_cap_mb, bool) or bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be a positive number, got {bucket_cap_mb!r}")
        return max(1, int(bucket_cap_mb * 1024 * 1024))
    if bucket_size_bytes is None:
        return DEFAULT_BUCKET_SIZE_BYTES
    if not isinstance(bucket_size_bytes, int) or isinstance(bucket_size_bytes, bool) or bucket_size_bytes < 1:
        raise ValueError(f"bucket_size_bytes must be a positive integer, got {bucket_size_bytes!r}")
    return bucket_size_bytes


def _device(module: torch.nn.Module, device_ids: Any, output_device: Any) -> Optional[torch.device]:
    """torch's rule: ``device_ids`` names the one device of a single-device accelerator module
    (inputs are moved there); for CPU modules it must be None."""
    devices = {p.device for p in module.parameters()}
    if device_ids is None:
        if output_device is not None:
            raise ValueError("output_device needs device_ids (torch DDP's rule); leave both out for CPU modules")
        return None
    if not isinstance(device_ids, (list, tuple)) or len(device_ids) != 1:
        raise ValueError(
            f"device_ids must list exactly one device (one process per device, as torch DDP requires), got {device_ids!r}"
        )
    device = _as_device(device_ids[0])
    if devices != {device}:
        raise ValueError(
            f"device_ids={list(device_ids)} names {device}, but the module's parameters are on "
            f"{sorted(map(str, devices))}; move the module there first (device_ids must be None for CPU modules)"
        )
    if output_device is not None and _as_device(output_device) != device:
        raise ValueError(f"output_device must be device_ids[0] ({device}) for a single-device module, got {output_device!r}")
    return device


def _as_device(value: Any) -> torch.device:
    if isinstance(value, int) and not isinstance(value, bool):
        return torch.device("cuda", value)
    return torch.device(value)


def resolve_process_group(process_group: Any) -> comm.BaguaProcessGroup:
    """The ranks that train together: all (None), a ``BaguaProcessGroup``, or a torch group."""
    if process_group is None:
        return comm.get_default_group()
    if isinstance(process_group, comm.BaguaProcessGroup):
        return process_group
    return comm.from_torch_group(process_group)  # a torch group, or a clear TypeError
