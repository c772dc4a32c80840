"""QAdamOptimizer: Adam whose momentum can be averaged compressed, its variance learnt from that average.

During the first ``warmup_steps`` steps it is Adam (L2 weight decay added to the gradient, as
``torch.optim.Adam`` does; with ``decoupled_weight_decay=True`` AdamW's decay instead). Then each
step moves the momentum ``m ← β1·m + (1−β1)·(g + wd·x)`` from the gradient the optimizer sees
(after clipping, unscaling, accumulation), and ``x ← x − lr · m̂ / (sqrt(v̂) + eps)``. That is
what lets ``QAdamAlgorithm`` average the momentum across ranks 8-bit compressed instead of the
gradient (the scheme of 1-bit Adam, Tang et al. 2021, and Bagua's QAdam): it installs a
``MomentumCommunicator`` as ``optimizer.momentum_communicator``, which ``step`` calls between
the momentum update and the parameter update. Used alone, the optimizer is Adam (with the floor
below after warm-up).

The second moment v after warm-up (``variance=``):

* ``"tracked"`` (default): updated at every step as Adam updates it, ``v ← β2·v + (1−β2)·ḡ²``,
  from the averaged gradient ḡ that the averaged momentum implies: every rank's momentum was
  ``β1·m̄ + (1−β1)·g_i`` from the same last average m̄, so ``ḡ = (m̄_new − β1·m̄) / (1−β1)``, the
  same bits on every rank and no extra byte on the wire (8-bit rounding of the ratio, amplified
  tenfold by 1/(1−β1), adds ~1% of v). With a 1-bit momentum that difference says nothing, so
  ``QAdamAlgorithm(bits=1)`` sends the momentum 8-bit on steps at doubling intervals (every 2nd,
  then 4th, ..., up to every 32nd: 0/1 Adam's schedule of variance updates, capped) and v learns
  on those. On the LM of ``docs/convergence.md`` (2 ranks, a constant learning rate) the frozen
  variance ended 5.7% above torch DDP's loss after 1000 steps, the tracked one 0.6%.
* ``"frozen"``: v and its bias correction freeze at the end of warm-up (1-bit Adam's scheme,
  and the original Bagua's QAdam), which makes every later step's size depend on how large the
  gradients were during warm-up.

After the last warm-up step, and after each later step that updated v, each tensor's v is floored:

* a coordinate whose gradient was exactly zero throughout warm-up (an embedding row not seen
  yet, a unit that was dead) has no variance estimate; it gets the mean v of its tensor's
  coordinates that have one (of all the optimizer's, if none of its tensor's has one), so it
  trains when its gradients arrive, with steps the size of its neighbours';
* every other coordinate is floored at ``variance_floor`` (default 1%) of that mean: a coordinate whose
  gradient was merely tiny during warm-up (v 1e-18 where its tensor's mean is 1e-10) but grows
  later would otherwise step by m / sqrt(v) ~ 1e3 and make training diverge (a 4-layer ReLU MLP
  did within 5 steps).

Each step then divides by sqrt(v̂) of a floored v, so no coordinate's update can blow up the
8-bit rounding noise of the momentum averaging (which is done on m / (sqrt(v̂) + eps)). That
denominator is computed once per value of v and kept: updates of v, ``load_state_dict`` and
in-place writes through ``state[p]["exp_avg_sq"]`` (of an unfused optimizer: they bump its version
counter) recompute it, a write through ``.data`` does not.

Deviations from the QAdam / 1-bit Adam papers and from the original Bagua, on purpose: the
momentum is computed in ``step`` from the processed gradient (the original computed it in
backward from the raw gradient, so clipping, GradScaler and accumulation were ignored) and it
includes the L2 weight decay (the original dropped it after warm-up); the variance is tracked
after warm-up by default (the original froze it, and kept dividing by 1 − β2^t, t the step, with
the frozen v; here the bias correction counts the updates of v, ``variance_updates``); the floor
above (the original divided by eps alone where v was 0); error feedback only with
``QAdamAlgorithm(bits=1)`` (1-bit Adam compensates the compression error; Bagua's 8-bit QAdam did
not, nor does ``bits=8``); warm-up is ``warmup_steps`` Adam
steps (the original's was one shorter); and the step count is one counter, ``step_count``,
saved by ``state_dict()`` with ``variance_updates`` (the original kept an int ``step`` per parameter).

With a ``torch.amp.GradScaler``, ``scaler.step(optimizer)`` hands this optimizer the scale and
whether it found inf/NaN gradients (``_step_supports_amp_scaling``): the optimizer unscales the
gradients itself and skips the step (momentum, variance and step count untouched) when any rank
found one. After warm-up the gradients are not averaged, so only this rank may have overflowed;
the skip is then agreed across ranks through the communicator, so every rank skips or none does.
Each rank's scaler still backs off on its own overflows only; the scale does not change the
unscaled gradient, so the ranks stay identical.

Example::

    opt = bagua.optim.QAdamOptimizer(model.parameters(), lr=1e-3, warmup_steps=100)
    model = bagua.DistributedDataParallel(model, [opt], bagua.algorithms.QAdamAlgorithm(opt))
    for x, y in loader:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)   # seen by the momentum
        opt.step()
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional, Protocol

import torch

# After warm-up each coordinate's variance is at least this fraction of its tensor's mean (by default).
VARIANCE_FLOOR = 0.01
#: ``QAdamOptimizer(variance=...)``: how the second moment evolves after warm-up
VARIANCE_POLICIES = ("tracked", "frozen")


class MomentumCommunicator(Protocol):
    """What ``QAdamOptimizer.step`` calls after warm-up when set as ``momentum_communicator``
    (``QAdamAlgorithm`` installs one). Every rank calls the methods in the same order."""

    def begin_step(self, found_inf: Optional[bool], scaled: bool) -> bool:
        """Begin a step on every rank alike; whether every rank skips it. ``found_inf``: whether
        this rank's gradients overflowed (a ``GradScaler`` step; None without one): a step is
        skipped everywhere when it overflowed anywhere. ``scaled``: the gradients still carry the
        loss scale, which this step divides out."""

    def covers(self, p: torch.Tensor) -> bool:
        """Whether ``p``'s momentum is averaged: then ``p`` steps on every rank, a gradient that
        is None on this rank (a parameter unused here this step) counting as zero."""

    def averaged_already(self, p: torch.Tensor) -> bool:
        """Whether ``p``'s momentum of this step is averaged already (computed during backward
        from the gradient ``p`` has now): the step leaves it to ``average_momentum``."""

    def average_momentum(self) -> bool:
        """Replace every covered parameter's ``exp_avg`` by its average over the ranks, in place.
        With ``variance="tracked"``, also update each covered ``exp_avg_sq`` from the averaged
        gradient that average implies (``averaged_gradient``: the same bits on every rank), and
        return whether it did (not on a step whose average is too coarse to tell it: 1-bit)."""


def decayed_gradient(p: torch.Tensor, grad: Optional[torch.Tensor], group: dict) -> torch.Tensor:
    """The gradient a step applies to ``p`` whose gradient is ``grad`` (zeros when None): plus the
    group's L2 weight decay ``wd·p`` (unless it is decoupled, AdamW's, which the step applies to
    ``p`` itself).

    Example::

        g = decayed_gradient(p, p.grad, opt.param_groups[0])
    """
    g = torch.zeros_like(p) if grad is None else grad
    coupled = group["weight_decay"] and not group.get("decoupled_weight_decay", False)
    return g.add(p, alpha=group["weight_decay"]) if coupled else g


def update_variance(v: torch.Tensor, g: torch.Tensor, beta2: float) -> None:
    """``v ← β2·v + (1−β2)·g²`` in place, as ``torch.optim.Adam`` updates its second moment.

    Example::

        update_variance(opt.state[p]["exp_avg_sq"], g, 0.999)
    """
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)


def averaged_gradient(new: torch.Tensor, old: torch.Tensor, beta1: float, out: torch.Tensor) -> torch.Tensor:
    """The averaged gradient that turned the averaged momentum ``old`` into ``new``:
    ``(new − β1·old) / (1 − β1)`` (each rank's momentum was ``β1·old + (1−β1)·g_i``), into ``out``.

    Example::

        averaged_gradient(m_after, m_before, 0.9, out=g)
    """
    return torch.sub(new, old, alpha=beta1, out=out).div_(1 - beta1)


def new_momentum(m: torch.Tensor, g: torch.Tensor, beta1: float, out: torch.Tensor) -> torch.Tensor:
    """``out ← β1·m + (1−β1)·g`` (``out`` may be ``m``), as ``torch.optim.Adam`` computes it (one
    ``lerp``): the one expression of the momentum update, so that a momentum computed ahead
    (``QAdamAlgorithm``'s overlap) has the step's bits.

    Example::

        new_momentum(m, g, 0.9, out=m)     # in place, as a step does
    """
    return torch.lerp(m, g, 1 - beta1, out=out)


class QAdamOptimizer(torch.optim.Optimizer):
    """Adam whose momentum ``QAdamAlgorithm`` averages compressed after ``warmup_steps`` (see the
    module docstring).

    Args:
        params: parameters or param groups.
        lr: as ``torch.optim.Adam``.
        betas: as ``torch.optim.Adam``.
        eps: as ``torch.optim.Adam``.
        weight_decay: as ``torch.optim.Adam``.
        decoupled_weight_decay: AdamW's weight decay (``x ← x·(1 − lr·wd)`` at each step, outside
            the momentum, as ``torch.optim.AdamW``) instead of the L2 term in the gradient.
        warmup_steps: steps of plain Adam (exact gradient averaging under ``QAdamAlgorithm``) before
            the momentum is averaged compressed (>= 1).
        variance: ``"tracked"`` (default) or ``"frozen"`` after warm-up (module docstring).
        variance_floor: after warm-up each coordinate's v is at least this fraction of its
            tensor's mean v (module docstring; 0: no floor).

    ``step_count`` counts the steps taken (skipped GradScaler steps excluded); ``state_dict()``
    holds it beside torch's usual ``state`` and ``param_groups``.

    Example::

        opt = bagua.optim.QAdamOptimizer(model.parameters(), lr=1e-3, warmup_steps=100)
        loss_fn(model(x), y).backward()
        opt.step()
    """

    # torch.amp.GradScaler.step then calls step() with self.grad_scale and self.found_inf set
    _step_supports_amp_scaling = True

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        warmup_steps: int = 100,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        decoupled_weight_decay: bool = False,
        variance: str = "tracked",
        variance_floor: float = VARIANCE_FLOOR,
    ):
        if variance not in VARIANCE_POLICIES:
            raise ValueError(f"variance must be one of {list(VARIANCE_POLICIES)} ('tracked': updated after warm-up from "
                             f"the averaged momentum; 'frozen': 1-bit Adam's, fixed at warm-up's end), got {variance!r}")
        if not 0.0 <= variance_floor <= 1.0:
            raise ValueError(f"variance_floor must be in [0, 1] (a fraction of each tensor's mean variance), got {variance_floor}")
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
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      decoupled_weight_decay=bool(decoupled_weight_decay)))
        self.warmup_steps = warmup_steps
        self.variance = variance
        self.variance_floor = float(variance_floor)
        self._init_runtime(0, 0)
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                self.state[p]["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def _init_runtime(self, step_count: int, variance_updates: int) -> None:
        self.step_count = step_count
        #: steps whose gradients updated the variance (its bias correction's t): every warm-up step,
        #: and with ``variance="tracked"`` every step after it whose averaged gradient was known
        self.variance_updates = variance_updates
        self.momentum_communicator: Optional[MomentumCommunicator] = None
        # A step that updated the variance after warm-up, or the last warm-up step, sets it; the
        # step post hook then floors each tensor's variance. A hook, because fuse_step runs step()
        # on flat runs spanning many tensors (a per-tensor mean cannot be taken there) and the
        # hooks around it, on the parameters themselves.
        self._floor_pending = False
        self._denominators = _Denominators()
        self.register_step_post_hook(_floor_variance)

    # --- pickling / checkpoints ---------------------------------------------------------------
    def __getstate__(self) -> dict:
        return {**super().__getstate__(), "warmup_steps": self.warmup_steps, "variance": self.variance,
                "variance_floor": self.variance_floor,
                "step_count": self.step_count, "variance_updates": self.variance_updates}

    def __setstate__(self, state: dict) -> None:
        step_count = state.pop("step_count", None)  # absent when torch's load_state_dict calls us
        variance_updates = state.pop("variance_updates", None)
        if step_count is not None:  # unpickled (or deep-copied); pickled before the variance could be tracked: frozen
            state = {"variance": "frozen", "variance_floor": VARIANCE_FLOOR, **state}
        super().__setstate__(state)
        if step_count is not None:  # not attached to any algorithm
            self._init_runtime(step_count, _saved_variance_updates(variance_updates, step_count, self.warmup_steps))

    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer state dict plus ``"step_count"`` and ``"variance_updates"``."""
        return {**super().state_dict(), "step_count": self.step_count, "variance_updates": self.variance_updates}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what ``state_dict()`` returned, step count included (so warm-up does not restart).
        The state tensors are replaced; an attached ``QAdamAlgorithm`` reads them afresh each step."""
        if "step_count" not in state_dict:
            raise ValueError(
                "QAdamOptimizer.load_state_dict: the state dict has no 'step_count' (it was not saved by "
                "QAdamOptimizer.state_dict()); without it warm-up would restart. Save with "
                "QAdamOptimizer.state_dict(), or add state_dict['step_count'] = <steps taken>."
            )
        step_count = int(state_dict["step_count"])
        variance_updates = _saved_variance_updates(state_dict.get("variance_updates"), step_count, self.warmup_steps)
        super().load_state_dict({k: v for k, v in state_dict.items() if k not in ("step_count", "variance_updates")})
        self.step_count, self.variance_updates = step_count, variance_updates
        self._floor_pending = False  # a state saved after a step is already floored
        self._denominators.clear()

    # --- the update ---------------------------------------------------------------------------
    @property
    def in_warmup(self) -> bool:
        """Whether the next ``step()`` is a warm-up (plain Adam) step."""
        return self.step_count < self.warmup_steps

    def denominator(self, p: torch.Tensor, group: dict, t: Optional[int] = None) -> torch.Tensor:
        """``sqrt(v / (1 - beta2^t)) + eps`` for ``p``; without ``t``, the denominator of the
        steps after warm-up (``t = variance_updates``, v floored), computed once per value of v
        and kept (read it, never write it)."""
        beta2, eps = group["betas"][1], group["eps"]
        if t is None:
            return self._denominators.get(self.state[p]["exp_avg_sq"], beta2, eps, self.variance_updates)
        return (self.state[p]["exp_avg_sq"] / (1 - beta2 ** t)).sqrt_().add_(eps)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        """One QAdam step (the closure, if given, runs first); returns the closure's loss.

        Example::

            def closure():
                opt.zero_grad()
                loss = loss_fn(model(x), y)
                loss.backward()
                return loss

            loss = opt.step(closure)
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        warmup = self.in_warmup
        communicator = None if warmup else self.momentum_communicator
        found_inf = getattr(self, "found_inf", None)  # set by GradScaler.step for this call
        grad_scale = getattr(self, "grad_scale", None)
        skip = found_inf is not None and bool(found_inf.item())
        if communicator is not None:  # in warm-up the averaged gradients overflowed on all ranks alike
            skip = communicator.begin_step(None if found_inf is None else skip, scaled=grad_scale is not None)
        if skip:
            return loss
        params = [
            (p, group) for group in self.param_groups for p in group["params"]
            if p.grad is not None or (communicator is not None and communicator.covers(p))
        ]  # fmt: skip
        grads = [p.grad for p, _ in params if p.grad is not None]
        if any(g.is_sparse for g in grads):
            raise RuntimeError("QAdamOptimizer does not support sparse gradients")
        if grad_scale is not None and grads:
            inv_scale = float(grad_scale.double().reciprocal().float())  # as GradScaler.unscale_
            torch._foreach_mul_(grads, inv_scale)
        self.step_count += 1
        tracked = self.variance == "tracked"
        updated = False  # whether this step updated the variance
        for p, group in params:
            if communicator is not None and communicator.averaged_already(p):
                continue
            g = decayed_gradient(p, p.grad, group)
            new_momentum(self.state[p]["exp_avg"], g, group["betas"][0], out=self.state[p]["exp_avg"])
            if warmup or (tracked and communicator is None):  # alone, a tracked variance is Adam's
                update_variance(self.state[p]["exp_avg_sq"], g, group["betas"][1])
                updated = True
        if communicator is not None:
            updated = communicator.average_momentum() and tracked
        self.variance_updates += updated
        for p, group in params:
            denom = self.denominator(p, group, self.variance_updates if warmup else None)
            if group["weight_decay"] and group.get("decoupled_weight_decay", False):
                p.mul_(1 - group["lr"] * group["weight_decay"])  # AdamW's decay, outside the momentum
            p.addcdiv_(self.state[p]["exp_avg"], denom, value=-group["lr"] / (1 - group["betas"][0] ** self.step_count))
        self._floor_pending = (warmup and self.step_count == self.warmup_steps) or (updated and not warmup)
        return loss


def _saved_variance_updates(saved: Optional[int], step_count: int, warmup_steps: int) -> int:
    """``variance_updates`` as saved, or for a state saved before the variance could be tracked
    (it froze at warm-up's end) the warm-up steps taken."""
    return int(saved) if saved is not None else min(step_count, warmup_steps)


@torch.no_grad()
def _floor_variance(optimizer: QAdamOptimizer, args: tuple, kwargs: dict) -> None:
    """Step post hook: after the last warm-up step, and after each later step that updated the
    variance, floor each tensor's v (module docstring)."""
    if not optimizer._floor_pending:
        return
    optimizer._floor_pending = False
    variances = [optimizer.state[p]["exp_avg_sq"] for group in optimizer.param_groups for p in group["params"]]
    if optimizer.step_count > optimizer.warmup_steps:  # floored before: no coordinate without an estimate
        for v in variances:
            if v.numel():  # (a tensor bound: no wait for the device per tensor)
                v.clamp_(min=v.mean() * optimizer.variance_floor)
        optimizer._denominators.clear()
        return
    known = [int(torch.count_nonzero(v)) for v in variances]
    if not any(known):
        raise RuntimeError(
            f"QAdamOptimizer: every gradient was exactly zero during the {optimizer.warmup_steps} warm-up "
            f"steps, so there is no variance to freeze; check that the loss depends on the parameters, "
            f"or use a larger warmup_steps"
        )
    fallback = sum(v.sum() for v in variances) / sum(known)  # mean over every coordinate with an estimate
    for v, n in zip(variances, known):
        mean = v.sum() / n if n else fallback
        unknown = v == 0
        v.clamp_(min=optimizer.variance_floor * mean).masked_fill_(unknown, mean)
    optimizer._denominators.clear()


class _Denominators:
    """The denominators ``sqrt(v / (1 - beta2^T)) + eps`` after warm-up, computed once per
    storage of ``exp_avg_sq`` tensors (a parameter's own, or a fused optimizer's flat buffer, whose
    runs and parameters then share it) instead of four passes over v each time a step needs them.
    An entry is kept while beta2, eps and T are, and the version counter of the tensor it was
    computed for; the optimizer clears them where it writes v (the floor, ``load_state_dict``)."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple] = {}  # storage address -> (v, its version, settings, denominators)

    def get(self, v: torch.Tensor, beta2: float, eps: float, t: int) -> torch.Tensor:
        storage = v.untyped_storage()
        settings = (beta2, eps, t, v.dtype, storage.nbytes())
        entry = self._entries.get(storage.data_ptr())
        if entry is None or entry[2] != settings or entry[0]._version != entry[1]:
            whole = v.new_empty(0).set_(storage, 0, (storage.nbytes() // v.element_size(),))
            entry = (v, v._version, settings, (whole / (1 - beta2 ** t)).sqrt_().add_(eps))
            self._entries[storage.data_ptr()] = entry
        return entry[3].as_strided(v.shape, v.stride(), v.storage_offset())

    def clear(self) -> None:
        self._entries.clear()


__all__ = ["MomentumCommunicator", "QAdamOptimizer", "averaged_gradient", "decayed_gradient", "new_momentum",
           "update_variance"]
