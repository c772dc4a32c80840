"""``ElasticDistributedSampler``: torch's ``DistributedSampler``, resumable mid-epoch at any world size.

Until resumed it yields exactly what ``torch.utils.data.DistributedSampler`` yields (same seed,
epoch, shuffle, padding and dropping). ``state_dict()`` records the epoch's progress;
``load_state_dict()`` continues each rank's order at the same world size, and at another one
deals the samples not consumed yet to the new ranks (see ``epoch_progress``).

Example::

    sampler = bagua.data.ElasticDistributedSampler(dataset, shuffle=True, seed=0)
    loader = bagua.data.ResumableDataLoader(dataset, batch_size=32, sampler=sampler, num_workers=4)
    if checkpoint:
        sampler.load_state_dict(checkpoint["sampler"])
    for epoch in range(sampler.epoch, epochs):
        sampler.set_epoch(epoch)
        for batch in loader:
            ...
"""

from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np
import torch

from .epoch_progress import SAMPLER_STREAM, ResumableIndexSampler, Segment, check_int, dataset_length, epoch_rng, replicas_and_rank

__all__ = ["ElasticDistributedSampler"]


class ElasticDistributedSampler(ResumableIndexSampler):
    """A drop-in for ``torch.utils.data.DistributedSampler`` that resumes mid-epoch, at any world size.

    Same arguments, ``set_epoch``, ``len()`` and order as torch's: with ``shuffle`` a permutation
    seeded by ``seed + epoch``, padded by repeating its first indices to a multiple of
    ``num_replicas`` (or its tail dropped with ``drop_last``), rank ``r`` taking every
    ``num_replicas``-th index from ``r``. ``state_dict()``/``load_state_dict()`` save and resume
    the epoch's progress. Resumed at the saved world size, each rank yields the rest of its order;
    at another one, the samples no rank consumed are permuted (seeded by seed, epoch and segment;
    increasing without ``shuffle``) and dealt the same way, padded or dropped to equal counts.
    Use ``ResumableDataLoader`` when the loader has worker processes (it counts what the loop
    received; alone, the sampler counts what it yielded, which prefetching makes more).

    Args:
        dataset: a map-style dataset (only ``len(dataset)`` is used).
        num_replicas: number of ranks; default ``bagua.get_world_size()``.
        rank: this rank in ``[0, num_replicas)``; default ``bagua.get_rank()``.
        shuffle: a new permutation each epoch (call ``set_epoch`` before each epoch).
        seed: base seed, identical on every rank.
        drop_last: drop the tail instead of padding.

    Example::

        >>> s = ElasticDistributedSampler(range(5), num_replicas=2, rank=0, shuffle=False)
        >>> list(s)
        [0, 2, 4]
        >>> it = iter(s); next(it)
        0
        >>> state = s.state_dict()                      # rank 0's: 1 index per rank consumed
        >>> t = ElasticDistributedSampler(range(5), num_replicas=1, rank=0, shuffle=False)
        >>> t.load_state_dict(state); list(t)           # 0 and 1 were consumed
        [2, 3, 4]
    """

    _state_kind = "ElasticDistributedSampler"

    def __init__(
        self,
        dataset: Any,
        num_replicas: Optional[int] = None,
        rank: Optional[int] = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        num_replicas, rank = replicas_and_rank(num_replicas, rank)
        n = dataset_length(dataset)
        self.dataset = dataset
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = bool(shuffle)
        self.seed = check_int("seed", seed)
        self.drop_last = bool(drop_last)
        self.epoch = 0
        self.num_samples = n // num_replicas if self.drop_last else math.ceil(n / num_replicas)
        self.total_size = self.num_samples * num_replicas
        self._dataset_length = n

    def _identity(self) -> tuple[int, int, dict[str, Any]]:
        return self._dataset_length, self.seed, {"shuffle": self.shuffle, "drop_last": self.drop_last}

    def _make_plan(self, segment: Segment) -> np.ndarray:
        order = segment.remaining()
        if order is None:  # the whole epoch: torch's permutation
            if self.shuffle:
                g = torch.Generator()
                g.manual_seed(self.seed + segment.epoch)
                order = torch.randperm(self._dataset_length, generator=g).numpy()
            else:
                order = np.arange(self._dataset_length)
        elif self.shuffle:
            order = order[epoch_rng(self.seed, segment.epoch, SAMPLER_STREAM, segment.index).permutation(len(order))]
        width, n = segment.num_replicas, len(order)
        steps = n // width if self.drop_last else math.ceil(n / width)
        if steps * width != n:  # pad by cycling from the start, as torch does, or drop the tail
            order = order[np.arange(steps * width) % n]
        return order.reshape(steps, width)
