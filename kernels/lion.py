"""Lion (EvoLved Sign Momentum, Chen et al. 2023) in one pass: a Triton kernel, its launcher and a
plain-torch reference. :class:`bagua.optim.Lion` is the optimizer that uses them.

Per element, in float32::

    g = -grad if maximize else grad
    u = sign(beta1 * m + (1 - beta1) * g)          (sign(0) = 0)
    p = p * (1 - lr * wd) - lr * u
    m = beta2 * m + (1 - beta2) * g

Example::

    >>> import torch
    >>> from bagua.kernels import lion
    >>> p, g, m = torch.ones(2), torch.tensor([1.0, -1.0]), torch.zeros(2)
    >>> lion.lion_step(p, g, m, lr=0.5)
    >>> p.tolist()
    [0.5, 1.5]
"""

from __future__ import annotations

import torch

from . import _optim_common as _c
from ._optim_common import HAS_TRITON, tl, triton

__all__ = ["HAS_TRITON", "lion_step", "lion_step_reference", "lion_step_triton"]


def lion_step_reference(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    *,
    lr: float,
    beta1: float = 0.9,
    beta2: float = 0.99,
    weight_decay: float = 0.0,
    maximize: bool = False,
) -> None:
    """Plain-torch Lion update, in place, over cache-sized chunks. Args: as :func:`lion_step`.

    Example::

        >>> lion_step_reference(torch.ones(2), torch.ones(2), torch.zeros(2), lr=0.1)
    """
    numel = _c.check_tensors("lion_step_reference", {"param": param, "grad": grad, "exp_avg": exp_avg})
    p_f, g_f, m_f = param.view(-1), grad.view(-1), exp_avg.view(-1)
    for s in _c.ref_chunks(numel):
        p = _c.as_f32(p_f[s])
        g = -g_f[s].float() if maximize else g_f[s].float()
        m = _c.as_f32(m_f[s])
        u = m.mul(beta1).add_(g, alpha=1 - beta1).sign_()
        if weight_decay != 0:
            p.mul_(1 - lr * weight_decay)
        p.add_(u, alpha=-lr)
        m.mul_(beta2).add_(g, alpha=1 - beta2)
        _c.write_back(p_f[s], p)
        _c.write_back(m_f[s], m)


if triton is not None:

    @triton.jit
    def _lion_kernel(
        p_ptr, g_ptr, m_ptr, numel, lr, beta1, one_minus_beta1, beta2, one_minus_beta2, decay,
        BLOCK: tl.constexpr, MASKED: tl.constexpr, MAXIMIZE: tl.constexpr, WEIGHT_DECAY: tl.constexpr,
    ):  # fmt: skip
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < numel
        p = _c.load_f32(p_ptr + offs, mask, MASKED)
        g = _c.load_f32(g_ptr + offs, mask, MASKED)
        m = _c.load_f32(m_ptr + offs, mask, MASKED)
        if MAXIMIZE:
            g = -g
        c = m * beta1 + one_minus_beta1 * g
        u = tl.where(c > 0, 1.0, tl.where(c < 0, -1.0, 0.0))
        if WEIGHT_DECAY:
            p = p * decay
        p = p - lr * u
        m = m * beta2 + one_minus_beta2 * g
        _c.store_rne(p_ptr + offs, p, mask, MASKED)
        _c.store_rne(m_ptr + offs, m, mask, MASKED)


def lion_step_triton(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    *,
    lr: float,
    beta1: float = 0.9,
    beta2: float = 0.99,
    weight_decay: float = 0.0,
    maximize: bool = False,
) -> None:
    """Triton single-pass Lion update, in place (CUDA, or CPU under TRITON_INTERPRET=1).

    Args: as :func:`lion_step`. Example::

        >>> lion_step_triton(p, g, m, lr=1e-4)  # doctest: +SKIP
    """
    numel = _c.check_tensors("lion_step_triton", {"param": param, "grad": grad, "exp_avg": exp_avg})
    _c.require_triton(param, "lion_step_triton")
    p_f, g_f, m_f = param.view(-1), grad.view(-1), exp_avg.view(-1)
    with _c.device_guard(param):
        for grid, e0, masked in _c.launches(numel):
            _lion_kernel[(grid,)](
                p_f[e0:], g_f[e0:], m_f[e0:], numel - e0, lr, beta1, 1.0 - beta1, beta2, 1.0 - beta2,
                1.0 - lr * weight_decay,
                BLOCK=_c.BLOCK_SIZE, MASKED=masked, MAXIMIZE=bool(maximize), WEIGHT_DECAY=weight_decay != 0,
                num_warps=_c.NUM_WARPS,
            )  # fmt: skip


def lion_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    *,
    lr: float,
    beta1: float = 0.9,
    beta2: float = 0.99,
    weight_decay: float = 0.0,
    maximize: bool = False,
) -> None:
    """One Lion step in place: the Triton kernel for CUDA tensors, the reference otherwise.

    Args:
        param, grad, exp_avg: contiguous float tensors of equal numel on one device
            (param and exp_avg are updated in place).
        lr, beta1, beta2: step size; interpolation factor of the update; decay of the momentum.
        weight_decay: decoupled decay, ``p *= 1 - lr * weight_decay``.
        maximize: ascend instead of descend.

    Example::

        >>> p = torch.zeros(2); lion_step(p, torch.tensor([2.0, 0.0]), torch.zeros(2), lr=1.0); p.tolist()
        [-1.0, 0.0]
    """
    fn = lion_step_triton if (HAS_TRITON and isinstance(param, torch.Tensor) and param.is_cuda) else lion_step_reference
    fn(param, grad, exp_avg, lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, maximize=maximize)
