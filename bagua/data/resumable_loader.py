"""``ResumableDataLoader``: a DataLoader that tells its bagua sampler what the loop actually received.

A DataLoader with worker processes pulls ``prefetch_factor * num_workers`` batches ahead from
its sampler, so a sampler counting what it yielded is ahead of the training loop; a checkpoint
taken then would skip those batches on resume. This loader counts the batches handed to the loop
instead and reports them to the sampler, whose ``state_dict()`` is then exact.

Example::

    sampler = bagua.data.ElasticDistributedSampler(dataset)
    loader = bagua.data.ResumableDataLoader(dataset, batch_size=32, sampler=sampler, num_workers=4)
    for step, batch in enumerate(loader):
        ...
        if step % 100 == 0:
            bagua.checkpoint.save_checkpoint(path, step=step, model=ddp, optimizers=[opt], sampler=sampler)
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

from torch.utils.data import BatchSampler, DataLoader

from .epoch_progress import ResumableSampler

__all__ = ["ResumableDataLoader"]


class ResumableDataLoader(DataLoader):
    """``torch.utils.data.DataLoader`` (same arguments and behaviour) that reports to its bagua
    sampler how much of the epoch the loop has received, so the sampler's ``state_dict()`` is
    exact even with worker processes prefetching.

    It reports when its sampler is one of bagua's: ``batch_sampler=`` a
    ``LoadBalancingDistributedBatchSampler`` (counted in batches), or ``sampler=`` an
    ``ElasticDistributedSampler`` or ``LoadBalancingDistributedSampler`` (counted in indices: the
    sizes of the batches received, e.g. with ``batch_size=B``). With any other sampler it is a
    plain DataLoader. A loop that runs to the end marks the pass complete, including a last
    partial batch that ``drop_last=True`` left out. Batches must arrive in order
    (``in_order=True``, the default).

    Example::

        >>> ds = list(range(10))
        >>> sampler = ElasticDistributedSampler(ds, num_replicas=1, rank=0, shuffle=False)
        >>> loader = ResumableDataLoader(ds, batch_size=4, sampler=sampler, num_workers=2)
        >>> for batch in loader:
        ...     break
        >>> sampler.state_dict()["position"]            # what the loop got, not what was prefetched
        4
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._progress_target = self._find_progress_target()
        if self._progress_target is not None and self.num_workers > 0 and not getattr(self, "in_order", True):
            raise ValueError(
                "ResumableDataLoader needs in_order=True with worker processes: out-of-order batches "
                "make the received part of the epoch something other than a prefix of the sampler's order"
            )

    def _find_progress_target(self) -> Optional[tuple[ResumableSampler, int]]:
        """The bagua sampler to report to, and how many of its units one received batch is."""
        if isinstance(self.batch_sampler, ResumableSampler):
            return self.batch_sampler, 1
        if isinstance(self.batch_sampler, BatchSampler) and isinstance(self.batch_sampler.sampler, ResumableSampler):
            return self.batch_sampler.sampler, self.batch_sampler.batch_size
        if self.batch_sampler is None and isinstance(self.sampler, ResumableSampler):
            return self.sampler, 1
        return None

    def __iter__(self) -> Iterator[Any]:
        if self._progress_target is None:
            return super().__iter__()
        return self._reporting_iter(*self._progress_target)

    def _reporting_iter(self, sampler: ResumableSampler, units_per_batch: int) -> Iterator[Any]:
        link = sampler._link_loader()
        exhausted = False
        try:
            for received, batch in enumerate(super().__iter__(), start=1):
                link.received(received * units_per_batch)
                yield batch
            exhausted = True
        finally:
            link.close(exhausted)
