"""What wrapping a module checks and leaves on it: the arguments' checks, the module's weak
link back to its wrapper (``module._bagua_wrapper``), through which a ``load_state_dict``, the
process's exit, or (``attach_to_module``) a call of the module itself reach the wrapper, and the
hook on each optimizer's ``step()``.

Example::

    check_module(model)
    opts = checked_optimizers([opt], model.parameters())
    model._bagua_wrapper = WrapperLink(wrapper)
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional

import torch

if TYPE_CHECKING:
    from .ddp import DistributedDataParallel


class WrapperLink:
    """The wrapped module's link back to its wrapper: a weak reference (the module does not keep
    the wrapper alive) that a copy or a pickle of the module gets inert."""

    def __init__(self, wrapper: Optional["DistributedDataParallel"] = None):
        self._ref = weakref.ref(wrapper) if wrapper is not None else None
        self._stepping = False  # the module's running forward began a training step (attach_to_module)

    def __call__(self) -> Optional["DistributedDataParallel"]:
        return None if self._ref is None else self._ref()

    def __reduce__(self):
        return (WrapperLink, ())

    def process_exiting(self) -> None:
        """bagua's exit handler: the algorithm stops its background work before the groups go."""
        wrapper = self()
        if wrapper is not None and not wrapper._closed:
            wrapper.impl.on_exit(wrapper)

    def forward_begins(self, module: torch.nn.Module, args: Any) -> None:
        """Forward pre-hook of an attached module (``attach_to_module``): begin the wrapper's step
        when the module itself is called, not from inside the wrapper's own forward."""
        wrapper = self()
        if wrapper is not None and not wrapper._in_forward:
            self._stepping = wrapper._forward_begins()

    def forward_ends(self, module: torch.nn.Module, args: Any, output: Any) -> Any:
        """Forward hook of an attached module: what the wrapper's forward does after the module's."""
        wrapper = self()
        if wrapper is None or wrapper._in_forward or not self._stepping:
            return None
        self._stepping = False
        return wrapper._forward_ends(output)

    def weights_loaded(self, module: torch.nn.Module, incompatible_keys: Any) -> None:
        """The module's load_state_dict post hook: tell the algorithm."""
        wrapper = self()
        if wrapper is not None and not wrapper._closed:
            wrapper.impl.on_weights_loaded(wrapper)


def open_wrapper(module: Any) -> Optional["DistributedDataParallel"]:
    """The open wrapper that holds ``module`` (through its link), or None.

    Example::

        ddp = open_wrapper(model)      # None once ddp.close() ran, or for a copy of the module
    """
    link = getattr(module, "_bagua_wrapper", None)
    wrapper = link() if callable(link) else None
    return wrapper if wrapper is not None and not wrapper._closed else None


def check_module(module: Any) -> None:
    """A clear error unless ``module`` is an nn.Module that no open wrapper holds."""
    from .ddp import DistributedDataParallel

    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    if isinstance(module, (DistributedDataParallel, torch.nn.parallel.DistributedDataParallel)):
        raise ValueError(
            f"module is already a {type(module).__module__}.{type(module).__name__}: wrapping it again would "
            f"communicate every gradient twice; wrap the inner module (.module) instead"
        )
    wrapper = open_wrapper(module)
    if wrapper is not None:
        raise ValueError(
            "this module is already wrapped by a bagua.DistributedDataParallel (algorithm "
            f"{wrapper.algorithm!r}); wrapping it again would stack two algorithms. To switch, call "
            "close() on the old wrapper first (it removes its hooks and stops its threads)"
        )


def ignored_names(module: torch.nn.Module) -> frozenset[str]:
    """Parameter and buffer names the user excluded from communication: torch DDP's
    ``module._ddp_params_and_buffers_to_ignore`` and the original Bagua's
    ``module._bagua_params_and_buffers_to_ignore`` (whose names of the root module's own
    tensors start with a dot, ``".weight"``), as ``module.named_parameters()`` names them.

    Example::

        model._ddp_params_and_buffers_to_ignore = ["embedding.weight"]   # trained locally
        ignored_names(model)   # frozenset({'embedding.weight'})
    """
    names = []
    for attribute in ("_ddp_params_and_buffers_to_ignore", "_bagua_params_and_buffers_to_ignore"):
        listed = getattr(module, attribute, ())
        if isinstance(listed, str) or not all(isinstance(name, str) for name in listed):
            raise TypeError(f"module.{attribute} must be a list of parameter/buffer names, got {listed!r}")
        names += [name[1:] if name.startswith(".") else name for name in listed]
    return frozenset(names)


def checked_optimizers(optimizers: Iterable[Any], params: Iterable[torch.Tensor]) -> list[torch.optim.Optimizer]:
    """``optimizers`` as a list, each a torch optimizer holding some of ``params``."""
    mine = {id(p) for p in params}
    checked = []
    for index, opt in enumerate(optimizers):
        if not isinstance(opt, torch.optim.Optimizer):
            hint = " (torch DDP's device_ids? pass it by keyword: device_ids=[...])" if isinstance(opt, (int, torch.device)) else ""
            raise TypeError(f"optimizers must be torch.optim.Optimizer instances, got {type(opt).__name__}{hint}")
        if not any(id(p) in mine for group in opt.param_groups for p in group["params"]):
            raise ValueError(
                f"optimizers[{index}] ({type(opt).__name__}) holds none of the module's trainable parameters; "
                f"build it from the wrapped module's parameters (model.parameters())"
            )
        checked.append(opt)
    return checked


def step_pre_hook(pre_step: Callable[[], None]) -> Callable:
    """An optimizer step pre-hook that runs ``pre_step()`` before the update: at once, or with
    ``step(closure)`` once the closure (forward and backward) has first run (LBFGS calls it
    often), so the algorithm's pre-step work sees this step's gradients.

    Example::

        opt.register_step_pre_hook(step_pre_hook(lambda: print("updating")))
    """
    def hook(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict):
        # torch passes step()'s own arguments, the optimizer first: (optimizer, closure?)
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if closure is None:
            pre_step()
            return None
        ran = []

        def closure_then_pre_step():
            loss = closure()
            if not ran:
                ran.append(True)
                pre_step()
            return loss

        if "closure" in kwargs:
            return args, {**kwargs, "closure": closure_then_pre_step}
        return (args[0], closure_then_pre_step, *args[2:]), kwargs

    return hook
