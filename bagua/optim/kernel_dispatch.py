"""Single-pass kernels for a flat run of ``fuse_optimizer``: the optimizers that have one
(Adam/AdamW, SGD, Lion; exact types, a subclass may change the math), each returning False when
this run's state or hyperparameters need the optimizer's own step instead.

Example::

    kernel = KERNELS.get(type(opt))
    if kernel is not None and kernel(opt, group, run):
        ...   # the run was updated in one pass
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from bagua.kernels import adam as _adam_k
from bagua.kernels import lion as _lion_k
from bagua.kernels import sgd as _sgd_k

from .flat_buffers import FlatRun
from .lion import Lion

__all__ = ["KERNELS"]


def _scalar(x: Any) -> float | None:
    if isinstance(x, torch.Tensor):
        return float(x) if (x.device.type == "cpu" and x.numel() == 1 and not x.requires_grad) else None
    return float(x)


def _run_step_value(run: FlatRun) -> int | None:
    step = run.scalar_lists["step"][0]
    if step.device.type == "cpu":
        return int(step.item())
    if run.step_value is None:
        run.step_value = float(step.item())  # one sync, then tracked on the host
    return int(run.step_value)


def _adam_kernel(opt, group, run: FlatRun) -> bool:
    if group.get("differentiable") or getattr(opt, "grad_scale", None) is not None:
        return False
    amsgrad = bool(group["amsgrad"])
    need = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ())
    if not all(k in run.state_views for k in need) or run.tensor_keys != ("step",) or run.py_keys:
        return False
    lr, b1, b2 = _scalar(group["lr"]), _scalar(group["betas"][0]), _scalar(group["betas"][1])
    wd = _scalar(group["weight_decay"])
    if None in (lr, b1, b2, wd):
        return False
    step = _run_step_value(run) + 1
    sv = run.state_views
    _adam_k.adam_step_triton(
        run.param_view, run.grad_view, sv["exp_avg"], sv["exp_avg_sq"], sv.get("max_exp_avg_sq"),
        step=step, lr=lr, beta1=b1, beta2=b2, eps=float(group["eps"]), weight_decay=wd, amsgrad=amsgrad,
        maximize=bool(group["maximize"]),
        decoupled_weight_decay=bool(group.get("decoupled_weight_decay", isinstance(opt, torch.optim.AdamW))),
    )  # fmt: skip
    if "step" in run.scalar_views:
        run.scalar_views["step"].add_(1.0)
    else:
        torch._foreach_add_(run.scalar_lists["step"], 1.0)
    if run.step_value is not None:
        run.step_value += 1.0
    return True


def _sgd_kernel(opt, group, run: FlatRun) -> bool:
    momentum = _scalar(group["momentum"])
    if group.get("differentiable") or run.tensor_keys or run.py_keys or momentum is None:
        return False
    if momentum != 0 and "momentum_buffer" not in run.state_views:
        return False  # the first step creates the buffers: the optimizer's own step does it
    lr, wd = _scalar(group["lr"]), _scalar(group["weight_decay"])
    if lr is None or wd is None:
        return False
    _sgd_k.sgd_step_triton(
        run.param_view, run.grad_view, run.state_views.get("momentum_buffer"), lr=lr, momentum=momentum,
        dampening=float(group["dampening"]), weight_decay=wd, nesterov=bool(group["nesterov"]),
        maximize=bool(group["maximize"]),
    )  # fmt: skip
    return True


def _lion_kernel(opt, group, run: FlatRun) -> bool:
    if "exp_avg" not in run.state_views or run.tensor_keys or run.py_keys:
        return False
    _lion_k.lion_step_triton(
        run.param_view, run.grad_view, run.state_views["exp_avg"], lr=float(group["lr"]),
        beta1=float(group["betas"][0]), beta2=float(group["betas"][1]),
        weight_decay=float(group["weight_decay"]), maximize=bool(group["maximize"]),
    )  # fmt: skip
    return True


# exact types: a subclass may change the math
KERNELS: dict[type, Callable[[torch.optim.Optimizer, dict, FlatRun], bool]] = {
    torch.optim.Adam: _adam_kernel,
    torch.optim.AdamW: _adam_kernel,
    torch.optim.SGD: _sgd_kernel,
    Lion: _lion_kernel,
}
