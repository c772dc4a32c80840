"""``torch.compile`` splits a wrapped model's graph at the wrapper's bucket boundaries.

A compiled backward is one autograd node: it hands every gradient over at its end, so bucket
communication could start only after all of backward. torch DDP avoids that with dynamo's
``DDPOptimizer``: while DDP's forward runs the module, it registers itself as the "active DDP
module", and dynamo compiles any frame traced then as one subgraph per bucket of
``bucket_bytes_cap`` bytes (the first of 1 MiB), each with its own backward, so gradients arrive
bucket by bucket as in eager mode. ``DistributedDataParallel.forward`` runs the module inside
``bucketed_graphs`` to get the same split, at bagua's bucket size (whose first bucket is 1 MiB as
well). The wrapper's forward is never traced (``eager_frame``), nor is its bookkeeping, with
everything it calls (``eager``); it calls the module from a small frame of its own
(``run_module``), the one dynamo compiles when the user compiles the wrapper. A user who compiles
the module itself gets the module's frames compiled, split the same way.

Where torch has no such hook, the context does nothing and compiled models still train, only with
communication after backward. The split is chosen when a frame is compiled: a later
``ddp.rebucket`` (or autotuning) changes the buckets, not the compiled graph's cuts.

Example::

    with bucketed_graphs(ddp.bucket_size_bytes):
        output = module(*args)          # a torch.compile'd module compiles in per-bucket graphs
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any, Callable, Iterator, TypeVar

import torch
from torch.nn.parallel import DistributedDataParallel as _TorchDDP


_F = TypeVar("_F", bound=Callable[..., Any])


def _disabled_at_first_call(fn: _F, recursive: bool) -> _F:
    """``torch.compiler.disable(fn, recursive=recursive)``, applied at ``fn``'s first call: it
    imports dynamo, which importing bagua should not (~1.6 s)."""
    disabled = None

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        nonlocal disabled
        if disabled is None:
            disabled = torch.compiler.disable(fn, recursive=recursive)
        return disabled(*args, **kwargs)

    return call  # type: ignore[return-value]


def eager_frame(fn: _F) -> _F:
    """``fn``'s own frame is never traced by dynamo; the frames it calls still are.

    Example::

        @eager_frame
        def forward(self, x):
            return run_module(self.module, (x,), {})   # compiled under torch.compile, forward is not
    """
    return _disabled_at_first_call(fn, recursive=False)


def eager(fn: _F) -> _F:
    """``fn`` and every frame it calls run as written, never traced by dynamo: the wrapper's
    bookkeeping (steps, algorithm hooks, collectives, buffers), whose tensor work must not become
    a graph.

    Example::

        @eager
        def _forward_begins(self) -> bool: ...
    """
    return _disabled_at_first_call(fn, recursive=True)


def run_module(module: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
    """``module(*args, **kwargs)`` in a frame of its own: under ``torch.compile`` of the wrapper
    this is the frame dynamo compiles, the module's call inlined into it, so a model made of torch's
    own containers (``nn.Sequential`` of torch layers, whose frames dynamo leaves alone) compiles too.

    Example::

        output = run_module(self.module, args, kwargs)
    """
    return module(*args, **kwargs)


@dataclass(frozen=True)
class _BucketCap:
    """What dynamo reads from the active DDP module: the bucket size its graph splits follow."""

    bucket_bytes_cap: int


@contextlib.contextmanager
@eager_frame
def bucketed_graphs(bucket_bytes: int) -> Iterator[None]:
    """Within it, a frame dynamo compiles is split at ``bucket_bytes`` buckets (as under torch DDP's
    forward); the previous active module is restored after, so wrappers may nest."""
    if not hasattr(_TorchDDP, "_active_ddp_module"):  # a torch without dynamo's DDP hook
        yield
        return
    previous = _TorchDDP._active_ddp_module
    _TorchDDP._active_ddp_module = _BucketCap(int(bucket_bytes))
    try:
        yield
    finally:
        _TorchDDP._active_ddp_module = previous
