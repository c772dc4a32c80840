"""Lion optimizer (EvoLved Sign Momentum, Chen et al. 2023, "Symbolic Discovery of Optimization
Algorithms"): the sign of an interpolated momentum as the update, with decoupled weight decay.

Its math lives in :mod:`bagua.kernels.lion`; :func:`bagua.optim.fuse_optimizer` runs it as one
Triton kernel over flat buffers on CUDA.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch

from bagua.kernels import lion as _lion

__all__ = ["Lion"]


class Lion(torch.optim.Optimizer):
    """Lion: ``p -= lr * (sign(beta1 * m + (1 - beta1) * g) + wd * p)``, ``m = beta2 * m + (1 - beta2) * g``.

    Args:
        params: parameters or param groups, as for any torch optimizer.
        lr: step size (Lion wants 3-10x smaller than AdamW's).
        betas: (beta1, beta2), the interpolation of the update and the momentum decay.
        weight_decay: decoupled weight decay (3-10x larger than AdamW's).
        maximize: ascend the objective instead.

    State per parameter: ``exp_avg`` (the momentum), created on its first step.

    Example::

        >>> model = torch.nn.Linear(4, 2)
        >>> opt = Lion(model.parameters(), lr=1e-4, weight_decay=0.1)
        >>> model(torch.randn(3, 4)).sum().backward(); opt.step()
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict],
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
        *,
        maximize: bool = False,
    ):
        if not lr > 0.0:
            raise ValueError(f"Lion: lr must be > 0, got {lr}")
        if not all(0.0 <= b < 1.0 for b in betas) or len(betas) != 2:
            raise ValueError(f"Lion: betas must be two values in [0, 1), got {betas}")
        if weight_decay < 0.0:
            raise ValueError(f"Lion: weight_decay must be >= 0, got {weight_decay}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay, maximize=maximize))

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None) -> torch.Tensor | None:
        """One Lion step over every parameter with a gradient (sparse gradients are refused)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("Lion does not support sparse gradients")
                state = self.state[p]
                if len(state) == 0:
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                grad = p.grad if p.grad.is_contiguous() else p.grad.contiguous()
                if p.is_contiguous():
                    _lion.lion_step(p, grad, state["exp_avg"], lr=group["lr"], beta1=beta1, beta2=beta2,
                                    weight_decay=group["weight_decay"], maximize=group["maximize"])  # fmt: skip
                else:
                    tmp = p.contiguous()
                    _lion.lion_step(tmp, grad, state["exp_avg"], lr=group["lr"], beta1=beta1, beta2=beta2,
                                    weight_decay=group["weight_decay"], maximize=group["maximize"])  # fmt: skip
                    p.copy_(tmp)
        return loss
