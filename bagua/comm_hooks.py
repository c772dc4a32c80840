"""Bagua's compressed gradient averaging for a job that stays on torch's ``DistributedDataParallel``.

A torch DDP communication hook (``register_comm_hook(state, hook)``) that sends what bagua's own
algorithms send, bit for bit: ``"bytegrad"`` (8-bit MinMax blocks, ~4x fewer bytes than fp32;
options ``block_size``, ``error_feedback``) and ``"onebit_grad"`` (1 bit per value with error
feedback after an exact warm-up, ~28x fewer; options ``warmup_steps``, ``block_size``), each
also ``hierarchical=True`` (exact within a machine, compressed between machines). For jobs whose
trainer builds the torch DDP wrapper itself (Lightning's ``DDPStrategy``, Hugging Face's
``Trainer``).

- **Where it runs.** On CPU tensors (Gloo) the hook hands the bucket to one background thread per
  hook state, in the order torch DDP launches them, so the backward pass goes on while it travels
  (as torch's own hooks do); on CUDA tensors (NCCL) it runs in the hook on the current stream.
- **Striped connections** (``BAGUA_NET_NSTREAMS=K``) apply as on bagua's own groups: the hook's
  large messages travel over K connections.
- **State.** The hook state keeps the step count (the warm-up's clock) and, with error feedback,
  this rank's residuals per parameter: ``state.state_dict()`` / ``load_state_dict()`` (per rank,
  as ``bagua.checkpoint`` saves the wrapper's), loadable before the first step. Torch DDP
  rebuilds its buckets after its first iteration: the residuals follow their tensors into the
  new buckets.
- **Process group.** The hook joins the job's ``torch.distributed`` default group on its first
  call (``bagua.init_process_group()`` where the job has not called it), so the state can be
  built before the processes start (Lightning builds its strategy first), and makes a
  communicator of its own over torch DDP's ranks (every rank of torch DDP's group, at the same
  first call): its traffic never interleaves with torch DDP's own (``find_unused_parameters``).

Differences from the wrapper's algorithm: the hook averages the gradients torch DDP hands it and
nothing else (no autotuning, no ``join()`` of bagua's). Gradients that overflow (GradScaler) on
any rank come out non-finite on every rank, so every rank's scaler skips the step.

Example::

    model = torch.nn.parallel.DistributedDataParallel(model)
    state = bagua.comm_hooks.register(model, "bytegrad")
    # or, as torch's API (Lightning: DDPStrategy(ddp_comm_state=state, ddp_comm_hook=compressed_hook)):
    state = bagua.comm_hooks.CompressionHookState("onebit_grad", warmup_steps=100)
    model.register_comm_hook(state, bagua.comm_hooks.compressed_hook)
    torch.save(state.state_dict(), f"hook.rank{torch.distributed.get_rank()}.pt")
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import logging
from typing import Any, Optional

import torch
import torch.distributed as dist

from . import comm
from .algorithms.base import Algorithm
from .algorithms.gradient_allreduce import allreduce_flat, hierarchical_node_groups
from .algorithms.residuals import BucketResiduals
from .comm import ReduceOp
from .comm.checks import trusted

logger = logging.getLogger(__name__)

#: the algorithms a hook can send as (the wrapper's, whose options it takes)
HOOK_ALGORITHMS = ("bytegrad", "onebit_grad")
"""The algorithms the hook sends, by name (``CompressionHookState(algorithm)``)."""


class CompressionHookState:
    """What ``compressed_hook`` needs across steps: the algorithm, its process group, the steps
    averaged so far and (with error feedback) this rank's residuals per parameter.

    Args:
        algorithm: ``"bytegrad"`` or ``"onebit_grad"``.
        process_group: a ``torch.distributed`` group (default: the whole job).
        module: the model whose parameters torch DDP averages (``register`` passes it): names the
            residuals in ``state_dict()``; without it they are named by the order torch DDP first
            hands the parameters over (the same in every run of the same model and bucket size).
        **options: the algorithm's options (``bagua.algorithms.ByteGradAlgorithm``,
            ``OneBitGradAlgorithm``), e.g. ``warmup_steps=100``, ``block_size=256``,
            ``hierarchical=True``. ``average=False`` is refused: torch DDP expects the average.

    Example::

        state = CompressionHookState("bytegrad", block_size=256, error_feedback=True)
        ddp_model.register_comm_hook(state, compressed_hook)
    """

    def __init__(self, algorithm: str = "bytegrad", process_group: Optional[dist.ProcessGroup] = None,
                 module: Optional[torch.nn.Module] = None, **options: Any):
        if algorithm not in HOOK_ALGORITHMS:
            raise ValueError(f"bagua.comm_hooks sends as one of {sorted(HOOK_ALGORITHMS)}, got {algorithm!r} "
                             f"(the other algorithms are not gradient averages: use bagua.DistributedDataParallel)")
        if options.get("average", True) is not True:
            raise ValueError("average=False: a torch DDP communication hook must return the average of the gradients")
        self.algorithm: Algorithm = Algorithm.init(algorithm, **options)  # checks the options
        self.name = algorithm
        self.warmup_steps = int(getattr(self.algorithm, "warmup_steps", 0))
        self.error_feedback = algorithm == "onebit_grad" or bool(getattr(self.algorithm, "error_feedback", False))
        self.steps = 0  # steps whose last bucket was handed over (the warm-up's clock)
        self._torch_group = process_group
        self._names: dict[int, str] = {}
        if module is not None:
            self.name_parameters(module)
        self._group: Optional[comm.BaguaProcessGroup] = None
        self._node_groups = None
        self._residuals: Optional[BucketResiduals] = None
        self._pending: Optional[dict] = None  # a state loaded before the first call
        self._checked: set[tuple] = set()  # bucket layouts already checked alike on every rank
        self._worker: Optional[concurrent.futures.ThreadPoolExecutor] = None

    def __repr__(self) -> str:
        return f"CompressionHookState({self.algorithm!r}, steps={self.steps})"

    # ---- checkpoints ----------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """The steps averaged and this rank's residuals per parameter (they differ across ranks:
        save every rank's). Call it between steps."""
        self._drain()
        state = {"algorithm": self.name, "steps": self.steps}
        if self.error_feedback:
            state["residuals"] = self._residuals.state_dict() if self._residuals is not None else (self._pending or {})
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()`` of this rank (before the first step or between steps)."""
        if not isinstance(state, dict) or state.get("algorithm") != self.name or "steps" not in state:
            raise ValueError(f"expected the state_dict() of a {self.name!r} CompressionHookState, got "
                             f"{state.get('algorithm') if isinstance(state, dict) else type(state).__name__!r}")
        self._drain()
        self.steps = int(state["steps"])
        residuals = state.get("residuals")
        if self.error_feedback and residuals is not None:
            if self._residuals is None:
                self._pending = residuals  # loaded at the first call, when the group is known
            else:
                self._residuals.load_state_dict(residuals)

    # ---- the hook's work ------------------------------------------------------------------------

    def _join(self) -> comm.BaguaProcessGroup:
        """Bagua's process group of the torch group, joining the job at the first call."""
        if self._group is None:
            if not dist.is_initialized():
                raise RuntimeError("bagua.comm_hooks: torch.distributed is not initialized; the hook runs inside "
                                   "torch's DistributedDataParallel, which needs init_process_group first")
            if not comm.is_initialized():
                comm.init_process_group(rank=dist.get_rank(), world_size=dist.get_world_size())
            group = self._torch_group if self._torch_group is not None else dist.group.WORLD
            # a communicator of its own over the same ranks: torch DDP's own collectives on its
            # group (find_unused_parameters' bitmap, buffer broadcasts) never meet the hook's
            # background thread there in another order on another rank (Gloo would wait forever)
            self._group = comm.new_group(dist.get_process_group_ranks(group))
            if getattr(self.algorithm, "hierarchical", False):
                self._node_groups = hierarchical_node_groups(self._group)
            if self.error_feedback:
                self._residuals = BucketResiduals(self.name, self._group, logger)
                if self._pending is not None:
                    self._residuals.load_state_dict(self._pending)
                    self._pending = None
        return self._group

    def name_parameters(self, module: torch.nn.Module) -> None:
        """Name the residuals in ``state_dict()`` by ``module``'s parameter names (before the first
        step; ``register`` does it), e.g. where the state was built before the model."""
        self._names = {id(p): name for name, p in module.named_parameters()}

    def _member_names(self, parameters: list[torch.Tensor]) -> list[str]:
        for p in parameters:
            if id(p) not in self._names:
                self._names[id(p)] = f"parameter {len(self._names)}"
        return [self._names[id(p)] for p in parameters]

    def allreduce(self, bucket: dist.GradBucket) -> torch.futures.Future:
        """Average ``bucket``'s buffer over the group as the algorithm does; see ``compressed_hook``."""
        group = self._join()
        flat = bucket.buffer()
        numels = [g.numel() for g in bucket.gradients()]
        starts = list(itertools.accumulate(numels[:-1], initial=0))
        names = self._member_names(bucket.parameters())
        layout = (tuple(names), tuple(numels))
        feedback = None
        if self.error_feedback:
            new = layout not in self._residuals
            feedback = self._residuals.attach(layout, names, starts, numels)
            if new:  # torch's first buckets, or its rebucketing: the residuals follow their tensors
                self._residuals.adopt(layout)
        exact = self.steps < self.warmup_steps
        if bucket.is_last():
            self.steps += 1
        codec = None if exact else self.algorithm.codec
        checked = (layout, exact) in self._checked
        self._checked.add((layout, exact))

        def run() -> torch.Tensor:
            # a layout seen before needs no cross-rank check: every rank hands over the same layouts in the same order
            with trusted() if checked else contextlib.nullcontext():
                handle = allreduce_flat(flat, starts, group, ReduceOp.AVG, self._node_groups, codec,
                                        error_feedback=None if exact else feedback)
            if handle is not None:
                handle.wait()
            return flat

        if flat.device.type != "cpu":  # a future of CUDA tensors names their device (its stream sync)
            future: torch.futures.Future = torch.futures.Future(devices=[flat.device])
            future.set_result(run())
            return future
        future = torch.futures.Future()
        if self._worker is None:
            self._worker = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="bagua-comm-hook")
        done = self._worker.submit(run)
        done.add_done_callback(lambda d: future.set_exception(d.exception()) if d.exception() is not None
                               else future.set_result(d.result()))
        return future

    def _drain(self) -> None:
        """Wait for the buckets handed to the background thread (so the residuals are settled)."""
        if self._worker is not None:
            self._worker.submit(lambda: None).result()

    def close(self) -> None:
        """Stop the background thread (also at exit)."""
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None


def compressed_hook(state: CompressionHookState, bucket: dist.GradBucket) -> torch.futures.Future:
    """A torch DDP communication hook: ``bucket``'s gradients averaged over ``state``'s group as
    ``state``'s algorithm averages them (exactly during its warm-up, compressed after).

    Example::

        ddp_model.register_comm_hook(CompressionHookState("bytegrad"), compressed_hook)
    """
    return state.allreduce(bucket)


# torch checks a hook's annotations as objects (this module's are strings, from __future__)
compressed_hook.__annotations__ = {"state": CompressionHookState, "bucket": dist.GradBucket,
                                   "return": torch.futures.Future[torch.Tensor]}


def register(model: torch.nn.parallel.DistributedDataParallel, algorithm: str = "bytegrad",
             process_group: Optional[dist.ProcessGroup] = None, **options: Any) -> CompressionHookState:
    """Attach bagua's ``algorithm`` to a torch ``DistributedDataParallel`` model as its
    communication hook (before its first backward); returns the hook's state (for checkpoints).

    Example::

        model = torch.nn.parallel.DistributedDataParallel(model)
        state = bagua.comm_hooks.register(model, "onebit_grad", warmup_steps=100)
    """
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(f"bagua.comm_hooks.register takes a torch.nn.parallel.DistributedDataParallel, got "
                        f"{type(model).__name__} (for bagua's own wrapper pass algorithm= to it instead)")
    state = CompressionHookState(algorithm, process_group if process_group is not None else model.process_group,
                                 module=model.module, **options)
    model.register_comm_hook(state, compressed_hook)
    return state


__all__ = ["CompressionHookState", "HOOK_ALGORITHMS", "compressed_hook", "register"]
