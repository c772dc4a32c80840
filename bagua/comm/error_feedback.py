"""Error feedback: what a compressed allreduce's rounding left out, kept and sent in later calls.

1-bit Adam's two-stage compressed allreduce (Tang et al. 2021), as
``compressed_allreduce(..., error_feedback=state)`` runs it over scatter-reduce-gather:

- every rank (worker) compresses ``v = x + e_w`` instead of its input ``x``, and keeps
  ``e_w = v - decode(encode(v))`` for the next call;
- the rank that reduces a chunk (its owner: rank ``j`` reduces chunk ``j`` of every segment)
  re-compresses ``r = reduced + e_s`` for the allgather and keeps ``e_s = r - decode(encode(r))``.

Over calls on the same buffer, what reaches every rank then sums to the sum of the inputs up to
the residuals still held, which stay bounded: the rounding of a step is sent in the next ones,
never lost. That is what makes a 1-bit codec (``sign1``) train.

What is identical on which rank: the result of every call is bit-identical on all ranks (all
decode the same bytes); the worker residual ``e_w`` is each rank's own (it follows its
gradients); the server residual ``e_s`` of an element lives only on the element's owner. So
no residual is replicated, and a checkpoint keeps every rank's state (``state_dict``).

This object holds both residuals of one flat buffer, element for element, as float32: ``worker``
and ``server`` (full size; zero where this rank owns nothing, so the sum over ranks is the
server residual of every element). Its caller owns it, passes it to every call on that buffer,
and saves it with its own state. Who owns which element depends on the call's layout (world
size, segments, codec blocks); when a call's layout is not the one the server residuals were
kept under (after ``load_state_dict``, after ``mark_moved``), the call first hands each element's
server residual to its new owner (one exact sum-allreduce of ``server``: each element is
non-zero on one rank at most, so the sum is exact), so results never depend on bucketing or
segment size. When a call's result is non-finite (a rank's input held NaN or Inf: GradScaler's
overflow step, skipped by every rank), the residuals restart at zero on every rank.

Example::

    state = ErrorFeedback()
    for step in range(steps):
        compressed_allreduce(grad, op="avg", codec="sign1", error_feedback=state)
    torch.save(state.state_dict(), f"residuals.rank{rank}.pt")
"""

from __future__ import annotations

from typing import Any, Hashable, Optional, Sequence

import torch

from .checks import trusted
from .collectives import ReduceOp, allreduce
from .process_group import BaguaProcessGroup

_UNKNOWN = object()  # the server residuals may lie on any rank: hand them over at the next call


class ErrorFeedback:
    """The worker and server residuals of one flat buffer's compressed allreduce (see the module
    docstring). Empty (all zero) until the first call; every rank of the group makes one per buffer.

    Attributes:
        worker: float32, the buffer's size: what this rank's last encodings left out (or None).
        server: float32, the buffer's size: what this rank's re-encodings of the chunks it
            reduces left out, zero elsewhere (or None).

    Example::

        state = ErrorFeedback()
        compressed_allreduce(grad, codec="sign1", error_feedback=state)
        float(state.worker.abs().max())
    """

    def __init__(self) -> None:
        self.worker: Optional[torch.Tensor] = None
        self.server: Optional[torch.Tensor] = None
        self._owners: Any = None  # None: zero everywhere; a layout key; or _UNKNOWN

    def __repr__(self) -> str:
        size = "empty" if self.worker is None else f"{self.worker.numel()} elements on {self.worker.device}"
        return f"ErrorFeedback({size})"

    def reset(self) -> None:
        """Forget both residuals (on every rank alike: the next call starts from zero)."""
        self.worker = self.server = None
        self._owners = None

    def state_dict(self) -> dict[str, Optional[torch.Tensor]]:
        """This rank's residuals (copies), for a checkpoint of every rank.

        Example::

            torch.save({"residuals": state.state_dict()}, f"ckpt.rank{rank}.pt")
        """
        return {name: None if t is None else t.clone() for name, t in (("worker", self.worker), ("server", self.server))}

    def load_state_dict(self, state: dict[str, Optional[torch.Tensor]]) -> None:
        """Restore what ``state_dict()`` returned on this rank (every rank loads its own, at the
        same point: the next call hands the server residuals to their owners).

        Example::

            state.load_state_dict(torch.load(f"ckpt.rank{rank}.pt")["residuals"])
        """
        if not isinstance(state, dict) or set(state) != {"worker", "server"}:
            raise ValueError(f"expected what ErrorFeedback.state_dict() returns (keys 'worker' and 'server'), got {state!r:.200}")
        worker, server = state["worker"], state["server"]
        if (worker is None) != (server is None) or (worker is not None and worker.shape != server.shape):
            raise ValueError("ErrorFeedback state: 'worker' and 'server' must be both None or of one shape")
        self.worker = None if worker is None else worker.detach().to(torch.float32).reshape(-1).clone()
        self.server = None if server is None else server.detach().to(torch.float32).reshape(-1).clone()
        self.mark_moved()

    def copy_from(self, other: "ErrorFeedback") -> None:
        """Make this state a copy of ``other``'s, its own buffers reused where they fit: a
        provisional state to run a call on that may be discarded (a speculation), and kept with
        ``swap`` otherwise.

        Example::

            trial.copy_from(state)
            compressed_allreduce(grad, codec="sign1", error_feedback=trial)
            if keep:
                state.swap(trial)   # state now holds what the call left; trial the old buffers
        """
        if other.worker is None:
            self.worker = self.server = None
        else:
            if self.worker is None or self.worker.shape != other.worker.shape or self.worker.device != other.worker.device:
                self.worker, self.server = torch.empty_like(other.worker), torch.empty_like(other.server)
            self.worker.copy_(other.worker)
            self.server.copy_(other.server)
        self._owners = other._owners

    def swap(self, other: "ErrorFeedback") -> None:
        """Exchange the states of ``self`` and ``other`` (no copy; see ``copy_from``)."""
        self.worker, other.worker = other.worker, self.worker
        self.server, other.server = other.server, self.server
        self._owners, other._owners = other._owners, self._owners

    def mark_moved(self) -> None:
        """Declare that ``server`` was rearranged (e.g. mapped per tensor into another bucket
        layout) or loaded, on every rank alike: the next call hands it to the new owners."""
        self._owners = _UNKNOWN

    def prepare(self, numel: int, device: torch.device, layout: Hashable, owned: Sequence[tuple[int, int]],
                group: BaguaProcessGroup) -> tuple[torch.Tensor, torch.Tensor]:
        """The (worker, server) residuals for a call of ``layout`` over ``group`` in which this rank
        owns the ``owned`` stretches: allocated, on ``device``, the server residuals handed over
        when the layout changed. Called by ``compressed_allreduce`` on every rank of ``group``."""
        if self.worker is not None and self.worker.numel() != numel:
            raise ValueError(
                f"this ErrorFeedback holds residuals of {self.worker.numel()} elements, the tensor has {numel}: "
                f"use one ErrorFeedback per buffer"
            )
        if self.worker is None:
            self.worker = torch.zeros(numel, dtype=torch.float32, device=device)
            self.server = torch.zeros(numel, dtype=torch.float32, device=device)
        elif self.worker.device != device:
            self.worker, self.server = self.worker.to(device), self.server.to(device)
        if self._owners is not None and self._owners != layout:
            self._hand_over(owned, group)
        self._owners = layout
        return self.worker, self.server

    def _hand_over(self, owned: Sequence[tuple[int, int]], group: BaguaProcessGroup) -> None:
        """Every element's server residual to its owner now: an exact sum over the ranks (each
        element is non-zero on its former owner only), then this rank keeps what it owns."""
        with trusted():  # every rank runs it in the same call of the same layout
            allreduce(self.server, op=ReduceOp.SUM, group=group)
        mine = torch.zeros_like(self.server)
        for a, b in owned:
            mine[a:b] = self.server[a:b]
        self.server = mine


__all__ = ["ErrorFeedback"]
