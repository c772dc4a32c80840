"""The original ``bagua.torch_api.contrib.fuse.optimizer``: ``fuse_optimizer``, ``fuse_step`` and
``is_fused_optimizer`` over ``bagua.optim``.

As the original's, ``fuse_step()`` runs the optimizer's own update on the fused (flat) tensors,
the same arithmetic per element as ``step()`` (bit-equal on CPU): the native single-pass
kernels (``bagua.optim.fuse_optimizer(opt)``) are faster and equal only within float rounding.
``optimizer._bagua_fused_count`` counts, as the original's, the (fuse_step, param group) pairs
that updated several parameters as one tensor.

Not here: the original's helpers behind its ``fuse_step`` (``calculate_mutual_groups``,
``flatten_params_and_states``, ...); the native fused optimizer finds its runs its own way.

Example::

    optimizer = fuse_optimizer(torch.optim.Adadelta(model.parameters()))
    loss.backward()
    optimizer.fuse_step()
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from bagua import optim

__all__ = ["fuse_optimizer", "fuse_step", "is_fused_optimizer"]

is_fused_optimizer = optim.is_fused_optimizer


def fuse_optimizer(optimizer: torch.optim.Optimizer, do_flatten: bool = True,
                   check_flatten: bool = True) -> torch.optim.Optimizer:
    """Make ``optimizer`` fused: flat parameters, gradients and states, and ``optimizer.fuse_step()``.

    Args:
        optimizer: any element-wise torch optimizer.
        do_flatten: move parameters, gradients and states into flat buffers; False fuses only
            parameters already adjacent in memory.
        check_flatten: warn when something broke the flat layout (``fuse_step`` repairs it).

    Returns:
        The same optimizer object.

    Raises:
        RuntimeError: it is fused already (as the original).

    Example::

        optimizer = fuse_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), do_flatten=True)
        optimizer.fuse_step()
    """
    if is_fused_optimizer(optimizer):
        raise RuntimeError(
            f"trying to fuse an optimizer twice! This {type(optimizer).__name__} went through fuse_optimizer "
            f"already; call optimizer.fuse_step() on it directly"
        )
    optim.fuse_optimizer(optimizer, do_flatten=do_flatten, check_flatten=check_flatten, single_pass=False)
    optimizer._bagua_fused_count = 0
    optimizer.register_step_post_hook(_update_fused_count)
    return optimizer


def _update_fused_count(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    optimizer._bagua_fused_count = optim.fused_update_count(optimizer)


def fuse_step(optimizer: torch.optim.Optimizer, closure: Optional[Callable[[], Any]] = None) -> Any:
    """``optimizer.fuse_step(closure)``: one update of the fused tensors; returns the closure's loss.

    Example::

        fuse_step(optimizer)
    """
    if not is_fused_optimizer(optimizer):
        raise ValueError(
            f"fuse_step needs a fused optimizer, got a plain {type(optimizer).__name__}: "
            f"call fuse_optimizer(optimizer) first"
        )
    return optimizer.fuse_step(closure)
