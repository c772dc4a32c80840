"""async: ranks train without waiting for each other; a background thread averages the weights.

For the first ``warmup_steps`` steps gradients are allreduced exactly (as gradient_allreduce).
Then gradient communication stops, and a background thread on every rank averages the model
weights with all ranks every ``sync_interval_ms`` while training goes on. An averaging round
snapshots the weights (holding a lock that every wrapped optimizer's ``step()`` also holds,
so a snapshot never sees half a step), allreduces the snapshot, and leaves
(average − snapshot) pending; the training thread adds it to the live weights before its next
forward, so the local steps taken meanwhile are kept and forward/backward never see weights
change under them.

Each round starts with a tiny allreduce of every rank's (stop, busy) flags, so all ranks'
threads run the same rounds and stop at the same one (a round is skipped everywhere while
any rank is still in warm-up or has a result not yet applied): ``abort(model)``, called on every rank,
stops the loop without leaving any rank inside a collective, then averages the weights once
more so that all ranks hold identical weights; ``resume(model)`` starts the loop again. The
thread talks on its own process group, so the training loop's collectives never interleave
with it.

Example::

    algo = AsyncModelAverageAlgorithm(sync_interval_ms=100, warmup_steps=10)
    model = bagua.DistributedDataParallel(model, [opt], algo)
    ...train...
    algo.abort(model)            # every rank: identical weights from here on
"""

from __future__ import annotations

import logging
import threading
from typing import Optional

import torch

from ..comm import BaguaProcessGroup, Bucket, ReduceOp, allreduce, new_group
from .base import Algorithm, AlgorithmImpl, check_choice, check_positive_int
from .gradient_allreduce import append_gradient_allreduce

logger = logging.getLogger(__name__)


class AsyncModelAverageImpl(AlgorithmImpl):
    def __init__(self, process_group: BaguaProcessGroup, sync_interval_ms: int, warmup_steps: int):
        super().__init__(process_group)
        self.sync_interval_s = sync_interval_ms / 1000.0
        self.warmup_steps = warmup_steps
        self.lock = threading.Lock()
        # its own communicator: the loop's rounds never interleave with the training loop's calls
        self.group = new_group(list(process_group.ranks)) if process_group.size > 1 else process_group
        self.rounds = 0
        self._params: list[torch.Tensor] = []
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()
        self._error: Optional[BaseException] = None
        self._ready = False
        self._pending: Optional[torch.Tensor] = None  # average - snapshot, not yet applied

    def init_operations(self, ddp, bucket: Bucket) -> None:
        append_gradient_allreduce(bucket, self.process_group, average=True)

    def ready_on_backward(self, ddp) -> bool:
        return ddp.step <= self.warmup_steps

    def on_forward_pre(self, ddp) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError("the asynchronous model-averaging thread failed") from error
        if not self._params:
            self._params = [p for _, p in ddp.named_trainable_parameters]
            self.start()
        self._ready = ddp.step >= self.warmup_steps  # this forward begins step ddp.step + 1
        self._apply_pending()

    @torch.no_grad()
    def _apply_pending(self) -> None:
        with self.lock:
            delta, self._pending = self._pending, None
        if delta is not None:
            offset = 0
            for p in self._params:
                p.add_(delta[offset:offset + p.numel()].view_as(p))
                offset += p.numel()

    def on_optimizer_step_pre(self, ddp) -> None:
        self.lock.acquire()

    def on_optimizer_step_post(self, ddp) -> None:
        self.lock.release()

    # --- the background loop ------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="bagua-async-average", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        try:
            while True:
                busy = not self._ready or self._pending is not None
                flags = torch.tensor([float(self._stop.is_set()), float(busy)])
                allreduce(flags, op=ReduceOp.MAX, group=self.group)
                if flags[0] > 0:
                    return  # some rank asked to stop: every rank leaves at this same round
                if flags[1] == 0:
                    self._average_round()
                self._stop.wait(self.sync_interval_s)
        except BaseException as error:  # surfaced on the training thread at the next forward
            logger.warning("bagua async model averaging stopped: %s", error)
            self._error = error

    @torch.no_grad()
    def _average_round(self) -> None:
        with self.lock:
            snapshot = torch.cat([p.detach().reshape(-1) for p in self._params])
        average = snapshot.clone()
        allreduce(average, op=ReduceOp.AVG, group=self.group)
        with self.lock:
            self._pending = average.sub_(snapshot)
        self.rounds += 1

    @torch.no_grad()
    def stop_and_synchronize(self) -> None:
        """Stop the loop (every rank) and make all ranks' weights identical (their average)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError("the asynchronous model-averaging thread failed") from error
        self._apply_pending()
        if self._params:
            flat = torch.cat([p.detach().reshape(-1) for p in self._params])
            allreduce(flat, op=ReduceOp.AVG, group=self.group)
            offset = 0
            for p in self._params:
                p.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()

    def close(self, ddp) -> None:
        if self._thread is not None:
            self.stop_and_synchronize()


@Algorithm.register("async")
class AsyncModelAverageAlgorithm(Algorithm):
    """Asynchronous model averaging in a background thread, after synchronous warm-up steps.

    Args:
        peer_selection_mode: ``"all"`` (average with every rank; the only mode).
        sync_interval_ms: pause between two averaging rounds.
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
    def _impl(model) -> AsyncModelAverageImpl:
        impl = getattr(model, "impl", None)
        if not isinstance(impl, AsyncModelAverageImpl):
            raise TypeError("abort()/resume() take the bagua.DistributedDataParallel model wrapped with this algorithm")
        return impl

    def abort(self, model) -> None:
        """Stop the averaging loop on every rank (call it on every rank), then bring all ranks to
        identical weights. Training may go on afterwards, unsynchronized until ``resume``."""
        self._impl(model).stop_and_synchronize()

    def resume(self, model) -> None:
        """Restart the averaging loop after ``abort`` (call it on every rank)."""
        self._impl(model).start()
