"""qadam: Adam with allreduced gradients during warm-up, then 8-bit (or 1-bit) compressed momentum.

During ``QAdamOptimizer``'s warm-up every bucket of gradients is allreduced exactly during
backward, so the optimizer is plain data-parallel Adam. Afterwards the gradients stay local, and
whatever the loop does to them before the step (clipping, GradScaler's unscaling, accumulation
over micro-batches) is what the momentum sees: ``QAdamOptimizer.step`` updates the local momentum
m ← β1·m + (1−β1)·(g + wd·x) and this algorithm (``optimizer.momentum_communicator``) averages it
across ranks, MinMaxUInt8-compressed, one buffer per gradient bucket with each tensor on its own
codec blocks; then the optimizer applies ``lr · m̂ / (sqrt(v̂) + eps)``. All ranks apply the same
averaged momentum, so they stay identical.

With ``overlap=True`` the averaging runs during backward: each parameter's momentum is
computed as soon as backward has produced its gradient, each bucket's allreduce launched as soon
as the bucket is complete, speculating that the step will see those gradients; the step checks that it does
(while the last bucket's allreduce still finishes on the communication thread: backward does not
wait for it) and otherwise averages again from what it sees, so every step has the bits of ``overlap=False``
(``bagua.algorithms.qadam_speculation`` says how, and what the check cannot see). With
``overlap="auto"`` (default) the ranks measure steps both ways soon after warm-up (and every 1000
steps) and keep the faster: the bits are the same either way.

The momentum is averaged as m / (sqrt(v̂) + eps): the variance is identical on all ranks,
so this is the same average, and the 8-bit rounding then stays small next to each coordinate's
own update (compressing m itself, coordinates with a small variance got rounding noise of the
block's large momenta divided by their small sqrt(v): it diverged within a few steps on a
10M-parameter MLP). It goes through a scratch buffer, so the momentum tensors stay the
optimizer's own (``load_state_dict`` and ``fuse_optimizer`` may replace or move them).

With ``QAdamOptimizer(variance="tracked")`` (default) each 8-bit average also updates the
variance: ``write_back`` takes the averaged gradient (m̄_t − β1·m̄_{t−1}) / (1 − β1) from the new
average and the last one (kept by ``begin_step``), the same bits on every rank, and updates v as
Adam does. With ``bits=1`` the momentum goes 8-bit, without residuals, on the steps of
``refreshes_variance`` (doubling intervals, every 32nd step at most), and v learns on those.

``bits=1`` sends the ratios as ``sign1`` (1-bit Adam's two-stage compressed allreduce, as
``onebit_grad`` sends gradients): every rank sends the sign of (ratio + its residual) and one scale
per 256 values, the rank that reduces a chunk the sign of (average + its residual); about 28x
fewer bytes than fp32, 7x fewer than 8 bits. What each step's rounding left out is sent in the
next ones (``bagua.comm.ErrorFeedback``). The residuals are this algorithm's state
(``bagua.algorithms.residuals``): saved per rank by ``state_dict()`` and ``bagua.checkpoint``,
carried by ``ddp.rebucket`` and autotuning tensor by tensor, the same fused or not; the averaged
momentum, and so the weights, stay bit-identical on every rank, the residuals are each rank's own.
A speculation (``overlap=True``) runs its allreduce on a provisional copy of the residuals, which
the step keeps on a hit and drops on a miss (clipping, unscaling, a skipped or raising step), so
the step averaging again starts from the residuals of the last step that averaged: every step,
residuals included, has the bits of ``overlap=False``. A step skipped on an overflow (GradScaler)
averages nothing, so its residuals stay as they were (the ratios are unscaled: no loss scale is
in them); a bucket whose average came out non-finite without a scaler (the step raises)
restarts its residuals at zero on every rank, as ``onebit_grad`` does.

Example::

    opt = bagua.optim.QAdamOptimizer(model.parameters(), lr=1e-3, warmup_steps=100)
    model = bagua.DistributedDataParallel(model, [opt], bagua.algorithms.QAdamAlgorithm(opt))
    model = bagua.DistributedDataParallel(model, [opt], "qadam", bits=1)   # 1-bit momentum
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from typing import Optional, Union

import torch

from ..comm import (BaguaProcessGroup, Bucket, ErrorFeedback, Handle, ReduceOp, allreduce, compressed_allreduce,
                    in_background)
from ..comm.checks import trusted
from ..comm.compressed import SEGMENT_ELEMS, all_finite, raise_if_nonfinite
from ..comm.hierarchical import hierarchical_allreduce
from ..optim.qadam import QAdamOptimizer, averaged_gradient, decayed_gradient, new_momentum, update_variance
from .base import Algorithm, AlgorithmImpl, Carry
from .gradient_allreduce import SEGMENT_SIZES, append_gradient_allreduce, hierarchical_node_groups
from .qadam_speculation import OverlapTrial, Speculation
from .residuals import BucketResiduals
from .tunable import Tunable

logger = logging.getLogger(__name__)
_WARMUP_STEP = object()  # what a step that averaged no momentum leaves for the overlap trial

#: the momentum's codec by ``bits``: 8 bits per value, or the sign and one scale per 256 values
CODECS = {8: "minmax_uint8", 1: "sign1"}
#: bits=1 with ``QAdamOptimizer(variance="tracked")``: the steps after warm-up whose momentum goes
#: 8-bit (no residuals), so that the variance learns the averaged gradient: every 2nd step for
#: REFRESHES_PER_INTERVAL refreshes, then every 4th, ..., the interval doubling up to MAX_REFRESH_INTERVAL
REFRESHES_PER_INTERVAL, MAX_REFRESH_INTERVAL = 16, 32


def refreshes_variance(step_after_warmup: int) -> bool:
    """Whether step ``step_after_warmup`` (1 for the first step after warm-up) of a 1-bit qadam
    with a tracked variance averages its momentum 8-bit, updating the variance (0/1 Adam's
    schedule of variance updates at intervals that double, here capped).

    Example::

        [s for s in range(1, 40) if refreshes_variance(s)][:3]     # [2, 4, 6]
    """
    start, interval = 0, 2
    while interval < MAX_REFRESH_INTERVAL and step_after_warmup > start + REFRESHES_PER_INTERVAL * interval:
        start += REFRESHES_PER_INTERVAL * interval
        interval *= 2
    return (step_after_warmup - start) % interval == 0


class MomentumBucket:
    """The momenta of one wrapper bucket's parameters as the ranks average them: each
    ``m / (sqrt(v̂) + eps)`` in the flat buffer ``flat`` (tensor ``i`` from ``starts[i]``, the
    starts of the codec blocks), then ``m`` back from the average.

    Args:
        optimizer: the ``QAdamOptimizer`` whose state holds the momenta.
        members: the bucket's parameters with their param groups, in bucket order.
        name: for errors and logs.

    Example::

        mb = MomentumBucket(opt, [(p, group) for p in params], "bucket0")
        mb.fill()                                                # what a step does after warm-up
        compressed_allreduce(mb.flat, op="avg", starts=mb.starts)
        if mb.finite():
            mb.write_back()
    """

    def __init__(self, optimizer: QAdamOptimizer, members: list[tuple[torch.Tensor, dict]], name: str):
        self.optimizer, self.members, self.name = optimizer, members, name
        #: the error-feedback residuals of ``flat``'s 1-bit allreduce (``bits=1``) as the last
        #: step that averaged left them (algorithm state, set by the algorithm), or None; and
        #: the scratch copy that a speculation runs on, kept by ``commit`` on a hit
        self.feedback: Optional[ErrorFeedback] = None
        self._provisional = ErrorFeedback()
        p0 = members[0][0]
        self.flat = torch.empty(sum(p.numel() for p, _ in members), dtype=p0.dtype, device=p0.device)
        self.starts, self.views = [], []
        for p, _ in members:
            start = self.starts[-1] + self.views[-1].numel() if self.views else 0
            self.starts.append(start)
            self.views.append(self.flat[start:start + p.numel()].view(p.shape))
        #: the speculation's copies of the gradients, in this bucket's layout (allocated by the first)
        self.grad_copies: Optional[torch.Tensor] = None
        self._finite: Optional[bool] = None  # finite(), once known for the averaged ratios in flat
        #: whether the average in flight or arrived tells the averaged gradient: ``write_back``
        #: then updates the variance from it and the momentum before this step (``previous``)
        self.tracking = False
        self.previous: list[torch.Tensor] = []  # views of one buffer in ``flat``'s layout (allocated by the first)

    def residuals(self, provisional: bool) -> Optional[ErrorFeedback]:
        """The residuals an allreduce of ``flat`` runs on: the kept ones, or (``provisional``, a
        speculation) a fresh copy of them, which the step keeps (``commit``) or drops."""
        if self.feedback is None or not provisional:
            return self.feedback
        self._provisional.copy_from(self.feedback)
        return self._provisional

    def commit(self) -> None:
        """Keep what the speculation's allreduce left in the provisional residuals (a hit)."""
        if self.feedback is not None:
            self.feedback.swap(self._provisional)

    @torch.no_grad()
    def fill(self) -> None:
        """Each ratio from the momentum as the step left it."""
        state = self.optimizer.state
        for (p, group), view in zip(self.members, self.views):
            torch.div(state[p]["exp_avg"], self.optimizer.denominator(p, group), out=view)

    def launching(self, tracking: bool) -> None:
        """``flat`` is about to be averaged anew: forget whether the last average was finite;
        ``tracking``: whether this average is fine enough to tell the averaged gradient."""
        self._finite = None
        self.tracking = tracking

    @torch.no_grad()
    def remember(self) -> None:
        """Keep each momentum as the last step left it (the average before this step's), into
        ``previous``: before the step changes it, for a tracking ``write_back``."""
        if not self.previous:
            buffer = torch.empty_like(self.flat)
            self.previous = [buffer[start:start + view.numel()].view(view.shape) for start, view in zip(self.starts, self.views)]
        state = self.optimizer.state
        for (p, _), previous in zip(self.members, self.previous):
            previous.copy_(state[p]["exp_avg"])

    def finite(self) -> bool:
        """Whether every averaged ratio is finite (NaN or Inf on any rank makes its block NaN);
        call once the average has arrived. Computed once per average."""
        if self._finite is None:
            self._finite = all_finite(self.flat)
        return self._finite

    @torch.no_grad()
    def update_locally(self) -> None:
        """Each momentum updated from this rank's gradient alone, as a step does before averaging."""
        for p, group in self.members:
            m = self.optimizer.state[p]["exp_avg"]
            new_momentum(m, decayed_gradient(p, p.grad, group), group["betas"][0], out=m)

    @torch.no_grad()
    def write_back(self) -> None:
        """Each momentum from its averaged ratio; when ``tracking``, each variance updated from
        the averaged gradient that took the momentum from ``previous`` to there (the same bits on
        every rank: every rank decoded the same average and kept the same previous one)."""
        state = self.optimizer.state
        if not self.tracking:
            for (p, group), view in zip(self.members, self.views):
                torch.mul(view, self.optimizer.denominator(p, group), out=state[p]["exp_avg"])
            return
        t = self.optimizer.variance_updates
        for (p, group), view in zip(self.members, self.views):  # every denominator before any variance changes
            # this member's own (the same bits as the kept ones): an earlier bucket's write-back changed v
            # elsewhere in a fused optimizer's buffer, and the kept ones would be computed anew for all of it
            view.mul_(self.optimizer.denominator(p, group, t))
        for (p, group), view, previous in zip(self.members, self.views, self.previous):
            m = state[p]["exp_avg"]
            averaged_gradient(view, previous, group["betas"][0], out=m)
            update_variance(state[p]["exp_avg_sq"], m, group["betas"][1])
            m.copy_(view)


class QAdamImpl(AlgorithmImpl):
    """The wrapper's hooks (warm-up: gradient allreduce; then the momentum's speculation) and the
    optimizer's ``MomentumCommunicator``."""

    def __init__(self, process_group: BaguaProcessGroup, optimizer: QAdamOptimizer, hierarchical: bool,
                 overlap: Union[bool, str], bits: int = 8):
        super().__init__(process_group)
        self.node_groups = hierarchical_node_groups(process_group) if hierarchical else None
        self.optimizer = optimizer
        self.codec = CODECS[bits]
        #: bits=1: each momentum bucket's error-feedback residuals (algorithm state, per rank)
        self.residuals = BucketResiduals("qadam", process_group, logger) if bits == 1 else None
        self.state_per_rank = self.residuals is not None
        self.segment_elems = SEGMENT_ELEMS  # of the compressed momentum allreduce
        #: the momentum averaged during backward (``overlap``); ``speculation.stats`` counts its hits
        self.speculation = Speculation(enabled=bool(overlap))
        self.overlap_allowed = bool(overlap)  # the autotuner may switch speculation off and on again
        #: overlap="auto": whether to speculate, measured (None: fixed, or the autotuner's to set)
        self.overlap_trial = OverlapTrial() if overlap == "auto" else None
        self._trial_sample: object = _WARMUP_STEP  # how the last step averaged: OverlapTrial.step_ended
        self._momentum: dict[int, MomentumBucket] = {}  # by id of the wrapper's bucket, in bucket order
        self._slots: dict[str, tuple[MomentumBucket, int]] = {}  # parameter name -> its bucket and place
        self._groups: dict[int, dict] = {}  # id(parameter) -> its param group
        self._covered: set[int] = set()  # ids of the parameters whose momentum is averaged
        self._covers_all = False  # every parameter of the optimizer is
        self._ops_in_warmup: Optional[bool] = None  # which ops the buckets carry
        self._averaged = False  # this step's momentum came averaged from backward
        #: the last launched momentum allreduce, unfinished, and its bucket (see _finish_in_flight)
        self._in_flight: Optional[tuple[MomentumBucket, Handle]] = None
        #: after backward, the speculation's last allreduce finishing on the communication thread
        #: while the step checks the speculation: its bucket and future (see _settle)
        self._landing: Optional[tuple[MomentumBucket, Future]] = None
        self._written_back = 0  # how many leading buckets' momenta this step has written back already
        optimizer.momentum_communicator = self  # the wrapper built last wins; close() detaches it

    # --- the wrapper's hooks ------------------------------------------------------------------
    def tensors_to_communicate(self, ddp) -> list:
        self._groups = {id(p): g for g in self.optimizer.param_groups for p in g["params"]}
        missing = [name for name, p in ddp.named_trainable_parameters if id(p) not in self._groups]
        if missing:
            raise ValueError(f"QAdamAlgorithm: parameters {missing[:5]} are not in the QAdamOptimizer it was given")
        self._covered = {id(p) for _, p in ddp.named_trainable_parameters}
        self._covers_all = self._covered == set(self._groups)
        self._settle()
        self._momentum.clear()
        self._slots.clear()
        self.speculation.forget()
        return super().tensors_to_communicate(ddp)

    def init_operations(self, ddp, bucket: Bucket) -> None:
        names = ddp.for_algorithms.names_in(bucket)
        params = [ddp.for_algorithms.parameter(name) for name in names]
        momentum = MomentumBucket(self.optimizer, [(p, self._groups[id(p)]) for p in params], bucket.name)
        if self.residuals is not None:
            momentum.feedback = self.residuals.attach(id(bucket), names, momentum.starts, [p.numel() for p in params])
        self._momentum[id(bucket)] = momentum
        self._slots.update((name, (momentum, i)) for i, name in enumerate(names))
        self.speculation.forget()
        self._ops_in_warmup = self.optimizer.in_warmup
        if self._ops_in_warmup:
            append_gradient_allreduce(bucket, self.process_group, average=True, node_groups=self.node_groups)
        else:
            bucket.append_op(lambda _: self._average(momentum, ahead=True), f"speculated_momentum_allreduce[{self.codec}]")

    def on_tensor_ready(self, ddp, name: str, param: torch.nn.Parameter) -> None:
        if ddp.engine.launched == 0:  # no op of this backward runs yet: an earlier one's transfer may
            self._settle()
        if not self.optimizer.in_warmup:
            if self.speculation.active:  # its momentum now, while backward goes on
                self.speculation.speculate(*self._slots[name], produced=ddp.for_algorithms.produced_gradient())
            elif self.speculation.probing:  # a few values, to tell whether speculating would hold
                self.speculation.probe(param)
        super().on_tensor_ready(ddp, name, param)

    def _average(self, momentum: MomentumBucket, ahead: bool) -> None:
        """Fill ``momentum``'s ratios (``ahead``: those backward's hooks have not, from the gradients
        as they are, speculating) and launch their allreduce once the previous bucket's has finished:
        one in flight at a time, left unfinished (``_in_flight``). With 1 bit, a speculation runs on
        a provisional copy of the residuals, which only a hit keeps.

        As a bucket's op (``ahead``, on the engine's thread) it hands no handle to the engine, so
        backward ends without waiting for the last bucket's allreduce; ``on_backward_end`` has
        the communication thread finish it while the step checks the speculation."""
        if self._in_flight is not None and self._in_flight[0] is momentum:  # its results would land on the fill
            self._finish_in_flight()
        if ahead:
            self.speculation.complete(momentum)
        else:
            momentum.fill()
        previous = self._in_flight[0] if self._in_flight is not None else None
        self._finish_in_flight()
        one_bit = self._one_bit_step(ahead)
        codec = self.codec if one_bit else CODECS[8]
        feedback = momentum.residuals(provisional=ahead) if one_bit else None
        momentum.launching(tracking=self.optimizer.variance == "tracked" and not one_bit)
        if self.node_groups is not None:
            hierarchical_allreduce(momentum.flat, op=ReduceOp.AVG, compression=codec, nonfinite="propagate",
                                   groups=self.node_groups, starts=momentum.starts, segment_elems=self.segment_elems,
                                   error_feedback=feedback)
            return
        handle = compressed_allreduce(momentum.flat, op=ReduceOp.AVG, codec=codec, group=self.process_group,
                                      async_op=True, nonfinite="propagate", starts=momentum.starts,
                                      segment_elems=self.segment_elems, error_feedback=feedback)
        self._in_flight = (momentum, handle)
        if previous is not None:
            previous.finite()  # checked while this bucket's transfer goes on, not at the step

    def _one_bit_step(self, ahead: bool) -> bool:
        """Whether this step's momentum goes 1-bit with residuals (``bits=1``), not 8-bit: with a
        tracked variance, every ``refreshes_variance`` step goes 8-bit. ``ahead``: asked before
        the optimizer counted the step (during backward, at ``begin_step``)."""
        if self.residuals is None:
            return False
        if self.optimizer.variance != "tracked":
            return True
        step = self.optimizer.step_count + (1 if ahead else 0)
        return not refreshes_variance(step - self.optimizer.warmup_steps)

    def _finish_in_flight(self) -> None:
        """Finish the momentum allreduce in flight, if any (before the next bucket's launches)."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None:
            in_flight[1].wait()

    def on_backward_end(self, ddp) -> None:
        """The speculation's last allreduce (the reduction and the second exchange) finishes on
        the communication thread, its average checked for NaN there, while the step checks the
        speculation and writes back the buckets that have arrived."""
        if self._in_flight is not None:
            momentum, handle = self._in_flight
            self._in_flight = None
            self._landing = (momentum, in_background(lambda: (handle.wait(), momentum.finite())))

    def _settle(self) -> None:
        """On the main thread, the engine idle: finish every momentum allreduce still going on,
        before a step, a backward or a change of buckets, state or settings uses the buffers or
        the process group."""
        landing, self._landing = self._landing, None
        if landing is not None:
            landing[1].result()
        self._finish_in_flight()

    def _follow_phase(self, ddp) -> None:
        """Between steps: give the buckets the ops of the optimizer's phase (warm-up or not)."""
        if self.optimizer.in_warmup != self._ops_in_warmup:
            ddp.for_algorithms.reset_operations()

    def on_forward_pre(self, ddp) -> None:
        self._settle()  # a backward whose step was not taken
        self._follow_phase(ddp)  # a checkpoint loaded since the last step may have changed it

    def on_optimizer_step_post(self, ddp) -> None:
        self._follow_phase(ddp)
        sample, self._trial_sample = self._trial_sample, _WARMUP_STEP
        if self.overlap_trial is not None and sample is not _WARMUP_STEP:
            self._count_for_trial(sample)

    def _count_for_trial(self, speculated: Optional[bool]) -> None:
        """``overlap="auto"``: time the step that just ended, agree on the trial's verdict at its
        end, and set whether the next step speculates."""
        medians = self.overlap_trial.step_ended(speculated, time.perf_counter())
        if medians is not None:
            agreed = torch.tensor(medians, dtype=torch.float64)
            with trusted():  # every rank ends the trial at the same step
                allreduce(agreed, op=ReduceOp.AVG, group=self.process_group)
            speculating, not_speculating = agreed.tolist()
            choice = self.overlap_trial.decide(speculating, not_speculating)
            if self.process_group.rank == 0:
                logger.info("qadam overlap=auto: a step took %.1f ms speculating, %.1f ms averaging in step(): %s",
                            1e3 * speculating, 1e3 * not_speculating, "speculating" if choice else "averaging in step()")
        self.speculation.enabled = self.overlap_trial.wants()

    def on_weights_loaded(self, ddp) -> None:
        self._settle()
        self.speculation.forget()

    def on_rebucket(self, ddp, carry: Carry) -> None:
        """bits=1: the residuals move to the new buckets tensor by tensor."""
        if self.residuals is not None:
            self.residuals.rebucketed(id(b) for b in ddp.buckets)

    def state_dict(self) -> dict:
        """bits=1: this rank's residuals per parameter name (``BucketResiduals.state_dict``);
        bits=8: nothing (the momentum is the optimizer's state)."""
        return {} if self.residuals is None else self.residuals.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """bits=1: restore this rank's residuals (a state without them, of another rank or world
        size restarts them at zero). Switching ``bits`` across a checkpoint warns: bits=8 drops
        the residuals of a bits=1 state, bits=1 starts from zero after a bits=8 one."""
        if self.residuals is None:
            if state.get("worker"):
                logger.warning("qadam bits=8: the checkpoint holds 1-bit error-feedback residuals (it was saved with "
                               "bits=1); they are dropped. Wrap with bits=1 to keep them")
            return
        if "worker" not in state:
            logger.warning("qadam bits=1: the checkpoint holds no error-feedback residuals (saved with bits=8); "
                           "they start at zero")
        self.residuals.load_state_dict(state)

    def tunables(self, ddp) -> dict[str, Tunable]:
        """The bucket size and the segment size of the momentum's compressed allreduce (each
        tensor is quantized on its own blocks, whatever bucket or segment it travels in), and,
        when built with ``overlap=True``, whether to speculate (both ways have the same bits;
        where the cores are all busy, the speculation's copy and check can cost more than the
        communication it hides). ``overlap=False`` given by the user stays: the check cannot
        see every loop."""
        tunables = {**super().tunables(ddp), "segment_elems": Tunable(SEGMENT_SIZES, self.segment_elems)}
        if self.overlap_allowed:
            tunables["overlap"] = Tunable((True, False), self.speculation.enabled)
        return tunables

    def set_tunable(self, ddp, name: str, value: object) -> None:
        if name == "segment_elems":
            self.segment_elems = int(value)
        elif name == "overlap" and self.overlap_allowed:
            self._settle()
            self.overlap_trial = None  # the tuner's choice from now on
            self.speculation.restart(enabled=bool(value))
        else:
            super().set_tunable(ddp, name, value)

    def ready_on_backward(self, ddp) -> bool:
        # the optimizer's step count and the speculation's state: the same for every backward of one step
        return self.optimizer.in_warmup or self.speculation.active

    def keeps_produced_gradients(self, ddp) -> bool:
        # a speculation keeps each gradient backward made as the copy of its bits the check needs
        return not self.optimizer.in_warmup and self.speculation.active

    def averages_gradients(self, ddp) -> bool:
        return self.optimizer.in_warmup

    def close(self, ddp) -> None:
        self._settle()
        self.speculation.forget()
        if self.optimizer.momentum_communicator is self:
            self.optimizer.momentum_communicator = None

    # --- MomentumCommunicator (called by QAdamOptimizer.step after warm-up) -----------------------
    def begin_step(self, found_inf: Optional[bool], scaled: bool) -> bool:
        if self.optimizer.variance == "tracked" and not self._one_bit_step(ahead=True):
            for momentum in self._momentum.values():  # the momenta before this step's, for the averaged gradients
                momentum.remember()
        speculated, probed = self.speculation.active, self.speculation.probing
        skip = bool(found_inf)
        if speculated:  # held: the speculation (or the probe) holds on this rank
            held = self.speculation.holds(list(self._momentum.values()), scaled)
        else:
            held = probed and self.speculation.probe_holds(scaled)
        if speculated or probed or found_inf is not None:  # one small allreduce: every rank skips or holds alike
            verdict = torch.tensor([float(skip), float(not held)])
            with trusted():  # every rank calls it at the same point of the same step
                allreduce(verdict, op=ReduceOp.MAX, group=self.process_group)
            skip, held = bool(verdict[0]), held and not verdict.any()
        self.speculation.conclude(speculated, held, probed=probed)
        self._averaged = hit = speculated and held
        # for overlap="auto": a step that speculated and took it (True), or did not speculate by
        # choice (False); neither (None) a skipped step, a miss, a pause or a probe
        self._trial_sample = None if skip or (self.speculation.enabled and not hit) else hit
        self._written_back = 0
        if hit:  # the momenta of the buckets that arrived, while the last one's allreduce finishes
            self._write_back_arrived()
        self._settle()
        if hit and self._one_bit_step(ahead=True):  # the speculation's residuals become the step's (a miss drops them)
            for momentum in self._momentum.values():
                momentum.commit()
        return skip

    def _write_back_arrived(self) -> None:
        """Write back the momenta of the leading buckets whose average has arrived and is finite
        (``_written_back`` counts them); ``average_momentum`` does the rest."""
        landing = self._landing[0] if self._landing is not None else None
        for momentum in self._momentum.values():
            if momentum is landing or not momentum.finite():
                return
            momentum.write_back()
            self._written_back += 1

    def covers(self, p: torch.Tensor) -> bool:
        return id(p) in self._covered

    def averaged_already(self, p: torch.Tensor) -> bool:
        return self._averaged and (self._covers_all or id(p) in self._covered)

    @torch.no_grad()
    def average_momentum(self) -> bool:
        buckets = list(self._momentum.values())
        if not self._averaged:
            with trusted():  # the buckets' layout was checked across ranks when the wrapper built them
                for momentum in buckets:
                    self._average(momentum, ahead=False)
                self._finish_in_flight()
        written, self._written_back = self._written_back, 0
        for k, momentum in enumerate(buckets[written:], start=written):
            if not momentum.finite():
                if self._averaged:  # leave the momenta as averaging in step() does: updated, not yet averaged
                    for rest in buckets[k:]:
                        rest.update_locally()
                raise_if_nonfinite(f"qadam's momentum allreduce ({momentum.name})", momentum.flat)
            momentum.write_back()
        return bool(buckets) and all(momentum.tracking for momentum in buckets)


@Algorithm.register("qadam")
class QAdamAlgorithm(Algorithm):
    """QAdam: exact gradient averaging during warm-up, then compressed momentum averaging (8 bits,
    or 1 bit with error feedback), during backward (``overlap``) or in ``QAdamOptimizer.step``
    (see the module docstring and ``bagua.optim.QAdamOptimizer``).

    Args:
        q_adam_optimizer: the ``bagua.optim.QAdamOptimizer`` that steps the model. The wrapper
            attaches to it until ``close()`` (one at a time: the one built last).
        hierarchical: exact within nodes, compressed across node leaders (with ``bits=1`` the
            leaders keep the residuals).
        overlap: after warm-up, average each bucket's momentum during backward, speculatively
            (``bagua.algorithms.qadam_speculation``): the same bits as ``overlap=False``, which
            averages in ``step()``, in every loop but those that write into the parameters or
            the optimizer's state between backward and step past the version counters.
            ``"auto"`` (default): speculate where it makes the steps faster, measured
            (``OverlapTrial``: 12 steps soon after warm-up and every 1000 steps, both ways; the
            ranks agree); ``True``: always. Speculating costs a check of the gradients at each
            step, which a fast link or busy cores may not repay. With ``autotune`` the tuner
            decides instead; ``overlap=False`` always stays off.
        bits: 8 (default): the momentum ratios MinMaxUInt8-compressed; 1: their signs and one
            scale per 256 values (sign1, about 28x fewer bytes than fp32, 7x fewer than 8
            bits), with error feedback on every rank and on each chunk's reducer, kept as this
            algorithm's state (saved per rank by checkpoints, carried by rebucketing); with the
            optimizer's tracked variance, 8 bits on the steps that update it (``refreshes_variance``).

    Example::

        opt = bagua.optim.QAdamOptimizer(model.parameters(), lr=1e-3, warmup_steps=100)
        model = bagua.DistributedDataParallel(model, [opt], QAdamAlgorithm(opt))
        model = bagua.DistributedDataParallel(model, [opt], "qadam", hierarchical=True)   # the same, by name
        model = bagua.DistributedDataParallel(model, [opt], QAdamAlgorithm(opt, overlap=False))  # in step() only
        model = bagua.DistributedDataParallel(model, [opt], "qadam", bits=1)   # 1-bit momentum
    """

    optimizer_class = QAdamOptimizer  # by name: the wrapper's one QAdamOptimizer

    def __init__(self, q_adam_optimizer: QAdamOptimizer, hierarchical: bool = False,
                 overlap: Union[bool, str] = "auto", bits: int = 8):
        if not isinstance(q_adam_optimizer, QAdamOptimizer):
            raise TypeError(
                f"QAdamAlgorithm needs a bagua.optim.QAdamOptimizer, got {type(q_adam_optimizer).__name__}"
            )
        if not isinstance(bits, int) or isinstance(bits, bool) or bits not in CODECS:
            raise ValueError(f"QAdamAlgorithm: bits must be one of {sorted(CODECS, reverse=True)} (8: MinMaxUInt8 "
                             f"momentum, 1: sign1 with error feedback), got {bits!r}")
        if overlap not in (True, False, "auto"):
            raise ValueError(f"QAdamAlgorithm: overlap must be True, False or 'auto' (speculate where it is faster, "
                             f"measured), got {overlap!r}")
        self.optimizer = q_adam_optimizer
        self.hierarchical = bool(hierarchical)
        self.overlap = overlap if overlap == "auto" else bool(overlap)
        self.bits = int(bits)

    def reify(self, process_group: BaguaProcessGroup) -> AlgorithmImpl:
        return QAdamImpl(process_group, self.optimizer, self.hierarchical, self.overlap, self.bits)
