"""SyncBatchNorm: batch normalization whose statistics span the batches of every rank, on CPU or GPU.

torch's ``nn.SyncBatchNorm`` computes its statistics with CUDA-only kernels; this one uses plain
tensor ops and ``bagua.comm`` (Gloo for CPU tensors, NCCL for CUDA ones), with torch's semantics:

* training forward: each rank sends its sample count and per-channel mean and sum of squared
  deviations (one allgather of ``1 + 2C`` numbers); every rank combines them into the mean and
  biased variance of the whole global batch (ranks may hold different batch sizes) and normalizes
  with them. The running statistics are updated with the global mean and the *unbiased* global
  variance, so they are identical on every rank.
* backward: the two per-channel sums the input gradient needs (of ``dy`` and ``dy * x_hat``) are
  allreduced; weight and bias gradients stay local, as in torch (the data-parallel wrapper
  averages them like every other gradient).
* evaluation (with running statistics) normalizes with the running statistics, without
  communication; so does a process group of one rank, or no process group at all.

Sums are accumulated in float64, so results match ``BatchNorm`` over the concatenated batch to
float rounding.

Example::

    bagua.init_process_group()
    model = bagua.parallel.convert_sync_batchnorm(model)    # every BatchNorm*d becomes SyncBatchNorm
    model = bagua.DistributedDataParallel(model, optimizers=[opt])
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from .. import comm
from .torch_options import resolve_process_group

__all__ = ["SyncBatchNorm", "convert_sync_batchnorm"]


def _reduced_dims(x: torch.Tensor) -> list[int]:
    return [0, *range(2, x.dim())]


def _per_channel(v: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``v`` (one value per channel) shaped to broadcast over ``like`` (N, C, ...)."""
    return v.view(1, -1, *([1] * (like.dim() - 2)))


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """Element-wise math in at least float32 (fp16/bf16 inputs are upcast)."""
    return torch.promote_types(x.dtype, torch.float32)


class _SyncBatchNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, weight, bias, running_mean, running_var, eps, momentum, group):
        dims = _reduced_dims(input)
        x = input.to(_compute_dtype(input))
        count = input.numel() // input.size(1)
        if count > 0:
            local_mean = x.sum(dims, dtype=torch.float64) / count
            local_m2 = (x - _per_channel(local_mean.to(x.dtype), x)).square().sum(dims, dtype=torch.float64)
        else:  # an empty batch on this rank contributes nothing
            local_mean = local_m2 = torch.zeros(input.size(1), dtype=torch.float64, device=input.device)
        packed = torch.cat([local_mean.new_tensor([float(count)]), local_mean, local_m2])
        stats = comm.allgather(packed.unsqueeze(0), group=group)  # (ranks, 1 + 2C)
        counts, means, m2s = stats[:, :1], stats[:, 1 : 1 + input.size(1)], stats[:, 1 + input.size(1) :]
        total = counts.sum()
        if total.item() <= 1:
            raise ValueError(
                f"SyncBatchNorm expected more than 1 value per channel when training, got {int(total.item())} "
                f"over all ranks (input size on this rank: {list(input.shape)})"
            )
        mean = (counts * means).sum(0) / total
        m2 = m2s.sum(0) + (counts * (means - mean).square()).sum(0)
        invstd = torch.rsqrt(m2 / total + eps)
        with torch.no_grad():
            if running_mean is not None:
                running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
            if running_var is not None:
                running_var.mul_(1 - momentum).add_((m2 / (total - 1)).to(running_var.dtype), alpha=momentum)
        mean_c = mean.to(x.dtype)
        out = (x - _per_channel(mean_c, x)) * _per_channel(invstd.to(x.dtype), x)
        if weight is not None:
            out = out * _per_channel(weight.to(x.dtype), x)
        if bias is not None:
            out = out + _per_channel(bias.to(x.dtype), x)
        ctx.save_for_backward(input, weight, mean_c, invstd)
        ctx.total = total.item()
        ctx.group = group
        ctx.has_bias = bias is not None
        return out.to(input.dtype)

    @staticmethod
    def backward(ctx, grad_output):
        input, weight, mean, invstd64 = ctx.saved_tensors
        need_input, need_weight, need_bias = ctx.needs_input_grad[:3]
        dims = _reduced_dims(input)
        x = input.to(mean.dtype)
        dy = grad_output.to(mean.dtype)
        xmu = x - _per_channel(mean, x)
        sum_dy = dy.sum(dims, dtype=torch.float64)
        sum_dy_xmu = (dy * xmu).sum(dims, dtype=torch.float64)
        grad_weight = (sum_dy_xmu * invstd64).to(weight.dtype) if weight is not None and need_weight else None
        grad_bias = sum_dy.to(weight.dtype) if ctx.has_bias and need_bias else None
        grad_input = None
        if need_input:
            sums = torch.cat([sum_dy, sum_dy_xmu])
            comm.allreduce(sums, group=ctx.group)
            c = invstd64.numel()
            mean_dy = (sums[:c] / ctx.total).to(x.dtype)
            # d/dx of the normalization: dy - mean(dy) - x_hat * mean(dy * x_hat), times invstd * weight
            proj = (sums[c:] / ctx.total * invstd64.square()).to(x.dtype)
            scale = invstd64.to(x.dtype) if weight is None else invstd64.to(x.dtype) * weight.to(x.dtype)
            grad_input = (dy - _per_channel(mean_dy, x) - xmu * _per_channel(proj, x)) * _per_channel(scale, x)
            grad_input = grad_input.to(input.dtype)
        return grad_input, grad_weight, grad_bias, None, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """BatchNorm over the whole global batch (all ranks of ``process_group``), on CPU or GPU.

    The arguments are those of ``torch.nn.SyncBatchNorm``; input is ``(N, C, ...)`` with any number
    of trailing dimensions (BatchNorm1d/2d/3d alike). Every rank of the group must run each training
    forward (and, when the input needs a gradient, each backward) of this layer; evaluation forwards
    do not communicate.

    Args:
        num_features: ``C``.
        eps: as in ``torch.nn.BatchNorm2d``.
        momentum: as in ``torch.nn.BatchNorm2d`` (``None``: cumulative moving average).
        affine: as in ``torch.nn.BatchNorm2d``.
        track_running_stats: as in ``torch.nn.BatchNorm2d``.
        process_group: the ranks whose batches are normalized together: a ``BaguaProcessGroup``
            or a ``torch.distributed`` group; default all ranks (the default group at forward time).

    Example::

        bn = bagua.parallel.SyncBatchNorm(16)
        y = bn(torch.randn(8, 16, 32, 32))      # mean/variance over 8 * world_size samples
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: Optional[float] = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: Any = None,
        device: Any = None,
        dtype: Optional[torch.dtype] = None,
    ):
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        self.process_group = process_group

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm expected at least 2D input (N, C, ...), got {input.dim()}D input")
        if input.size(1) != self.num_features:
            raise ValueError(
                f"SyncBatchNorm({self.num_features}) expected {self.num_features} channels in dim 1, "
                f"got input of shape {list(input.shape)}"
            )

    def _sync_group(self) -> Optional[comm.BaguaProcessGroup]:
        """The group to normalize over, or None when there is nothing to synchronize."""
        if self.process_group is None and not comm.is_initialized():
            return None
        group = resolve_process_group(self.process_group)
        return group if group.size > 1 else None

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                factor = 1.0 / float(self.num_batches_tracked)
        # Batch statistics in training, and in evaluation when there are no running statistics.
        bn_training = self.training or (self.running_mean is None and self.running_var is None)
        running_mean = self.running_mean if not self.training or self.track_running_stats else None
        running_var = self.running_var if not self.training or self.track_running_stats else None
        group = self._sync_group() if bn_training and self.training else None
        if group is None:
            return F.batch_norm(input, running_mean, running_var, self.weight, self.bias, bn_training, factor, self.eps)
        return _SyncBatchNormFunction.apply(
            input, self.weight, self.bias, running_mean, running_var, self.eps, factor, group
        )

    @classmethod
    def convert_sync_batchnorm(cls, module: torch.nn.Module, process_group: Any = None) -> torch.nn.Module:
        """Every ``BatchNorm*d`` in ``module`` replaced by this class, sharing its parameters and buffers.

        Returns ``module`` with its BatchNorm layers replaced, or a new layer when ``module`` itself
        is one. Call it before wrapping the model (``bagua.DistributedDataParallel``).

        Example::

            model = SyncBatchNorm.convert_sync_batchnorm(torchvision.models.resnet18())
        """
        converted = module
        if isinstance(module, _BatchNorm):
            converted = cls(module.num_features, module.eps, module.momentum, module.affine,
                            module.track_running_stats, process_group)
            if module.affine:
                with torch.no_grad():
                    converted.weight = module.weight
                    converted.bias = module.bias
            converted.running_mean = module.running_mean
            converted.running_var = module.running_var
            converted.num_batches_tracked = module.num_batches_tracked
            converted.training = module.training
            if hasattr(module, "qconfig"):
                converted.qconfig = module.qconfig
        for name, child in module.named_children():
            converted.add_module(name, cls.convert_sync_batchnorm(child, process_group))
        return converted


def convert_sync_batchnorm(module: torch.nn.Module, process_group: Any = None) -> torch.nn.Module:
    """``SyncBatchNorm.convert_sync_batchnorm(module, process_group)``.

    Example::

        model = bagua.parallel.convert_sync_batchnorm(model)
    """
    return SyncBatchNorm.convert_sync_batchnorm(module, process_group)
