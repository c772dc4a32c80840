"""The original ``bagua.torch_api.contrib.load_balancing_data_loader``: the load-balanced samplers
with the original's signatures, over ``bagua.data``.

Each step every rank gets a sample of nearly the same complexity (as the original); which rank
gets which member of a group, the shuffled order and the padding are the native sampler's, so
the indices differ from the original's.

Example::

    from bagua.torch_api.contrib import LoadBalancingDistributedSampler, LoadBalancingDistributedBatchSampler
    sampler = LoadBalancingDistributedSampler(dataset, complexity_fn=lambda sample: len(sample[0]))
    batch_sampler = LoadBalancingDistributedBatchSampler(sampler, batch_fn=make_batches)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=batch_sampler)
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional

from bagua import data

__all__ = ["LoadBalancingDistributedSampler", "LoadBalancingDistributedBatchSampler"]


class LoadBalancingDistributedSampler(data.LoadBalancingDistributedSampler):
    """``bagua.data.LoadBalancingDistributedSampler`` with the original's positional arguments.

    Args:
        dataset: the map-style dataset.
        complexity_fn: called on each sample; returns its complexity (a number).
        num_replicas: default the world size.
        rank: default this rank.
        shuffle: as torch's ``DistributedSampler``.
        seed: as torch's ``DistributedSampler``.
        drop_last: as torch's ``DistributedSampler``.
        random_level: in [0, 1]; 0 balances best, larger values mix complexities more.

    Example::

        sampler = LoadBalancingDistributedSampler(dataset, lambda x: x[1], num_replicas=2, rank=0)
        sampler.set_epoch(epoch)
    """

    def __init__(
        self,
        dataset: Any,
        complexity_fn: Callable[..., int],
        num_replicas: Optional[int] = None,
        rank: Optional[int] = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        random_level: float = 0,
    ) -> None:
        super().__init__(dataset, complexity_fn=complexity_fn, num_replicas=num_replicas, rank=rank,
                         shuffle=shuffle, seed=seed, drop_last=drop_last, random_level=random_level)

    def shuffle_chunks(self) -> tuple[List[List[int]], List[int]]:
        """This epoch's plan as the original returned it: ``(index_chunks, chunk_indices)``, where
        rank ``r`` yields ``[index_chunks[i][r] for i in chunk_indices]``.

        Example::

            chunks, order = sampler.shuffle_chunks()
            assert [chunks[i][sampler.rank] for i in order] == list(sampler)
        """
        per_rank = [self.indices_for_rank(r) for r in range(self.num_replicas)]
        return [list(chunk) for chunk in zip(*per_rank)], list(range(self.num_samples))


class LoadBalancingDistributedBatchSampler(data.LoadBalancingDistributedBatchSampler):
    """``bagua.data.LoadBalancingDistributedBatchSampler`` with the original's positional arguments.

    Args:
        sampler: a :class:`LoadBalancingDistributedSampler`.
        batch_fn: ``batch_fn(indices) -> list of batches``, called on every rank's indices.
        drop_last: True stops every rank at the fewest batches of any rank; False pads every rank
            to the most by repeating its first batches.

    Example::

        eights = lambda ix: [ix[i:i + 8] for i in range(0, len(ix), 8)]
        batches = LoadBalancingDistributedBatchSampler(sampler, batch_fn=eights)
        batches.set_epoch(epoch)
    """

    def __init__(self, sampler: LoadBalancingDistributedSampler, batch_fn: Callable[[List[int]], List[List[int]]],
                 drop_last: bool = False) -> None:
        super().__init__(sampler, batch_fn=batch_fn, drop_last=drop_last)

    def generate_batches(self) -> List[List[List[int]]]:
        """Every rank's batches of this epoch, padded or cut to the same count (index ``r``: rank ``r``'s).

        Example::

            assert batch_sampler.generate_batches()[batch_sampler.rank] == list(batch_sampler)
        """
        return [self.batches_for_rank(r) for r in range(self.num_replicas)]
