"""The wrapper's backward: a bucket becomes ready once, when its count of gradients reaches zero.

torch DDP learns in C++ (its reducer's autograd hooks) that a gradient has been accumulated. Here
each parameter's post-accumulate-grad hook is one decrement of its bucket's count; the bucket's
work (marking it ready, which launches its ops in bucket order) runs once, when the count reaches
zero. At the start of a synced backward every gradient bucket becomes the home of its gradients
(``bucketing.gradients_in_place``): None gradients become zeroed views of the flat buffer, so
autograd accumulates in place, with no copy and no Python per parameter; the end of backward
works per bucket too. A bucket that never completes is the rare case: only then does the end of
backward ask autograd which parameters it did not reach.

What needs each parameter as backward reaches it keeps the per-parameter path
(``per_parameter_reason``): ``find_unused_parameters`` (which parameters a step reached, one by
one, as torch DDP traverses the graph for it), an algorithm that overrides ``on_tensor_ready``
(qadam's speculation reads each gradient as it arrives), buckets on several devices (autograd
runs one thread per device, and the counts are not atomic), gradients that live in a fused
optimizer's buffer rather than the buckets (weight-communicating algorithms), and per backward a
``create_graph=True`` backward (autograd then replaces the gradient instead of adding in place) or
an algorithm that keeps the gradients backward produces. So does a backward that reaches a
parameter before the outputs of the wrapper's forward (nothing told it that backward began).

Example::

    tracker = BackwardTracker(ddp)       # the wrapper builds one; attach() again after rebucketing
    tracker.forward_done(synced=True)    # a training forward: the next backward communicates
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

import torch

from ..algorithms.base import AlgorithmImpl
from . import bucketing, unused_parameters
from .bucketing import gradient_into

if TYPE_CHECKING:
    from .ddp import DistributedDataParallel

#: a count no backward brings to zero: the hooks do nothing (inside ``no_sync()``, between steps)
DISARMED = -(1 << 62)


def per_parameter_reason(ddp: "DistributedDataParallel") -> Optional[str]:
    """Why ``ddp`` needs each parameter's gradient as backward reaches it, or None (per bucket).

    Example::

        per_parameter_reason(ddp)     # "find_unused_parameters=True: ..." or None
    """
    if ddp.find_unused_parameters:
        return "find_unused_parameters=True: which parameters each backward reached, one by one"
    if type(ddp.impl).on_tensor_ready is not AlgorithmImpl.on_tensor_ready:
        return f"{type(ddp.impl).__name__} acts on each tensor as it becomes ready (on_tensor_ready)"
    if _several_devices(ddp):
        return "buckets on several devices: autograd accumulates on a thread per device"
    homes = set(map(id, ddp._grad_view.values()))
    if homes and not all(id(v) in homes for bucket in ddp.buckets for v in bucket.views):
        return "gradients live in a fused optimizer's buffer, outside the buckets"
    return None


class BackwardTracker:
    """One wrapper's gradient hooks and the state of its running backward."""

    def __init__(self, ddp: "DistributedDataParallel"):
        self._ddp = ddp
        self._left: list[int] = []  # per bucket, then one slot for parameters outside the buckets
        self._handles: list = []
        self._counting = False  # this backward counts per bucket
        self._marks = False  # ... and marks each bucket ready when its count reaches zero
        self.reason: Optional[str] = None
        self.attach()

    def attach(self) -> None:
        """(Re)build the hooks for the wrapper's current buckets."""
        self.detach()
        ddp = self._ddp
        self.reason = per_parameter_reason(ddp)
        self._sizes = [len(names) for names in ddp._bucket_names]
        outside = len(self._sizes)
        self._left[:] = [DISARMED] * (outside + 1)
        self._all_names = frozenset(name for name, _ in ddp.named_trainable_parameters)
        self._gradient_buckets = bucketing.gradient_buckets(ddp)
        self._several_devices = _several_devices(ddp)
        # held, so that each parameter keeps the same node (torch DDP holds them too): asked which
        # ones a backward will run when a bucket's count does not reach zero
        self._accumulators = {name: _accumulator(ddp._params[name]) for name in ddp._slot}
        self._handles = [
            p.register_post_accumulate_grad_hook(self._hook(ddp._slot.get(name, (outside,))[0], name))
            for name, p in ddp.named_trainable_parameters
        ]
        self.forward_done(synced=False)

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _hook(self, b: int, name: str) -> Callable[[torch.Tensor], None]:
        left, reached = self._left, self._reached

        def hook(param: torch.Tensor) -> None:  # per parameter and backward: one decrement
            left[b] -= 1
            if not left[b]:
                reached(b, name, param)

        return hook

    # --- the steps of a step -------------------------------------------------------------------
    def forward_done(self, synced: bool) -> None:
        """A forward ended: its backward communicates (``synced``) or accumulates locally. Until
        the outputs' hook says backward began, every hook call takes the per-parameter path,
        which begins the backward itself if a parameter comes first."""
        self._counting = False
        if self.reason is not None or synced:
            self._left[:] = [1] * len(self._left)
        else:  # inside no_sync(): gradients accumulate where they are; the synced backward moves them in
            self._left[:] = [DISARMED] * len(self._left)

    def accumulates(self) -> bool:
        """In the outputs' hook: whether the running backward accumulates any parameter's gradient.
        ``torch.autograd.grad`` never does (a gradient penalty's gradient with respect to the
        inputs, or to the parameters with ``create_graph=True``): its end is not the step's."""
        will_run = torch._C._will_engine_execute_node
        try:
            return any(map(will_run, self._accumulators.values()))
        except RuntimeError:  # autograd.grad() running: autograd does not say, and accumulates nothing
            return False

    def backward_begins(self) -> list[str]:
        """The outputs' hook of a synced backward: every gradient into its bucket view, and a count
        per bucket when nothing needs each parameter. The names whose gradient was None."""
        ddp = self._ddp
        if ddp.impl.keeps_produced_gradients(ddp) or self._several_devices:
            return []  # each gradient made afresh (the algorithm keeps it), or a thread per device
        preset = bucketing.gradients_in_place(self._gradient_buckets)
        if self.reason is not None or torch.is_grad_enabled():
            return preset  # per parameter (create_graph: autograd replaces gradients, not adds in place)
        self._left[:-1] = self._sizes
        self._left[-1] = DISARMED
        self._counting = True
        self._marks = ddp.impl.ready_on_backward(ddp)
        return preset

    def _reached(self, b: int, name: str, param: torch.Tensor) -> None:
        if self._counting:  # every gradient of bucket b is in place
            if self._marks:
                self._ddp.for_algorithms.mark_bucket_ready(b)
            return
        self._left[b] = 1  # per parameter: every call comes here
        self._per_parameter(name, param)

    def _per_parameter(self, name: str, param: torch.Tensor) -> None:
        ddp = self._ddp
        view = ddp._grad_view.get(name)
        produced = None
        if view is not None:  # a fresh gradient (after zero_grad(set_to_none=True)) moves into it
            produced = gradient_into(param, view)
        ddp._used.add(name)
        if not ddp._sync_backward:
            return  # inside no_sync(), or a backward of no training forward
        if not ddp._callback_queued:
            ddp._queue_end_of_backward()  # backward reached the parameter without the outputs
        ddp._produced_gradient = produced  # for_algorithms.produced_gradient(), during the call only
        try:
            ddp.impl.on_tensor_ready(ddp, name, param)
        finally:
            ddp._produced_gradient = None

    def backward_ends(self, preset: list[str]) -> None:
        """What ends a synced backward: unreached parameters (an error where gradients are
        averaged), then the launched buckets finished."""
        ddp = self._ddp
        counting, self._counting = self._counting, False
        ready = ddp.impl.ready_on_backward(ddp)
        averaged = ready and ddp.impl.averages_gradients(ddp)
        if counting:
            twice = [ddp.buckets[b].name for b, left in enumerate(self._left[:-1]) if left < 0]
            if twice:
                ddp._drain_engine()
                raise RuntimeError(
                    f"bagua.DistributedDataParallel: a parameter of bucket(s) {', '.join(twice)} accumulated its "
                    f"gradient twice in one backward (used both inside and outside a reentrant activation "
                    f"checkpoint?); use torch.utils.checkpoint(..., use_reentrant=False)"
                )
            unused = self._unreached()
            ddp._used = self._all_names.difference(unused) if unused else self._all_names  # (a frozenset)
        else:
            is_ready = ddp.engine.is_ready
            unused = [n for n, slot in ddp._slot.items() if not is_ready(*slot)] if ready else []
        if unused and averaged and not ddp.find_unused_parameters:
            bucketing.restore_unreached(ddp, preset, set(unused))
            ddp._drain_engine()
            raise RuntimeError(
                f"bagua.DistributedDataParallel: {len(unused)} parameter(s) got no gradient in this "
                f"step ({', '.join(unused[:5])}{', ...' if len(unused) > 5 else ''}); pass "
                f"find_unused_parameters=True if parts of the model are skipped on purpose"
            )
        if not averaged:  # the gradients stay this rank's own: what backward did not reach has none
            bucketing.restore_unreached(ddp, preset, set(preset) - ddp._used)
        for name in unused:  # averaged: they count as zero (or as what they accumulated) this step
            if averaged:
                unused_parameters.contribute(ddp, name)
            ddp.for_algorithms.mark_ready(name)
        if ddp.engine.marked:
            ddp.engine.wait()
        if ddp.find_unused_parameters and averaged:
            unused_parameters.adopt_averaged_gradients(ddp, unused, preset)

    def _unreached(self) -> list[str]:
        """The parameters of the buckets whose count did not reach zero that this backward will
        not reach, as autograd's graph task says (asked only when a bucket is incomplete)."""
        ddp = self._ddp
        incomplete = [b for b, left in enumerate(self._left[:-1]) if left]
        if not incomplete:
            return []
        will_run = torch._C._will_engine_execute_node
        return [name for b in incomplete for name in ddp._bucket_names[b] if not will_run(self._accumulators[name])]

    def disarm(self) -> None:
        """The backward ended or was abandoned: hooks do nothing until the next forward says."""
        self._counting = False
        if self.reason is None:
            self._left[:] = [DISARMED] * len(self._left)


def _several_devices(ddp: "DistributedDataParallel") -> bool:
    """Whether ``ddp``'s buckets live on more than one device (autograd: a thread each)."""
    return len({bucket.device for bucket in ddp.buckets}) > 1


def _accumulator(param: torch.Tensor) -> torch.autograd.graph.Node:
    """``param``'s gradient accumulator, the node autograd runs to accumulate its gradient (the
    same node for as long as something references it)."""
    with torch.enable_grad():
        return param.view_as(param).grad_fn.next_functions[0][0]
