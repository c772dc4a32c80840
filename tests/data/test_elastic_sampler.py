"""ElasticDistributedSampler: never resumed, it is torch's DistributedSampler, index for index."""

import itertools

import pytest
from torch.utils.data import DataLoader, DistributedSampler

from bagua.data import ElasticDistributedSampler


@pytest.mark.parametrize("n,replicas,shuffle,drop_last", list(itertools.product(
    (0, 1, 5, 16, 33), (1, 2, 3, 8), (True, False), (False, True))))
def test_same_as_torch(n, replicas, shuffle, drop_last):
    for rank in range(replicas):
        ours = ElasticDistributedSampler(range(n), num_replicas=replicas, rank=rank, shuffle=shuffle, seed=7,
                                         drop_last=drop_last)
        ref = DistributedSampler(range(n), num_replicas=replicas, rank=rank, shuffle=shuffle, seed=7,
                                 drop_last=drop_last)
        for epoch in (0, 1, 5):
            ours.set_epoch(epoch)
            ref.set_epoch(epoch)
            assert list(ours) == list(ref), (rank, epoch)
            assert len(ours) == len(ref) == ours.num_samples == ref.num_samples
            assert ours.total_size == ref.total_size
        assert list(ours) == list(ours), "a second pass of the same epoch repeats it"


def test_defaults_and_attributes_like_torch():
    s = ElasticDistributedSampler(list(range(10)), num_replicas=3, rank=2)
    ref = DistributedSampler(list(range(10)), num_replicas=3, rank=2)
    for name in ("num_replicas", "rank", "epoch", "shuffle", "seed", "drop_last", "num_samples", "total_size"):
        assert getattr(s, name) == getattr(ref, name), name
    s.set_epoch(4)
    assert s.epoch == 4
    assert s.indices_for_rank(2) == list(s)


def test_in_a_dataloader_like_torch():
    data = list(range(23))
    ours = DataLoader(data, batch_size=4, sampler=ElasticDistributedSampler(data, num_replicas=2, rank=1, seed=3))
    ref = DataLoader(data, batch_size=4, sampler=DistributedSampler(data, num_replicas=2, rank=1, seed=3))
    assert [b.tolist() for b in ours] == [b.tolist() for b in ref]


@pytest.mark.parametrize("kw,match", [
    (dict(num_replicas=2, rank=2), r"rank must be in \[0, num_replicas=2\), got 2"),
    (dict(num_replicas=0, rank=0), r"num_replicas must be >= 1, got 0"),
    (dict(num_replicas=2, rank=0, seed="1"), r"seed must be an integer, got '1'"),
])
def test_bad_input(kw, match):
    with pytest.raises(ValueError, match=match):
        ElasticDistributedSampler(range(4), **kw)


def test_dataset_without_length_and_defaults_need_process_group():
    import bagua

    with pytest.raises(ValueError, match=r"dataset must have a length .* got generator"):
        ElasticDistributedSampler((i for i in range(3)), num_replicas=1, rank=0)
    if bagua.is_initialized():
        pytest.skip("a process group is already initialized in this test process")
    with pytest.raises(RuntimeError, match=r"init_process_group"):
        ElasticDistributedSampler(range(4))
