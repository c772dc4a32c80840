"""Adam / AdamW update in one pass: a Triton kernel, its launcher and a plain-torch reference.

The math is torch.optim.Adam's (``_single_tensor_adam``), per element, in float32, for the step
number ``step`` (already incremented, >= 1)::

    g  = -grad if maximize else grad
    p  = p * (1 - lr * wd)             if decoupled_weight_decay (AdamW)
    g  = g + wd * p                    otherwise, when wd != 0
    m  = m + (1 - beta1) * (g - m)                 (torch's lerp)
    v  = v * beta2 + (1 - beta2) * g * g
    vm = max(vm, v)                    if amsgrad, and v is replaced by vm below
    p  = p - lr / (1 - beta1**step) * m / (sqrt(v) / sqrt(1 - beta2**step) + eps)

Tensors may be float32, float16 or bfloat16 (states may differ from the parameter); the math is
float32 and results are rounded to each tensor's dtype (nearest even). The kernel reads every
operand once and writes it once: 4 (+1 with amsgrad) loads and 3 (+1) stores per element.

Example::

    >>> import torch
    >>> from bagua.kernels import adam
    >>> p, g = torch.ones(10), torch.full((10,), 0.5)
    >>> m, v = torch.zeros(10), torch.zeros(10)
    >>> adam.adam_step(p, g, m, v, step=1, lr=0.1)
    >>> round(float(p[0]), 4)
    0.9
"""

from __future__ import annotations

import math

import torch

from . import _optim_common as _c
from ._optim_common import HAS_TRITON, tl, triton

__all__ = ["HAS_TRITON", "adam_step", "adam_step_reference", "adam_step_triton"]


def _constants(step: int, lr: float, beta1: float, beta2: float, weight_decay: float) -> tuple[float, float, float]:
    if not isinstance(step, int) or isinstance(step, bool) or step < 1:
        raise ValueError(f"step must be the (already incremented) step number, an int >= 1, got {step!r}")
    step_size = lr / (1.0 - beta1**step)
    bc2_sqrt = math.sqrt(1.0 - beta2**step)
    decay = 1.0 - lr * weight_decay
    return step_size, bc2_sqrt, decay


def _check(fn, param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, amsgrad) -> int:
    if amsgrad and max_exp_avg_sq is None:
        raise ValueError(f"{fn}: amsgrad=True needs max_exp_avg_sq")
    return _c.check_tensors(
        fn,
        {"param": param, "grad": grad, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq,
         "max_exp_avg_sq": max_exp_avg_sq if amsgrad else None},
    )  # fmt: skip


def adam_step_reference(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    max_exp_avg_sq: torch.Tensor | None = None,
    *,
    step: int,
    lr: float,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    amsgrad: bool = False,
    maximize: bool = False,
    decoupled_weight_decay: bool = False,
) -> None:
    """Plain-torch Adam/AdamW update, in place, over cache-sized chunks (any device).

    Args: as :func:`adam_step`. Example::

        >>> adam_step_reference(p, g, m, v, step=1, lr=1e-3)  # doctest: +SKIP
    """
    numel = _check("adam_step_reference", param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, amsgrad)
    step_size, bc2_sqrt, decay = _constants(step, lr, beta1, beta2, weight_decay)
    p_f, g_f, m_f, v_f = (t.view(-1) for t in (param, grad, exp_avg, exp_avg_sq))
    vm_f = max_exp_avg_sq.view(-1) if amsgrad else None
    for s in _c.ref_chunks(numel):
        p = _c.as_f32(p_f[s])
        g = -g_f[s].float() if maximize else g_f[s].float()  # never modified in place below
        if weight_decay != 0:
            if decoupled_weight_decay:
                p.mul_(decay)
            else:
                g = g.add(p, alpha=weight_decay)
        m = _c.as_f32(m_f[s])
        m.lerp_(g, 1 - beta1)
        v = _c.as_f32(v_f[s])
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        src = v
        if amsgrad:
            vm = _c.as_f32(vm_f[s])
            torch.maximum(vm, v, out=vm)
            _c.write_back(vm_f[s], vm)
            src = vm
        denom = src.sqrt().div_(bc2_sqrt).add_(eps)
        p.addcdiv_(m, denom, value=-step_size)
        _c.write_back(p_f[s], p)
        _c.write_back(m_f[s], m)
        _c.write_back(v_f[s], v)


if triton is not None:

    @triton.jit
    def _adam_kernel(
        p_ptr, g_ptr, m_ptr, v_ptr, vm_ptr, numel,
        one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay, decay, step_size, bc2_sqrt,
        BLOCK: tl.constexpr, MASKED: tl.constexpr, AMSGRAD: tl.constexpr, MAXIMIZE: tl.constexpr,
        WEIGHT_DECAY: tl.constexpr, DECOUPLED: tl.constexpr,
    ):  # fmt: skip
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < numel
        p = _c.load_f32(p_ptr + offs, mask, MASKED)
        g = _c.load_f32(g_ptr + offs, mask, MASKED)
        m = _c.load_f32(m_ptr + offs, mask, MASKED)
        v = _c.load_f32(v_ptr + offs, mask, MASKED)
        if MAXIMIZE:
            g = -g
        if WEIGHT_DECAY:
            if DECOUPLED:
                p = p * decay
            else:
                g = g + weight_decay * p
        m = m + one_minus_beta1 * (g - m)
        v = v * beta2 + one_minus_beta2 * g * g
        if AMSGRAD:
            vm = tl.maximum(_c.load_f32(vm_ptr + offs, mask, MASKED), v)
            _c.store_rne(vm_ptr + offs, vm, mask, MASKED)
            denom = tl.sqrt_rn(vm) / bc2_sqrt + eps
        else:
            denom = tl.sqrt_rn(v) / bc2_sqrt + eps
        p = p - step_size * tl.math.div_rn(m, denom)
        _c.store_rne(p_ptr + offs, p, mask, MASKED)
        _c.store_rne(m_ptr + offs, m, mask, MASKED)
        _c.store_rne(v_ptr + offs, v, mask, MASKED)


def adam_step_triton(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    max_exp_avg_sq: torch.Tensor | None = None,
    *,
    step: int,
    lr: float,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    amsgrad: bool = False,
    maximize: bool = False,
    decoupled_weight_decay: bool = False,
) -> None:
    """Triton single-pass Adam/AdamW update, in place (CUDA, or CPU under TRITON_INTERPRET=1).

    Args: as :func:`adam_step`. Example::

        >>> adam_step_triton(p, g, m, v, step=1, lr=1e-3)  # doctest: +SKIP
    """
    numel = _check("adam_step_triton", param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, amsgrad)
    _c.require_triton(param, "adam_step_triton")
    step_size, bc2_sqrt, decay = _constants(step, lr, beta1, beta2, weight_decay)
    p_f, g_f, m_f, v_f = (t.view(-1) for t in (param, grad, exp_avg, exp_avg_sq))
    vm_f = max_exp_avg_sq.view(-1) if amsgrad else v_f  # not read without AMSGRAD
    with _c.device_guard(param):
        for grid, e0, masked in _c.launches(numel):
            _adam_kernel[(grid,)](
                p_f[e0:], g_f[e0:], m_f[e0:], v_f[e0:], vm_f[e0:], numel - e0,
                1.0 - beta1, beta2, 1.0 - beta2, eps, weight_decay, decay, step_size, bc2_sqrt,
                BLOCK=_c.BLOCK_SIZE, MASKED=masked, AMSGRAD=bool(amsgrad), MAXIMIZE=bool(maximize),
                WEIGHT_DECAY=weight_decay != 0, DECOUPLED=bool(decoupled_weight_decay),
                num_warps=_c.NUM_WARPS,
            )  # fmt: skip


def adam_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    max_exp_avg_sq: torch.Tensor | None = None,
    *,
    step: int,
    lr: float,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    amsgrad: bool = False,
    maximize: bool = False,
    decoupled_weight_decay: bool = False,
) -> None:
    """One Adam/AdamW step in place: the Triton kernel for CUDA tensors, the reference otherwise.

    Args:
        param, grad, exp_avg, exp_avg_sq: contiguous float tensors of equal numel on one device
            (param, exp_avg, exp_avg_sq, max_exp_avg_sq are updated in place).
        max_exp_avg_sq: the running max of exp_avg_sq, needed with ``amsgrad``.
        step: the step number after this step's increment (1 on the first step).
        lr, beta1, beta2, eps, weight_decay, amsgrad, maximize: as torch.optim.Adam.
        decoupled_weight_decay: AdamW's decay ``p *= 1 - lr * weight_decay`` instead of L2.

    Example::

        >>> p, g, m, v = torch.ones(4), torch.ones(4), torch.zeros(4), torch.zeros(4)
        >>> adam_step(p, g, m, v, step=1, lr=0.5)
        >>> p.tolist()
        [0.5, 0.5, 0.5, 0.5]
    """
    fn = adam_step_triton if (HAS_TRITON and isinstance(param, torch.Tensor) and param.is_cuda) else adam_step_reference
    fn(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
       weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize,
       decoupled_weight_decay=decoupled_weight_decay)  # fmt: skip
