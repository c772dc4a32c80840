"""QAdamOptimizer: Adam whose variance freezes after warm-up, so the momentum can be compressed.

During the first ``warmup_steps`` steps it is Adam (L2 weight decay added to the gradient, as
``torch.optim.Adam`` does). Afterwards the second moment v and its bias correction stay frozen
and only the momentum m moves; the update is ``lr * m̂ / (sqrt(v̂) + eps)``. That is what lets
``QAdamAlgorithm`` average the momentum across ranks 8-bit compressed instead of the gradient
(the scheme of 1-bit Adam, Tang et al. 2021, and Bagua's QAdam). Used alone, the optimizer
updates the momentum from the local gradient itself.

A coordinate whose gradient was zero throughout warm-up (a dead ReLU unit, an input feature
that is always 0) has a frozen variance of exactly 0: its update m / (sqrt(0) + eps) would turn
the compression's rounding noise on a momentum of 0 into steps of up to lr * 1e-7 / eps. Such
coordinates are left unchanged after warm-up. A coordinate whose gradient was merely tiny
during warm-up (variance 1e-18 where its tensor's mean is 1e-10) but grows later would step
by m / sqrt(v) ~ 1e3 and make training diverge (a 4-layer ReLU MLP did within 5 steps): after
warm-up the frozen variance of every coordinate is floored at ``VARIANCE_FLOOR`` (1%) of its
tensor's mean.

Example::

    opt = bagua.optim.QAdamOptimizer(model.parameters(), lr=1e-3, warmup_steps=100)
    model = bagua.DistributedDataParallel(model, [opt], bagua.algorithms.QAdamAlgorithm(opt))
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch


# After warm-up each coordinate's frozen variance is at least this fraction of its tensor's mean.
VARIANCE_FLOOR = 0.01


class QAdamOptimizer(torch.optim.Optimizer):
    """Adam with a variance frozen after ``warmup_steps`` (see the module docstring).

    Args:
        params: parameters or param groups.
        lr, betas, eps, weight_decay: as ``torch.optim.Adam``.
        warmup_steps: steps of plain Adam before the variance freezes (>= 1).
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        warmup_steps: int = 100,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ):
        if not lr > 0.0:
            raise ValueError(f"lr must be positive, got {lr}")
        if not isinstance(warmup_steps, int) or warmup_steps < 1:
            raise ValueError(f"warmup_steps must be an integer >= 1 (the variance needs estimates), got {warmup_steps!r}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"betas must be in [0, 1), got {betas}")
        if not eps > 0.0:
            raise ValueError(f"eps must be positive, got {eps}")
        if weight_decay < 0.0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.warmup_steps = warmup_steps
        self.step_count = 0
        # set by QAdamAlgorithm: after warm-up it computes (and averages) the momentum itself
        self.momentum_from_algorithm = False
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                self.state[p]["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    @property
    def in_warmup(self) -> bool:
        """Whether the next ``step()`` is a warm-up (plain Adam) step."""
        return self.step_count < self.warmup_steps

    @staticmethod
    def momentum_input(p: torch.Tensor, group: dict) -> torch.Tensor:
        """The gradient the moments see: ``grad + weight_decay * p``."""
        return p.grad.add(p, alpha=group["weight_decay"]) if group["weight_decay"] else p.grad

    def denominator(self, p: torch.Tensor, group: dict, t: int | None = None) -> torch.Tensor:
        """``sqrt(v / (1 - beta2^t)) + eps`` for ``p`` at warm-up step ``t``; without ``t``, the
        frozen denominator of every step after warm-up, where v is floored at
        ``VARIANCE_FLOOR`` times the mean of p's v (see the module docstring)."""
        v = self.state[p]["exp_avg_sq"]
        if t is None:
            t = self.warmup_steps
            v = torch.maximum(v, v.mean() * VARIANCE_FLOOR)
        return (v / (1 - group["betas"][1] ** t)).sqrt_().add_(group["eps"])

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        warmup = self.in_warmup
        self.step_count += 1
        t = self.step_count
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            bias1 = 1 - beta1 ** t
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("QAdamOptimizer does not support sparse gradients")
                state = self.state[p]
                m, v = state["exp_avg"], state["exp_avg_sq"]
                if warmup or not self.momentum_from_algorithm:
                    g = self.momentum_input(p, group)
                    m.mul_(beta1).add_(g, alpha=1 - beta1)
                    if warmup:
                        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                denom = self.denominator(p, group, t) if warmup else self.denominator(p, group)
                if not warmup:  # coordinates with no variance estimate stay put (module docstring)
                    m = m.masked_fill(v == 0, 0.0)
                p.addcdiv_(m, denom, value=-group["lr"] / bias1)
        return loss


__all__ = ["QAdamOptimizer"]
