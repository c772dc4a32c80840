"""SGD (momentum, dampening, Nesterov, weight decay) in one pass: a Triton kernel, its launcher
and a plain-torch reference.

The math is torch.optim.SGD's (``_single_tensor_sgd``), per element, in float32::

    g = -grad if maximize else grad
    g = g + wd * p                               when wd != 0
    b = g                                        first step (no momentum buffer yet)
    b = b * momentum + (1 - dampening) * g       later steps        } only when momentum != 0
    g = g + momentum * b if nesterov else b                         }
    p = p - lr * g

With ``momentum == 0`` there is no buffer (pass ``None``). ``first=True`` initialises the buffer
from g, as torch does on the first step.

Example::

    >>> import torch
    >>> from bagua.kernels import sgd
    >>> p, g, b = torch.ones(3), torch.ones(3), torch.empty(3)
    >>> sgd.sgd_step(p, g, b, lr=0.1, momentum=0.9, first=True)
    >>> p.tolist(), b.tolist()
    ([0.8999999761581421, 0.8999999761581421, 0.8999999761581421], [1.0, 1.0, 1.0])
"""

from __future__ import annotations

import torch

from . import _optim_common as _c
from ._optim_common import HAS_TRITON, tl, triton

__all__ = ["HAS_TRITON", "sgd_step", "sgd_step_reference", "sgd_step_triton"]


def _check(fn, param, grad, momentum_buffer, momentum) -> int:
    if momentum != 0 and momentum_buffer is None:
        raise ValueError(f"{fn}: momentum={momentum} needs a momentum_buffer tensor")
    return _c.check_tensors(
        fn, {"param": param, "grad": grad, "momentum_buffer": momentum_buffer if momentum != 0 else None}
    )


def sgd_step_reference(
    param: torch.Tensor,
    grad: torch.Tensor,
    momentum_buffer: torch.Tensor | None = None,
    *,
    lr: float,
    momentum: float = 0.0,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    maximize: bool = False,
    first: bool = False,
) -> None:
    """Plain-torch SGD update, in place, over cache-sized chunks. Args: as :func:`sgd_step`.

    Example::

        >>> sgd_step_reference(torch.ones(2), torch.ones(2), lr=0.5)
    """
    numel = _check("sgd_step_reference", param, grad, momentum_buffer, momentum)
    p_f, g_f = param.view(-1), grad.view(-1)
    b_f = momentum_buffer.view(-1) if momentum != 0 else None
    for s in _c.ref_chunks(numel):
        p = _c.as_f32(p_f[s])
        g = -g_f[s].float() if maximize else g_f[s].float()
        if weight_decay != 0:
            g = g.add(p, alpha=weight_decay)
        if momentum != 0:
            if first:
                b = g.clone()
            else:
                b = _c.as_f32(b_f[s])
                b.mul_(momentum).add_(g, alpha=1 - dampening)
            _c.write_back(b_f[s], b)
            g = g.add(b, alpha=momentum) if nesterov else b
        p.add_(g, alpha=-lr)
        _c.write_back(p_f[s], p)


if triton is not None:

    @triton.jit
    def _sgd_kernel(
        p_ptr, g_ptr, b_ptr, numel, lr, momentum, one_minus_dampening, weight_decay,
        BLOCK: tl.constexpr, MASKED: tl.constexpr, MOMENTUM: tl.constexpr, FIRST: tl.constexpr,
        NESTEROV: tl.constexpr, MAXIMIZE: tl.constexpr, WEIGHT_DECAY: tl.constexpr,
    ):  # fmt: skip
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < numel
        p = _c.load_f32(p_ptr + offs, mask, MASKED)
        g = _c.load_f32(g_ptr + offs, mask, MASKED)
        if MAXIMIZE:
            g = -g
        if WEIGHT_DECAY:
            g = g + weight_decay * p
        if MOMENTUM:
            if FIRST:
                b = g
            else:
                b = _c.load_f32(b_ptr + offs, mask, MASKED) * momentum + one_minus_dampening * g
            _c.store_rne(b_ptr + offs, b, mask, MASKED)
            if NESTEROV:
                g = g + momentum * b
            else:
                g = b
        p = p - lr * g
        _c.store_rne(p_ptr + offs, p, mask, MASKED)


def sgd_step_triton(
    param: torch.Tensor,
    grad: torch.Tensor,
    momentum_buffer: torch.Tensor | None = None,
    *,
    lr: float,
    momentum: float = 0.0,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    maximize: bool = False,
    first: bool = False,
) -> None:
    """Triton single-pass SGD update, in place (CUDA, or CPU under TRITON_INTERPRET=1).

    Args: as :func:`sgd_step`. Example::

        >>> sgd_step_triton(p, g, b, lr=0.1, momentum=0.9)  # doctest: +SKIP
    """
    numel = _check("sgd_step_triton", param, grad, momentum_buffer, momentum)
    _c.require_triton(param, "sgd_step_triton")
    p_f, g_f = param.view(-1), grad.view(-1)
    b_f = momentum_buffer.view(-1) if momentum != 0 else p_f  # not touched without MOMENTUM
    with _c.device_guard(param):
        for grid, e0, masked in _c.launches(numel):
            _sgd_kernel[(grid,)](
                p_f[e0:], g_f[e0:], b_f[e0:], numel - e0, lr, momentum, 1.0 - dampening, weight_decay,
                BLOCK=_c.BLOCK_SIZE, MASKED=masked, MOMENTUM=momentum != 0, FIRST=bool(first),
                NESTEROV=bool(nesterov), MAXIMIZE=bool(maximize), WEIGHT_DECAY=weight_decay != 0,
                num_warps=_c.NUM_WARPS,
            )  # fmt: skip


def sgd_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    momentum_buffer: torch.Tensor | None = None,
    *,
    lr: float,
    momentum: float = 0.0,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    maximize: bool = False,
    first: bool = False,
) -> None:
    """One SGD step in place: the Triton kernel for CUDA tensors, the reference otherwise.

    Args:
        param, grad: contiguous float tensors of equal numel on one device.
        momentum_buffer: the momentum buffer (updated in place), needed when momentum != 0.
        lr, momentum, dampening, weight_decay, nesterov, maximize: as torch.optim.SGD.
        first: the buffer holds no history yet and is set to the (decayed) gradient.

    Example::

        >>> p = torch.ones(2); sgd_step(p, torch.ones(2), lr=0.25); p.tolist()
        [0.75, 0.75]
    """
    fn = sgd_step_triton if (HAS_TRITON and isinstance(param, torch.Tensor) and param.is_cuda) else sgd_step_reference
    fn(param, grad, momentum_buffer, lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
       nesterov=nesterov, maximize=maximize, first=first)  # fmt: skip
