"""async: ranks train without waiting for each other; a background thread averages the weights.

For the first ``warmup_steps`` steps gradients are allreduced exactly (as gradient_allreduce).
Then gradient communication stops, and a background thread on every rank averages the model
weights with all ranks, at most once every ``sync_interval_ms``, while training goes on.

Only the training thread touches the live weights, and only where a training forward begins
(``on_forward_pre``): there it adds the result of the last averaging round if one is ready,
then, if the loop wants one, copies the weights into a snapshot buffer. The loop allreduces the
snapshots and leaves (average − snapshot) as the delta for a later forward, so the local steps
taken meanwhile are kept. No lock is ever held across user code: an optimizer step, a closure
(``opt.step(closure)``, whose forward runs inside the step) or a step that raises needs nothing
from this algorithm, forward/backward never see the weights change under them, and a
``state_dict()`` taken on the training thread between steps is never half an update.

Rounds: each starts with a tiny allreduce of every rank's (stop, not-ready) flags, so all ranks'
threads run the same rounds and stop at the same one; the snapshots are averaged in a round
where every rank has offered one. A rank that stops training for a while (evaluation, a slow
loader) keeps exchanging flags, so no thread waits long in a collective. ``abort(model)``,
called on every rank, stops the loop, adds any delta received, then averages the weights once
more so that all ranks hold identical weights; ``resume(model)`` starts the loop again.
``model.close()`` does the same (weights and buffers) before removing the hooks;
``model.close(synchronize=False)`` (after an error) only stops this rank's loop. The loop
talks on its own process group, so the training loop's collectives never interleave with it.

Checkpoints: ``model.state_dict()`` first adds a delta that is ready (a state_dict pre-hook on
the wrapped module), so a checkpoint holds every round this rank has received. A round still in
flight is not in it: its delta (the average minus this rank's snapshot) carries none of this
rank's own updates, which are all in the weights, so a job resumed from the checkpoint only
misses that one pull towards the other ranks, and its first round averages the restored weights
again. Ranks save at their own moments of an asynchronous run, so like the replicas themselves
their checkpoints differ; for one set of identical weights call ``abort(model)`` on every rank
before saving (and ``resume(model)`` after). The implementation's own ``state_dict()`` holds
the steps taken (``model.algorithm_state_dict()`` carries it), so a resumed run does not redo the warm-up. Load weights after wrapping to keep
each rank's own: weights loaded before wrapping are replaced by rank 0's (the wrapper broadcasts
them), which is also a valid point to go on from.

Example::

    algo = AsyncModelAverageAlgorithm(sync_interval_ms=100, warmup_steps=10)
    model = bagua.DistributedDataParallel(model, [opt], algo)
    ...train...
    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                "bagua": model.algorithm_state_dict()}, f"ckpt{bagua.get_rank()}.pt")
    ...train...
    algo.abort(model)            # every rank: identical weights from here on
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from typing import Any, Optional

import torch

from ..comm import BaguaProcessGroup, Bucket, ReduceOp, allreduce, checks, new_group
from .base import Algorithm, AlgorithmImpl, check_choice, check_positive_int
from .gradient_allreduce import append_gradient_allreduce

logger = logging.getLogger(__name__)

# Who owns the snapshot and delta buffers: the training thread while "idle" or "delta" (a round's
# result waits to be added), the loop while "offered" (the snapshot waits for, or is in, a round).
_IDLE, _OFFERED, _DELTA = "idle", "offered", "delta"
# Longest a loop waits for its own rank's snapshot before exchanging flags anyway, so that the
# other ranks' loops never sit in a collective for long.
_POLL_S = 0.05
# Longest the exit handler waits for the loop to leave (a dead peer would keep it in a collective).
_EXIT_JOIN_S = 10.0


class AsyncModelAverageImpl(AlgorithmImpl):
    """What ``AsyncModelAverageAlgorithm`` runs (``model.impl``): see the module docstring.
    ``steps`` and ``rounds`` count the training forwards and the averaging rounds so far."""

    def __init__(self, process_group: BaguaProcessGroup, sync_interval_ms: int, warmup_steps: int):
        super().__init__(process_group)
        self.sync_interval_s = sync_interval_ms / 1000.0
        self.warmup_steps = warmup_steps
        # its own communicator: the loop's rounds never interleave with the training loop's calls
        self.group = new_group(list(process_group.ranks)) if process_group.size > 1 else process_group
        self.steps = 0  # training forwards so far, this run and the runs it resumed
        self.rounds = 0  # averaging rounds so far
        self._params: list[torch.Tensor] = []
        self._snapshot = self._delta = torch.empty(0)
        self._snapshot_views: list[torch.Tensor] = []
        self._delta_views: list[torch.Tensor] = []
        self._snapshot_taken: Optional[torch.cuda.Event] = None
        self._save_hook: Optional[torch.utils.hooks.RemovableHandle] = None
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self._averaging = False  # started, and not aborted on this rank since
        # held only to hand the buffers over (never across user code or a collective)
        self._cond = threading.Condition()
        self._state = _IDLE
        self._stop_requested = False
        self._next_round_at = 0.0  # time.monotonic() before which no snapshot is offered

    def on_wrapped(self, ddp) -> None:
        """Once, at wrap time: buffers for the handoff, then every rank's loop starts together."""
        self._params = [p for _, p in ddp.named_trainable_parameters]
        dtypes = {p.dtype for p in self._params} or {torch.float32}
        device = self._params[0].device if self._params else torch.device("cpu")
        numel = sum(p.numel() for p in self._params)
        self._snapshot = torch.empty(numel, dtype=functools.reduce(torch.promote_types, dtypes), device=device)
        self._delta = torch.empty_like(self._snapshot)
        self._snapshot_views = _views_of(self._snapshot, self._params)
        self._delta_views = _views_of(self._delta, self._params)
        self._save_hook = ddp.module.register_state_dict_pre_hook(_ApplyDeltaBeforeSave(self))
        self.start()

    def init_operations(self, ddp, bucket: Bucket) -> None:
        append_gradient_allreduce(bucket, self.process_group, average=True)

    def ready_on_backward(self, ddp) -> bool:
        return self.steps <= self.warmup_steps

    def broadcasts_buffers(self, ddp) -> bool:
        return self.steps <= self.warmup_steps  # afterwards no rank waits for another (abort syncs them)

    def replicas_identical(self, ddp) -> bool:
        return self.steps <= self.warmup_steps or not self._averaging  # after abort(): identical

    def on_forward_pre(self, ddp) -> None:
        self._raise_loop_error()
        self.steps += 1  # the step this forward begins
        if self.steps > self.warmup_steps:
            self._exchange()

    # --- the training thread's side of the handoff ---------------------------------------------
    @torch.no_grad()
    def _exchange(self) -> None:
        """Add a ready delta, then offer a snapshot of the weights if the loop wants one."""
        self._apply_delta()
        with self._cond:
            if not self._averaging or self._state != _IDLE or time.monotonic() < self._next_round_at:
                return
        torch._foreach_copy_(self._snapshot_views, self._params)  # one call, not a Python step per tensor
        if self._snapshot.is_cuda:  # the loop waits for the copies before reading the snapshot
            self._snapshot_taken = torch.cuda.Event()
            self._snapshot_taken.record()
        with self._cond:
            self._state = _OFFERED
            self._cond.notify()

    @torch.no_grad()
    def _apply_delta(self) -> None:
        """Add the last round's (average − snapshot) to the weights, if it is ready."""
        with self._cond:
            if self._state != _DELTA:
                return
        torch._foreach_add_(self._params, self._delta_views)
        with self._cond:
            self._state = _IDLE

    def _raise_loop_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(
                "bagua async: the background model-averaging thread failed (cause below) and has "
                "stopped; the other ranks' logs show where it started"
            ) from error

    # --- the background loop ------------------------------------------------------------------
    def start(self) -> None:
        """Start the averaging loop (a no-op while it runs). Every rank must call it."""
        self._averaging = True
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop_requested = False
        self._next_round_at = 0.0
        self._thread = threading.Thread(target=self._loop, name="bagua-async-average", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        try:
            with checks.trusted():  # every rank's loop issues the same two calls per round on its own group
                self._rounds()
        except BaseException as error:  # surfaced on the training thread at the next forward
            logger.warning("bagua async model averaging stopped: %s", error)
            self._error = error

    def _rounds(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._state == _OFFERED or self._stop_requested, timeout=_POLL_S)
                flags = torch.tensor([float(self._stop_requested), float(self._state != _OFFERED)],
                                     device=self._snapshot.device)
            allreduce(flags, op=ReduceOp.MAX, group=self.group)
            if flags[0] > 0:
                return  # some rank asked to stop: every rank leaves at this same round
            if flags[1] == 0:
                self._average_round()

    @torch.no_grad()
    def _average_round(self) -> None:
        if self._snapshot_taken is not None:
            self._snapshot_taken.synchronize()
        self._delta.copy_(self._snapshot)
        allreduce(self._delta, op=ReduceOp.AVG, group=self.group)
        self._delta.sub_(self._snapshot)
        if self._delta.is_cuda:  # done before the training thread may add it
            torch.cuda.current_stream(self._delta.device).synchronize()
        with self._cond:
            self._state = _DELTA
            self._next_round_at = time.monotonic() + self.sync_interval_s
            self.rounds += 1

    def _stop(self) -> None:
        """Stop this rank's loop: every rank's loop leaves at the same round (so every rank
        must call this). Re-raises the loop's error, if it failed."""
        with self._cond:
            self._stop_requested = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join()
        self._raise_loop_error()

    def on_exit(self, ddp) -> None:
        """At exit: the loop leaves at its next round (every rank is exiting too), or is left
        behind after ``_EXIT_JOIN_S`` if a peer is gone."""
        with self._cond:
            self._stop_requested = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=_EXIT_JOIN_S)

    @torch.no_grad()
    def stop_and_synchronize(self) -> None:
        """Stop the loop (every rank) and make all ranks' weights identical (their average)."""
        self._averaging = False
        self._stop()
        self._apply_delta()
        self._state = _IDLE  # a snapshot offered but not averaged is only a copy of the weights
        torch._foreach_copy_(self._snapshot_views, self._params)
        allreduce(self._snapshot, op=ReduceOp.AVG, group=self.group)
        torch._foreach_copy_(self._params, self._snapshot_views)

    # --- checkpoints --------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The steps taken (a resumed run does not redo the warm-up) and the rounds averaged.

        The weights need nothing from here: the wrapped module's ``state_dict()`` first adds a
        delta that is ready (see the module's docstring).

        Example::

            torch.save({"model": model.module.state_dict(), "bagua": model.algorithm_state_dict()}, path)
        """
        return {"steps": self.steps, "rounds": self.rounds}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on from ``state_dict()``'s counters. Call it on every rank, after wrapping.

        A running loop stops (at the same round on every rank) and starts again, and a round's
        result or a snapshot of the weights that the checkpoint replaces is dropped, so no round
        mixes weights from before and after the load.

        Raises:
            ValueError: ``state`` is not this algorithm's, or the ranks resume inside the
                synchronous warm-up at different steps (their gradient allreduces would not
                match).

        Example::

            model.module.load_state_dict(ckpt["model"])
            model.load_algorithm_state_dict(ckpt["bagua"])   # calls this
        """
        if not isinstance(state, dict) or not all(
            isinstance(state.get(key), int) and state[key] >= 0 for key in ("steps", "rounds")
        ):
            raise ValueError(
                f"an async algorithm state is {{'steps': int >= 0, 'rounds': int >= 0}} (from "
                f"model.algorithm_state_dict()['algorithm'] with this algorithm), got {state!r}"
            )
        self._stop()
        self._state = _IDLE
        self.steps, self.rounds = state["steps"], state["rounds"]
        self._check_same_warmup_on_all_ranks()
        if self._averaging:
            self.start()

    def _check_same_warmup_on_all_ranks(self) -> None:
        span = torch.tensor([self.steps, -self.steps], dtype=torch.int64, device=self._snapshot.device)
        allreduce(span, op=ReduceOp.MAX, group=self.group)  # the loop is stopped: the group is free
        most, fewest = int(span[0]), -int(span[1])
        if fewest < self.warmup_steps and most != fewest:
            raise ValueError(
                f"the ranks resume at different steps ({fewest} to {most}) inside the synchronous "
                f"warm-up (warmup_steps={self.warmup_steps}); load every rank's checkpoint from the same step"
            )

    def close(self, ddp) -> None:
        try:
            if self._averaging and not self._stop_requested:  # not after on_exit: peers may be gone
                self.stop_and_synchronize()
                ddp.sync_buffers()  # identical buffers too, as abort() leaves them
        finally:
            if self._save_hook is not None:
                self._save_hook.remove()


class _ApplyDeltaBeforeSave:
    """The wrapped module's state_dict pre-hook: add a ready delta before the weights are read.
    A copy or pickle of the module gets an inert hook (its weights are not the averaged ones)."""

    def __init__(self, impl: Optional[AsyncModelAverageImpl]):
        self.impl = impl

    def __call__(self, module: torch.nn.Module, prefix: str, keep_vars: bool) -> None:
        if self.impl is not None:
            self.impl._apply_delta()

    def __reduce__(self):
        return (type(self), (None,))


def _views_of(flat: torch.Tensor, params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Consecutive views of ``flat``, shaped like ``params``."""
    views, offset = [], 0
    for p in params:
        views.append(flat[offset:offset + p.numel()].view_as(p))
        offset += p.numel()
    return views


@Algorithm.register("async")
class AsyncModelAverageAlgorithm(Algorithm):
    """Asynchronous model averaging in a background thread, after synchronous warm-up steps.

    Args:
        peer_selection_mode: ``"all"`` (average with every rank; the only mode).
        sync_interval_ms: least time between the end of one averaging round and the next
            snapshot of the weights.
        warmup_steps: steps of synchronous gradient allreduce before going asynchronous.
    """

    def __init__(self, peer_selection_mode: str = "all", sync_interval_ms: int = 500, warmup_steps: int = 0):
        check_choice("peer_selection_mode", peer_selection_mode, ("all",))
        check_positive_int("sync_interval_ms", sync_interval_ms, minimum=0)
        check_positive_int("warmup_steps", warmup_steps, minimum=0)
        self.peer_selection_mode = peer_selection_mode
        self.sync_interval_ms = sync_interval_ms
        self.warmup_steps = warmup_steps

    def reify(self, process_group: BaguaProcessGroup) -> AlgorithmImpl:
        return AsyncModelAverageImpl(process_group, self.sync_interval_ms, self.warmup_steps)

    @staticmethod
    def _wrapper(model):
        """The wrapper ``model``, or the wrapper of the module ``model`` (the original Bagua passed
        the module that ``with_bagua`` returned)."""
        from ..parallel.wrapping import open_wrapper  # the wrapper imports the algorithms

        wrapper = open_wrapper(model) or model
        if not isinstance(getattr(wrapper, "impl", None), AsyncModelAverageImpl):
            raise TypeError("abort()/resume() take the bagua.DistributedDataParallel model wrapped with this "
                            "algorithm (or the module it wraps)")
        return wrapper

    def abort(self, model) -> None:
        """Stop the averaging loop on every rank (call it on every rank), then bring all ranks to
        identical weights (and the first rank's buffers). Training may go on afterwards,
        unsynchronized until ``resume``."""
        wrapper = self._wrapper(model)
        wrapper.impl.stop_and_synchronize()
        wrapper.sync_buffers()

    def resume(self, model) -> None:
        """Restart the averaging loop after ``abort`` (call it on every rank)."""
        self._wrapper(model).impl.start()
