"""The wrapper's buckets: built at wrap time, rebuilt between steps; and what else may change then.

``build`` groups the tensors the algorithm communicates into buckets (gradients become views of
the buckets' flat buffers, or stay in a fused optimizer's) and gives them to a new engine.
``rebucket`` rebuilds the buckets at another size as if the wrapper had been built with it:
gradients, weights, optimizer state (a fused optimizer's flat buffers included) and the
algorithm's per-bucket state carry over, value for value. ``configure`` applies any of
``tunables``: the bucket size, the number of stripes the wrapper's collectives spread over
(``streams``, when ``init_process_group(streams=K)`` made several) and what the algorithm
declares. None of them changes a result (see each algorithm's ``tunables``); every rank must
call them at the same point between two steps, as the autotuner does.

Example::

    ddp.rebucket(4 << 20)
    ddp.configure(bucket_size_bytes=8 << 20, segment_elems=1 << 18)    # bytegrad
"""

from __future__ import annotations

import operator
from collections import deque
from itertools import repeat
from typing import TYPE_CHECKING, Any, Optional

import torch

from ..algorithms.tunable import Tunable, powers_of_two
from ..comm import Bucket, Engine, stripes
from . import comm_hook

if TYPE_CHECKING:
    from .ddp import DistributedDataParallel

_GRAD = operator.attrgetter("grad")


def build(ddp: "DistributedDataParallel", bucket_size_bytes: int) -> None:
    """Bucket what ``ddp``'s algorithm communicates, at ``bucket_size_bytes``, and append its ops."""
    named = ddp.impl.tensors_to_communicate(ddp)
    groups = [group for group in ddp.impl.bucket_tensors(named, bucket_size_bytes) if group]
    ddp.buckets = [
        Bucket([t for _, t in group], name=f"bucket{i}[{group[0][0]}..{group[-1][0]}]")
        for i, group in enumerate(groups)
    ]
    ddp._bucket_names = [[name for name, _ in group] for group in groups]
    ddp._slot = {name: (b, i) for b, group in enumerate(groups) for i, (name, _) in enumerate(group)}
    # where each gradient lives: its bucket view, or (weight algorithms) a fused optimizer's slot
    ddp._grad_view = {}
    for name, (b, i) in ddp._slot.items():
        if name in ddp._gradient_slots and ddp.buckets[b].tensors[i] is ddp._gradient_slots[name]:
            ddp._grad_view[name] = ddp.buckets[b].views[i]
    for name, p in ddp.named_trainable_parameters:
        home = ddp._gradient_home(p)
        if name not in ddp._grad_view and home is not None:
            ddp._grad_view[name] = home
    for bucket in ddp.buckets:
        ddp.impl.init_operations(ddp, bucket)
    ddp.engine = Engine(ddp.buckets, group=ddp.comm_group)


def tunables(ddp: "DistributedDataParallel") -> dict[str, Tunable]:
    """What ``configure`` may set on ``ddp``, by name, with the choices the autotuner tries.
    With a communication hook the buckets are the hook's business: only ``streams`` remains."""
    space = {} if ddp._comm_hook is not None else dict(ddp.impl.tunables(ddp))
    group = ddp.comm_group
    if stripes.can_stripe(group, ddp.buckets[0].device.type):
        available = 1 + len(group.stripes)
        choices = sorted({k for k in powers_of_two(1, 64) if k <= available} | {available})
        space["streams"] = Tunable(tuple(choices), group.streams)
    return space


def configure(ddp: "DistributedDataParallel", settings: dict[str, Any]) -> None:
    """Apply ``settings`` (names from ``tunables(ddp)``) to ``ddp`` between steps."""
    _check_between_steps(ddp, "configure")
    space = tunables(ddp)
    for name, value in settings.items():
        if name not in space:
            raise ValueError(
                f"{name!r} is not tunable for {ddp.algorithm!r} here; tunable: {sorted(space) or 'nothing'}"
            )
        if name == "bucket_size_bytes":
            _check_bucket_size(value)
        elif not space[name].allows(value):
            raise ValueError(f"{name} must be one of {list(space[name].choices)}, got {value!r}")
    ops_changed = False
    for name, value in settings.items():
        if name == "streams":
            ddp.comm_group.use_streams(value)
        elif name != "bucket_size_bytes" and value != space[name].current:
            ddp.impl.set_tunable(ddp, name, value)
            ops_changed = True
    size = settings.get("bucket_size_bytes", ddp.bucket_size_bytes)
    if size != ddp.bucket_size_bytes:
        _rebuild(ddp, size)
    elif ops_changed:
        ddp.for_algorithms.reset_operations()


def rebucket(ddp: "DistributedDataParallel", bucket_size_bytes: int) -> None:
    """Rebuild ``ddp``'s buckets at ``bucket_size_bytes``, carrying every value over."""
    _check_bucket_size(bucket_size_bytes)
    _check_between_steps(ddp, "rebucket")
    _rebuild(ddp, bucket_size_bytes)


def _rebuild(ddp: "DistributedDataParallel", bucket_size_bytes: int) -> None:
    """``rebucket`` once its arguments and timing are checked."""
    ddp._repair_gradients()  # gradients accumulated outside their views (no_sync()) carry over from them
    old = {id(b): (b, names) for b, names in zip(ddp.buckets, ddp._bucket_names)}

    def carry(per_bucket: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        pieces: dict[str, torch.Tensor] = {}
        for key, flat in per_bucket.items():
            bucket, names = old[key]
            for name, start, numel in zip(names, bucket.offsets, bucket.numels):
                pieces[name] = flat[start:start + numel]
        carried = {}
        for b, names in zip(ddp.buckets, ddp._bucket_names):
            if all(name in pieces for name in names):  # each at its offset: a fused optimizer's
                flat = pieces[names[0]].new_empty(sum(b.numels))  # buffer may order them otherwise
                for name, start, numel in zip(names, b.offsets, b.numels):
                    flat[start:start + numel] = pieces[name]
                carried[id(b)] = flat
        return carried

    for bucket, _ in old.values():
        bucket.release()
    build(ddp, bucket_size_bytes)
    ddp.bucket_size_bytes = bucket_size_bytes
    ddp.impl.on_rebucket(ddp, carry)
    ddp._backward.attach()
    if ddp._comm_hook is not None:
        comm_hook.append_hook_ops(ddp)


def _check_bucket_size(value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"bucket_size_bytes must be a positive integer, got {value!r}")


def _check_between_steps(ddp: "DistributedDataParallel", what: str) -> None:
    if ddp._closed:
        raise RuntimeError(f"{what}: this bagua.DistributedDataParallel was closed")
    if ddp.engine.marked or ddp._callback_queued:
        raise RuntimeError(
            f"{what} runs between steps: a backward of this wrapper is still in progress; call it "
            f"before the next forward (after optimizer.step()), on every rank"
        )


def gradient_buckets(ddp: "DistributedDataParallel") -> list[tuple[Bucket, list[str], list[torch.Tensor]]]:
    """``ddp``'s buckets of gradients (each view the gradient of its parameter; not an algorithm's
    buckets of weights), with their parameters' names and the parameters."""
    return [(bucket, names, [ddp._params[name] for name in names])
            for bucket, names in zip(ddp.buckets, ddp._bucket_names)
            if all(map(operator.is_, map(ddp._grad_view.get, names), bucket.views))]


def gradients_in_place(buckets: list[tuple[Bucket, list[str], list[torch.Tensor]]]) -> list[str]:
    """At the start of a synced backward: make every gradient of ``buckets``
    (``gradient_buckets``) its bucket view, so autograd accumulates in place. A bucket whose
    gradients all live there already costs one check; one whose gradients are all None (after
    ``zero_grad()``) a zeroing of its flat buffer and the rebinding, both without Python per
    parameter; a mixed one (accumulated outside, or assigned) copies what exists and zeroes the
    rest. The names whose gradient was None (``restore_unreached`` gives them None back if
    backward does not reach them).

    Example::

        preset = gradients_in_place(gradient_buckets(ddp))     # backward begins
    """
    preset: list[str] = []
    for bucket, names, params in buckets:
        views = bucket.views
        grads = list(map(_GRAD, params))
        if all(map(operator.is_, grads, repeat(None))):
            bucket.flat.zero_()
            deque(map(setattr, params, repeat("grad"), views), maxlen=0)  # p.grad = view, in C
            preset += names
            continue
        if all(map(operator.is_, grads, views)):
            continue
        for name, p, grad, view in zip(names, params, grads, views):
            if grad is None:
                view.zero_()
                p.grad = view
                preset.append(name)
            elif grad is not view:
                gradient_into(p, view)
    return preset


def restore_unreached(ddp: "DistributedDataParallel", preset: list[str], unreached: set[str]) -> None:
    """Give the parameters in ``preset`` that ended in ``unreached`` their None gradient back."""
    for name in preset:
        if name in unreached:
            ddp._params[name].grad = None


def gradient_into(p: torch.Tensor, view: torch.Tensor) -> Optional[torch.Tensor]:
    """Make ``view`` (a bucket view or a fused optimizer's flat slot) ``p``'s gradient, copying
    ``p.grad`` (not None) into it unless it already lives there. Returns the gradient tensor it
    replaced (None when ``p.grad`` already lived in ``view``). The view takes the values only
    (after ``backward(create_graph=True)`` the gradient has a history; the view records none)."""
    grad = p.grad
    if grad.data_ptr() == view.data_ptr():
        return None
    with torch.no_grad():
        view.copy_(grad)
    p.grad = view
    return grad
