"""Engine: launches each bucket's ops once all its tensors are ready, in bucket order.

During backward, gradients become ready one by one (``mark_ready``). When every tensor
of a bucket is ready and every earlier bucket has been launched, the engine hands the
bucket's op chain to the communication thread, so communication overlaps with the rest
of backward. Launch order is the bucket order on every rank, whatever order the tensors
became ready in, so all ranks issue the same collectives in the same sequence.
``wait()`` ends the step: it launches nothing new, waits for every launched chain, and
re-raises the first error. On CUDA the chains run on a side stream that first waits
for the work that produced the tensors.

When every bucket's chain only enqueues one collective (``Bucket.launches_only``: an exact
allreduce by the group's own backend), there is nothing for the thread to wait on: the engine
enqueues each bucket's collective on the thread that made it ready, in the same bucket order,
and ``wait()`` finishes them. No hand-off per bucket, which on a busy host costs more than the
enqueueing itself.

Example::

    engine = Engine([bucket0, bucket1])
    for t in tensors_in_the_order_backward_produces_them:
        engine.mark_ready(t)
    engine.wait()
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
import zlib
from typing import Callable, Iterator, Optional, Sequence

import torch

from . import checks
from ._torch_compat import all_gather_flat
from .bucket import Bucket
from .process_group import BaguaProcessGroup, get_default_group, is_initialized


class EngineError(RuntimeError):
    """A step could not complete: a tensor never became ready, or an op failed."""


_worker_lock = threading.Lock()
_worker: Optional[concurrent.futures.ThreadPoolExecutor] = None


def _comm_thread() -> concurrent.futures.ThreadPoolExecutor:
    """One communication thread per process: chains of every engine run in launch order."""
    global _worker
    with _worker_lock:
        if _worker is None:
            _worker = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="bagua-comm")
        return _worker


def in_background(fn: Callable[[], None]) -> concurrent.futures.Future:
    """Run ``fn`` on the communication thread, after every chain handed to it before: e.g. finish
    a collective whose result is needed later while the caller goes on (its ``result()`` then
    re-raises what ``fn`` raised).

    Example::

        landing = in_background(handle.wait)    # the reduction and the second exchange
        ...                                     # work that does not need the result
        landing.result()
    """
    return _comm_thread().submit(fn)


class Engine:
    """Tracks tensor readiness for a list of buckets and runs their ops in order."""

    def __init__(
        self,
        buckets: Sequence[Bucket],
        timeout_s: Optional[float] = None,
        group: Optional[BaguaProcessGroup] = None,
    ):
        """
        Args:
            buckets: the same buckets, in the same order, on every rank.
            timeout_s: how long ``wait()`` waits for the communication thread before it
                fails naming the bucket (default: no limit beyond the process group's own
                timeout, which already ends a stuck collective with an error).
            group: the ranks that run these buckets (default: all, when the process group
                is initialized). The engine checks once, here, that they all hold the same
                bucket layout; the ops then skip the per-call agreement check.
        """
        self.buckets = list(buckets)
        if not self.buckets:
            raise ValueError("Engine needs at least one bucket")
        if group is not None or is_initialized():
            self._verify_layout(group or get_default_group())
        self.timeout_s = timeout_s
        self._slot: dict[int, tuple[int, int]] = {}
        for b, bucket in enumerate(self.buckets):
            for i, t in enumerate(bucket.tensors):
                key = id(t)
                if key in self._slot:
                    raise ValueError(f"tensor {i} of bucket {bucket.name!r} is also in another bucket")
                self._slot[key] = (b, i)
        self._lock = threading.Lock()
        self._stream = None
        if any(b.device.type == "cuda" for b in self.buckets):
            self._stream = torch.cuda.Stream(device=self.buckets[0].device)
        #: whether this step's chains are enqueued on the marking thread (see the module
        #: docstring); read from the buckets at each step's first launch, since algorithms,
        #: communication hooks and rebucketing append ops anew between steps
        self.inline = False
        self._reset()

    def _verify_layout(self, group: BaguaProcessGroup) -> None:
        if group.size == 1:
            return
        layout = [(b.flat.numel(), str(b.dtype), len(b)) for b in self.buckets]
        row = torch.tensor(
            [len(layout), sum(n for n, _, _ in layout), zlib.crc32(repr(layout).encode())], dtype=torch.int64
        )
        table = torch.empty(group.size * 3, dtype=torch.int64)
        all_gather_flat(table, row, group=group.group)
        rows = table.view(group.size, 3).tolist()
        if any(r != rows[0] for r in rows):
            detail = ", ".join(f"rank {rank}: {n} buckets, {total} elements" for rank, (n, total, _) in zip(group.ranks, rows))
            raise ValueError(
                f"Engine: the bucket layout differs across ranks ({detail}); every rank must build the "
                f"same buckets from the same model"
            )

    def _reset(self) -> None:
        self._ready = [[False] * len(b) for b in self.buckets]
        self._missing = [len(b) for b in self.buckets]
        self._next = 0
        self._marked = False
        self._futures: list[tuple[Bucket, concurrent.futures.Future]] = []
        self._in_flight = None  # the last launched bucket's collective, not yet finished
        self._enqueued: list[tuple[Bucket, object]] = []  # inline: each bucket's handle, or its error

    @property
    def marked(self) -> bool:
        """Whether any tensor has been marked ready in the current step."""
        return self._marked

    def is_ready(self, bucket_index: int, tensor_index: int) -> bool:
        """Whether tensor ``tensor_index`` of bucket ``bucket_index`` was marked ready this step."""
        return self._ready[bucket_index][tensor_index]

    @property
    def launched(self) -> int:
        """How many buckets of the current step have been launched (enqueued, or handed to the communication thread)."""
        return self._next

    def mark_ready(self, tensor: torch.Tensor) -> None:
        """Declare ``tensor`` (one of the buckets' tensors) ready for this step."""
        slot = self._slot.get(id(tensor))
        if slot is None:
            raise KeyError("mark_ready: this tensor is in none of the engine's buckets")
        self.mark_ready_at(*slot)

    def mark_ready_at(self, bucket_index: int, tensor_index: int) -> None:
        """Declare tensor ``tensor_index`` of bucket ``bucket_index`` ready for this step."""
        with self._lock:
            if self._ready[bucket_index][tensor_index]:
                bucket = self.buckets[bucket_index]
                raise EngineError(
                    f"tensor {tensor_index} of bucket {bucket.name!r} was marked ready twice in one "
                    f"step; call wait() to end a step before the next one starts"
                )
            self._ready[bucket_index][tensor_index] = True
            self._missing[bucket_index] -= 1
            self._marked = True
            self._launch_ready()

    def mark_bucket_ready(self, bucket_index: int) -> None:
        """Declare every tensor of bucket ``bucket_index`` ready at once (none of them may be yet)."""
        with self._lock:
            ready = self._ready[bucket_index]
            if any(ready):
                raise EngineError(
                    f"bucket {self.buckets[bucket_index].name!r} was marked ready as a whole with tensors "
                    f"{[i for i, ok in enumerate(ready) if ok]} already ready in this step"
                )
            self._ready[bucket_index] = [True] * len(ready)
            self._missing[bucket_index] = 0
            self._marked = True
            self._launch_ready()

    def mark_all_ready(self) -> None:
        """Declare every tensor not yet ready ready now: every bucket launches, in order."""
        with self._lock:
            for b, ready in enumerate(self._ready):
                if self._missing[b]:
                    self._ready[b] = [True] * len(ready)
                    self._missing[b] = 0
            self._marked = True
            self._launch_ready()

    def _launch_ready(self) -> None:
        """Launch, in bucket order, every bucket from the next one on whose tensors are all ready."""
        while self._next < len(self.buckets) and self._missing[self._next] == 0:
            self._launch(self.buckets[self._next])
            self._next += 1

    def _launch(self, bucket: Bucket) -> None:
        if self._next == 0:
            self.inline = all(b.launches_only for b in self.buckets)
        if self.inline:
            self._enqueued.append((bucket, self._enqueue(bucket)))
            return
        event = None
        if self._stream is not None:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(bucket.device))
        future = _comm_thread().submit(self._run, bucket, event)
        self._futures.append((bucket, future))

    @contextlib.contextmanager
    def _communicating(self) -> Iterator[None]:
        """Where a bucket's ops run: on the side stream (CUDA), without the per-call agreement
        check (the layout was verified once at construction)."""
        with checks.trusted(), (torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()):
            yield

    def _run(self, bucket: Bucket, event) -> None:
        with self._communicating():
            if event is not None:
                self._stream.wait_event(event)
            self._pipeline(bucket.run_ops(defer_last=True))

    def _enqueue(self, bucket: Bucket) -> object:
        """Enqueue ``bucket``'s one collective here; its handle, or the error (raised by ``wait()``,
        as from the communication thread, not inside backward)."""
        try:
            if self._stream is not None:
                self._stream.wait_stream(torch.cuda.current_stream(bucket.device))
            with self._communicating():
                return bucket.run_ops(defer_last=True)
        except Exception as error:  # noqa: BLE001 - handed to wait()
            return error

    def _finish_enqueued(self) -> None:
        for _, outcome in self._enqueued:
            if isinstance(outcome, Exception):
                raise outcome
            if outcome is not None:
                with self._communicating():
                    outcome.wait()

    def _pipeline(self, handle) -> None:
        """Keep this bucket's last collective in flight and finish the previous bucket's: its
        data crosses the link while the previous one is reduced and decoded."""
        previous, self._in_flight = self._in_flight, handle
        if previous is not None:
            previous.wait()

    def _finish_in_flight(self) -> None:
        handle, self._in_flight = self._in_flight, None
        if handle is not None:
            with self._communicating():
                handle.wait()

    def wait(self) -> None:
        """End the step: wait for every bucket's ops; raise if a bucket never became ready.

        The engine is ready for the next step afterwards, also after an error.
        """
        try:
            unready = [
                f"{b.name!r} (tensors {[i for i, ok in enumerate(r) if not ok]})"
                for b, r in zip(self.buckets, self._ready) if not all(r)
            ]
            self._finish_enqueued()
            if self._futures:  # the last bucket's collective, finished on the communication thread
                self._futures.append((self._futures[-1][0], _comm_thread().submit(self._finish_in_flight)))
            for bucket, future in self._futures:
                try:
                    future.result(timeout=self.timeout_s)
                except concurrent.futures.TimeoutError:
                    raise EngineError(
                        f"bucket {bucket.name!r}: its ops did not finish within {self.timeout_s} s "
                        f"(ops {bucket.ops}); a peer rank may have died or stopped calling backward"
                    ) from None
            if unready:
                raise EngineError(
                    "these buckets never became ready, so their ops did not run on this rank: "
                    + ", ".join(unready)
                    + ". Every tensor must be marked ready each step (for parameters that get no "
                    "gradient, mark them anyway, e.g. with find_unused_parameters=True)"
                )
            if self._stream is not None:
                torch.cuda.current_stream(self.buckets[0].device).wait_stream(self._stream)
        finally:
            self._reset()
