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
"""

from __future__ import annotations

import logging
import math
import numbers
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence, Union

import numpy as np
from torch.utils.data import Sampler

from ..comm import get_rank, get_world_size

logger = logging.getLogger(__name__)

__all__ = ["LoadBalancingDistributedSampler", "LoadBalancingDistributedBatchSampler"]

# Streams drawn from one epoch's seed: the sampler's own, and the batch sampler's batch order.
_SAMPLER_STREAM = 0
_BATCH_STREAM = 1


def _epoch_rng(seed: int, epoch: int, stream: int) -> np.random.Generator:
    """A generator determined by ``seed + epoch`` (as torch's DistributedSampler) and a stream tag."""
    return np.random.default_rng([(seed + epoch) % 2**64, stream])


def _check_int(name: str, value: Any, minimum: Optional[int] = None) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


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


class LoadBalancingDistributedSampler(Sampler[int]):
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
        if num_replicas is None:
            num_replicas = get_world_size()
        if rank is None:
            rank = get_rank()
        num_replicas = _check_int("num_replicas", num_replicas, minimum=1)
        rank = _check_int("rank", rank)
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank must be in [0, num_replicas={num_replicas}), got {rank}")
        if isinstance(random_level, bool) or not isinstance(random_level, numbers.Real):
            raise ValueError(f"random_level must be a number in [0, 1], got {random_level!r}")
        if not 0.0 <= float(random_level) <= 1.0:  # also rejects NaN
            raise ValueError(f"random_level must be in [0, 1], got {random_level!r}")
        seed = _check_int("seed", seed)
        if (complexity_fn is None) == (complexities is None):
            given = "both" if complexity_fn is not None else "neither"
            raise ValueError(
                f"give exactly one of complexity_fn (called on each sample) or complexities "
                f"(one number per index); got {given}"
            )
        try:
            n = len(dataset)
        except TypeError as e:
            raise ValueError(
                f"dataset must have a length (a map-style dataset), got {type(dataset).__name__}"
            ) from e

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
        self._cached: Optional[tuple[int, np.ndarray]] = None

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

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch; with ``shuffle=True`` each epoch gets a different order."""
        self.epoch = _check_int("epoch", epoch)

    def __len__(self) -> int:
        return self.num_samples

    def __iter__(self) -> Iterator[int]:
        return iter(self._plan()[:, self.rank].tolist())

    def indices_for_rank(self, rank: int) -> list[int]:
        """The indices rank ``rank`` yields this epoch (for inspection; no communication)."""
        rank = _check_int("rank", rank)
        if not 0 <= rank < self.num_replicas:
            raise ValueError(f"rank must be in [0, num_replicas={self.num_replicas}), got {rank}")
        return self._plan()[:, rank].tolist()

    def _plan(self) -> np.ndarray:
        """This epoch's ``(len(self), num_replicas)`` matrix: ``[j, r]`` is rank r's j-th index.

        Identical on every rank; cached for the current epoch.
        """
        if self._cached is None or self._cached[0] != self.epoch:
            self._cached = (self.epoch, self._make_plan(self.epoch))
        return self._cached[1]

    def _make_plan(self, epoch: int) -> np.ndarray:
        c = self.complexities
        n, width, total = len(c), self.num_replicas, self.total_size
        kept = min(n, total)
        idx_dtype = np.int32 if n < 2**31 else np.int64
        if self.shuffle:
            rng = _epoch_rng(self.seed, epoch, _SAMPLER_STREAM)
            # A random permutation first: equal keys end up in random order, and with
            # drop_last the dropped samples are random ones.
            pool = rng.permutation(n).astype(idx_dtype, copy=False)[:kept]
            keys = c[pool]
            if self.random_level > 0 and self._cmax > self._cmin:
                keys += rng.random(kept) * (self.random_level * (self._cmax - self._cmin))
            else:
                keys = self._sort_keys(keys)
            order = pool[np.argsort(keys, kind="stable")]
            del pool, keys
        else:
            rng = None
            order = np.argsort(self._sort_keys(c[:kept]), kind="stable").astype(idx_dtype, copy=False)
        if total > kept:  # fill the last group with repeats of its own members
            partial = kept % width
            tail = order[kept - partial:]
            order = np.concatenate([order, tail[np.arange(total - kept) % partial]])
        groups = order.reshape(self.num_samples, width)
        if rng is None:
            return groups
        steps = groups[rng.permutation(self.num_samples)]
        rotate = rng.integers(0, width, size=(self.num_samples, 1), dtype=idx_dtype)
        member = (np.arange(width, dtype=idx_dtype) + rotate) % width
        return np.take_along_axis(steps, member, axis=1)


class LoadBalancingDistributedBatchSampler(Sampler[list[int]]):
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
        self._layout: Optional[tuple[int, np.ndarray, Any]] = None

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch of the underlying sampler."""
        self.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.batches_for_rank(self.rank))

    def __len__(self) -> int:
        return len(self.batches_for_rank(self.rank))

    def batches_for_rank(self, rank: int) -> list[list[int]]:
        """The batches rank ``rank`` yields this epoch (computed locally, no communication)."""
        rank = _check_int("rank", rank)
        if not 0 <= rank < self.num_replicas:
            raise ValueError(f"rank must be in [0, num_replicas={self.num_replicas}), got {rank}")
        epoch = self.sampler.epoch
        if self._layout is None or self._layout[0] != epoch:
            plan = self.sampler._plan()
            layout = self._budget_layout(plan) if self.max_complexity is not None else self._fn_layout(plan)
            self._layout = (epoch, plan, layout)
        _, plan, layout = self._layout
        if self.max_complexity is not None:
            rows, bounds = layout
            col = plan[rows, rank].tolist()
            return [col[bounds[i]:bounds[i + 1]] for i in range(len(bounds) - 1)]
        counts = [len(b) for b in layout]
        target = min(counts) if self.drop_last else max(counts)
        own = layout[rank]
        if len(own) < target:
            if not own:
                raise ValueError(
                    f"batch_fn returned no batch for rank {rank} but {target} for another rank; "
                    f"cannot pad to equal batch counts"
                )
            own = own + [own[i % len(own)] for i in range(target - len(own))]
        return own[:target]

    def _budget_layout(self, plan: np.ndarray) -> tuple[np.ndarray, list[int]]:
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
        order = _epoch_rng(self.sampler.seed, self.sampler.epoch, _BATCH_STREAM).permutation(len(bounds) - 1)
        segments = [rows[bounds[i]:bounds[i + 1]] for i in order.tolist()]
        new_bounds = np.concatenate([[0], np.cumsum([len(seg) for seg in segments])]).tolist()
        return np.concatenate(segments), new_bounds

    def _fn_layout(self, plan: np.ndarray) -> list[list[list[int]]]:
        """``batch_fn``'s batches for every rank (before padding or truncating)."""
        out = []
        for r in range(self.num_replicas):
            result = self.batch_fn(plan[:, r].tolist())
            try:
                out.append([list(b) for b in result])
            except TypeError as e:
                raise ValueError(
                    f"batch_fn must return an iterable of batches (lists of indices), got {result!r}"
                ) from e
        return out
