"""QAdamOptimizer's variance after warm-up: tracked from the averaged momentum (8 bits), refreshed
on 8-bit steps at doubling intervals (1 bit), or frozen; the same on every rank."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import bagua
from bagua.algorithms.q_adam import refreshes_variance
from tests.harness import run_ranks
from tests.parallel.models import make_model, rank_batches

pytestmark = pytest.mark.xdist_group("qadam_variance")  # its module-scoped jobs run once, on one worker

WARMUP = 3
STEPS = 40


def _variance(opt) -> torch.Tensor:
    return torch.cat([opt.state[p]["exp_avg_sq"].reshape(-1) for g in opt.param_groups for p in g["params"]]).clone()


def _run(rank: int, bits: int, variance: str) -> dict:
    model = make_model(width=256)  # several codec blocks per tensor
    opt = bagua.optim.QAdamOptimizer(model.parameters(), lr=0.01, warmup_steps=WARMUP, variance=variance)
    # overlap=False: no step sends a speculation's verdict, so each step's bytes are its momentum's alone
    ddp = bagua.DistributedDataParallel(model, [opt], bagua.algorithms.QAdamAlgorithm(opt, bits=bits, overlap=False))
    sent, changed, variances = [], [], []
    for x, y in rank_batches(rank, STEPS):
        before = _variance(opt)
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
        sent.append(ddp.bytes_sent_this_step)
        changed.append(not torch.equal(before, _variance(opt)))
        variances.append(_variance(opt))
    ddp.close()
    return dict(sent=sent, changed=changed, variances=variances, updates=opt.variance_updates)


def _reference_variances(steps: int) -> list[torch.Tensor]:
    """Adam (a QAdamOptimizer alone tracks its variance as Adam does) on the exact mean of the two
    ranks' gradients: the variance the ranks' averaged momenta imply."""
    model = make_model(width=256)
    opt = bagua.optim.QAdamOptimizer(model.parameters(), lr=0.01, warmup_steps=WARMUP)
    out = []
    for pair in zip(rank_batches(0, steps), rank_batches(1, steps)):
        grads = []
        for x, y in pair:
            model.zero_grad()
            F.cross_entropy(model(x), y).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for p, gs in zip(model.parameters(), zip(*grads)):
            p.grad = (gs[0] + gs[1]) / 2
        opt.step()
        out.append(_variance(opt))
    return out


@pytest.fixture(scope="module")
def runs() -> dict:
    return {(bits, variance): run_ranks(_run, 2, bits, variance, timeout=180)
            for bits, variance in ((8, "tracked"), (1, "tracked"), (8, "frozen"))}


def test_tracked_variance_follows_adam_on_the_averaged_gradients(runs):
    ranks = runs[(8, "tracked")]
    assert all(torch.equal(a, b) for a, b in zip(ranks[0]["variances"], ranks[1]["variances"]))  # every rank alike
    assert all(ranks[0]["changed"]) and ranks[0]["updates"] == STEPS  # every step updated it
    reference = _reference_variances(STEPS)
    for step in (WARMUP + 1, WARMUP + 5, STEPS - 1):  # within the 8-bit momentum's error of Adam's
        ours, theirs = ranks[0]["variances"][step], reference[step]
        assert (ours - theirs).norm() < 0.1 * theirs.norm(), step
    frozen = runs[(8, "frozen")][0]["variances"]
    # the frozen one does not follow: its variance is the warm-up's, far from Adam's by the end
    assert (frozen[-1] - reference[-1]).norm() > 3 * (ranks[0]["variances"][-1] - reference[-1]).norm()


def test_frozen_variance_stays_as_warm_up_left_it(runs):
    for r in runs[(8, "frozen")]:
        assert r["changed"] == [True] * WARMUP + [False] * (STEPS - WARMUP)  # the floor after warm-up: step WARMUP
        assert r["updates"] == WARMUP


def test_one_bit_refreshes_the_variance_on_the_same_8_bit_steps_on_every_rank(runs):
    r0, r1 = runs[(1, "tracked")]
    assert r0["sent"] == r1["sent"] and r0["changed"] == r1["changed"]
    assert all(torch.equal(a, b) for a, b in zip(r0["variances"], r1["variances"]))
    refresh = [step < WARMUP or refreshes_variance(step + 1 - WARMUP) for step in range(STEPS)]
    assert r0["changed"] == refresh and sum(refresh[WARMUP:]) >= 10
    one_bit = [s for s, fresh in zip(r0["sent"][WARMUP:], refresh[WARMUP:]) if not fresh]
    eight_bit = [s for s, fresh in zip(r0["sent"][WARMUP:], refresh[WARMUP:]) if fresh]
    assert len(set(one_bit)) == 1 and len(set(eight_bit)) == 1 and eight_bit[0] > 5 * one_bit[0]
    assert r0["updates"] == sum(refresh)


def test_the_refresh_schedule_doubles_its_interval_up_to_32():
    steps = [s for s in range(1, 2000) if refreshes_variance(s)]
    gaps = [b - a for a, b in zip(steps, steps[1:])]
    assert steps[:3] == [2, 4, 6] and gaps[:15] == [2] * 15 and gaps[16:31] == [4] * 15
    assert max(gaps) == 32 and gaps[-1] == 32 and sorted(gaps) == gaps


@pytest.mark.parametrize("kw, message", [
    (dict(variance="adaptive"), "variance must be one of ['tracked', 'frozen']"),
    (dict(variance_floor=2.0), "variance_floor must be in [0, 1]"),
])
def test_bad_variance_options_are_named(kw, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        bagua.optim.QAdamOptimizer(torch.nn.Linear(2, 2).parameters(), **kw)
