"""qadam's momentum averaged while backward runs: speculatively, with the bits of the exact path.

After warm-up ``QAdamOptimizer.step`` averages ``m / (sqrt(v̂) + eps)`` over the ranks, ``m`` being
the momentum updated from the gradient the optimizer sees. That gradient usually is the one
backward produced, but the loop may change it before the step (clipping, GradScaler's
unscaling, a further backward, a manual edit). So each parameter's momentum is computed as soon
as backward has produced its gradient (in the wrapper's gradient hook), and each bucket's 8-bit
allreduce launched as soon as the bucket is complete, while the rest of backward runs: a
speculation. At ``step()`` each rank checks that what the
speculation read is still what the step would read; the ranks agree (one small allreduce); on
a hit the averaged momentum is taken as it is, on a miss anywhere it is discarded and the step
averages from the final gradients, as without overlap. Both ways fill the same buffers (one per
wrapper bucket, ``bagua.algorithms.q_adam.MomentumBucket``) with the same arithmetic
(``bagua.optim.qadam.new_momentum``), each tensor on its own codec blocks: the same bits.

The check, per parameter:

* its gradient, bit for bit, against the copy of its bits that the speculation computed from
  (None against None). Bits see every way a gradient changes: clipping that clipped
  (``clip_grad_norm_`` multiplies by 1.0 when it clips nothing, which changes no bit and is a
  hit), ``GradScaler.unscale_`` (whose kernel bumps no version counter), writes through
  ``p.grad.data`` (a counter of their own), NumPy or DLPack views, communication into it,
  another backward, ``zero_grad``, a hook racing the speculation;
* its ``exp_avg`` and ``exp_avg_sq`` (the same objects, version counters unchanged), the
  parameter itself where weight decay reads it (version counter), and its group's betas, eps,
  weight decay and the warm-up length (values): torch's writers of these (``load_state_dict`` of
  the module or the optimizer, ``fuse_optimizer``'s loads, optimizer steps) replace them or bump
  their counters.

A step under a ``GradScaler`` whose gradients are still scaled (``scaler.step`` without
``unscale_``) misses: the speculation read the scaled ones. What the check cannot see: a write
into a parameter (with weight decay) or into ``exp_avg``/``exp_avg_sq`` between backward and
``step()`` that bumps no version counter (through ``.data``, NumPy, DLPack or a custom kernel);
use ``QAdamAlgorithm(opt, overlap=False)`` for a loop that does that.

Speculating costs a copy of the gradients and its comparison at the step. The copy is usually
free: after ``zero_grad()`` (set to None) backward makes each gradient afresh and the wrapper
copies it into the parameter's bucket view, so the tensor backward made is kept as the copy. A
miss wastes the speculation's traffic, so after a miss speculation pauses (1 step, then 2, 4, ...
up to ``MAX_PAUSE`` while the loop keeps changing its gradients), and the step that ends a pause
probes instead of speculating: backward's hooks keep ``PROBE_ELEMS`` evenly spaced values of
each gradient (no copy, no traffic), the step checks them as it would check a speculation, and
only if they held on every rank does the next step speculate again. A loop that clips every
step so pays a few values per probe, not a wasted allreduce. The logger
``bagua.algorithms.qadam_speculation`` logs each step's outcome and the hit rate at DEBUG.

Where the copy and the check cost more than the communication they hide (a fast link, every
core busy), not speculating is faster. ``OverlapTrial`` (``QAdamAlgorithm(overlap="auto")``, the
default) times steps both ways soon after warm-up and every ``TRIAL_EVERY`` steps, and the ranks
keep the faster way.

Example::

    model = bagua.DistributedDataParallel(model, [opt], bagua.algorithms.QAdamAlgorithm(opt))
    ...                                   # the usual loop
    print(model.impl.speculation.stats)   # SpeculationStats(hits=98, misses=0, paused=0, probes=0)
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import math
import statistics
from typing import TYPE_CHECKING, Callable, Optional

import torch

from ..optim.qadam import QAdamOptimizer, decayed_gradient, new_momentum

if TYPE_CHECKING:  # q_adam imports this module
    from .q_adam import MomentumBucket

logger = logging.getLogger(__name__)

#: the longest pause of speculation after consecutive misses, in steps
MAX_PAUSE = 64
#: about how many values of each gradient a probe keeps and checks (evenly spaced)
PROBE_ELEMS = 64
_SAME_SIZE_INT = {2: torch.int16, 4: torch.int32, 8: torch.int64}
#: ``overlap="auto"``: steps after warm-up before each trial (the loop settles; they speculate),
#: the trial's steps (speculating two, then not two, and so on), and every how many steps it repeats
TRIAL_SETTLE_STEPS, TRIAL_STEPS, TRIAL_EVERY = 2, 12, 1000


class _Inputs:
    """What one parameter's speculated momentum was made from."""

    __slots__ = ("usable", "grad_copy", "param_version", "exp_avg", "exp_avg_version", "exp_avg_sq",
                 "exp_avg_sq_version", "settings")

    def __init__(self, p: torch.Tensor, group: dict, opt: QAdamOptimizer, grad_copy: Callable[[], torch.Tensor]):
        """Read ``p``'s inputs; ``grad_copy()`` gives a copy of its gradient's bits (called when
        it has a gradient of ``p``'s shape)."""
        state, grad = opt.state[p], p.grad
        self.usable = grad is None or grad.shape == p.shape
        self.grad_copy = grad_copy() if grad is not None and self.usable else None
        self.param_version = p._version
        self.exp_avg, self.exp_avg_version = state["exp_avg"], state["exp_avg"]._version
        self.exp_avg_sq, self.exp_avg_sq_version = state["exp_avg_sq"], state["exp_avg_sq"]._version
        self.settings = _settings(group, opt)

    def unchanged(self, p: torch.Tensor, group: dict, opt: QAdamOptimizer) -> bool:
        """Whether a step now would make ``p``'s momentum from these very inputs."""
        state = opt.state[p]
        m, v = state.get("exp_avg"), state.get("exp_avg_sq")
        if not self.usable or m is not self.exp_avg or v is not self.exp_avg_sq:
            return False
        if m._version != self.exp_avg_version or v._version != self.exp_avg_sq_version:
            return False
        if _settings(group, opt) != self.settings or (group["weight_decay"] and p._version != self.param_version):
            return False
        return _same_bits(p.grad, self.grad_copy)


def _settings(group: dict, opt: QAdamOptimizer) -> tuple:
    return (tuple(group["betas"]), group["eps"], group["weight_decay"], group.get("decoupled_weight_decay", False),
            opt.warmup_steps)


def _same_bits(grad: Optional[torch.Tensor], copy: Optional[torch.Tensor]) -> bool:
    if grad is None or copy is None:
        return grad is None and copy is None
    if grad.shape != copy.shape or grad.dtype != copy.dtype or grad.device != copy.device:
        return False
    if grad.numel() == 0:
        return True
    if _MEMCMP is not None and grad.device.type == "cpu" and grad.is_contiguous() and copy.is_contiguous():
        # the C library's memcmp: ~1.8x faster than torch.equal on 8-byte words, GIL released
        return _MEMCMP(grad.data_ptr(), copy.data_ptr(), grad.numel() * grad.element_size()) == 0
    if all(_as_words(t) for t in (grad, copy)):  # 8-byte words: ~1.5x faster than element by element
        return torch.equal(grad.reshape(-1).view(torch.int64), copy.reshape(-1).view(torch.int64))
    as_int = _SAME_SIZE_INT[grad.element_size()]
    return torch.equal(grad.view(as_int), copy.view(as_int))


def _as_words(t: torch.Tensor) -> bool:
    """Whether ``t``'s bytes can be read as whole 8-byte integers."""
    size = t.element_size()
    return t.is_contiguous() and t.numel() * size % 8 == 0 and t.storage_offset() * size % 8 == 0


def _libc_memcmp() -> Optional[Callable[[int, int, int], int]]:
    """``memcmp`` of the C library this process runs on, or None where there is none to load."""
    try:
        memcmp = ctypes.CDLL(None).memcmp
    except (OSError, AttributeError, TypeError):  # no dlopen(NULL) (Windows), or no such symbol
        return None
    memcmp.restype = ctypes.c_int
    memcmp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    return memcmp


_MEMCMP = _libc_memcmp()


@dataclasses.dataclass
class SpeculationStats:
    """Steps after warm-up whose momentum was speculated and taken (``hits``), speculated and
    discarded (``misses``: a step skipped under a GradScaler counts too), not speculated during
    a pause after misses (``paused``), or not speculated but probed at the end of a pause
    (``probes``: whether a speculation would have held, checked on a few values)."""

    hits: int = 0
    misses: int = 0
    paused: int = 0
    probes: int = 0

    @property
    def hit_rate(self) -> float:
        """hits / (hits + misses); 0 before the first speculation."""
        return self.hits / max(1, self.hits + self.misses)


def _probe_values(grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """About ``PROBE_ELEMS`` evenly spaced values of ``grad`` (a copy), or None for None."""
    if grad is None:
        return None
    flat = grad.detach().reshape(-1)
    return flat[:: max(1, flat.numel() // PROBE_ELEMS)].clone()


class Speculation:
    """One wrapper's speculations: what each bucket's momentum was made from, the check at
    ``step()``, and when to speculate (``active``). Every rank holds the same ``active``.

    Args:
        enabled: speculate at all (``QAdamAlgorithm``'s ``overlap``).

    Example::

        spec = Speculation(enabled=True)
        spec.speculate(momentum_bucket, i)                # as backward produces member i's gradient
        spec.complete(momentum_bucket)                    # the bucket's op: the rest, then its allreduce
        hit = spec.holds(momentum_buckets, scaled=False)  # at step(), then agreed across ranks
        spec.conclude(speculated=True, hit=agreed)
    """

    def __init__(self, enabled: bool):
        self.stats = SpeculationStats()
        self._inputs: dict[int, list[Optional[_Inputs]]] = {}  # by id of the MomentumBucket, by member
        self._fresh: dict[int, set[int]] = {}  # the members filled since their bucket's last completion
        self._probes: dict[int, tuple[torch.Tensor, Optional[torch.Tensor]]] = {}  # id(p) -> p, its values
        self.restart(enabled)

    @property
    def active(self) -> bool:
        """Whether the momentum of the coming step is speculated (its backward launches it)."""
        return self.enabled and self._pause == 0 and not self._probe_next

    @property
    def probing(self) -> bool:
        """Whether the coming step probes: its backward keeps a few values of each gradient
        (``probe``), its step checks them (``probe_holds``)."""
        return self.enabled and self._pause == 0 and self._probe_next

    def probe(self, p: torch.Tensor) -> None:
        """Keep a few values of ``p``'s gradient as backward left it (a probing step)."""
        self._probes[id(p)] = (p, _probe_values(p.grad))

    def probe_holds(self, scaled: bool) -> bool:
        """This rank's probe verdict: whether a speculation of this step would have held, as far
        as the kept values tell (a heuristic: the speculation's own check is exact)."""
        probes, self._probes = self._probes, {}
        return not scaled and all(_same_bits(_probe_values(p.grad), kept) for p, kept in probes.values())

    @torch.no_grad()
    def speculate(self, mb: "MomentumBucket", index: int, produced: Optional[torch.Tensor] = None) -> None:
        """Fill member ``index`` of ``mb``: the ratio of the momentum a step would make from its
        gradient as it is now, computed from a copy of the gradient's bits, which the check
        compares with the gradient at the step. ``produced``: such a copy already made, that
        nothing else holds (the tensor backward produced, which the wrapper copied into the
        gradient's bucket view: ``ForAlgorithms.produced_gradient``); otherwise the bits are
        copied into the bucket's ``grad_copies``."""
        (p, group), view, start = mb.members[index], mb.views[index], mb.starts[index]

        def grad_copy() -> torch.Tensor:
            grad = p.grad
            if produced is not None and produced.dtype == grad.dtype and produced.shape == grad.shape:
                return produced
            if mb.grad_copies is None:
                mb.grad_copies = torch.empty_like(mb.flat)
            return mb.grad_copies[start:start + p.numel()].view(p.shape).copy_(grad)

        record = _Inputs(p, group, mb.optimizer, grad_copy)
        g = decayed_gradient(p, record.grad_copy, group)
        new_momentum(mb.optimizer.state[p]["exp_avg"], g, group["betas"][0], out=view)
        view.div_(mb.optimizer.denominator(p, group))
        self._inputs.setdefault(id(mb), [None] * len(mb.members))[index] = record
        self._fresh.setdefault(id(mb), set()).add(index)

    def complete(self, mb: "MomentumBucket") -> None:
        """Fill the members of ``mb`` not filled since its last completion (parameters backward
        did not reach), before its allreduce."""
        fresh = self._fresh.get(id(mb), set())
        for index in range(len(mb.members)):
            if index not in fresh:
                self.speculate(mb, index)
        self._fresh.pop(id(mb), None)

    def restart(self, enabled: bool) -> None:
        """Speculate from the next step on (``enabled``) or not at all, with no pause pending
        (the autotuner's ``overlap``, set on every rank at the same step)."""
        self.enabled = enabled
        self._pause, self._backoff = 0, 1
        self._probe_next = False  # the step that ends a pause probes instead of speculating
        self.forget()

    def forget(self) -> None:
        """Drop every speculation (the buckets or the weights changed)."""
        self._inputs.clear()
        self._fresh.clear()
        self._probes.clear()

    def holds(self, buckets: list["MomentumBucket"], scaled: bool) -> bool:
        """This rank's verdict: every bucket was speculated and from what the step would use now.
        The speculations are consumed."""
        inputs, self._inputs = self._inputs, {}
        if scaled or any(id(mb) not in inputs for mb in buckets):
            return False
        return all(
            record is not None and record.unchanged(p, group, mb.optimizer)
            for mb in buckets
            for (p, group), record in zip(mb.members, inputs[id(mb)])
        )

    def conclude(self, speculated: bool, hit: bool, probed: bool = False) -> None:
        """Count a step after warm-up (``hit``: every rank's speculation, or with ``probed`` every
        rank's probe, held) and decide whether the next one speculates, probes or pauses."""
        if probed:
            self.stats.probes += 1
            if hit:
                self._probe_next = False
            else:
                self._back_off()
            self._log("probe held" if hit else "probe failed", hit)
            return
        if not speculated:
            if self.enabled:
                self._pause -= 1
                self.stats.paused += 1
            return
        if hit:
            self.stats.hits += 1
            self._backoff = 1
        else:
            self.stats.misses += 1
            self._back_off()
        self._log("hit" if hit else "missed", hit)

    def _back_off(self) -> None:
        """After a miss or a failed probe: pause, twice as long as the last time (up to
        ``MAX_PAUSE``), then probe."""
        self._pause, self._backoff = self._backoff, min(2 * self._backoff, MAX_PAUSE)
        self._probe_next = True

    def _log(self, outcome: str, hit: bool) -> None:
        if logger.isEnabledFor(logging.DEBUG):
            s = self.stats
            logger.debug("qadam speculation %s; hit rate %.0f%% (%d hits, %d misses, %d steps paused, %d probes)%s",
                         outcome, 100 * s.hit_rate, s.hits, s.misses, s.paused, s.probes,
                         "" if hit else f"; pausing {self._pause} step(s), then probing")


class OverlapTrial:
    """``QAdamAlgorithm(overlap="auto")``: whether speculating pays here, measured. Both ways
    give the same bits, but the speculation's copy and check cost compute that the communication
    it hides may not repay (a fast link, every core busy). ``TRIAL_SETTLE_STEPS`` after warm-up
    (and every ``TRIAL_EVERY`` steps), ``TRIAL_STEPS`` steps alternate two speculating and two
    not; each step's wall time (from the end of the step before: forward, backward and step)
    counts for its way, a speculation that missed or paused for neither. The ranks average their
    medians (``decide``), so every rank keeps the same way until the next trial.

    Example::

        trial = OverlapTrial()
        speculation.enabled = trial.wants()                  # before each step's backward
        medians = trial.step_ended(True, time.perf_counter())  # after it: it speculated and hit
        if medians is not None:                              # the trial's last step
            speculation.enabled = trial.decide(*averaged_over_ranks(medians))
    """

    def __init__(self) -> None:
        self.choice = True  # speculate, until a trial says otherwise
        #: the last trial's median step seconds (speculating, not), averaged over the ranks; None before
        self.times: Optional[tuple[float, float]] = None
        self._steps = 0  # steps after warm-up so far
        self._last_end: Optional[float] = None
        self._samples: dict[bool, list[float]] = {True: [], False: []}

    def _position(self) -> int:
        """Where the coming step falls in its trial (outside ``[0, TRIAL_STEPS)``: no trial)."""
        return self._steps % TRIAL_EVERY - TRIAL_SETTLE_STEPS

    def wants(self) -> bool:
        """Whether the coming step speculates."""
        position = self._position()
        if 0 <= position < TRIAL_STEPS:
            return position // 2 % 2 == 0
        return self.choice

    def step_ended(self, speculated: Optional[bool], now: float) -> Optional[tuple[float, float]]:
        """Count a step after warm-up that ended at ``now`` (``perf_counter``): ``speculated``
        True (its speculation was taken), False (it did not speculate), None (neither: a miss, a
        pause, a probe). After the trial's last step: this rank's median step seconds
        (speculating, not; ``inf`` without a sample) for the ranks to average and ``decide``."""
        position = self._position()
        if 0 <= position < TRIAL_STEPS and speculated is not None and self._last_end is not None:
            self._samples[speculated].append(now - self._last_end)
        self._last_end = now
        self._steps += 1
        if position != TRIAL_STEPS - 1:
            return None
        medians = tuple(statistics.median(s) if s else math.inf for s in (self._samples[True], self._samples[False]))
        self._samples = {True: [], False: []}
        return medians

    def decide(self, speculating: float, not_speculating: float) -> bool:
        """Keep the faster way (medians averaged over the ranks) until the next trial."""
        self.times = (speculating, not_speculating)
        self.choice = speculating <= not_speculating and math.isfinite(speculating)
        return self.choice


__all__ = ["MAX_PAUSE", "PROBE_ELEMS", "TRIAL_EVERY", "TRIAL_SETTLE_STEPS", "TRIAL_STEPS", "OverlapTrial",
           "Speculation", "SpeculationStats"]
