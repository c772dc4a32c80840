"""Resumable epochs for bagua's samplers: what an epoch consumed, saved and resumed at any world size.

An epoch is yielded in *segments*. Segment 0 is the sampler's ordinary plan of the whole epoch.
Resuming at the world size the current segment was planned for continues that segment where it
stopped (each rank yields the rest of its original order). Resuming at another world size starts
the next segment: the samples of the epoch that no rank consumed yet, planned afresh for the new
ranks with the sampler's own method (seeded by seed, epoch and segment number). Progress is
global: all ranks are at the same position of the same plan (lockstep), so rank 0's
``state_dict()`` is the one to save.

``ResumableSampler`` holds this bookkeeping (iteration passes, ``state_dict``/``load_state_dict``,
the link to a ``ResumableDataLoader``); ``ResumableIndexSampler`` adds the plan matrix shared by
the index samplers. State layout (``STATE_FORMAT``)::

    {"format": "bagua.data.sampler_state/1", "sampler": class name, "dataset_length": n,
     "seed": seed, "config": {setting: value, ...}, "epoch": e,
     "num_replicas": world size of the current segment, "segment": its number (0: the whole epoch),
     "position": units (indices or batches) each rank consumed of it,
     "consumed_before": None for segment 0, else np.packbits of the n-sample mask consumed before it}
"""

from __future__ import annotations

import logging
import numbers
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping, Optional, TypeVar

import numpy as np
from torch.utils.data import Sampler

from ..comm import get_rank, get_world_size

logger = logging.getLogger(__name__)

STATE_FORMAT = "bagua.data.sampler_state/1"
_STATE_KEYS = ("format", "sampler", "dataset_length", "seed", "config", "epoch", "num_replicas", "segment",
               "position", "consumed_before")

# Streams drawn from one epoch's seed: an index sampler's own, and the batch sampler's batch order.
SAMPLER_STREAM = 0
BATCH_STREAM = 1

T = TypeVar("T")


def check_int(name: str, value: Any, minimum: Optional[int] = None) -> int:
    """``value`` as an int, or a ValueError naming ``name`` (bools and non-integers rejected)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def dataset_length(dataset: Any) -> int:
    """``len(dataset)``, or a ValueError saying a sampler needs a map-style dataset."""
    try:
        return len(dataset)
    except TypeError as e:
        raise ValueError(f"dataset must have a length (a map-style dataset), got {type(dataset).__name__}") from e


def replicas_and_rank(num_replicas: Optional[int], rank: Optional[int]) -> tuple[int, int]:
    """Checked ``(num_replicas, rank)``; ``None`` means the process group's world size / rank."""
    num_replicas = check_int("num_replicas", get_world_size() if num_replicas is None else num_replicas, minimum=1)
    rank = check_int("rank", get_rank() if rank is None else rank)
    if not 0 <= rank < num_replicas:
        raise ValueError(f"rank must be in [0, num_replicas={num_replicas}), got {rank}")
    return num_replicas, rank


def epoch_rng(seed: int, epoch: int, stream: int, segment: int = 0) -> np.random.Generator:
    """A generator determined by ``seed + epoch`` (as torch's DistributedSampler), a stream tag and,
    for a segment after a resume at another world size, its number."""
    key = [(seed + epoch) % 2**64, stream] + ([segment] if segment else [])
    return np.random.default_rng(key)


@dataclass(frozen=True, eq=False)
class Segment:
    """A part of an epoch planned for ``num_replicas`` ranks: segment 0 plans every sample; a later
    one the samples not in ``consumed_before`` (a bool mask over the dataset)."""

    epoch: int
    index: int
    num_replicas: int
    consumed_before: Optional[np.ndarray] = None

    def remaining(self) -> Optional[np.ndarray]:
        """The indices this segment plans, increasing; ``None`` for all of them (segment 0)."""
        return None if self.consumed_before is None else np.flatnonzero(~self.consumed_before)

    def same_as(self, other: Optional[Segment]) -> bool:
        """Whether ``other`` has the same plan (segments after a resume compare by identity)."""
        if self is other:
            return True
        if other is None or self.consumed_before is not None or other.consumed_before is not None:
            return False
        return (self.epoch, self.index, self.num_replicas) == (other.epoch, other.index, other.num_replicas)


@dataclass
class _Pass:
    """One ``__iter__`` over a segment: its units ``[start, end)`` and how far it got."""

    segment: Segment
    start: int
    end: int
    position: int
    counted_by_loader: bool


class LoaderLink:
    """A ``ResumableDataLoader``'s hold on the next pass of a sampler: the loop's receipts set its position."""

    def __init__(self, sampler: ResumableSampler) -> None:
        self._sampler = sampler
        self._pass: Optional[_Pass] = None

    def received(self, units: int) -> None:
        """The loop has received ``units`` units of this pass (clipped to what the pass holds)."""
        if self._pass is not None:
            self._pass.position = min(self._pass.start + units, self._pass.end)

    def close(self, exhausted: bool) -> None:
        """The loader's iteration ended; ``exhausted``: it ran to the end, so the pass is complete."""
        if self._pass is not None and exhausted:
            self._pass.position = self._pass.end
        if self._sampler._next_link is self:
            self._sampler._next_link = None


class ResumableSampler(Sampler[T], ABC):
    """Base of bagua's samplers: passes over an epoch, saved with ``state_dict()`` and resumed
    with ``load_state_dict()``, also at another world size (see the module docstring).

    Every ``__iter__`` yields the whole epoch, except the first one after ``load_state_dict``,
    which yields what the saved run had not consumed; ``set_epoch`` with another epoch than the
    loaded one abandons that resume. Without a ``ResumableDataLoader`` the units yielded count as
    consumed (exact when iterating directly or with ``num_workers=0``).
    """

    _state_kind: str  # the class name stored in and checked against states
    num_replicas: int
    rank: int
    epoch: int
    _resume: Optional[tuple[Segment, int]] = None
    _pass: Optional[_Pass] = None
    _next_link: Optional[LoaderLink] = None

    @abstractmethod
    def set_epoch(self, epoch: int) -> None:
        """Set the epoch (implementations call ``_keep_resume_if``)."""

    @abstractmethod
    def _identity(self) -> tuple[int, int, dict[str, Any]]:
        """``(dataset length, seed, settings the plan depends on)``, checked when loading a state."""

    @abstractmethod
    def _segment_length(self, segment: Segment) -> int:
        """Units (indices or batches) every rank yields in ``segment``."""

    @abstractmethod
    def _consumed_in(self, segment: Segment, position: int) -> np.ndarray:
        """The indices all ranks consumed in the first ``position`` units of ``segment``."""

    @abstractmethod
    def _units(self, segment: Segment, start: int) -> Iterable[T]:
        """This rank's units of ``segment`` from ``start`` on."""

    def _keep_resume_if(self, epoch: int) -> None:
        """Called by ``set_epoch``: a pending resume of another epoch is abandoned."""
        if self._resume is not None and self._resume[0].epoch != epoch:
            self._resume = None

    def __iter__(self) -> Iterator[T]:
        # A generator: the pass begins at the first ``next()`` (a DataLoader may call ``iter()``
        # on its sampler twice before using the second iterator).
        resume, self._resume = self._resume, None
        if resume is not None and resume[0].epoch == self.epoch:
            segment, start = resume
        else:
            segment, start = Segment(self.epoch, 0, self.num_replicas), 0
        link, self._next_link = self._next_link, None
        current = _Pass(segment, start, self._segment_length(segment), start, counted_by_loader=link is not None)
        if link is not None:
            link._pass = current
        self._pass = current
        for unit in self._units(segment, start) if start < current.end else ():
            if not current.counted_by_loader:
                current.position += 1
            yield unit

    def _link_loader(self) -> LoaderLink:
        """Let a ``ResumableDataLoader`` count the next pass by what its loop receives."""
        self._next_link = LoaderLink(self)
        return self._next_link

    def state_dict(self) -> dict[str, Any]:
        """The epoch's progress (see the module docstring for the layout); small and picklable.

        Example::

            torch.save({"sampler": sampler.state_dict(), ...}, path)   # rank 0's is the one to keep
        """
        if self._resume is not None and self._resume[0].epoch == self.epoch:
            segment, position = self._resume
        elif self._pass is not None and self._pass.segment.epoch == self.epoch:
            segment, position = self._pass.segment, self._pass.position
        else:
            segment, position = Segment(self.epoch, 0, self.num_replicas), 0
        n, seed, config = self._identity()
        before = segment.consumed_before
        return {
            "format": STATE_FORMAT, "sampler": self._state_kind, "dataset_length": n, "seed": seed,
            "config": dict(config), "epoch": segment.epoch, "num_replicas": segment.num_replicas,
            "segment": segment.index, "position": position,
            "consumed_before": None if before is None else np.packbits(before),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from ``state``: sets the epoch, and the next ``__iter__`` yields what was not consumed.

        At the saved world size each rank continues its own order; at another one the samples no
        rank consumed are planned anew for the current ranks. A state saved when its epoch was
        wholly consumed (a checkpoint at an epoch's end) resumes at the start of the next epoch.
        Raises ValueError for a state of another sampler class, dataset length, seed or
        settings, or a corrupt one.

        Example::

            sampler.load_state_dict(checkpoint["sampler"])
            for epoch in range(sampler.epoch, epochs):
                sampler.set_epoch(epoch)   # the loaded epoch: resumes; the next ones: whole epochs
                for i in sampler: ...
        """
        n, seed, config = self._identity()
        epoch, replicas, index, position, before = _parse_state(state, self._state_kind, n, seed, config)
        segment = Segment(epoch, index, replicas, before)
        length = self._segment_length(segment)
        if position > length:
            raise ValueError(f"corrupt sampler state: position {position} is past the end of segment {index} "
                             f"({length} units per rank at num_replicas={replicas})")
        if position == length:  # the epoch is done: the loop goes on with the next one, whole
            self.set_epoch(epoch + 1)
            self._resume = self._pass = None
            return
        if replicas != self.num_replicas:
            consumed = np.zeros(n, dtype=bool) if before is None else before.copy()
            consumed[self._consumed_in(segment, position)] = True
            segment, position = Segment(epoch, index + 1, self.num_replicas, consumed), 0
            logger.info("%s: epoch %d saved at world size %d resumes at %d: %d samples not consumed yet, "
                        "planned as segment %d", self._state_kind, epoch, replicas, self.num_replicas,
                        n - int(consumed.sum()), index + 1)
        self.set_epoch(epoch)
        self._resume = (segment, position)
        self._pass = None


class ResumableIndexSampler(ResumableSampler[int]):
    """An index sampler whose segment plan is a ``(steps, num_replicas)`` matrix: ``[j, r]`` is rank
    ``r``'s ``j``-th index. Subclasses implement ``_make_plan`` and set ``epoch``/``seed``."""

    num_samples: int
    _cached: Optional[tuple[Segment, np.ndarray]] = None

    @abstractmethod
    def _make_plan(self, segment: Segment) -> np.ndarray:
        """The plan matrix of ``segment`` (``segment.num_replicas`` columns)."""

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch; with ``shuffle=True`` each epoch gets a different order."""
        self.epoch = check_int("epoch", epoch)
        self._keep_resume_if(self.epoch)

    def __len__(self) -> int:
        """Indices per rank in a whole epoch (also while a resumed, shorter pass is pending)."""
        return self.num_samples

    def indices_for_rank(self, rank: int) -> list[int]:
        """The indices rank ``rank`` yields in a whole pass of this epoch (no communication)."""
        rank = check_int("rank", rank)
        if not 0 <= rank < self.num_replicas:
            raise ValueError(f"rank must be in [0, num_replicas={self.num_replicas}), got {rank}")
        return self._plan()[:, rank].tolist()

    def _plan(self) -> np.ndarray:
        """This epoch's whole plan at this world size (identical on every rank)."""
        return self._segment_plan(Segment(self.epoch, 0, self.num_replicas))

    def _segment_plan(self, segment: Segment) -> np.ndarray:
        if self._cached is None or not segment.same_as(self._cached[0]):
            self._cached = (segment, self._make_plan(segment))
        return self._cached[1]

    def _segment_length(self, segment: Segment) -> int:
        return self._segment_plan(segment).shape[0]

    def _consumed_in(self, segment: Segment, position: int) -> np.ndarray:
        return self._segment_plan(segment)[:position].ravel()

    def _units(self, segment: Segment, start: int) -> Iterable[int]:
        return self._segment_plan(segment)[start:, self.rank].tolist()


def _parse_state(
    state: Any, kind: str, n: int, seed: int, config: dict[str, Any]
) -> tuple[int, int, int, int, Optional[np.ndarray]]:
    """Check a state against this sampler; ``(epoch, num_replicas, segment, position, consumed_before)``."""
    if not isinstance(state, Mapping):
        raise ValueError(f"a sampler state must be the dict from state_dict(), got {type(state).__name__}")
    if state.get("format") != STATE_FORMAT:
        raise ValueError(f"not a bagua sampler state: format {state.get('format')!r}, expected {STATE_FORMAT!r}")
    missing = [k for k in _STATE_KEYS if k not in state]
    unexpected = sorted(map(str, set(state) - set(_STATE_KEYS)))
    if missing or unexpected:
        raise ValueError(f"corrupt sampler state: missing keys {missing}, unexpected keys {unexpected}")
    if state["sampler"] != kind:
        raise ValueError(f"the sampler state is from {state['sampler']!r}, cannot load it into {kind!r}")
    if state["dataset_length"] != n:
        raise ValueError(f"the sampler state is for a dataset of {state['dataset_length']!r} samples, "
                         f"this sampler's dataset has {n}")
    if state["seed"] != seed:
        raise ValueError(f"the sampler state was saved with seed {state['seed']!r}, this sampler has seed {seed}; "
                         f"resume with the same seed")
    saved = state["config"]
    if not isinstance(saved, Mapping):
        raise ValueError(f"corrupt sampler state: config must be a dict, got {saved!r}")
    for key in sorted(set(saved) | set(config)):
        if saved.get(key) != config.get(key):
            raise ValueError(f"the sampler state was saved with {key}={saved.get(key)!r}, this sampler has "
                             f"{key}={config.get(key)!r}; resume with the same settings")
    try:
        epoch = check_int("epoch", state["epoch"], minimum=0)
        replicas = check_int("num_replicas", state["num_replicas"], minimum=1)
        index = check_int("segment", state["segment"], minimum=0)
        position = check_int("position", state["position"], minimum=0)
    except ValueError as e:
        raise ValueError(f"corrupt sampler state: {e}") from None
    packed = state["consumed_before"]
    if index == 0:
        if packed is not None:
            raise ValueError("corrupt sampler state: segment 0 has nothing consumed before it, "
                             f"but consumed_before is {type(packed).__name__}")
        return epoch, replicas, index, position, None
    size = (n + 7) // 8
    if not (isinstance(packed, np.ndarray) and packed.dtype == np.uint8 and packed.shape == (size,)):
        described = f"{packed.dtype} array of shape {packed.shape}" if isinstance(packed, np.ndarray) else repr(packed)
        raise ValueError(f"corrupt sampler state: consumed_before must be a uint8 array of shape ({size},) "
                         f"(np.packbits of {n} flags), got {described}")
    bits = np.unpackbits(packed)
    if bits[n:].any():
        raise ValueError(f"corrupt sampler state: consumed_before has flags set past the dataset's {n} samples")
    return epoch, replicas, index, position, bits[:n].astype(bool)
