"""``torch.compile`` splits a wrapped model's graph at the wrapper's bucket boundaries.

A compiled backward is one autograd node: it hands every gradient over at its end, so bucket
communication could start only after all of backward. torch DDP avoids that with dynamo's
``DDPOptimizer``: while DDP's forward runs the module, it registers itself as the "active DDP
module", and dynamo compiles any frame traced then as one subgraph per bucket of
``bucket_bytes_cap`` bytes (the first of 1 MiB), each with its own backward, so gradients arrive
bucket by bucket as in eager mode. ``DistributedDataParallel.forward`` runs the module inside
``bucketed_graphs`` to get the same split, at bagua's bucket size (whose first bucket is 1 MiB as
well); the wrapper's own frame stays eager (``torch.compiler.disable(recursive=False)``), so the
module's frames are the ones compiled whichever way the user composes them.

Where torch has no such hook, the context does nothing and compiled models still train, only with
communication after backward. The split is chosen when a frame is compiled: a later
``ddp.rebucket`` (or autotuning) changes the buckets, not the compiled graph's cuts.

Example::

    with bucketed_graphs(ddp.bucket_size_bytes):
        output = module(*args)          # a torch.compile'd module compiles in per-bucket graphs
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch
from torch.nn.parallel import DistributedDataParallel as _TorchDDP


@dataclass(frozen=True)
class _BucketCap:
    """What dynamo reads from the active DDP module: the bucket size its graph splits follow."""

    bucket_bytes_cap: int


@contextlib.contextmanager
@torch.compiler.disable(recursive=False)
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
