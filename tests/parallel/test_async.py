"""async model averaging on real ranks: it trains, survives closures, raising steps and
checkpoints, loses no averaging result, and abort() leaves identical weights on every rank."""

from __future__ import annotations

import copy
import pickle
import time

import pytest
import torch

import bagua
from tests.harness import run_ranks
from tests.parallel.models import flat_params, make_model, rank_batches


def _loss(model, batches) -> float:
    with torch.no_grad():
        return sum(torch.nn.functional.cross_entropy(model(x), y).item() for x, y in batches) / len(batches)


def _train(ddp, opt, batches, pause_s: float = 0.0) -> None:
    for x, y in batches:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        time.sleep(pause_s)


def _async_run(rank: int) -> dict:
    batches = rank_batches(rank, 40)
    model = make_model(seed=rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    algo = bagua.algorithms.AsyncModelAverageAlgorithm(sync_interval_ms=5, warmup_steps=3)
    ddp = bagua.DistributedDataParallel(model, [opt], algo)
    start_loss = _loss(model, batches)
    pause = 0.01 * (1 + rank)  # ranks at different speeds: nobody waits for anybody

    _train(ddp, opt, batches[:3], pause)
    after_warmup = flat_params(model)  # warm-up was synchronous: identical on all ranks
    _train(ddp, opt, batches[3:20], pause)
    during = flat_params(model)
    algo.abort(ddp)
    rounds_first = ddp.impl.rounds
    after_abort = flat_params(model)
    algo.resume(ddp)
    _train(ddp, opt, batches[20:], pause)
    algo.abort(ddp)
    ddp.close()
    return dict(after_warmup=after_warmup, during=during, after_abort=after_abort, final=flat_params(model),
                rounds_first=rounds_first, rounds=ddp.impl.rounds, start_loss=start_loss, end_loss=_loss(model, batches))


def test_async_averages_in_the_background_and_aborts_to_identical_weights():
    a, b = run_ranks(_async_run, 2, timeout=120)
    assert torch.equal(a["after_warmup"], b["after_warmup"])
    assert not torch.equal(a["during"], b["during"])  # asynchronous: the replicas drift apart...
    assert a["rounds_first"] > 0 and a["rounds_first"] == b["rounds_first"]  # ...while rounds average them
    assert a["rounds"] > a["rounds_first"]  # resume() restarted the loop
    assert torch.equal(a["after_abort"], b["after_abort"])  # abort(): identical on every rank
    assert torch.equal(a["final"], b["final"])
    assert a["end_loss"] < a["start_loss"]  # it trains (convergence on real data: test_convergence.py)


def _closure_run(rank: int) -> dict:
    batches = rank_batches(rank, 30)
    model = make_model(seed=rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.5)
    algo = bagua.algorithms.AsyncModelAverageAlgorithm(sync_interval_ms=1, warmup_steps=3)
    ddp = bagua.DistributedDataParallel(model, [opt], algo)
    start_loss = _loss(model, batches)
    for x, y in batches:
        def closure():  # forward and backward run inside step(), after its pre-hooks
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(ddp(x), y)
            loss.backward()
            return loss

        opt.step(closure)
        time.sleep(0.003 * (1 + rank))
    algo.abort(ddp)
    ddp.close()
    return dict(params=flat_params(model), rounds=ddp.impl.rounds, start_loss=start_loss, end_loss=_loss(model, batches))


def test_closure_steps_train_and_average_without_deadlock():
    a, b = run_ranks(_closure_run, 2, timeout=60)
    assert a["rounds"] > 0 and a["rounds"] == b["rounds"]
    assert torch.equal(a["params"], b["params"])
    assert a["end_loss"] < a["start_loss"]


def _raising_steps_run(rank: int) -> dict:
    batches = rank_batches(rank, 30)
    model = make_model(seed=rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    algo = bagua.algorithms.AsyncModelAverageAlgorithm(sync_interval_ms=1, warmup_steps=2)
    ddp = bagua.DistributedDataParallel(model, [opt], algo)
    fail_now = {"pre_hook": False}

    def failing_pre_hook(optimizer, args, kwargs):  # registered after the wrapper's own hooks
        if fail_now["pre_hook"]:
            fail_now["pre_hook"] = False
            raise OSError("the pre-hook failed")

    opt.register_step_pre_hook(failing_pre_hook)
    caught = []
    for i, (x, y) in enumerate(batches):
        def closure():
            opt.zero_grad()
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
            if i == 12:
                raise ValueError("the closure failed")

        fail_now["pre_hook"] = i == 6
        try:
            opt.step(closure)
        except (OSError, ValueError) as error:  # torch skips the step's post-hooks
            caught.append(str(error))
        time.sleep(0.002)
    algo.abort(ddp)
    ddp.close()
    return dict(caught=caught, params=flat_params(model), rounds=ddp.impl.rounds)


def test_steps_that_raise_leave_nothing_locked():
    a, b = run_ranks(_raising_steps_run, 2, timeout=60)
    assert a["caught"] == ["the pre-hook failed", "the closure failed"]
    assert a["rounds"] > 0
    assert torch.equal(a["params"], b["params"])


def _stress_run(rank: int, steps: int) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    algo = bagua.algorithms.AsyncModelAverageAlgorithm(sync_interval_ms=0, warmup_steps=0)
    ddp = bagua.DistributedDataParallel(model, [opt], algo)
    with torch.no_grad():  # the wrapper made the weights equal: start each rank elsewhere
        g = torch.Generator().manual_seed(rank)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype))
    start = flat_params(model)
    moved = torch.zeros_like(start)  # everything this rank's optimizer steps did to the weights
    for i, (x, y) in enumerate(rank_batches(rank, steps, batch=4)):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x.double()), y).backward()
        before = flat_params(model)
        opt.step()
        moved += flat_params(model) - before
        if i % 10 == 0:
            ddp.state_dict()  # what a checkpoint does: adds a delta that is ready
    algo.abort(ddp)
    ddp.close()
    return dict(start=start, moved=moved, final=flat_params(model), rounds=ddp.impl.rounds)


def test_no_averaging_result_is_lost_or_half_applied_under_stress():
    # Each round's deltas (average - snapshot) sum to zero over the ranks, so rounds keep the sum
    # of the ranks' weights: after abort every rank must hold the mean of (start + own steps).
    # A delta lost, applied twice or half-applied on one rank would break this by far more than
    # float64 rounding.
    results = run_ranks(_stress_run, 2, 400, timeout=60)
    expected = torch.stack([r["start"] + r["moved"] for r in results]).mean(dim=0)
    assert results[0]["rounds"] >= 10, results[0]["rounds"]  # the loop raced the training thread a lot
    for r in results:
        assert torch.equal(r["final"], results[0]["final"])
        torch.testing.assert_close(r["final"], expected, rtol=0, atol=1e-10)


_WARMUP = 5
_SAVED_AT = 12


def _checkpoint_save(rank: int, directory: str) -> dict:
    batches = rank_batches(rank, 20)
    model = make_model(seed=rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    algo = bagua.algorithms.AsyncModelAverageAlgorithm(sync_interval_ms=1, warmup_steps=_WARMUP)
    ddp = bagua.DistributedDataParallel(model, [opt], algo)
    _train(ddp, opt, batches[:_SAVED_AT], 0.002 * (1 + rank))
    state = {"model": ddp.module.state_dict(), "opt": opt.state_dict(), "algo": ddp.impl.state_dict()}
    torch.save(state, f"{directory}/rank{rank}.pt")
    saved = flat_params(model)
    copied = copy.deepcopy(model)  # copies and pickles of the module leave the live weights alone
    pickle.loads(pickle.dumps(copied)).state_dict()
    assert torch.equal(flat_params(copied), saved)
    _train(ddp, opt, batches[_SAVED_AT:], 0.002 * (1 + rank))  # the job goes on after saving
    algo.abort(ddp)
    ddp.close()
    return dict(saved=saved, algo=state["algo"])


def _checkpoint_resume(rank: int, directory: str, load_before_wrapping: bool) -> dict:
    state = torch.load(f"{directory}/rank{rank}.pt")
    batches = rank_batches(rank, 20)[_SAVED_AT:]
    model = make_model(seed=100 + rank)  # not the saved weights
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    algo = bagua.algorithms.AsyncModelAverageAlgorithm(sync_interval_ms=1, warmup_steps=_WARMUP)
    if load_before_wrapping:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
    ddp = bagua.DistributedDataParallel(model, [opt], algo)
    if not load_before_wrapping:
        ddp.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
    ddp.impl.load_state_dict(state["algo"])
    loaded = flat_params(model)
    x, y = batches[0]
    opt.zero_grad()
    torch.nn.functional.cross_entropy(ddp(x), y).backward()
    first_grad = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).clone()
    opt.step()
    _train(ddp, opt, batches[1:], 0.002 * (1 + rank))
    algo.abort(ddp)
    ddp.close()
    return dict(loaded=loaded, first_grad=first_grad, steps=ddp.impl.steps, rounds=ddp.impl.rounds,
                final=flat_params(model))


@pytest.mark.parametrize("load_before_wrapping", [False, True], ids=["load_after_wrapping", "load_before_wrapping"])
def test_checkpoint_mid_training_resumes_past_warmup_and_keeps_averaging(tmp_path, load_before_wrapping):
    saved = run_ranks(_checkpoint_save, 2, str(tmp_path), timeout=60)
    assert [s["algo"]["steps"] for s in saved] == [_SAVED_AT, _SAVED_AT]
    assert all(s["algo"]["rounds"] > 0 for s in saved)
    a, b = run_ranks(_checkpoint_resume, 2, str(tmp_path), load_before_wrapping, timeout=60)
    if load_before_wrapping:  # the wrapper broadcasts rank 0's weights
        assert torch.equal(a["loaded"], saved[0]["saved"]) and torch.equal(b["loaded"], saved[0]["saved"])
    else:  # every rank goes on from its own weights
        assert torch.equal(a["loaded"], saved[0]["saved"]) and torch.equal(b["loaded"], saved[1]["saved"])
    assert not torch.equal(a["first_grad"], b["first_grad"])  # no warm-up again: gradients stay local
    assert a["steps"] == b["steps"] == 20
    assert a["rounds"] > saved[0]["algo"]["rounds"]  # averaging went on
    assert torch.equal(a["final"], b["final"])


def _resume_inside_warmup_at_different_steps(rank: int) -> dict:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    algo = bagua.algorithms.AsyncModelAverageAlgorithm(sync_interval_ms=1, warmup_steps=_WARMUP)
    ddp = bagua.DistributedDataParallel(model, [opt], algo)
    errors = []
    for state in ({"steps": 3}, {"steps": 2 + rank, "rounds": 0}):
        try:
            ddp.impl.load_state_dict(state)
        except ValueError as error:
            errors.append(str(error))
    ddp.impl.load_state_dict({"steps": _WARMUP + rank, "rounds": 0})  # past warm-up: may differ
    _train(ddp, opt, rank_batches(rank, 3))
    algo.abort(ddp)
    ddp.close()
    return dict(errors=errors)


def test_resuming_with_a_bad_state_or_inside_warmup_at_different_steps_is_a_clear_error():
    for r in run_ranks(_resume_inside_warmup_at_different_steps, 2, timeout=60):
        bad_state, different_steps = r["errors"]
        assert "{'steps': int >= 0, 'rounds': int >= 0}" in bad_state and "{'steps': 3}" in bad_state
        assert "different steps (2 to 3) inside the synchronous warm-up (warmup_steps=5)" in different_steps
