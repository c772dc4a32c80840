"""DistributedDataParallel: wrap a model in one line; an Algorithm decides how ranks communicate.

At wrap time the wrapper makes a communicator of its own (the user's collectives never
interleave with its traffic), checks that every rank holds the same model, broadcasts
parameters, buffers and optimizer state from the first rank, lets the algorithm pick and bucket
the tensors it communicates (gradients become views of the buckets' flat buffers), and hooks
into the training loop: training forwards, each parameter's gradient accumulation, the end of
backward, and each wrapped optimizer's ``step()``. The loop itself stays the user's, with torch
DDP's semantics: ``no_sync()`` for accumulation, evaluation forwards that only run the module,
``broadcast_buffers``, ``find_unused_parameters`` leaving globally unused gradients None,
``join()`` for uneven inputs and ``register_comm_hook``.

Example::

    bagua.init_process_group()
    model = bagua.DistributedDataParallel(model, optimizers=[opt], algorithm="bytegrad")
    for x, y in loader:
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()          # buckets are allreduced while backward runs
        opt.step()
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence, Union

import torch
from torch.utils._pytree import tree_flatten, tree_map

from .. import comm
from ..algorithms.base import Algorithm, AlgorithmImpl, resolve
from ..algorithms.tunable import Tunable
from ..optim.fused import gradient_home
from . import algorithm_state, bucketing, comm_hook, join as _join
from .bucketing import gradient_into
from .compiled import bucketed_graphs, eager, eager_frame, run_module
from .for_algorithms import ForAlgorithms
from .backward import BackwardTracker
from .autotune import AutotuneConfig, AutotuneResult, Tuner, resolve_autotune
from .state_sync import BufferBroadcast, broadcast_tensors, check_same_model, sync_optimizer_states
from .torch_options import DEFAULT_BUCKET_SIZE_BYTES, TorchOptions, resolve_process_group, torch_options
from .wrapping import WrapperLink, check_module, checked_optimizers, ignored_names, step_pre_hook

__all__ = ["DEFAULT_BUCKET_SIZE_BYTES", "DistributedDataParallel", "with_bagua"]


class DistributedDataParallel(torch.nn.Module):
    """Data-parallel training of ``module`` with a pluggable communication algorithm.

    Args:
        module: the model; every rank builds the same one.
        optimizers: the optimizers that step the module's parameters (algorithms such as
            low_precision_decentralized work through their ``step()``).
        algorithm: an ``Algorithm`` or a registered name (see
            ``bagua.algorithms.registered_names()``).
        process_group: the ranks that train together (default: all): a ``BaguaProcessGroup``
            or a ``torch.distributed`` group. The wrapper talks on a new communicator over them.
        bucket_size_bytes: target size of one communication bucket (or torch's ``bucket_cap_mb``).
        find_unused_parameters: allow parameters that get no gradient in a step: they count as
            zero in the average, and one no rank used keeps its gradient (None stays None);
            when False such a parameter is a clear error.
        broadcast_buffers: every training step ends with the first rank's buffers (BatchNorm
            statistics) on every rank, in one message per dtype.
        init_sync: broadcast parameters, buffers and optimizer state at wrap time (default).
        autotune: search the system parameters (``tunables()``) during the first steps and keep
            the fastest: True, or a ``bagua.AutotuneConfig``; default ``BAGUA_AUTOTUNE`` (off).
            Results are unchanged; see ``bagua.parallel.autotune``.

    Other keyword arguments: torch DDP's, with torch's meaning (``device_ids``,
    ``output_device``, ``dim``, ``bucket_cap_mb``, ``gradient_as_bucket_view``,
    ``static_graph``, ``forward_sync_buffers``, ...; see ``bagua.parallel.torch_options``), and
    the options of an algorithm given by name (``algorithm="decentralized",
    peer_selection_mode="shift_one"``); an algorithm built around its optimizer (``"qadam"``)
    takes the one ``QAdamOptimizer`` of ``optimizers``.

    ``.module`` is the wrapped model; ``state_dict()`` has torch DDP's ``module.`` prefix.
    ``bytes_sent_last_step`` is what this rank sent in the last complete step;
    ``bytes_sent_this_step`` since the current training forward began. What algorithms use of
    the wrapper is under ``for_algorithms`` (``docs/writing_an_algorithm.md``).

    Example::

        model = bagua.DistributedDataParallel(model, optimizers=[opt], algorithm="bytegrad")
    """

    #: what a step assigns (a dozen times a step): plain attributes, set without nn.Module's
    #: bookkeeping for parameters, modules and buffers, which costs ~1.5 us an assignment
    _STEP_STATE = frozenset({
        "step", "_sync_backward", "_callback_queued", "_buffers_sent", "_preset", "_in_forward", "_used",
        "_step_start_bytes", "_bytes_sent_last_step", "parameters_used_last_step", "_produced_gradient",
        "_require_sync",
    })

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._STEP_STATE:
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)

    def __init__(
        self,
        module: torch.nn.Module,
        optimizers: Sequence[torch.optim.Optimizer] = (),
        algorithm: Union[Algorithm, str] = "gradient_allreduce",
        process_group: Any = None,
        bucket_size_bytes: Optional[int] = None,
        find_unused_parameters: bool = False,
        broadcast_buffers: Optional[bool] = None,
        init_sync: bool = True,
        autotune: Union[None, bool, AutotuneConfig] = None,
        **kwargs: Any,
    ):
        """Wrap ``module`` for data-parallel training on every rank of ``process_group`` (the
        arguments are the class's, above); every rank calls it with the same model.

        Example::

            bagua.init_process_group()
            ddp = bagua.DistributedDataParallel(model, [opt], "decentralized", peer_selection_mode="shift_one")
        """
        super().__init__()
        check_module(module)
        options, algorithm_options = torch_options(module, bucket_size_bytes, broadcast_buffers, kwargs)
        tuning = resolve_autotune(autotune)
        if isinstance(optimizers, torch.optim.Optimizer):
            optimizers = [optimizers]
        if not comm.is_initialized():
            raise comm.NotInitializedError(
                "bagua.DistributedDataParallel needs a process group: call bagua.init_process_group() first"
            )
        self.module = module
        self.ignored = ignored_names(module)
        self.named_trainable_parameters = [
            (n, p) for n, p in module.named_parameters() if p.requires_grad and n not in self.ignored
        ]
        if not self.named_trainable_parameters:
            raise RuntimeError(
                "bagua.DistributedDataParallel is not needed when a module doesn't have any parameter "
                "that requires a gradient (as torch DDP says); nothing would be communicated"
            )
        self._params = dict(self.named_trainable_parameters)
        self.optimizers = checked_optimizers(optimizers, self._params.values())
        self.algorithm = resolve("bagua.DistributedDataParallel", algorithm, self.optimizers, algorithm_options)
        self.process_group = resolve_process_group(process_group)
        # A communicator of its own: the user's collectives (logging, Lightning's sync_dist) on the
        # default group never interleave with the wrapper's traffic, in flight or in background.
        self.comm_group = comm.new_group(list(self.process_group.ranks))
        self.find_unused_parameters = bool(find_unused_parameters)
        self.broadcast_buffers = options.broadcast_buffers
        self.options: TorchOptions = options
        self.step = 0  # training forwards so far (training steps)
        self._bytes_sent_last_step = 0
        self._step_start_bytes = 0
        self._src = self.comm_group.ranks[0]

        check_same_model(module, self.comm_group)
        if init_sync:
            self._sync_from_first_rank(buffers=options.init_sync_buffers)

        self.impl: AlgorithmImpl = self.algorithm.reify(self.comm_group)
        if self.impl.needs_optimizers and not self.optimizers:
            raise ValueError(
                f"algorithm {self.algorithm!r} works through the optimizer's step(): pass it, "
                f"bagua.DistributedDataParallel(model, optimizers=[opt], algorithm=...)"
            )
        self._gradient_slots: dict[str, torch.Tensor] = {}
        #: what algorithms use of the wrapper: bucket views, bucket contents, readiness
        self.for_algorithms = ForAlgorithms(self)
        self.bucket_size_bytes = options.bucket_size_bytes
        bucketing.build(self, options.bucket_size_bytes)
        has_buffers = bool(self._synced_buffers())  # torch DDP too looks once, at wrap time
        self._buffer_broadcast = BufferBroadcast(self._synced_buffers, self.comm_group) if self.broadcast_buffers and has_buffers else None

        self._require_sync = True   # False inside no_sync()
        self._sync_backward = False  # whether the running backward communicates (set by forward)
        self._buffers_sent = False  # whether this step's buffer broadcast has started
        self._preset: list[str] = []  # gradients this backward made bucket views before it began
        self._used: set[str] = set()  # parameters that got a gradient since the last synced backward
        #: names of the parameters that got a gradient on this rank in the last synced step
        #: (its backward, and the accumulation before it); empty before the first
        self.parameters_used_last_step: frozenset[str] = frozenset()
        self._callback_queued = False
        self._produced_gradient: Optional[torch.Tensor] = None  # see ForAlgorithms.produced_gradient
        self._join: Optional[_join.JoinState] = None
        self._comm_hook: Optional[tuple[Any, Callable]] = None  # (state, hook)
        self._closed = False
        self._in_forward = False
        self._backward = BackwardTracker(self)  # the gradient hooks: readiness per bucket
        self._hooks: list = []  # the optimizers' and the module's hooks, removed by close()
        for opt in self.optimizers:
            self._hooks.append(opt.register_step_pre_hook(step_pre_hook(lambda: self.impl.on_optimizer_step_pre(self))))
            self._hooks.append(opt.register_step_post_hook(lambda *_: self.impl.on_optimizer_step_post(self)))
        link = WrapperLink(self)
        self._hooks.append(module.register_load_state_dict_post_hook(link.weights_loaded))
        module._bagua_wrapper = link
        self._forget_at_exit = comm.at_teardown(link.process_exiting)
        self.impl.on_wrapped(self)
        self._tuner = Tuner(self, tuning) if tuning is not None else None

    # --- buckets ------------------------------------------------------------------------------
    def _gradient_home(self, p: torch.Tensor) -> Optional[torch.Tensor]:
        """Where a fused optimizer keeps ``p``'s gradient in its flat buffer (None if nowhere)."""
        homes = (gradient_home(opt, p) for opt in self.optimizers)
        return next((h for h in homes if h is not None), None)

    def rebucket(self, bucket_size_bytes: int) -> None:
        """Rebuild the buckets at ``bucket_size_bytes``, between steps, on every rank: as if the
        wrapper had been built with that size. Gradients, weights, optimizer state (a fused
        optimizer's flat buffers too) and the algorithm's state carry over, value for value.

        Example::

            opt.step()
            ddp.rebucket(4 << 20)      # before the next forward
        """
        bucketing.rebucket(self, bucket_size_bytes)

    def tunables(self) -> dict[str, Tunable]:
        """The system parameters ``configure`` may set here (none changes a result), by name,
        with their choices and current values: ``bucket_size_bytes``, ``streams`` (when
        ``init_process_group(streams=K)`` made stripes) and what the algorithm declares.

        Example::

            ddp.tunables()["bucket_size_bytes"].current      # 26214400
        """
        return bucketing.tunables(self)

    def configure(self, **settings: Any) -> None:
        """Apply system parameters from ``tunables()`` between steps, on every rank at the same
        step (what the autotuner does at each trial).

        Example::

            ddp.configure(bucket_size_bytes=8 << 20, streams=2)
        """
        bucketing.configure(self, settings)

    @property
    def autotune_result(self) -> Optional[AutotuneResult]:
        """What autotuning chose, once it has finished (None before, or without autotune)."""
        return self._tuner.result if self._tuner is not None else None

    @property
    def autotune_log(self) -> list[dict[str, Any]]:
        """Every autotuning trial so far: its configuration, first step, score and outcome;
        the same on every rank."""
        return list(self._tuner.log) if self._tuner is not None else []

    # --- forward ------------------------------------------------------------------------------
    @eager_frame  # the module's frames compile, in per-bucket graphs
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the module; a training forward (train mode, grad enabled, outside ``no_sync()``)
        begins a step whose backward communicates, an evaluation forward only runs the module.
        Under ``torch.compile`` (of this wrapper or of the module) the module compiles as under
        torch DDP, one graph per bucket, and the wrapper's bookkeeping is never traced
        (``bagua.parallel.compiled``).

        Example::

            loss = F.cross_entropy(ddp(x), y)
        """
        if self.options.device is not None:
            args, kwargs = _to_device((args, kwargs), self.options.device)
        stepping = self._forward_begins()
        self._in_forward = True  # the module's own hooks (attach_to_module) stand aside
        try:
            with bucketed_graphs(self.bucket_size_bytes):
                output = run_module(self.module, args, kwargs)
        finally:
            self._in_forward = False
        return self._forward_ends(output) if stepping else output

    @eager  # under torch.compile too: algorithm hooks, collectives and the step's state run as written
    def _forward_begins(self) -> bool:
        """Begin a training step if this forward is one; whether it is."""
        if not (self.module.training and torch.is_grad_enabled()):
            return False  # evaluation: the module only, no step, no traffic
        if not self._require_sync:
            self._sync_backward = False  # inside no_sync(): backward accumulates locally
            self._backward.forward_done(synced=False)
            return False
        self._begin_step()
        return True

    @eager
    def _forward_ends(self, output: Any) -> Any:
        self._start_buffer_broadcast()  # overlaps with backward
        return self._watch_backward_start(output)

    def attach_to_module(self) -> None:
        """Make a call of the wrapped module itself (``model(x)``) train exactly as a call of this
        wrapper does, as the original Bagua's ``model.with_bagua(...)`` did (it returned the
        module). ``close()`` detaches. The wrapper's ``device_ids`` move of inputs applies to
        calls of the wrapper only.

        Example::

            ddp = bagua.DistributedDataParallel(model, [opt])
            ddp.attach_to_module()
            model(x).sum().backward()      # gradients averaged, as ddp(x) would
        """
        link = self.module._bagua_wrapper  # a copy of the module gets an inert link: its calls are its own
        self._hooks += [self.module.register_forward_pre_hook(link.forward_begins),
                        self.module.register_forward_hook(link.forward_ends)]

    def _start_buffer_broadcast(self) -> None:
        if self._buffer_broadcast is not None and not self._buffers_sent and self.impl.broadcasts_buffers(self):
            self._buffers_sent = True
            self._buffer_broadcast.start(self._buffer_source())

    def _buffer_source(self) -> int:
        return self._src if self._join is None else self._join.authoritative_rank()

    def _begin_step(self) -> None:
        if self._closed:
            raise RuntimeError("this bagua.DistributedDataParallel was closed; wrap the module again to train it")
        if self.engine.marked or self._callback_queued:
            self.reset()  # the previous backward raised before it ended
        if self._tuner is not None:
            self._tuner.on_step_begin(self)
        if self._join is not None:
            self._join.notify_active()
        now = comm.bytes_sent()
        if self.step:
            self._bytes_sent_last_step = now - self._step_start_bytes
        self._step_start_bytes = now
        if self._backward.reason is not None:  # per bucket, the backward's start moves them in itself
            self._repair_gradients()
        self.impl.on_forward_pre(self)
        self.step += 1
        self._sync_backward = True
        self._buffers_sent = False
        self._backward.forward_done(synced=True)

    def _repair_gradients(self) -> None:
        """Put an assigned gradient (``p.grad = t``) back into its bucket view, or its fused
        optimizer's flat buffer, so backward accumulates there. A gradient set to None by
        ``zero_grad()`` stays None: backward makes a fresh one and the gradient hook copies it
        into the view (one copy, cheaper than zeroing the view for backward to add into)."""
        for name, view in self._grad_view.items():
            p = self._params[name]
            if p.grad is not None:
                gradient_into(p, view)

    def _watch_backward_start(self, output: Any) -> Any:
        """Queue the end-of-backward callback from the outputs' gradient hooks: they run in the
        outermost backward, so a nested one (reentrant activation checkpointing) cannot end the
        step early. Tensors are returned as they are (a hook, no copy)."""
        tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        for t in tensors:
            t.register_hook(self._queue_end_of_backward)
        return output

    def _queue_end_of_backward(self, grad: Optional[torch.Tensor] = None) -> None:
        if not self._callback_queued and self._sync_backward:
            if grad is not None and not self._backward.accumulates():
                return  # torch.autograd.grad through the outputs: the step's backward comes later
            self._callback_queued = True
            if grad is not None:  # the outputs' hook: backward is beginning
                self._preset = self._backward.backward_begins()
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def prepare_for_backward(self, outputs: Any) -> None:
        """Declare that a backward of ``outputs`` follows inside the current training forward:
        for loops whose backward runs within the wrapped module's forward (Lightning's manual
        optimization: ``manual_backward`` inside ``training_step``), or that run several backwards
        in one forward. The buffers are broadcast from here, and each such backward communicates
        the gradients (algorithms that communicate weights do it once per step, as usual).
        Nothing happens outside a training forward or inside ``no_sync()``.

        Example::

            def training_step(self, batch, i):           # called through the wrapper
                loss = self.loss(batch)
                ddp.prepare_for_backward(loss)
                loss.backward(); opt.step(); opt.zero_grad()
        """
        if not (self.step and self._require_sync and self.module.training and torch.is_grad_enabled()):
            return
        if not self._sync_backward and self.impl.ready_on_backward(self):
            self._sync_backward = True  # another backward in the same forward: it communicates too
            self._backward.forward_done(synced=True)
        self._buffers_sent = False  # each backward ends with the buffers its forwards left on rank 0
        self._start_buffer_broadcast()
        self._watch_backward_start(outputs)

    # --- backward (bagua.parallel.backward) --------------------------------------------------
    def _end_of_backward(self) -> None:
        self._callback_queued = False
        self._sync_backward = False
        try:
            self._backward.backward_ends(self._preset)
        finally:
            self._backward.disarm()
            self._preset = []
        self._finish_synced_step()

    def _finish_synced_step(self) -> None:
        """What ends every synced step after the buckets: buffers, then the algorithm's own end."""
        self.parameters_used_last_step = frozenset(self._used)
        self._used = set()
        if self._join is not None:
            self._join.scale_gradients()
        if self._buffer_broadcast is not None:
            self._buffer_broadcast.finish()
        self.impl.on_backward_end(self)

    def _drain_engine(self) -> None:
        try:
            self.engine.wait()
        except comm.EngineError:
            pass  # the error raised next names the cause; the engine is reset for the next step

    def sync_buffers(self) -> None:
        """Make every rank's buffers the first rank's now (every rank calls it), e.g. after
        training with an algorithm whose ranks do not wait for each other."""
        broadcast_tensors(self._synced_buffers(), self.comm_group, self._src)

    def _sync_from_first_rank(self, buffers: bool = True) -> None:
        """Every rank takes the first rank's parameters (and buffers) and optimizer state."""
        tensors = self._synced_parameters() + (self._synced_buffers() if buffers else [])
        broadcast_tensors(tensors, self.comm_group, self._src)
        sync_optimizer_states(self.optimizers, self.comm_group, self._src)

    def _synced_parameters(self) -> list[torch.Tensor]:
        return [p for n, p in self.module.named_parameters() if n not in self.ignored]

    def _synced_buffers(self) -> list[torch.Tensor]:
        """The module's buffers that ranks share (all but the ignored ones, see ``ignored_names``)."""
        return [b for n, b in self.module.named_buffers() if n not in self.ignored]

    def reset(self) -> None:
        """Abandon a step whose backward raised (a skipped out-of-memory batch): wait for the
        buckets it already launched, and forget what it marked ready. The next training forward
        does this by itself; call it directly to recover without another forward.

        Example::

            try:
                loss.backward()
            except torch.OutOfMemoryError:
                model.reset(); opt.zero_grad(); continue
        """
        self._drain_engine()
        if self._buffer_broadcast is not None:
            self._buffer_broadcast.finish()
        self._callback_queued = False
        self._sync_backward = False
        self._backward.disarm()
        bucketing.restore_unreached(self, self._preset, set(self._preset) - self._used)
        self._preset = []
        self._used = set()

    # --- torch DDP's methods ----------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally: backward inside communicates nothing; the first synced
        backward after it communicates the accumulated gradients (torch DDP's ``no_sync``).
        Forwards inside are not steps for weight-communicating algorithms either.

        Example::

            with model.no_sync():
                loss_fn(model(x0), y0).backward()     # local only
            loss_fn(model(x1), y1).backward()         # one allreduce of the sum
            opt.step()
        """
        previous, self._require_sync = self._require_sync, False
        try:
            yield
        finally:
            self._require_sync = previous

    def join(
        self, divide_by_initial_world_size: bool = True, enable: bool = True, throw_on_early_termination: bool = False
    ) -> contextlib.AbstractContextManager:
        """Train on uneven inputs (torch DDP's ``join``): a rank that runs out of data shadows
        the others' collectives until every rank is done, then every rank takes the model,
        buffers and optimizer state of the last rank to finish. See ``bagua.parallel.join``.

        Example::

            with model.join():
                for x, y in my_shard:            # shards of different lengths
                    ...
        """
        if self._tuner is not None:
            self._tuner.stop(self)  # a rank out of data would miss the tuner's collectives
        return _join.join(self, divide_by_initial_world_size, enable, throw_on_early_termination)

    def register_comm_hook(self, state: Any, hook: Callable) -> None:
        """Replace the gradient allreduce of each bucket by ``hook(state, bucket)`` (a
        ``torch.distributed.GradBucket``), returning a future of the reduced buffer, as with
        torch DDP; only for ``gradient_allreduce``. See ``bagua.parallel.comm_hook``.

        Example::

            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
            model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        """
        comm_hook.register(self, state, hook)

    def algorithm_state_dict(self) -> dict:
        """What a checkpoint needs beyond the module's and the optimizers' state dicts to resume
        this wrapper exactly: the step count (communication schedules, warm-ups), the
        algorithm's own state, which algorithm (and version of its state) wrote it, and the
        configuration autotuning chose, once it has. See ``bagua.parallel.algorithm_state``.

        Example::

            torch.save({"model": ddp.state_dict(), "opt": opt.state_dict(),
                        "bagua": ddp.algorithm_state_dict()}, path)
        """
        return algorithm_state.state_dict(self)

    def load_algorithm_state_dict(self, state: dict) -> None:
        """Restore what ``algorithm_state_dict()`` returned (after loading the module's weights
        and the optimizers' state, on every rank). A wrapper with autotuning on takes the
        configuration tuned before and skips the search. State written by another algorithm
        is defined too: the step count carries over, the rest is dropped with one warning, and
        an algorithm that keeps replicas identical starts every rank from rank 0's weights
        (see ``bagua.parallel.algorithm_state``).

        Example::

            ddp.load_algorithm_state_dict(torch.load(path)["bagua"])
        """
        algorithm_state.load_state_dict(self, state)

    @property
    def bytes_sent_last_step(self) -> int:
        """Bytes this rank sent in the last complete training step (0 before the second one).

        Example::

            print(f"{ddp.bytes_sent_last_step / 2**20:.1f} MiB per step")
        """
        return self._bytes_sent_last_step

    @property
    def bytes_sent_this_step(self) -> int:
        """Bytes this rank has sent since the current step's forward began."""
        return comm.bytes_sent() - self._step_start_bytes

    # --- housekeeping ------------------------------------------------------------------------
    def close(self, synchronize: bool = True) -> None:
        """Stop the algorithm's background work and remove the hooks (idempotent); the module
        may then be wrapped again, e.g. with another algorithm. Every rank calls it: the async
        algorithm's ranks end with identical weights. After an error, when a peer may be gone,
        ``synchronize=False`` stops the background work without waiting for the other ranks
        (each rank keeps its own weights).

        Example::

            ddp.close()
            ddp = bagua.DistributedDataParallel(ddp.module, [opt], algorithm="bytegrad")
        """
        if self._closed:
            return
        self._closed = True
        self._forget_at_exit()
        if not synchronize:
            self.impl.on_exit(self)
        self.impl.close(self)
        self._backward.detach()
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        if getattr(self.module, "_bagua_wrapper", lambda: None)() is self:
            del self.module._bagua_wrapper

    def __repr__(self) -> str:
        return f"bagua.DistributedDataParallel({self.algorithm!r}, {len(self.buckets)} buckets)\n  {self.module!r}"


@eager
def _to_device(tree: Any, device: torch.device) -> Any:
    return tree_map(lambda t: t.to(device, non_blocking=True) if isinstance(t, torch.Tensor) else t, tree)


def with_bagua(
    module: torch.nn.Module,
    optimizers: Iterable[torch.optim.Optimizer],
    algorithm: Union[Algorithm, str] = "gradient_allreduce",
    **kwargs: Any,
) -> DistributedDataParallel:
    """``DistributedDataParallel(module, optimizers, algorithm, **kwargs)``, the original Bagua's spelling.

    Example::

        model = bagua.with_bagua(model, [opt], "decentralized")
    """
    return DistributedDataParallel(module, optimizers=list(optimizers), algorithm=algorithm, **kwargs)
