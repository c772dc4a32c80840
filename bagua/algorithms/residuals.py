"""Error-feedback residuals kept per wrapper bucket, as algorithm state (onebit_grad, qadam bits=1).

An algorithm that allreduces a buffer per bucket through a 1-bit codec with error feedback
(``bagua.comm.ErrorFeedback``) keeps one residual state per bucket, and that state is the
algorithm's: ``state_dict()`` holds this rank's residuals per parameter name (they differ from
rank to rank, so checkpoints keep every rank's), ``load_state_dict`` puts them back into
whatever buckets the wrapper has now, and a rebucketing moves them tensor by tensor into the
new buckets. Each bucket's buffer holds its members at offsets the algorithm declares
(``attach``): the bucket's own for a gradient bucket, a scratch buffer's for qadam's momentum.

Example::

    residuals = BucketResiduals("onebit_grad", process_group, logging.getLogger("bagua.algorithms.onebit_grad"))
    feedback = residuals.attach(id(bucket), names, bucket.offsets, bucket.numels)   # init_operations
    compressed_allreduce(bucket.flat, codec="sign1", error_feedback=feedback)
    residuals.rebucketed([id(b) for b in ddp.buckets])                             # on_rebucket
    state = residuals.state_dict()
"""

from __future__ import annotations

import logging
from typing import Hashable, Iterable, Optional, Sequence

import torch

from ..comm import BaguaProcessGroup, ErrorFeedback

_SIDES = ("worker", "server")


class BucketResiduals:
    """The ``ErrorFeedback`` of each of a wrapper's buckets, and their members' places in it.

    Args:
        algorithm: the algorithm's name, for warnings.
        process_group: the algorithm's ranks (the rank and world size a state belongs to).
        log: where warnings go (the algorithm module's logger).
    """

    def __init__(self, algorithm: str, process_group: BaguaProcessGroup, log: logging.Logger):
        self.algorithm, self.process_group, self.log = algorithm, process_group, log
        self._feedback: dict[Hashable, ErrorFeedback] = {}  # per bucket (a key: e.g. its id)
        self._members: dict[Hashable, list[tuple[str, int, int]]] = {}  # per bucket: (name, offset, numel)
        # per side, by name: residuals of buckets gone (or loaded before any bucket) that no bucket holds yet
        self._unplaced: dict[str, dict[str, torch.Tensor]] = {side: {} for side in _SIDES}

    def attach(self, key: Hashable, names: Sequence[str], offsets: Sequence[int], numels: Sequence[int]) -> ErrorFeedback:
        """The residual state of bucket ``key`` (made empty the first time), whose members
        ``names`` lie at ``offsets`` for ``numels`` elements of the flat buffer it serves."""
        feedback = self._feedback.setdefault(key, ErrorFeedback())
        self._members[key] = list(zip(names, offsets, numels))
        return feedback

    def __contains__(self, key: Hashable) -> bool:
        return key in self._feedback

    def reset(self) -> None:
        """Every bucket's residuals restart at zero (on every rank alike)."""
        for feedback in self._feedback.values():
            feedback.reset()
        self._unplaced = {side: {} for side in _SIDES}

    def adopt(self, key: Hashable) -> None:
        """Bucket ``key`` (just attached) takes its members' residuals from the buckets that held
        them before, which are retired (their other members' residuals wait, by name, for the
        buckets that take those members next). For callers that learn a new bucket layout one
        bucket at a time (a torch DDP communication hook after torch's rebucketing), on every
        rank alike."""
        names = {name for name, _, _ in self._members[key]}
        stale = [k for k in self._feedback if k != key and names & {name for name, _, _ in self._members[k]}]
        retired = self._per_name((self._feedback.pop(k), self._members.pop(k)) for k in stale)
        for side in _SIDES:
            self._unplaced[side].update((name, t.clone()) for name, t in retired[side].items())
        if any(name in self._unplaced["worker"] for name in names):
            members = self._members[key]
            taken = {side: {name: self._unplaced[side].pop(name) for name in names if name in self._unplaced[side]}
                     for side in _SIDES}
            self._feedback[key].load_state_dict({side: _flat(members, taken[side]) for side in _SIDES})

    def rebucketed(self, keys: Iterable[int]) -> None:
        """The buckets are now ``keys`` (each attached already): the residuals of the buckets
        that went move into them tensor by tensor (the server residuals to their new reducers
        at the next call)."""
        new = set(keys)
        old = [(self._feedback.pop(key), self._members.pop(key)) for key in list(self._feedback) if key not in new]
        pieces = self._per_name(old)
        if not pieces["worker"]:
            return  # nothing kept yet (before the first compressed step), on every rank alike
        for key in new:
            members = self._members[key]
            self._feedback[key].load_state_dict({side: _flat(members, pieces[side]) for side in _SIDES})

    def state_dict(self) -> dict:
        """This rank's residuals per parameter name (its own: they differ across ranks), with
        the rank and world size they belong to."""
        pieces = self._per_name((feedback, self._members[key]) for key, feedback in self._feedback.items())
        for side in _SIDES:
            pieces[side] = {**self._unplaced[side], **pieces[side]}
        return {"rank": self.process_group.rank, "world_size": self.process_group.size,
                "worker": {name: t.clone() for name, t in pieces["worker"].items()},
                "server": {name: t.clone() for name, t in pieces["server"].items()}}

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()``: the residuals of this rank's own state (every rank loads its
        own, as ``bagua.checkpoint`` does); a member no bucket holds yet finds its residuals in
        the bucket that ``adopt``s it. A state of another rank or world size (one file for every
        rank), or one without residuals, restarts them at zero, with a warning where the state
        held residuals."""
        if "worker" not in state:  # written without residuals (qadam with bits=8)
            self.reset()
            return
        mine = (state["rank"], state["world_size"]) == (self.process_group.rank, self.process_group.size)
        if not mine and state["worker"]:
            self.log.warning(
                "%s: the checkpoint holds the error-feedback residuals of rank %d of %d, this is rank %d of %d: the "
                "residuals restart at zero (save every rank's state, as bagua.checkpoint does, to keep them)",
                self.algorithm, state["rank"], state["world_size"], self.process_group.rank, self.process_group.size)
        held = {name for members in self._members.values() for name, _, _ in members}
        self._unplaced = {side: {name: t.detach().to(torch.float32).reshape(-1).clone()
                                 for name, t in state[side].items() if mine and name not in held}
                          for side in _SIDES}  # for buckets not made yet (a hook's, before its first call)
        for key, feedback in self._feedback.items():
            members = self._members[key]
            if mine and members and all(name in state["worker"] for name, _, _ in members):
                feedback.load_state_dict({side: _flat(members, state[side]) for side in _SIDES})
            else:
                feedback.reset()
            feedback.mark_moved()  # every rank alike, whatever it loaded: the next call hands the server residuals over

    @staticmethod
    def _per_name(buckets: Iterable[tuple[ErrorFeedback, list[tuple[str, int, int]]]]) -> dict[str, dict[str, torch.Tensor]]:
        """Each side's residuals of ``buckets`` by parameter name (views), where a bucket has some."""
        pieces: dict[str, dict[str, torch.Tensor]] = {side: {} for side in _SIDES}
        for feedback, members in buckets:
            if feedback.worker is None:
                continue
            for side in _SIDES:
                flat = getattr(feedback, side)
                pieces[side].update((name, flat[offset:offset + numel]) for name, offset, numel in members)
        return pieces


def _flat(members: list[tuple[str, int, int]], per_name: dict[str, torch.Tensor]) -> torch.Tensor:
    """A bucket's flat residuals from per-parameter ones, each at its member's offset (a fused
    optimizer's buffer may hold them in another order); zero where ``per_name`` has none."""
    some: Optional[torch.Tensor] = next(iter(per_name.values()), None)
    device = some.device if some is not None else None
    flat = torch.zeros(sum(numel for _, _, numel in members), dtype=torch.float32, device=device)
    for name, offset, numel in members:
        if name in per_name:
            flat[offset:offset + numel] = per_name[name].reshape(-1)
    return flat


__all__ = ["BucketResiduals"]
