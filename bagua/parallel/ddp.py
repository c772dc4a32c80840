"""DistributedDataParallel: wrap a model in one line; an Algorithm decides how ranks communicate.

At wrap time the wrapper checks that every rank holds the same parameter names and shapes,
broadcasts parameters and buffers from rank 0, lets the algorithm pick and bucket the tensors
it communicates (gradients become views of the buckets' flat buffers), and hooks into the
training loop: module forward, each parameter's gradient accumulation, the end of backward,
and each wrapped optimizer's ``step()``. The loop itself stays the user's.

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

import ast
import zlib
from typing import Any, Iterable, Optional, Sequence, Union

import torch

from .. import comm
from ..algorithms.base import Algorithm, AlgorithmImpl, resolve
from ..comm import BaguaProcessGroup, Bucket, Engine
from ..optim.fused import gradient_home


DEFAULT_BUCKET_SIZE_BYTES = 25 * 1024 * 1024  # torch DDP's default


class DistributedDataParallel(torch.nn.Module):
    """Data-parallel training of ``module`` with a pluggable communication algorithm.

    Args:
        module: the model; every rank builds the same one.
        optimizers: the optimizers that step the module's parameters (algorithms such as
            async and decentralized hook their ``step()``).
        algorithm: an ``Algorithm`` or a registered name (see
            ``bagua.algorithms.registered_names()``).
        process_group: the ranks that train together (default: all).
        bucket_size_bytes: target size of one communication bucket.
        find_unused_parameters: allow parameters that get no gradient in a step (their
            gradient counts as zero); when False such a parameter is a clear error.

    ``.module`` is the wrapped model. ``bytes_sent_last_step`` is what this rank sent in the
    last complete step (from one forward to the next); ``bytes_sent_this_step`` since the
    current forward.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        optimizers: Sequence[torch.optim.Optimizer] = (),
        algorithm: Union[Algorithm, str] = "gradient_allreduce",
        process_group: Optional[BaguaProcessGroup] = None,
        bucket_size_bytes: int = DEFAULT_BUCKET_SIZE_BYTES,
        find_unused_parameters: bool = False,
    ):
        super().__init__()
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        if isinstance(optimizers, torch.optim.Optimizer):
            optimizers = [optimizers]
        for opt in optimizers:
            if not isinstance(opt, torch.optim.Optimizer):
                raise TypeError(f"optimizers must be torch.optim.Optimizer instances, got {type(opt).__name__}")
        if not isinstance(bucket_size_bytes, int) or bucket_size_bytes < 1:
            raise ValueError(f"bucket_size_bytes must be a positive integer, got {bucket_size_bytes!r}")
        if not comm.is_initialized():
            raise comm.NotInitializedError(
                "bagua.DistributedDataParallel needs a process group: call bagua.init_process_group() first"
            )
        self.module = module
        self.optimizers = list(optimizers)
        self.algorithm = resolve(algorithm)
        self.process_group = process_group or comm.get_default_group()
        self.find_unused_parameters = find_unused_parameters
        self.named_trainable_parameters = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self._params = dict(self.named_trainable_parameters)
        self.step = 0  # forward passes so far (training steps)
        self.bytes_sent_last_step = 0
        self._step_start_bytes = 0

        self._check_same_model_on_all_ranks()
        self._broadcast_from_rank0(list(module.parameters()) + list(module.buffers()))
        for p in self._params.values():
            if p.grad is None:  # a fused optimizer's flat gradient buffer, if it has one for p
                p.grad = self._gradient_home(p)
                if p.grad is None:
                    p.grad = torch.zeros_like(p)

        self.impl: AlgorithmImpl = self.algorithm.reify(self.process_group)
        named = self.impl.tensors_to_communicate(self)
        groups = self.impl.bucket_tensors(named, bucket_size_bytes)
        self.buckets = [
            Bucket([t for _, t in group], name=f"bucket{i}[{group[0][0]}..{group[-1][0]}]")
            for i, group in enumerate(groups) if group
        ]
        self._bucket_names = [[name for name, _ in group] for group in groups if group]
        self._slot = {name: (b, i) for b, group in enumerate(groups) for i, (name, _) in enumerate(group)}
        self._grad_view = {
            name: self.buckets[b].views[i] for name, (b, i) in self._slot.items()
            if self._params.get(name) is not None and self._params[name].grad is self.buckets[b].tensors[i]
        }
        for name, p in self.named_trainable_parameters:  # weight algorithms + a fused optimizer
            home = self._gradient_home(p)
            if name not in self._grad_view and home is not None:
                self._grad_view[name] = home
        for bucket in self.buckets:
            self.impl.init_operations(self, bucket)
        self.engine = Engine(self.buckets, group=self.process_group)

        self._marked: set[str] = set()
        self._callback_queued = False
        self._hooks = [p.register_post_accumulate_grad_hook(self._make_grad_hook(n)) for n, p in self.named_trainable_parameters]
        for opt in self.optimizers:
            self._hooks.append(opt.register_step_pre_hook(lambda *_: self.impl.on_optimizer_step_pre(self)))
            self._hooks.append(opt.register_step_post_hook(lambda *_: self._after_optimizer_step()))

    # --- wrap-time checks ------------------------------------------------------------------
    def _check_same_model_on_all_ranks(self) -> None:
        """Compare parameter/buffer names, shapes and dtypes across ranks before any
        collective on them, so a mismatch is a clear error rather than a hang or a crash."""
        entries = [(n, tuple(t.shape), str(t.dtype)) for n, t in self.module.named_parameters()]
        entries += [(n, tuple(t.shape), str(t.dtype)) for n, t in self.module.named_buffers()]
        entries += [(n, "requires_grad") for n, _ in self.named_trainable_parameters]
        mine = torch.tensor([len(entries), zlib.crc32(repr(entries).encode())], dtype=torch.int64)
        table = comm.allgather(mine, group=self.process_group).view(-1, 2).tolist()
        if all(row == table[0] for row in table):
            return
        names = torch.tensor(list(repr(entries).encode()), dtype=torch.uint8)
        sizes = comm.allgather(torch.tensor([names.numel()]), group=self.process_group).tolist()
        padded = torch.zeros(max(sizes), dtype=torch.uint8)
        padded[: names.numel()] = names
        everyone = comm.allgather(padded, group=self.process_group).view(len(sizes), -1)
        reference = set(_parse_entries(bytes(everyone[0][: sizes[0]].tolist())))
        lines = []
        for rank, (row, size) in zip(self.process_group.ranks, zip(everyone, sizes)):
            theirs = set(_parse_entries(bytes(row[:size].tolist())))
            if theirs != reference:
                extra, missing = sorted(theirs - reference, key=repr)[:3], sorted(reference - theirs, key=repr)[:3]
                lines.append(f"rank {rank}: has {extra} that rank {self.process_group.ranks[0]} lacks, lacks {missing}")
        raise ValueError(
            "bagua.DistributedDataParallel: the model differs across ranks (parameter/buffer names, "
            "shapes, dtypes or requires_grad); every rank must build the same model. "
            + "; ".join(lines)
        )

    def _gradient_home(self, p: torch.Tensor) -> Optional[torch.Tensor]:
        """Where a fused optimizer keeps ``p``'s gradient in its flat buffer (None if nowhere)."""
        homes = (gradient_home(opt, p) for opt in self.optimizers)
        return next((h for h in homes if h is not None), None)

    def _broadcast_from_rank0(self, tensors: list[torch.Tensor]) -> None:
        src = self.process_group.ranks[0]
        with torch.no_grad():
            for t in tensors:
                comm.broadcast(t.data, src=src, group=self.process_group)

    # --- the training loop's hooks ---------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._begin_step()
        return self.module(*args, **kwargs)

    def _begin_step(self) -> None:
        now = comm.bytes_sent()
        if self.step:
            self.bytes_sent_last_step = now - self._step_start_bytes
        self._step_start_bytes = now
        self._repair_gradients()
        self.impl.on_forward_pre(self)
        self.step += 1

    def _repair_gradients(self) -> None:
        """Put an assigned gradient (``p.grad = t``) back into its bucket view, or its fused
        optimizer's flat buffer, so backward accumulates there. A gradient set to None by
        ``zero_grad()`` stays None: backward makes a fresh one and the gradient hook copies it
        into the view (one copy, cheaper than zeroing the view for backward to add into)."""
        for name, view in self._grad_view.items():
            p = self._params[name]
            if p.grad is not None:
                _gradient_into(p, view)

    def _make_grad_hook(self, name: str):
        def hook(param: torch.Tensor) -> None:
            view = self._grad_view.get(name)
            if view is not None:
                _gradient_into(param, view)  # a fresh gradient (after zero_grad(set_to_none=True))
            if not self._callback_queued:
                self._callback_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self.impl.on_tensor_ready(self, name, param)

        return hook

    def names_in(self, bucket: Bucket) -> list[str]:
        """The names (parameter names) of ``bucket``'s tensors, in bucket order."""
        return self._bucket_names[next(i for i, b in enumerate(self.buckets) if b is bucket)]

    def named_parameter(self, name: str) -> torch.nn.Parameter:
        """The trainable parameter called ``name``."""
        return self._params[name]

    def mark_ready(self, name: str) -> None:
        """Declare the bucketed tensor ``name`` ready for this step (algorithms call this)."""
        self._marked.add(name)
        self.engine.mark_ready_at(*self._slot[name])

    def mark_all_ready(self) -> None:
        """Declare every bucketed tensor ready now: all buckets launch, in order."""
        for name in self._slot:
            if name not in self._marked:
                self.mark_ready(name)

    def communicate_all(self) -> None:
        """Run every bucket's ops now, in bucket order, and wait for them (for algorithms that
        communicate outside backward, e.g. after the optimizer step)."""
        self.mark_all_ready()
        try:
            self.engine.wait()
        finally:
            self._marked.clear()

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        try:
            if self.impl.ready_on_backward(self):
                unused = [n for n in self._slot if n not in self._marked]
                if unused and not self.find_unused_parameters:
                    self._drain_engine()
                    raise RuntimeError(
                        f"bagua.DistributedDataParallel: {len(unused)} parameter(s) got no gradient in this "
                        f"step ({', '.join(unused[:5])}{', ...' if len(unused) > 5 else ''}); pass "
                        f"find_unused_parameters=True if parts of the model are skipped on purpose"
                    )
                for name in unused:  # their gradient counts as zero this step
                    self._use_view_as_gradient(name)
                    self.mark_ready(name)
            if self._marked:
                self.engine.wait()
        finally:
            self._marked.clear()
        self.impl.on_backward_end(self)

    def _use_view_as_gradient(self, name: str) -> None:
        """Make the view the gradient of a parameter backward did not reach: zeros if its
        gradient was None, else what it held (e.g. accumulated in earlier backward passes)."""
        view, p = self._grad_view.get(name), self._params[name]
        if view is None:
            return
        if p.grad is None:
            view.zero_()
            p.grad = view
        else:
            _gradient_into(p, view)

    def _drain_engine(self) -> None:
        try:
            self.engine.wait()
        except comm.EngineError:
            pass  # the error raised next names the cause; the engine is reset for the next step
        finally:
            self._marked.clear()

    def _after_optimizer_step(self) -> None:
        self.impl.on_optimizer_step_post(self)

    @property
    def bytes_sent_this_step(self) -> int:
        """Bytes this rank has sent since the current step's forward began."""
        return comm.bytes_sent() - self._step_start_bytes

    # --- housekeeping ------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the algorithm's background work and remove the hooks (idempotent)."""
        self.impl.close(self)
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    def __repr__(self) -> str:
        return f"bagua.DistributedDataParallel({self.algorithm!r}, {len(self.buckets)} buckets)\n  {self.module!r}"


def _gradient_into(p: torch.Tensor, view: torch.Tensor) -> None:
    """Make ``view`` (a bucket view or a fused optimizer's flat slot) ``p``'s gradient, copying
    ``p.grad`` (not None) into it unless it already lives there."""
    if p.grad.data_ptr() != view.data_ptr():
        view.copy_(p.grad)
        p.grad = view


def _parse_entries(text: bytes) -> list:
    """Parse the repr of a list of tuples of str/int/tuples (no code runs: literal_eval)."""
    return [tuple(e) if isinstance(e, list) else e for e in ast.literal_eval(text.decode())]


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
