"""The original ``BaguaModule``: ``model.with_bagua(optimizers, algorithm)`` on every ``nn.Module``.

Importing ``bagua.torch_api`` adds to ``torch.nn.Module`` (as the original did):
``with_bagua(optimizers, algorithm, process_group=None, do_flatten=True)``, which wraps the
module with the native ``DistributedDataParallel``, makes calls of the module itself train
through it (``attach_to_module``) and returns the module itself, so ``state_dict()`` keys and
checkpoint code do not change; ``bagua_algorithm``, ``bagua_optimizers``, ``bagua_buckets``,
``bagua_module_name``. Calling ``with_bagua`` again switches algorithm: the old wrapper's hooks
and threads go. ``_bagua_params_and_buffers_to_ignore`` (names as in ``state_dict()``, root
tensors with a leading dot) are left out of communication, as torch DDP's
``_ddp_params_and_buffers_to_ignore``.

Example::

    import bagua.torch_api as bagua
    model = model.with_bagua([opt], bagua.algorithms.gradient_allreduce.GradientAllReduceAlgorithm())
    loss_fn(model(x), y).backward(); opt.step()
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from ..parallel.wrapping import open_wrapper
from .data_parallel.distributed import DistributedDataParallel
from .env import get_default_bucket_size

__all__ = ["BaguaModule"]


class _Keeper:
    """Holds the module's wrapper alive (the native link is weak); a copy or a pickle of the
    module gets an empty one, as a copied module is not wrapped."""

    def __init__(self, wrapper: Optional[DistributedDataParallel] = None):
        self.wrapper = wrapper

    def __deepcopy__(self, memo: dict) -> "_Keeper":
        return _Keeper()

    def __reduce__(self):
        return (_Keeper, ())


class BaguaModule:
    """The methods and properties added to ``torch.nn.Module``."""

    def with_bagua(
        self: Any,
        optimizers: Sequence[torch.optim.Optimizer],
        algorithm: Any,
        process_group: Any = None,
        do_flatten: bool = True,
    ) -> torch.nn.Module:
        """Train this module data-parallel with ``algorithm``; returns the module itself.

        Args:
            optimizers: the optimizers stepping the module's parameters.
            algorithm: a ``bagua.torch_api.algorithms`` algorithm.
            process_group: the ranks that train together (default all).
            do_flatten: gradients live in flat communication buckets (torch DDP's
                ``gradient_as_bucket_view``).

        Buckets hold ``BAGUA_DEFAULT_BUCKET_SIZE`` bytes (default 10 MiB), as in the original.
        """
        wrapper = DistributedDataParallel(self, process_group=process_group, gradient_as_bucket_view=do_flatten,
                                          bucket_cap_mb=get_default_bucket_size() / 2**20,
                                          optimizers=optimizers, algorithm=algorithm)
        wrapper.attach_to_module()
        self._bagua_keeper = _Keeper(wrapper)
        return self

    @property
    def bagua_ddp(self: Any) -> DistributedDataParallel:
        """The ``bagua.torch_api.data_parallel.DistributedDataParallel`` that ``with_bagua`` made (AttributeError before)."""
        wrapper = open_wrapper(self)
        if wrapper is None:
            raise AttributeError(
                f"this {type(self).__name__} is not trained with bagua: call model.with_bagua(optimizers, algorithm) first"
            )
        return wrapper

    @property
    def bagua_algorithm(self: Any) -> Any:
        """The algorithm given to ``with_bagua``."""
        return self.bagua_ddp.algorithm

    @property
    def bagua_optimizers(self: Any) -> list:
        """The optimizers given to ``with_bagua``."""
        return self.bagua_ddp.optimizers

    @property
    def bagua_buckets(self: Any) -> list:
        """The communication buckets, as the original's ``BaguaBucket`` objects."""
        return self.bagua_ddp.bagua_buckets

    @property
    def bagua_module_name(self: Any) -> str:
        """A name for the module, ``"{class}_{id}"`` unless set."""
        return self.__dict__.get("_bagua_module_name") or f"{type(self).__name__}_{id(self)}"

    @bagua_module_name.setter
    def bagua_module_name(self: Any, name: str) -> None:
        self.__dict__["_bagua_module_name"] = name


for _name in ("with_bagua", "bagua_ddp", "bagua_algorithm", "bagua_optimizers", "bagua_buckets", "bagua_module_name"):
    setattr(torch.nn.Module, _name, BaguaModule.__dict__[_name])
