"""async model averaging on real ranks: it trains, stays consistent, and stops cleanly (qadam: test_qadam.py)."""

from __future__ import annotations

import time

import torch

import bagua
from tests.harness import run_ranks
from tests.parallel.models import flat_params, make_model, rank_batches


def _loss(model, batches) -> float:
    with torch.no_grad():
        return sum(torch.nn.functional.cross_entropy(model(x), y).item() for x, y in batches) / len(batches)


def _async_run(rank: int) -> dict:
    batches = rank_batches(rank, 40)
    model = make_model(seed=rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    algo = bagua.algorithms.AsyncModelAverageAlgorithm(sync_interval_ms=5, warmup_steps=3)
    ddp = bagua.DistributedDataParallel(model, [opt], algo)
    start_loss = _loss(model, batches)

    def train(steps):
        for x, y in steps:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
            time.sleep(0.01 * (1 + rank))  # ranks at different speeds: nobody waits for anybody

    train(batches[:3])
    after_warmup = flat_params(model)  # warm-up was synchronous: identical on all ranks
    train(batches[3:20])
    during = flat_params(model)
    algo.abort(ddp)
    rounds_first = ddp.impl.rounds
    after_abort = flat_params(model)
    algo.resume(ddp)
    train(batches[20:])
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
