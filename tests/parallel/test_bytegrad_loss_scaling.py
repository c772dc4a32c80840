"""bytegrad under a loss scaler: a step whose gradients overflow on one rank comes out non-finite
on every rank, so torch.amp.GradScaler skips it everywhere and halves its scale."""

from __future__ import annotations

import pytest
import torch

import bagua
from tests.harness import run_ranks
from tests.parallel.models import flat_params, make_model, rank_batches

STEPS = 5
OVERFLOW_STEP = 2
INIT_SCALE = 2.0 ** 10


def _scaled_training(rank: int, hierarchical: bool) -> dict:
    model = make_model(seed=rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ddp = bagua.DistributedDataParallel(model, [opt], algorithm=bagua.algorithms.ByteGradAlgorithm(hierarchical=hierarchical))
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=1000)
    steps = []
    for step, (x, y) in enumerate(rank_batches(rank, STEPS)):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        if step == OVERFLOW_STEP and rank == 1:
            loss = loss * 1e36  # times the scale: beyond float32, as with a scale that grew too large
        scaler.scale(loss).backward()
        grads_finite = all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())
        scaler.step(opt)
        scaler.update()
        steps.append({"scale": scaler.get_scale(), "weights": flat_params(model), "grads_finite": grads_finite})
    nan_on_rank_1 = torch.randn(4096)
    if rank == 1:
        nan_on_rank_1[7] = float("nan")
    try:
        bagua.comm.allreduce(nan_on_rank_1, op="avg", compression="minmax_uint8")
        standalone_error = None
    except ValueError as error:
        standalone_error = str(error)
    return {"start": flat_params(make_model(seed=0)), "steps": steps, "standalone_error": standalone_error}


@pytest.mark.parametrize("world, local, hierarchical", [(2, 2, False), (4, 2, True)])
def test_an_overflow_on_one_rank_skips_the_step_on_every_rank(world, local, hierarchical):
    runs = run_ranks(_scaled_training, world, hierarchical, local_world_size=local, timeout=120)
    for run in runs:
        steps = run["steps"]
        assert [s["grads_finite"] for s in steps] == [step != OVERFLOW_STEP for step in range(STEPS)]
        assert [s["scale"] for s in steps] == [INIT_SCALE] * OVERFLOW_STEP + [INIT_SCALE / 2] * (STEPS - OVERFLOW_STEP)
        weights = [run["start"]] + [s["weights"] for s in steps]
        for step, (before, after) in enumerate(zip(weights, weights[1:])):
            assert torch.isfinite(after).all()
            assert torch.equal(before, after) == (step == OVERFLOW_STEP)  # skipped, then trains on
        for s, first in zip(steps, runs[0]["steps"]):
            assert torch.equal(s["weights"], first["weights"])  # identical on every rank
        # the public collective keeps refusing non-finite input, on every rank
        assert "NaN or Inf" in run["standalone_error"] and "loss scaler" in run["standalone_error"]
