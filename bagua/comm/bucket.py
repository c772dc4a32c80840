"""Bucket: many tensors of one dtype and device living as views of one flat buffer.

Building a bucket copies each tensor's values into the buffer once and rebinds the
tensor's ``.data`` to its view, so the caller's tensor objects (parameters, gradients)
keep working while a single collective on ``bucket.flat`` moves them all, with no copy
per step. Tensors that already tile one contiguous stretch of memory (e.g. the flat buffers
of ``bagua.optim.fuse_optimizer``) are adopted as they are: no copy, no rebinding. An algorithm appends the communication ops the bucket runs when it is ready.

Example::

    bucket = Bucket([p.grad for p in params], name="grads-0")
    bucket.append_allreduce(op=ReduceOp.AVG)
    bucket.run_ops()             # usually the Engine runs them, overlapped with backward
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence, Union

import torch

from .collectives import Handle, ReduceOp, allreduce, broadcast
from .host_staging import moves_cuda_with_gloo
from .process_group import BaguaProcessGroup, get_default_group

BucketOp = Callable[["Bucket"], Optional[Handle]]


def _shared_region(tensors: Sequence[torch.Tensor]) -> Optional[tuple[torch.Tensor, list[int]]]:
    """If ``tensors`` exactly tile one contiguous stretch of one storage (in any order, no gaps,
    no overlaps), that stretch as a flat tensor and each tensor's offset in it; else None."""
    storage = tensors[0].untyped_storage()
    if any(t.untyped_storage().data_ptr() != storage.data_ptr() or not t.is_contiguous() for t in tensors):
        return None
    spans = sorted((t.storage_offset(), t.numel()) for t in tensors)
    if any(a + n != b for (a, n), (b, _) in zip(spans, spans[1:])):
        return None
    start = spans[0][0]
    flat = torch.empty(0, dtype=tensors[0].dtype, device=tensors[0].device)
    flat.set_(storage, start, (spans[-1][0] + spans[-1][1] - start,))
    return flat, [t.storage_offset() - start for t in tensors]


class Bucket:
    """A flat buffer holding ``tensors`` as views, plus its chain of communication ops."""

    def __init__(self, tensors: Sequence[torch.Tensor], name: str = "bucket", rebind: bool = True):
        """
        Args:
            tensors: one dtype, one device, at least one tensor.
            name: shown in errors and logs.
            rebind: point each tensor's ``.data`` at its view (default). With False the
                views are independent copies, reachable through ``bucket.views``.
        """
        tensors = list(tensors)
        if not tensors:
            raise ValueError(f"bucket {name!r}: needs at least one tensor")
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"bucket {name!r}: expected tensors, got {type(t).__name__}")
        dtypes = {t.dtype for t in tensors}
        devices = {t.device for t in tensors}
        if len(dtypes) > 1 or len(devices) > 1:
            raise ValueError(
                f"bucket {name!r}: tensors must share one dtype and one device, got dtypes "
                f"{sorted(map(str, dtypes))} on {sorted(map(str, devices))}; make one bucket per kind"
            )
        self.name = name
        self._rebound = rebind
        self.dtype = tensors[0].dtype
        self.device = tensors[0].device
        self.numels = [t.numel() for t in tensors]
        self.tensors = tensors
        self._ops: list[tuple[str, BucketOp]] = []
        self._launch_only = False  # whether the chain is one op that only enqueues a collective
        region = _shared_region(tensors) if rebind else None
        #: the flat buffer is a stretch of someone else's (adopted), not this bucket's own
        self.adopted = region is not None
        if region is not None:  # already one flat buffer (e.g. a fused optimizer's): adopt it
            self.flat, self.offsets = region
            self.views = [t.data for t in tensors]
            return
        self.offsets = [0]
        for numel in self.numels[:-1]:
            self.offsets.append(self.offsets[-1] + numel)
        self.flat = torch.empty(sum(self.numels), dtype=self.dtype, device=self.device)
        self.views: list[torch.Tensor] = []
        for t, start, numel in zip(tensors, self.offsets, self.numels):
            view = self.flat[start:start + numel].view(t.shape)
            view.copy_(t.detach())
            self.views.append(view)
            if rebind:
                t.data = view

    def __len__(self) -> int:
        return len(self.tensors)

    def __repr__(self) -> str:
        return f"Bucket({self.name!r}, {len(self)} tensors, {self.flat.numel()} x {self.dtype}, {self.device})"

    @property
    def nbytes(self) -> int:
        """The size of the bucket's flat buffer, in bytes."""
        return self.flat.nbytes

    def release(self) -> None:
        """Give each tensor rebound to this bucket's own buffer storage of its own again (a copy
        of its view, shared by the tensor and its view), so that new buckets can be built from
        them as from fresh tensors. An adopted buffer stays where it is. The bucket is unusable
        afterwards.

        Example::

            for b in old_buckets:
                b.release()
            new_buckets = [Bucket(group) for group in regrouped]
        """
        if self.adopted or not self._rebound:
            return
        for t, view in zip(self.tensors, self.views):
            own = view.detach().clone()
            view.data = own
            if t is not view:
                t.data = own
        self.flat = self.flat[:0]
        self._ops.clear()

    def is_intact(self) -> bool:
        """Whether every tensor still lives in the flat buffer (nobody replaced its storage)."""
        return all(t.data_ptr() == v.data_ptr() and t.shape == v.shape for t, v in zip(self.tensors, self.views))

    # --- the chain of ops ---------------------------------------------------------------
    @property
    def ops(self) -> list[str]:
        """Names of the appended ops, in run order."""
        return [name for name, _ in self._ops]

    @property
    def launches_only(self) -> bool:
        """Whether running the ops only enqueues one collective and returns its ``Handle``,
        never blocking the host: then the engine runs them on the thread that makes the bucket
        ready, with no hand-off to its communication thread."""
        return self._launch_only and len(self._ops) == 1

    def append_op(self, op: BucketOp, name: Optional[str] = None, launch_only: bool = False) -> "Bucket":
        """Append ``op(bucket)``; it runs after the ops appended before it. Returns self.

        ``launch_only``: the op only enqueues a collective and returns its ``Handle`` (an
        ``async_op=True`` call that waits for nothing and copies nothing to the host)."""
        if not callable(op):
            raise TypeError(f"bucket {self.name!r}: op must be callable, got {type(op).__name__}")
        self._launch_only = launch_only if not self._ops else False
        self._ops.append((name or getattr(op, "__name__", "op"), op))
        return self

    def append_allreduce(
        self,
        op: Union[ReduceOp, str] = ReduceOp.AVG,
        group: Optional[BaguaProcessGroup] = None,
        compression: Optional[object] = None,
    ) -> "Bucket":
        """Append an allreduce of the whole flat buffer (optionally compressed)."""
        def run(bucket: "Bucket") -> Handle:
            return allreduce(bucket.flat, op=op, group=group, compression=compression, async_op=True)

        # an exact allreduce by the group's own backend only enqueues (no host staging)
        staged = self.device.type == "cuda" and moves_cuda_with_gloo(group or get_default_group())
        return self.append_op(run, f"allreduce[{compression or 'exact'}]", launch_only=compression is None and not staged)

    def append_broadcast(self, src: int = 0, group: Optional[BaguaProcessGroup] = None) -> "Bucket":
        """Append a broadcast of the flat buffer from global rank ``src``."""
        def run(bucket: "Bucket") -> None:
            broadcast(bucket.flat, src=src, group=group)

        return self.append_op(run, f"broadcast[{src}]")

    def clear_ops(self) -> None:
        """Forget the appended ops."""
        self._ops.clear()
        self._launch_only = False

    def run_ops(self, defer_last: bool = False) -> Optional[Handle]:
        """Run the ops in order, now, on the calling thread.

        An op may return a ``Handle`` (a collective still in flight): it is waited for before
        the next op runs. With ``defer_last`` the last op's handle is returned unfinished
        instead, so the caller (the Engine) can launch the next bucket first.
        """
        for k, (name, op) in enumerate(self._ops):
            with self._naming_errors(name):
                handle = op(self)
                if isinstance(handle, Handle):
                    if defer_last and k == len(self._ops) - 1:
                        return _NamedHandle(handle, self._naming_errors(name))
                    handle.wait()
        return None

    def _naming_errors(self, op_name: str) -> "_OpErrors":
        return _OpErrors(f"while running op {op_name!r} of bucket {self.name!r}")


class _OpErrors:
    """Add a note naming the bucket and op to any exception raised inside."""

    def __init__(self, note: str):
        self.note = note

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is not None and hasattr(exc, "add_note"):  # Python 3.11+
            exc.add_note(self.note)
        return False


class _NamedHandle:
    """A deferred op's handle whose errors still name the bucket and op."""

    def __init__(self, handle: Handle, errors: _OpErrors):
        self.handle, self.errors = handle, errors

    def wait(self) -> None:
        with self.errors:
            self.handle.wait()
