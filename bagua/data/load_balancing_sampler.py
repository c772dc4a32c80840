"""Load-balanced distributed sampling: every rank gets the same amount of work per step.

``LoadBalancingDistributedSampler`` replaces ``torch.utils.data.DistributedSampler`` when
samples differ in cost (sentence length, audio duration). Each epoch it sorts the samples
by cost, deals consecutive groups of ``num_replicas`` samples (one sample of each group per
rank), and shuffles the order of the groups identically on every rank. So at every step
the ranks process samples of nearly the same cost, and no rank waits for a straggler.

``LoadBalancingDistributedBatchSampler`` groups the sampler's indices into batches, either
with a user ``batch_fn`` or under a complexity budget per batch (e.g. a token budget); with
a budget, each batch holds samples of similar cost (little padding) and every rank gets the
same number of batches, computed identically on every rank without communication.

Example::

    import bagua, torch
    bagua.init_process_group()
    lengths = [len(s) for s in sentences]
    sampler = bagua.data.LoadBalancingDistributedSampler(dataset, complexities=lengths)
    batches = bagua.data.LoadBalancingDistributedBatchSampler(sampler, max_complexity=4096)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=batches, collate_fn=pad)
    for epoch in range(10):
        batches.set_epoch(epoch)
        for batch in loader:
            ...

Both samplers resume mid-epoch, also at another world size: ``state_dict()`` /
``load_state_dict()`` (the bookkeeping is in ``epoch_progress``); a resumed plan at another
world size is made with the same method over the samples not consumed yet.
"""

from __future__ import annotations

import logging
import math
import numbers
from typing import Any, Callable, Iterable, Optional, Sequence, Union

import numpy as np

from .epoch_progress import (
    BATCH_STREAM, SAMPLER_STREAM, ResumableIndexSampler, ResumableSampler, Segment, check_int, dataset_length,
    epoch_rng, replicas_and_rank,
)

logger = logging.getLogger(__name__)

__all__ = ["LoadBalancingDistributedSampler", "LoadBalancingDistributedBatchSampler"]


def _check_complexities(values: np.ndarray, where: str) -> None:
    """Raise ValueError naming the first non-finite or negative complexity."""
    bad = ~np.isfinite(values)
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(f"complexities must be finite; {where} {i} has complexity {float(values[i])!r}")
    negative = values < 0
    if negative.any():
        i = int(np.argmax(negative))
        raise ValueError(f"complexities must be >= 0; {where} {i} has complexity {float(values[i])!r}")


class LoadBalancingDistributedSampler(ResumableIndexSampler):
    """A ``DistributedSampler`` that gives every rank samples of the same cost at each step.

    Each epoch the samples are sorted by complexity (plus noise when ``random_level > 0``),
    cut into consecutive groups of ``num_replicas`` samples, and each rank takes one sample
    of every group; the order of the groups (the steps) is shuffled with a generator seeded
    by ``seed + epoch``, the same on every rank, and which rank takes which member of a
    group is randomized too. Every rank yields ``len(self)`` indices per epoch.

    With ``shuffle=False`` the order is fixed: groups in increasing complexity (ties by
    index), and rank ``r`` takes the ``r``-th member of each group; with one replica that
    is all indices in increasing complexity order. ``random_level`` only applies when
    shuffling.

    Padding and dropping follow torch's ``DistributedSampler``: ``len(self)`` is
    ``ceil(n / num_replicas)``, or ``floor(n / num_replicas)`` with ``drop_last=True``.
    Without ``drop_last`` the last, incomplete group is filled by repeating its own members
    (so the padded step stays balanced); with ``drop_last`` the samples dropped are random
    ones when shuffling (the tail of a random permutation) and the highest indices otherwise.

    Cost: one sort per epoch, O(n log n) (a radix sort, O(n), for integer complexities
    spanning less than 65536), cached for the epoch; construction only checks and copies
    the complexities. Every rank must see the same complexities and run the same numpy
    version (numpy's generators may change streams between versions).

    Balance is limited by the spread inside a group: with a heavy tail, the group of the
    ``num_replicas`` largest samples differs most, so very short epochs on many ranks
    balance less well (see ``benchmarks/results/sampler.md``). ``random_level`` noise is
    relative to the whole range ``max - min``, so on a heavy-tailed distribution even a
    small level mixes groups considerably.

    ``state_dict()``/``load_state_dict()`` save and resume the epoch's progress (in indices per
    rank), also at another world size, where the samples not consumed yet are balanced the same
    way for the new ranks. Use ``ResumableDataLoader`` when the loader has worker processes (it
    counts what the loop received; the sampler alone counts what it yielded, which prefetching
    makes more).

    Args:
        dataset: the map-style dataset (only ``len(dataset)`` is used when ``complexities``
            is given).
        complexity_fn: called on each sample ``dataset[i]``; returns its cost (a number >= 0).
        complexities: the costs as a sequence of numbers, one per index (the fast path: no
            sample is loaded). Give exactly one of ``complexity_fn`` and ``complexities``.
        num_replicas: number of ranks; default ``bagua.get_world_size()``.
        rank: this rank in ``[0, num_replicas)``; default ``bagua.get_rank()``.
        shuffle: shuffle the steps each epoch (call ``set_epoch`` before each epoch).
        seed: base seed, identical on every rank.
        drop_last: drop the tail instead of padding so that ranks split the data evenly.
        random_level: in ``[0, 1]``: 0 sorts strictly by complexity (best balance); larger
            values add uniform noise of up to ``random_level * (max - min)`` complexity to
            the sort keys, so groups mix samples of different cost (more randomness).

    Example::

        >>> ds = list(range(10))
        >>> s = LoadBalancingDistributedSampler(ds, complexities=[5, 3, 9, 1, 0, 2, 8, 7, 6, 4],
        ...                                     num_replicas=1, rank=0, shuffle=False)
        >>> list(s)
        [4, 3, 5, 1, 9, 0, 8, 7, 6, 2]
    """

    _state_kind = "LoadBalancingDistributedSampler"

    def __init__(
        self,
        dataset: Any,
        complexity_fn: Optional[Callable[[Any], float]] = None,
        complexities: Optional[Union[Sequence[float], np.ndarray]] = None,
        num_replicas: Optional[int] = None,
        rank: Optional[int] = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        random_level: float = 0.0,
    ) -> None:
        num_replicas, rank = replicas_and_rank(num_replicas, rank)
        if isinstance(random_level, bool) or not isinstance(random_level, numbers.Real):
            raise ValueError(f"random_level must be a number in [0, 1], got {random_level!r}")
        if not 0.0 <= float(random_level) <= 1.0:  # also rejects NaN
            raise ValueError(f"random_level must be in [0, 1], got {random_level!r}")
        seed = check_int("seed", seed)
        if (complexity_fn is None) == (complexities is None):
            given = "both" if complexity_fn is not None else "neither"
            raise ValueError(
                f"give exactly one of complexity_fn (called on each sample) or complexities "
                f"(one number per index); got {given}"
            )
        n = dataset_length(dataset)

        if complexities is not None:
            values = self._from_sequence(complexities, n)
        else:
            if not callable(complexity_fn):
                raise ValueError(f"complexity_fn must be callable, got {complexity_fn!r}")
            values = self._from_fn(dataset, complexity_fn, n)
        values.flags.writeable = False

        self.dataset = dataset
        self.complexities: np.ndarray = values
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = bool(shuffle)
        self.seed = seed
        self.drop_last = bool(drop_last)
        self.random_level = float(random_level)
        self.epoch = 0
        if self.drop_last:
            self.num_samples = n // num_replicas
        else:
            self.num_samples = math.ceil(n / num_replicas)
        self.total_size = self.num_samples * num_replicas
        self._cmin = float(values.min()) if n else 0.0
        self._cmax = float(values.max()) if n else 0.0
        # Integer complexities spanning < 2**16 sort as uint16 keys: numpy's stable sort is
        # then a radix sort, O(n). (Stable sorts only: the plan must not depend on the CPU.)
        self._small_int_keys = bool(
            n and self._cmax - self._cmin < 2**16 and np.array_equal(values, np.floor(values))
        )
        self._cached: Optional[tuple[Segment, np.ndarray]] = None

    def _sort_keys(self, values: np.ndarray) -> np.ndarray:
        """Keys with the order of ``values`` (a gathered copy of the complexities, no noise)."""
        if self._small_int_keys:
            return (values - self._cmin).astype(np.uint16)
        return values

    @staticmethod
    def _from_sequence(complexities: Any, n: int) -> np.ndarray:
        if hasattr(complexities, "detach"):  # a torch tensor
            complexities = complexities.detach().cpu().numpy()
        try:
            raw = np.asarray(complexities)
        except (TypeError, ValueError) as e:
            raise ValueError(f"complexities must be a sequence of numbers: {e}") from e
        if raw.dtype.kind not in "biuf":
            first = raw.ravel()[:1].tolist()
            raise ValueError(
                f"complexities must be a sequence of numbers, got elements of type {raw.dtype} "
                f"(first: {first[0] if first else None!r})"
            )
        values = np.array(raw, dtype=np.float64)  # a copy: later changes by the caller must not move the plan
        if values.ndim != 1:
            raise ValueError(f"complexities must be one-dimensional, got shape {values.shape}")
        if len(values) != n:
            raise ValueError(
                f"complexities must have one number per dataset index: got {len(values)} "
                f"for a dataset of length {n}"
            )
        _check_complexities(values, "index")
        return values

    @staticmethod
    def _from_fn(dataset: Any, complexity_fn: Callable[[Any], float], n: int) -> np.ndarray:
        values = np.empty(n, dtype=np.float64)
        for i in range(n):
            c = complexity_fn(dataset[i])
            if hasattr(c, "item") and getattr(c, "ndim", 0) == 0:
                c = c.item()
            if isinstance(c, bool) or not isinstance(c, numbers.Real):
                raise ValueError(f"complexity_fn must return a number; for index {i} it returned {c!r}")
            values[i] = float(c)
        _check_complexities(values, "index")
        return values

    def _identity(self) -> tuple[int, int, dict[str, Any]]:
        return len(self.complexities), self.seed, {
            "shuffle": self.shuffle, "drop_last": self.drop_last, "random_level": self.random_level,
        }

    def _make_plan(self, segment: Segment) -> np.ndarray:
        """The ``(steps, width)`` matrix of ``segment``: ``[j, r]`` is rank r's j-th index.

        Segment 0 plans all samples (the epoch's plan); a later one the samples not consumed
        before it, with a generator that also depends on the segment number.
        """
        c = self.complexities
        members = segment.remaining()  # None: all of them
        n = len(c) if members is None else len(members)
        width = segment.num_replicas
        steps = n // width if self.drop_last else math.ceil(n / width)
        total = steps * width
        kept = min(n, total)
        idx_dtype = np.int32 if len(c) < 2**31 else np.int64
        if self.shuffle:
            rng = epoch_rng(self.seed, segment.epoch, SAMPLER_STREAM, segment.index)
            # A random permutation first: equal keys end up in random order, and with
            # drop_last the dropped samples are random ones.
            pool = rng.permutation(n).astype(idx_dtype, copy=False)[:kept]
            if members is not None:
                pool = members[pool].astype(idx_dtype, copy=False)
            keys = c[pool]
            if self.random_level > 0 and self._cmax > self._cmin:
                keys += rng.random(kept) * (self.random_level * (self._cmax - self._cmin))
            else:
                keys = self._sort_keys(keys)
            order = pool[np.argsort(keys, kind="stable")]
            del pool, keys
        else:
            rng = None
            pool = slice(0, kept) if members is None else members[:kept]
            order = np.argsort(self._sort_keys(c[pool]), kind="stable").astype(idx_dtype, copy=False)
            if members is not None:
                order = members[:kept][order].astype(idx_dtype, copy=False)
        if total > kept:  # fill the last group with repeats of its own members
            partial = kept % width
            tail = order[kept - partial:]
            order = np.concatenate([order, tail[np.arange(total - kept) % partial]])
        groups = order.reshape(steps, width)
        if rng is None:
            return groups
        shuffled = groups[rng.permutation(steps)]
        rotate = rng.integers(0, width, size=(steps, 1), dtype=idx_dtype)
        member = (np.arange(width, dtype=idx_dtype) + rotate) % width
        return np.take_along_axis(shuffled, member, axis=1)


class LoadBalancingDistributedBatchSampler(ResumableSampler[list[int]]):
    """Batches of a ``LoadBalancingDistributedSampler``'s indices; equal batch counts on every rank.

    Two ways to form batches (give exactly one):

    * ``max_complexity``: a budget per batch on the *padded* cost, i.e. the number of
      samples times the largest complexity in the batch (a token budget when complexity is
      a length). A batch is a run of consecutive groups of the sampler's sorted order, so
      its samples have similar cost, and rank ``r``'s batch is its member of each of those
      groups: every rank has the same batch count and the same samples per batch, computed
      identically on every rank with no communication. The batch order is shuffled with
      ``seed + epoch`` when the sampler shuffles, and is increasing complexity otherwise.
      A single sample over the budget forms a batch of its own, or with ``drop_last=True``
      its group is dropped.
    * ``batch_fn(indices) -> list of batches``: called on every rank's index list (in the
      sampler's order), so it must be deterministic. Ranks that get fewer batches than the
      most repeat their own first batches; with ``drop_last=True`` every rank stops at the
      fewest instead.

    Call ``set_epoch`` (it sets the sampler's epoch) before each epoch.

    ``state_dict()``/``load_state_dict()`` save and resume the epoch's progress in batches per
    rank (save this object's state, not its sampler's). At another world size the samples that
    no rank's consumed batches held are planned again, by the sampler's method and this
    batching. Use ``ResumableDataLoader`` when the loader has worker processes (it counts the
    batches the loop received; alone, this sampler counts what it yielded, which prefetching
    makes more).

    Args:
        sampler: the ``LoadBalancingDistributedSampler`` whose indices to batch.
        batch_fn: a function from a list of indices to a list of batches (lists of indices).
        max_complexity: budget per batch (> 0) on ``len(batch) * max complexity in batch``.
        drop_last: see above.

    Example::

        >>> s = LoadBalancingDistributedSampler(list(range(6)), complexities=[1, 1, 2, 2, 4, 4],
        ...                                     num_replicas=2, rank=0, shuffle=False)
        >>> list(LoadBalancingDistributedBatchSampler(s, max_complexity=4))
        [[0, 2], [4]]
    """

    _state_kind = "LoadBalancingDistributedBatchSampler"

    def __init__(
        self,
        sampler: LoadBalancingDistributedSampler,
        batch_fn: Optional[Callable[[list[int]], Iterable[Sequence[int]]]] = None,
        max_complexity: Optional[float] = None,
        drop_last: bool = False,
    ) -> None:
        if not isinstance(sampler, LoadBalancingDistributedSampler):
            raise ValueError(
                f"sampler must be a LoadBalancingDistributedSampler, got {type(sampler).__name__}"
            )
        if (batch_fn is None) == (max_complexity is None):
            given = "both" if batch_fn is not None else "neither"
            raise ValueError(f"give exactly one of batch_fn or max_complexity; got {given}")
        if batch_fn is not None and not callable(batch_fn):
            raise ValueError(f"batch_fn must be callable, got {batch_fn!r}")
        if max_complexity is not None:
            if isinstance(max_complexity, bool) or not isinstance(max_complexity, numbers.Real):
                raise ValueError(f"max_complexity must be a number > 0, got {max_complexity!r}")
            if not (math.isfinite(max_complexity) and max_complexity > 0):
                raise ValueError(f"max_complexity must be a finite number > 0, got {max_complexity!r}")
            max_complexity = float(max_complexity)
        self.sampler = sampler
        self.batch_fn = batch_fn
        self.max_complexity = max_complexity
        self.drop_last = bool(drop_last)
        self.num_replicas = sampler.num_replicas
        self.rank = sampler.rank
        self._layout: Optional[tuple[Segment, np.ndarray, Any]] = None

    @property
    def epoch(self) -> int:
        """The sampler's epoch."""
        return self.sampler.epoch

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch of the underlying sampler."""
        self.sampler.set_epoch(epoch)
        self._keep_resume_if(self.sampler.epoch)

    def __len__(self) -> int:
        """Batches per rank in a whole epoch (also while a resumed, shorter pass is pending)."""
        return len(self.batches_for_rank(self.rank))

    def batches_for_rank(self, rank: int) -> list[list[int]]:
        """The batches rank ``rank`` yields in a whole pass of this epoch (computed locally, no communication)."""
        rank = check_int("rank", rank)
        if not 0 <= rank < self.num_replicas:
            raise ValueError(f"rank must be in [0, num_replicas={self.num_replicas}), got {rank}")
        return self._rank_batches(Segment(self.epoch, 0, self.num_replicas), rank)

    def _identity(self) -> tuple[int, int, dict[str, Any]]:
        n, seed, config = self.sampler._identity()
        return n, seed, {**config, "batch_drop_last": self.drop_last, "max_complexity": self.max_complexity}

    def _segment_layout(self, segment: Segment) -> tuple[np.ndarray, Any]:
        """The sampler's plan of ``segment`` and its batch layout (cached for the segment)."""
        if self._layout is None or not segment.same_as(self._layout[0]):
            plan = self.sampler._segment_plan(segment)
            if self.max_complexity is not None:
                layout = self._budget_layout(plan, segment)
            else:
                layout = self._fn_layout(plan)
            self._layout = (segment, plan, layout)
        return self._layout[1], self._layout[2]

    def _rank_batches(self, segment: Segment, rank: int) -> list[list[int]]:
        plan, layout = self._segment_layout(segment)
        if self.max_complexity is not None:
            rows, bounds = layout
            col = plan[rows, rank].tolist()
            return [col[bounds[i]:bounds[i + 1]] for i in range(len(bounds) - 1)]
        target = self._fn_target(layout)
        own = layout[rank]
        if len(own) < target:
            if not own:
                raise ValueError(
                    f"batch_fn returned no batch for rank {rank} but {target} for another rank; "
                    f"cannot pad to equal batch counts"
                )
            own = own + [own[i % len(own)] for i in range(target - len(own))]
        return own[:target]

    def _fn_target(self, layout: list[list[list[int]]]) -> int:
        """The batch count of every rank under ``batch_fn``: the fewest with drop_last, else the most."""
        counts = [len(b) for b in layout]
        return min(counts) if self.drop_last else max(counts)

    def _segment_length(self, segment: Segment) -> int:
        _, layout = self._segment_layout(segment)
        if self.max_complexity is not None:
            return len(layout[1]) - 1
        return self._fn_target(layout)

    def _consumed_in(self, segment: Segment, position: int) -> np.ndarray:
        plan, layout = self._segment_layout(segment)
        if self.max_complexity is not None:
            rows, bounds = layout
            return plan[rows[:bounds[position]]].ravel()
        batches = [b for r in range(segment.num_replicas) for b in self._rank_batches(segment, r)[:position]]
        return np.fromiter((i for b in batches for i in b), dtype=np.int64)

    def _units(self, segment: Segment, start: int) -> Iterable[list[int]]:
        return self._rank_batches(segment, self.rank)[start:]

    def _budget_layout(self, plan: np.ndarray, segment: Segment) -> tuple[np.ndarray, list[int]]:
        """Rows of ``plan`` in batch order, and the batch boundaries in that array (all ranks)."""
        budget = self.max_complexity
        num_groups = plan.shape[0]
        if num_groups == 0:
            return np.zeros(0, dtype=np.int64), [0]
        # Cost of a group = its largest member; groups in increasing cost (already nearly so).
        group_cost = self.sampler.complexities[plan].max(axis=1)
        rows = np.argsort(group_cost, kind="stable")
        cost = group_cost[rows]
        oversized = cost > budget
        if oversized.any():
            count = int(oversized.sum())
            if self.drop_last:
                logger.warning(
                    "LoadBalancingDistributedBatchSampler: dropping %d group(s) whose largest "
                    "sample exceeds max_complexity=%g (largest: %g)", count, budget, cost[-1],
                )
                keep = ~oversized
                rows, cost = rows[keep], cost[keep]
                num_groups = len(rows)
                if num_groups == 0:
                    return rows, [0]
            else:
                logger.warning(
                    "LoadBalancingDistributedBatchSampler: %d sample group(s) exceed "
                    "max_complexity=%g (largest: %g); each forms a batch of its own",
                    count, budget, cost[-1],
                )
        # For every start group a: the most groups m with m * cost[a + m - 1] <= budget
        # (monotone in m since cost is sorted): a vectorized binary search over all a.
        start = np.arange(num_groups)
        lo = np.zeros(num_groups, dtype=np.int64)
        hi = num_groups - start
        while True:
            active = lo < hi
            if not active.any():
                break
            mid = (lo + hi + 1) // 2
            fits = mid * cost[np.minimum(start + mid - 1, num_groups - 1)] <= budget
            lo = np.where(active & fits, mid, lo)
            hi = np.where(active & ~fits, mid - 1, hi)
        take = np.maximum(lo, 1).tolist()
        bounds = []
        a = 0
        while a < num_groups:
            bounds.append(a)
            a += take[a]
        bounds.append(num_groups)
        if not self.sampler.shuffle:
            return rows, bounds
        rng = epoch_rng(self.sampler.seed, segment.epoch, BATCH_STREAM, segment.index)
        order = rng.permutation(len(bounds) - 1)
        runs = [rows[bounds[i]:bounds[i + 1]] for i in order.tolist()]
        new_bounds = np.concatenate([[0], np.cumsum([len(run) for run in runs])]).tolist()
        return np.concatenate(runs), new_bounds

    def _fn_layout(self, plan: np.ndarray) -> list[list[list[int]]]:
        """``batch_fn``'s batches for every rank (before padding or truncating)."""
        out = []
        for r in range(plan.shape[1]):
            result = self.batch_fn(plan[:, r].tolist())
            try:
                out.append([list(b) for b in result])
            except TypeError as e:
                raise ValueError(
                    f"batch_fn must return an iterable of batches (lists of indices), got {result!r}"
                ) from e
        return out
