"""The original ``bagua.torch_api.data_parallel.DistributedDataParallel``: torch DDP's constructor
plus ``optimizers=`` and ``algorithm=``, over the native wrapper.

Wrapping a module that an earlier wrapper still holds replaces that wrapper (its hooks and
threads go), as the original let code switch algorithms by wrapping again.

Example::

    from bagua.torch_api.data_parallel import DistributedDataParallel as DDP
    model = DDP(model, optimizers=[opt], algorithm=bytegrad.ByteGradAlgorithm())
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from ... import parallel
from ...algorithms import Algorithm
from ...parallel.wrapping import open_wrapper

__all__ = ["BaguaBucket", "DistributedDataParallel", "DistributedDataParallel_V1_9_0"]


class DistributedDataParallel(parallel.DistributedDataParallel):
    """``bagua.DistributedDataParallel`` with the original's signature (torch DDP's arguments
    first, then ``optimizers`` and ``algorithm``, default gradient allreduce) and attributes
    (``bagua_algorithm``, ``bagua_optimizers``, ``bagua_buckets``, ``require_backward_grad_sync``,
    ``parameters_to_ignore``). ``check_reduction`` is deprecated in torch and ignored."""

    def __init__(
        self,
        module: torch.nn.Module,
        device_ids: Optional[Sequence[Any]] = None,
        output_device: Any = None,
        dim: int = 0,
        broadcast_buffers: bool = True,
        process_group: Any = None,
        bucket_cap_mb: float = 25,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = True,
        optimizers: Sequence[torch.optim.Optimizer] = (),
        algorithm: Optional[Algorithm] = None,
    ) -> None:
        release_wrapper(module)
        super().__init__(
            module, optimizers=list(optimizers), algorithm=algorithm or "gradient_allreduce",
            process_group=native_group(process_group), find_unused_parameters=find_unused_parameters,
            broadcast_buffers=broadcast_buffers, device_ids=device_ids, output_device=output_device, dim=dim,
            bucket_cap_mb=bucket_cap_mb, gradient_as_bucket_view=gradient_as_bucket_view,
        )

    @property
    def bagua_algorithm(self) -> Algorithm:
        """The algorithm the wrapper runs."""
        return self.algorithm

    @property
    def bagua_optimizers(self) -> list[torch.optim.Optimizer]:
        """The wrapped optimizers."""
        return self.optimizers

    @property
    def bagua_buckets(self) -> list["BaguaBucket"]:
        """The communication buckets, as the original's ``BaguaBucket`` objects."""
        return [BaguaBucket(bucket, self.impl) for bucket in self.buckets]

    @property
    def require_backward_grad_sync(self) -> bool:
        """Whether the next backward communicates (False inside ``no_sync()``)."""
        return self._require_sync

    @property
    def parameters_to_ignore(self) -> list[str]:
        """The names of the parameters the wrapper leaves alone, sorted."""
        return sorted(self.ignored)

    @property
    def inner(self) -> "DistributedDataParallel":
        """The original's engine object (``BaguaDistributedDataParallel``); here the wrapper itself."""
        return self

    def bagua_build_params(self) -> list[tuple[str, torch.nn.Parameter]]:
        """``(name, parameter)`` of the parameters that are communicated: those that require a
        gradient and are not ignored; with ``find_unused_parameters=True``, after a step, those
        that got a gradient in it on this rank (as the original rebuilt its buckets from)."""
        used = self.parameters_used_last_step
        if self.find_unused_parameters and used:
            return [(name, p) for name, p in self.named_trainable_parameters if name in used]
        return list(self.named_trainable_parameters)


DistributedDataParallel_V1_9_0 = DistributedDataParallel  # the original's name of the class


class BaguaBucket:
    """One communication bucket, as the original's ``bagua_buckets`` listed it: ``name``,
    ``tensors``, ``bytes()``, ``flattened_tensor()``, and the algorithm's state of the bucket under
    the original's names: decentralized's ``_peer_weight`` (the weights averaged with the peers
    at the last communication step), low_precision_decentralized's ``_weight``,
    ``_left_peer_weight`` and ``_right_peer_weight`` (this rank's replicas).

    Example::

        model.bagua_buckets[0]._peer_weight      # with DecentralizedAlgorithm
    """

    def __init__(self, bucket: Any, impl: Any):
        self._bucket = bucket
        self._impl = impl

    @property
    def name(self) -> str:
        return self._bucket.name

    @property
    def tensors(self) -> list[torch.Tensor]:
        return list(self._bucket.tensors)

    def bytes(self) -> int:
        """The bucket's size in bytes."""
        return self._bucket.nbytes

    def flattened_tensor(self) -> torch.Tensor:
        """A new flat tensor holding the bucket's tensors, in order."""
        return self._bucket.flat.clone()

    @property
    def _peer_weight(self) -> torch.Tensor:
        return self._algorithm_state("peer_weight", "bucket._peer_weight exists", "DecentralizedAlgorithm")

    @property
    def _weight(self) -> torch.Tensor:
        return self._replicas()[0]

    @property
    def _left_peer_weight(self) -> torch.Tensor:
        return self._replicas()[1]

    @property
    def _right_peer_weight(self) -> torch.Tensor:
        return self._replicas()[2]

    def _replicas(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self._algorithm_state("replicas", "bucket._weight, ._left_peer_weight and ._right_peer_weight exist",
                                     "LowPrecisionDecentralizedAlgorithm")

    def _algorithm_state(self, method: str, what: str, algorithm: str) -> Any:
        read = getattr(self._impl, method, None)
        if read is None:
            raise AttributeError(f"{what} with {algorithm} only; this bucket's algorithm is {type(self._impl).__name__}")
        return read(self._bucket)

    def __repr__(self) -> str:
        return f"BaguaBucket({self.name!r}, {len(self._bucket)} tensors, {self.bytes()} bytes)"


def release_wrapper(module: Any) -> None:
    """Close the open wrapper that holds ``module``, if any (its hooks and threads go)."""
    wrapper = open_wrapper(module)
    if wrapper is not None:
        wrapper.close()


def native_group(process_group: Any) -> Any:
    """The native group (or torch group) behind a group of ``bagua.torch_api.communication``."""
    return getattr(process_group, "native", process_group)
