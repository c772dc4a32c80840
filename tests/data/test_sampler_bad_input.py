"""Every bad input to the samplers is a ValueError whose message names the value."""

import math

import numpy as np
import pytest

from bagua.data import LoadBalancingDistributedBatchSampler, LoadBalancingDistributedSampler

DATA = list(range(10))
C = [1.0] * 10


def _sampler(**kw):
    args = dict(complexities=C, num_replicas=2, rank=0)
    args.update(kw)
    return LoadBalancingDistributedSampler(DATA, **args)


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(random_level=1.5), r"random_level must be in \[0, 1\], got 1.5"),
        (dict(random_level=-0.1), r"random_level must be in \[0, 1\], got -0.1"),
        (dict(random_level=math.nan), r"random_level must be in \[0, 1\], got nan"),
        (dict(random_level="0.5"), r"random_level must be a number in \[0, 1\], got '0.5'"),
        (dict(rank=2), r"rank must be in \[0, num_replicas=2\), got 2"),
        (dict(rank=-1), r"rank must be in \[0, num_replicas=2\), got -1"),
        (dict(rank=1.0), r"rank must be an integer, got 1.0"),
        (dict(num_replicas=0, rank=0), r"num_replicas must be >= 1, got 0"),
        (dict(num_replicas=True), r"num_replicas must be an integer, got True"),
        (dict(seed=1.5), r"seed must be an integer, got 1.5"),
        (dict(complexity_fn=len), r"exactly one of complexity_fn .* got both"),
        (dict(complexities=None), r"exactly one of complexity_fn .* got neither"),
        (dict(complexities=[1.0] * 9), r"got 9 for a dataset of length 10"),
        (dict(complexities=[1.0] * 11), r"got 11 for a dataset of length 10"),
        (dict(complexities=[[1.0] * 10]), r"one-dimensional, got shape \(1, 10\)"),
        (dict(complexities=["a"] * 10), r"sequence of numbers, got elements of type <U1 \(first: 'a'\)"),
        (dict(complexities=["3"] * 10), r"sequence of numbers, got elements of type <U1"),
        (dict(complexities=[1, "2"] + [1] * 8), r"sequence of numbers"),
        (dict(complexities=[None] * 10), r"sequence of numbers, got elements of type object"),
        (dict(complexities=[1.0] * 4 + [math.nan] + [1.0] * 5), r"finite; index 4 has complexity nan"),
        (dict(complexities=[1.0] * 7 + [math.inf] + [1.0] * 2), r"finite; index 7 has complexity inf"),
        (dict(complexities=[1.0] * 3 + [-2.0] + [1.0] * 6), r">= 0; index 3 has complexity -2.0"),
    ],
)
def test_sampler_bad_input(kw, match):
    with pytest.raises(ValueError, match=match):
        _sampler(**kw)


def test_complexity_fn_bad_results():
    with pytest.raises(ValueError, match=r"index 3 has complexity -1.0"):
        LoadBalancingDistributedSampler(DATA, complexity_fn=lambda x: -1 if x == 3 else x, num_replicas=1, rank=0)
    with pytest.raises(ValueError, match=r"index 0 it returned 'long'"):
        LoadBalancingDistributedSampler(DATA, complexity_fn=lambda x: "long", num_replicas=1, rank=0)
    with pytest.raises(ValueError, match=r"index 2 has complexity nan"):
        LoadBalancingDistributedSampler(
            DATA, complexity_fn=lambda x: np.nan if x == 2 else 1, num_replicas=1, rank=0
        )
    with pytest.raises(ValueError, match=r"complexity_fn must be callable, got 3"):
        LoadBalancingDistributedSampler(DATA, complexity_fn=3, num_replicas=1, rank=0)


def test_dataset_without_length():
    with pytest.raises(ValueError, match=r"dataset must have a length .* got generator"):
        LoadBalancingDistributedSampler((i for i in range(3)), complexities=[1, 2, 3], num_replicas=1, rank=0)


def test_default_replicas_need_process_group():
    import bagua

    if bagua.is_initialized():
        pytest.skip("a process group is already initialized in this test process")
    with pytest.raises(RuntimeError, match=r"init_process_group"):
        LoadBalancingDistributedSampler(DATA, complexities=C)


def test_set_epoch_and_indices_for_rank_bad_input():
    s = _sampler()
    with pytest.raises(ValueError, match=r"epoch must be an integer, got '1'"):
        s.set_epoch("1")
    with pytest.raises(ValueError, match=r"rank must be in \[0, num_replicas=2\), got 5"):
        s.indices_for_rank(5)


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(), r"exactly one of batch_fn or max_complexity; got neither"),
        (dict(batch_fn=lambda i: [i], max_complexity=4), r"got both"),
        (dict(max_complexity=0), r"finite number > 0, got 0"),
        (dict(max_complexity=-3.0), r"finite number > 0, got -3.0"),
        (dict(max_complexity=math.inf), r"finite number > 0, got inf"),
        (dict(max_complexity="8"), r"max_complexity must be a number > 0, got '8'"),
        (dict(batch_fn=5), r"batch_fn must be callable, got 5"),
    ],
)
def test_batch_sampler_bad_input(kw, match):
    with pytest.raises(ValueError, match=match):
        LoadBalancingDistributedBatchSampler(_sampler(), **kw)


def test_batch_sampler_needs_our_sampler():
    with pytest.raises(ValueError, match=r"LoadBalancingDistributedSampler, got list"):
        LoadBalancingDistributedBatchSampler([1, 2], max_complexity=3)


def test_batch_fn_bad_results():
    bs = LoadBalancingDistributedBatchSampler(_sampler(), batch_fn=lambda idx: 7)
    with pytest.raises(ValueError, match=r"iterable of batches .* got 7"):
        list(bs)
    # Rank 0 gets no batch while rank 1 gets some: cannot pad rank 0.
    bs = LoadBalancingDistributedBatchSampler(
        _sampler(shuffle=False), batch_fn=lambda idx: [] if idx[0] == 0 else [idx]
    )
    with pytest.raises(ValueError, match=r"no batch for rank 0 but 1 for another rank"):
        list(bs)
