"""Resuming the samplers mid-epoch: at the same world size (bit-exact continuation), at another
one (nothing consumed is repeated, nothing left is lost), across epoch boundaries, under a
ResumableDataLoader with worker processes, and bad states.

Ranks are simulated in one process: one sampler per rank with explicit num_replicas and rank, all
stepped in lockstep; rank 0's state is the one saved and loaded on every rank.
"""

import io
import itertools
import math

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from bagua.data import (
    ElasticDistributedSampler, LoadBalancingDistributedBatchSampler, LoadBalancingDistributedSampler,
    ResumableDataLoader,
)

N = 61  # prime: every world size pads (or drops)
C = np.random.default_rng(0).integers(1, 20, size=N).astype(float)
OVERSIZED = (5, 17)
C[list(OVERSIZED)] = 50.0  # over BUDGET: a batch of its own, or its group dropped with drop_last
BUDGET = 40.0
KINDS = ("elastic", "lb", "budget", "fn")


def _cut_after_multiples_of_5(indices):
    """A deterministic batch_fn whose batch count differs between ranks."""
    batches, current = [], []
    for i in indices:
        current.append(i)
        if i % 5 == 0:
            batches.append(current)
            current = []
    return batches + ([current] if current else [])


def _make(kind, replicas, shuffle=True, drop_last=False, seed=0, n=N):
    """One sampler per rank."""
    out = []
    for rank in range(replicas):
        if kind == "elastic":
            out.append(ElasticDistributedSampler(range(n), num_replicas=replicas, rank=rank, shuffle=shuffle,
                                                 seed=seed, drop_last=drop_last))
            continue
        s = LoadBalancingDistributedSampler(range(n), complexities=C[:n], num_replicas=replicas, rank=rank,
                                            shuffle=shuffle, seed=seed, drop_last=drop_last)
        if kind == "budget":
            s = LoadBalancingDistributedBatchSampler(s, max_complexity=BUDGET, drop_last=drop_last)
        elif kind == "fn":
            s = LoadBalancingDistributedBatchSampler(s, batch_fn=_cut_after_multiples_of_5, drop_last=drop_last)
        out.append(s)
    return out


def _whole(samplers, epoch):
    for s in samplers:
        s.set_epoch(epoch)
    return [list(s) for s in samplers]


def _samples(units):
    """Sample indices of a list of units (indices, or batches of indices)."""
    return [i for u in units for i in ([u] if isinstance(u, int) else u)]


def _same_state(a, b):
    return a.keys() == b.keys() and all(
        np.array_equal(a[k], b[k]) if isinstance(a[k], np.ndarray) else a[k] == b[k] for k in a
    )


def _lockstep_state(samplers):
    """Rank 0's state, after checking that every rank's is the same."""
    states = [s.state_dict() for s in samplers]
    assert all(_same_state(s, states[0]) for s in states), "ranks disagree on the progress"
    return states[0]


@pytest.mark.parametrize("kind,shuffle,drop_last,replicas",
                         list(itertools.product(KINDS, (True, False), (False, True), (1, 3))))
def test_same_world_resume_equals_uninterrupted(kind, shuffle, drop_last, replicas):
    cfg = dict(shuffle=shuffle, drop_last=drop_last)
    full = _whole(_make(kind, replicas, **cfg), epoch=2)
    length = len(full[0])
    for cut in sorted({0, 1, length // 2, length - 1, length}):
        first = _make(kind, replicas, **cfg)
        for s in first:
            s.set_epoch(2)
        taken = [list(itertools.islice(iter(s), cut)) for s in first]
        state = _lockstep_state(first)
        assert state["position"] == cut and state["num_replicas"] == replicas and state["segment"] == 0
        for rank, s in enumerate(_make(kind, replicas, **cfg)):
            s.load_state_dict(state)
            if cut == length:
                assert s.epoch == 3 and taken[rank] == full[rank], "a finished epoch resumes at the next one"
                continue
            assert s.epoch == 2
            s.set_epoch(2)  # the resumed loop's set_epoch at the top of the epoch keeps the resume
            assert taken[rank] + list(s) == full[rank], f"rank {rank}, cut {cut}"
            assert list(s) == full[rank], "the pass after the resumed one is the whole epoch"


def _run_chain(kind, chain, shuffle, drop_last, epoch=1):
    """Run one epoch through restarts: ``chain`` is ``(world size, fraction of what is left to
    consume before the next restart)``, None: to the end. Returns [(world size, samples consumed
    on all ranks)] per segment (runs at the world size of the run before continue its segment)."""
    cfg = dict(shuffle=shuffle, drop_last=drop_last)
    state, segments = None, {}
    for replicas, fraction in chain:
        samplers, probes = _make(kind, replicas, **cfg), _make(kind, replicas, **cfg)
        for s in samplers + probes:
            if state is not None:
                s.load_state_dict(state)
            s.set_epoch(epoch)
        rest = [list(p) for p in probes]
        assert len({len(r) for r in rest}) == 1, f"ranks got different counts: {[len(r) for r in rest]}"
        if kind == "budget":
            for step in zip(*rest):
                assert len({len(b) for b in step}) == 1, "ranks got different batch sizes at one step"
        cut = len(rest[0]) if fraction is None else int(fraction * len(rest[0]))
        taken = [list(itertools.islice(iter(s), cut)) for s in samplers]
        assert taken == [r[:cut] for r in rest]
        state = _lockstep_state(samplers)
        world, samples = segments.setdefault(state["segment"], (replicas, []))
        assert world == replicas
        samples.extend(_samples(itertools.chain.from_iterable(taken)))
    return list(segments.values())


CHAINS = [((2, 0.4), (1, None)), ((2, 0.5), (3, None)), ((3, 0.3), (2, 0.5), (4, None)),
          ((3, 0.5), (3, 0.5), (1, 0.0), (2, 0.7), (2, None))]


@pytest.mark.parametrize("kind,chain,shuffle,drop_last",
                         list(itertools.product(KINDS, CHAINS, (True, False), (False, True))))
def test_other_world_resume_loses_and_repeats_nothing(kind, chain, shuffle, drop_last):
    """Across segments (parts of the epoch planned at one world size) nothing repeats; inside
    one, only the padding its plan has, as torch's sampler; drops happen in the last one only."""
    runs = _run_chain(kind, chain, shuffle, drop_last)
    assert len(runs) == 1 + sum(a[0] != b[0] for a, b in zip(chain, chain[1:]))
    sets = [set(samples) for _, samples in runs]
    for a, b in itertools.combinations(sets, 2):
        assert not a & b, f"samples consumed before a restart were yielded again: {sorted(a & b)}"
    covered = set().union(*sets)
    left = N - len(set().union(*sets[:-1]))  # what the last segment started with
    last_world, last = runs[-1]
    if drop_last:
        assert all(len(s) == len(set(s)) for _, s in runs), "drop_last must not repeat a sample"
    if kind in ("elastic", "lb", "budget") and not drop_last:
        assert covered == set(range(N))
        # Repeats only as padding: at most world - 1 per run; the last run pads exactly like torch.
        assert len(last) == math.ceil(left / last_world) * last_world
        assert all(len(s) - len(set(s)) <= w - 1 for w, s in runs)
    elif kind in ("elastic", "lb"):
        assert len(covered) == N - left % last_world, "only the last run's remainder is dropped"
    elif kind == "budget":
        missing = set(range(N)) - covered
        assert set(OVERSIZED) <= missing, "oversized samples are dropped with drop_last"
        assert len(missing) <= left % last_world + last_world * len(OVERSIZED)
    elif not drop_last:  # batch_fn: ranks pad with their own batches
        assert covered == set(range(N))


@pytest.mark.parametrize("shuffle", (True, False))
def test_other_world_resume_stays_load_balanced(shuffle):
    first = _make("lb", 2, shuffle=shuffle)
    for s in first:
        s.set_epoch(0)
        list(itertools.islice(iter(s), 10))
    rest = []
    for s in _make("lb", 3, shuffle=shuffle):
        s.load_state_dict(first[0].state_dict())
        rest.append(list(s))
    steps = C[np.asarray(rest).T]  # (steps, ranks) complexities
    assert (steps.max(1) - steps.min(1)).mean() <= 1.0, "a resumed step mixes samples of different cost"
    if not shuffle:
        assert all(np.all(np.diff(C[r]) >= 0) for r in rest), "unshuffled: increasing complexity"


def test_elastic_unshuffled_resume_at_another_world_size_is_explicit():
    first = _make("elastic", 2, shuffle=False, n=10)  # rank 0: 0 2 4 6 8, rank 1: 1 3 5 7 9
    for s in first:
        list(itertools.islice(iter(s), 2))  # consumed 0 1 2 3
    later = _make("elastic", 3, shuffle=False, n=10)
    for s in later:
        s.load_state_dict(first[0].state_dict())
    state = later[0].state_dict()
    assert (state["num_replicas"], state["segment"], state["position"]) == (3, 1, 0)
    assert np.unpackbits(state["consumed_before"])[:10].tolist() == [1, 1, 1, 1, 0, 0, 0, 0, 0, 0]
    assert [list(s) for s in later] == [[4, 7], [5, 8], [6, 9]]
    assert later[0].state_dict()["position"] == 2


@pytest.mark.parametrize("kind", KINDS)
def test_epoch_boundaries(kind):
    first = _make(kind, 2)
    _whole(first, 3)
    done = _lockstep_state(first)
    assert done["epoch"] == 3 and done["position"] == len(first[0]), "a finished pass is complete"
    for replicas in (2, 3):
        later = _make(kind, replicas)
        for s in later:
            s.load_state_dict(done)
            assert s.epoch == 4, "a finished epoch resumes at the start of the next one"
            assert (s.state_dict()["epoch"], s.state_dict()["position"]) == (4, 0)
        assert [list(s) for s in later] == _whole(_make(kind, replicas), 4), "the next epoch is whole"
    # Before iterating, a new epoch's state is its start.
    first[0].set_epoch(5)
    assert (first[0].state_dict()["epoch"], first[0].state_dict()["position"]) == (5, 0)


@pytest.mark.parametrize("kind", KINDS)
def test_set_epoch_to_another_epoch_abandons_the_resume(kind):
    first = _make(kind, 2)
    for s in first:
        s.set_epoch(1)
        list(itertools.islice(iter(s), 3))
    state = _lockstep_state(first)
    s = _make(kind, 2)[0]
    s.load_state_dict(state)
    assert _same_state(s.state_dict(), state), "a loaded, not yet iterated state saves as it was"
    s.set_epoch(1)
    s.set_epoch(2)
    assert list(s) == _whole(_make(kind, 2), 2)[0]
    s.load_state_dict(state)
    s.set_epoch(1)
    assert list(s) == _whole(_make(kind, 2), 1)[0][3:]


def test_state_survives_torch_save():
    first = _make("budget", 3)
    for s in first:
        list(itertools.islice(iter(s), 2))
    middle = _make("budget", 2)
    for s in middle:
        s.load_state_dict(first[0].state_dict())
        list(itertools.islice(iter(s), 1))
    state = middle[0].state_dict()
    assert state["segment"] == 1 and state["consumed_before"].dtype == np.uint8
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    a, b = _make("budget", 2)[1], _make("budget", 2)[1]
    a.load_state_dict(state)
    b.load_state_dict(loaded)
    assert list(a) == list(b) and len(list(itertools.chain(a))) > 0


DATA = list(range(N))


def _break_after(loader, batches):
    got = []
    for k, batch in enumerate(loader, start=1):
        got.append(batch.tolist())
        if k == batches:
            break
    return got


@pytest.mark.parametrize("kind", ("elastic", "lb"))
def test_loader_with_workers_counts_what_the_loop_received(kind):
    plain, resumable, uninterrupted = (_make(kind, 2)[0] for _ in range(3))
    _break_after(DataLoader(DATA, batch_size=4, sampler=plain, num_workers=2), 3)
    assert plain.state_dict()["position"] > 12, "prefetching: the sampler alone counts more than received"
    got = _break_after(ResumableDataLoader(DATA, batch_size=4, sampler=resumable, num_workers=2), 3)
    state = resumable.state_dict()
    assert state["position"] == 12
    resumed = _make(kind, 2)[0]
    resumed.load_state_dict(state)
    assert _samples(got) + list(resumed) == list(uninterrupted)


def test_loader_with_workers_counts_batches_of_a_batch_sampler():
    plain, resumable, uninterrupted = (_make("budget", 2)[0] for _ in range(3))
    assert len(plain) > 8
    _break_after(DataLoader(DATA, batch_sampler=plain, num_workers=2), 3)
    assert plain.state_dict()["position"] > 3
    got = _break_after(ResumableDataLoader(DATA, batch_sampler=resumable, num_workers=2), 3)
    assert resumable.state_dict()["position"] == 3
    resumed = _make("budget", 2)[0]
    resumed.load_state_dict(resumable.state_dict())
    assert got + list(resumed) == list(uninterrupted)


def test_plain_loader_without_workers_is_exact():
    s = _make("elastic", 2)[0]
    _break_after(DataLoader(DATA, batch_size=4, sampler=s), 3)
    assert s.state_dict()["position"] == 12


def test_loader_run_to_the_end_completes_the_pass():
    s = _make("elastic", 1)[0]
    batches = list(ResumableDataLoader(DATA, batch_size=4, drop_last=True, sampler=s, num_workers=2))
    assert len(batches) == N // 4
    assert s.state_dict()["position"] == N, "the tail that drop_last left out is not left for a resume"
    t = _make("elastic", 3)[0]
    t.load_state_dict(s.state_dict())
    assert t.epoch == 1 and list(t) == _whole(_make("elastic", 3), 1)[0], "the next epoch, whole"


def test_loader_with_other_samplers_is_a_dataloader():
    ours = ResumableDataLoader(DATA, batch_size=5, shuffle=True, generator=torch.Generator().manual_seed(1))
    ref = DataLoader(DATA, batch_size=5, shuffle=True, generator=torch.Generator().manual_seed(1))
    assert [b.tolist() for b in ours] == [b.tolist() for b in ref]
    with pytest.raises(ValueError, match=r"in_order=True"):
        ResumableDataLoader(DATA, batch_size=4, sampler=_make("lb", 1)[0], num_workers=2, in_order=False)


def _mid_state(kind="elastic", **kw):
    s = _make(kind, 2, **kw)[0]
    list(itertools.islice(iter(s), 2))
    return s.state_dict()


def _changed(**changes):
    state = _mid_state()
    state.update(changes)
    return state


@pytest.mark.parametrize("state,match", [
    (lambda: _mid_state("lb"), r"from 'LoadBalancingDistributedSampler', cannot load it into 'ElasticDistributedSampler'"),
    (lambda: _mid_state("budget"), r"from 'LoadBalancingDistributedBatchSampler'"),
    (lambda: _changed(dataset_length=62), r"dataset of 62 samples, this sampler's dataset has 61"),
    (lambda: _mid_state(seed=1), r"saved with seed 1, this sampler has seed 0"),
    (lambda: _mid_state(shuffle=False), r"saved with shuffle=False, this sampler has shuffle=True"),
    (lambda: [1, 2], r"must be the dict from state_dict\(\), got list"),
    (lambda: _changed(format="other/1"), r"not a bagua sampler state: format 'other/1'"),
    (lambda: {k: v for k, v in _mid_state().items() if k != "position"}, r"missing keys \['position'\]"),
    (lambda: _changed(position=-1), r"corrupt sampler state: position must be >= 0, got -1"),
    (lambda: _changed(position=999), r"position 999 is past the end of segment 0 \(31 units"),
    (lambda: _changed(epoch="1"), r"corrupt sampler state: epoch must be an integer, got '1'"),
    (lambda: _changed(consumed_before=np.zeros(8, np.uint8)), r"segment 0 has nothing consumed before it"),
    (lambda: _changed(segment=1), r"consumed_before must be a uint8 array of shape \(8,\) .* got None"),
    (lambda: _changed(segment=1, consumed_before=np.full(8, 255, np.uint8)), r"flags set past the dataset's 61"),
])
def test_bad_states(state, match):
    s = _make("elastic", 2)[0]
    with pytest.raises(ValueError, match=match):
        s.load_state_dict(state())


@pytest.mark.parametrize("kind", KINDS)
def test_the_elastic_recipe_resume_loop_trains_every_sample_once_per_epoch(kind):
    """The loop of docs/elastic.md's recipe, ``for epoch in range(sampler.epoch, epochs)``, resumed from a
    state saved mid-epoch and from one saved when an epoch had just ended: no epoch is entered
    twice and every sample is trained once per epoch, as in the uninterrupted run."""
    def train(samplers, epochs, stop_after=None):
        seen, units = {}, 0
        for epoch in range(samplers[0].epoch, epochs):
            for s in samplers:
                s.set_epoch(epoch)
            seen[epoch] = []  # entered (and evaluated, and saved, in a real loop)
            for step in zip(*samplers):
                seen[epoch].extend(_samples(step))
                units += 1
                if units == stop_after:
                    return seen, _lockstep_state(samplers)
        return seen, None

    uninterrupted, _ = train(_make(kind, 2), 3)
    per_epoch = len(_whole(_make(kind, 2), 0)[0])  # units (indices or batches) per rank in epoch 0
    for stop_after in (per_epoch // 2, per_epoch):  # mid-epoch, and at the end of epoch 0
        first, state = train(_make(kind, 2), 3, stop_after)
        resumed = _make(kind, 2)
        for s in resumed:
            s.load_state_dict(state)
        rest, _ = train(resumed, 3)
        assert min(rest) == (1 if stop_after == per_epoch else 0), "a finished epoch is not entered again"
        for epoch in range(3):
            assert sorted(first.get(epoch, []) + rest.get(epoch, [])) == sorted(uninterrupted[epoch])
