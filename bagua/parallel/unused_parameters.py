"""``find_unused_parameters=True``: parameters a step did not reach, treated as torch DDP does.

A parameter backward did not reach on this rank still takes part in its bucket (the engine
launches whole buckets in the same order on every rank): it contributes what it accumulated
inside ``no_sync()``, or zeros. After the buckets the ranks agree (one small allreduce) which
parameters anyone used: those get the averaged gradient; one no rank used keeps its gradient as
it was (None stays None), so an optimizer leaves it alone.

Example::

    ddp = bagua.DistributedDataParallel(model, [opt], find_unused_parameters=True)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .. import comm
from ..comm.checks import trusted
from .bucketing import gradient_into, restore_unreached

if TYPE_CHECKING:
    from .ddp import DistributedDataParallel


def contribute(ddp: "DistributedDataParallel", name: str) -> None:
    """Parameter ``name``, which this backward did not reach, contributes its gradient as it is,
    or zeros when it has none; its ``.grad`` stays as it is until the ranks agree."""
    view, p = ddp._grad_view.get(name), ddp.for_algorithms.parameter(name)
    if view is None:
        return
    if p.grad is None:
        view.zero_()
    else:
        gradient_into(p, view)


def adopt_averaged_gradients(ddp: "DistributedDataParallel", locally_unused: list[str], preset: list[str]) -> None:
    """After the buckets: a parameter some rank used gets the averaged gradient; one no rank
    used keeps its gradient untouched (None stays None, also where backward began by presetting
    it to its bucket view, ``preset``), as with torch DDP."""
    if ddp.comm_group.size == 1:
        restore_unreached(ddp, preset, set(locally_unused))
        return
    names = list(ddp._slot)
    used = torch.tensor([name in ddp._used for name in names], dtype=torch.int32)
    with trusted():  # every rank sends the same layout, at the same point of every step
        comm.allreduce(used, op=comm.ReduceOp.MAX, group=ddp.comm_group)
    unused = set(locally_unused)
    anyone_used = dict(zip(names, used.tolist()))
    for name, anyone in anyone_used.items():
        if anyone and name in unused and name in ddp._grad_view:
            ddp.for_algorithms.parameter(name).grad = ddp._grad_view[name]
    restore_unreached(ddp, preset, {name for name, anyone in anyone_used.items() if not anyone})
