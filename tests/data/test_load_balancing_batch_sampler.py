"""LoadBalancingDistributedBatchSampler: equal batch counts, budget, coverage, shuffling."""

import itertools
from collections import Counter

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from bagua.data import LoadBalancingDistributedBatchSampler, LoadBalancingDistributedSampler


def _batch_samplers(c, replicas, *, sampler_kw=None, **kw):
    out = []
    for r in range(replicas):
        s = LoadBalancingDistributedSampler(
            range(len(c)), complexities=c, num_replicas=replicas, rank=r, **(sampler_kw or {})
        )
        out.append(LoadBalancingDistributedBatchSampler(s, **kw))
    return out


def _epoch(bss, epoch):
    for b in bss:
        b.set_epoch(epoch)
    return [list(b) for b in bss]


def _growing(indices):
    """Batches of size 1, 2, 3, ... over consecutive indices (the original Bagua's test)."""
    batches, size, i = [], 1, 0
    while i < len(indices):
        batches.append(list(indices[i:i + size]))
        i += size
        size += 1
    return batches


@pytest.mark.parametrize(
    "n,replicas,drop_last,sampler_drop_last,random_level,budget",
    list(itertools.product((1, 7, 50, 257), (1, 2, 3, 8), (False, True), (False, True), (0.0, 0.5), (10.0, 64.0))),
)
def test_budget_equal_counts_budget_and_coverage(n, replicas, drop_last, sampler_drop_last, random_level, budget):
    c = np.random.default_rng(n + replicas).integers(1, 40, size=n)
    bss = _batch_samplers(
        c, replicas, max_complexity=budget, drop_last=drop_last,
        sampler_kw=dict(drop_last=sampler_drop_last, random_level=random_level),
    )
    for epoch in (0, 1):
        per_rank = _epoch(bss, epoch)
        counts = {len(b) for b in per_rank} | {len(b) for b in bss}
        assert len(counts) == 1, f"ranks disagree on the batch count: {counts}"
        for step in zip(*per_rank):
            sizes = {len(b) for b in step}
            assert len(sizes) == 1, f"ranks got different batch sizes at one step: {sizes}"
            for b in step:
                assert len(b) >= 1
                padded = len(b) * c[b].max()
                assert padded <= budget or len(b) == 1, f"batch over budget: {padded} > {budget}"
        # Same multiset of indices as the sampler's epoch on all ranks (minus dropped oversize).
        samplers = [bs.sampler for bs in bss]
        expected = Counter(itertools.chain.from_iterable(list(s) for s in samplers))
        got = Counter(i for b in itertools.chain.from_iterable(per_rank) for i in b)
        if drop_last:
            assert got <= expected
            assert all(c[i] <= budget for i in got)
        else:
            assert got == expected


def test_budget_batches_are_similar_cost_and_shuffled():
    c = np.random.default_rng(1).lognormal(4.0, 1.0, 20000).round() + 1
    bss = _batch_samplers(c, 4, max_complexity=2048)
    per_rank = _epoch(bss, 0)
    real = sum(c[b].sum() for b in itertools.chain.from_iterable(per_rank))
    padded = sum(len(b) * c[b].max() for b in itertools.chain.from_iterable(per_rank))
    assert real / padded >= 0.9, f"padding efficiency {real / padded:.3f}"
    first_cost = [c[b].max() for b in per_rank[0]]
    assert first_cost != sorted(first_cost), "batches must be shuffled, not in increasing cost"
    assert per_rank != _epoch(bss, 1), "epochs must differ"
    assert per_rank == _epoch(_batch_samplers(c, 4, max_complexity=2048), 0), "same seed and epoch must repeat"


def test_budget_shuffle_false_increasing_cost():
    c = np.random.default_rng(2).integers(1, 100, size=300)
    (bs,) = _batch_samplers(c, 1, max_complexity=200, sampler_kw=dict(shuffle=False))
    flat = [i for b in bs for i in b]
    assert flat == sorted(range(300), key=lambda i: (c[i], i))


def test_budget_oversized_samples():
    c = [1, 1, 1, 1, 50, 60]
    keep = _batch_samplers(c, 2, max_complexity=10, sampler_kw=dict(shuffle=False))
    assert [list(b) for b in keep] == [[[0, 2], [4]], [[1, 3], [5]]]
    drop = _batch_samplers(c, 2, max_complexity=10, drop_last=True, sampler_kw=dict(shuffle=False))
    assert [list(b) for b in drop] == [[[0, 2]], [[1, 3]]]


def test_batch_fn_growing_sizes_like_original_bagua():
    total_batch = 5
    n = sum(range(1, total_batch + 1))
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(0))
    dataset = TensorDataset(torch.randn(n, 2), perm)
    s = LoadBalancingDistributedSampler(dataset, complexity_fn=lambda x: x[1], num_replicas=1, rank=0, shuffle=False)
    loader = DataLoader(dataset, batch_sampler=LoadBalancingDistributedBatchSampler(s, batch_fn=_growing))
    cur = 0
    for i, (_, cost) in enumerate(loader):
        assert len(cost) == i + 1
        assert cost.tolist() == list(range(cur, cur + i + 1))
        cur += i + 1
    assert i == total_batch - 1


@pytest.mark.parametrize("n,replicas,drop_last", list(itertools.product((3, 20, 101), (1, 2, 4, 5), (False, True))))
def test_batch_fn_equal_counts(n, replicas, drop_last):
    c = np.random.default_rng(n).integers(0, 9, size=n)
    # A batch_fn whose batch count depends on the indices: different per rank.
    def by_parity(indices):
        return [[i] for i in indices if i % 2 == 0] + [[i for i in indices if i % 2]]

    bss = _batch_samplers(c, replicas, batch_fn=by_parity, drop_last=drop_last)
    for epoch in (0, 1):
        per_rank = _epoch(bss, epoch)
        raw = [len(by_parity(bs.sampler.indices_for_rank(r))) for r, bs in enumerate(bss)]
        assert {len(b) for b in per_rank} == {min(raw) if drop_last else max(raw)}
        for r, batches in enumerate(per_rank):
            own = by_parity(bss[r].sampler.indices_for_rank(r))
            assert batches[: len(own)] == own[: len(batches)]  # own batches first, then repeats
            assert all(b in own for b in batches)


def test_dataloader_with_budget_batches():
    lengths = np.random.default_rng(5).integers(1, 30, size=200)
    data = [torch.ones(int(k)) for k in lengths]

    def pad(batch):
        return torch.nn.utils.rnn.pad_sequence(batch, batch_first=True)

    s = LoadBalancingDistributedSampler(data, complexities=lengths, num_replicas=2, rank=1)
    bs = LoadBalancingDistributedBatchSampler(s, max_complexity=120)
    shapes = [x.shape for x in DataLoader(data, batch_sampler=bs, collate_fn=pad)]
    assert len(shapes) == len(bs)
    assert all(b * t <= 120 for b, t in shapes)
    assert sum(b for b, _ in shapes) == len(s)
