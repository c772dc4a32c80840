"""onebit_grad beyond the conformance matrix (real ranks): the warm-up's exact steps, then ~32x
fewer bytes; the same result fused or not, whatever the segment size or bucketing set between
steps; join() on uneven inputs; hierarchical; a checkpoint of another rank's residuals."""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

import bagua
from tests.harness import run_ranks
from tests.parallel.models import flat_params, make_model, rank_batches

WARMUP = 2
STEPS = 6


def _model() -> torch.nn.Module:
    return make_model(width=256)  # 4.6k parameters: several sign1 blocks per tensor


def _run(rank: int, fused: bool = False, reconfigure: bool = False, hierarchical: bool = False) -> dict:
    model = _model()
    # no momentum: torch's fused CPU SGD rounds momentum steps otherwise than its per-tensor one
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    opt = bagua.optim.fuse_optimizer(opt) if fused else opt
    ddp = bagua.DistributedDataParallel(model, [opt], "onebit_grad", warmup_steps=WARMUP, hierarchical=hierarchical)
    sent, trace = [], []
    for step, (x, y) in enumerate(rank_batches(rank, STEPS)):
        if reconfigure and step in (3, 4):  # after the warm-up: residuals to carry
            ddp.configure(**({"segment_elems": 1 << 16} if step == 3 else {"bucket_size_bytes": 1024}))
        opt.zero_grad()
        before = bagua.comm.bytes_sent()
        F.cross_entropy(ddp(x), y).backward()
        sent.append(bagua.comm.bytes_sent() - before)
        opt.fuse_step() if fused else opt.step()
        trace.append(flat_params(model))
    residuals = ddp.impl.state_dict()
    ddp.close()
    return {"trace": trace, "sent": sent, "residuals": residuals}


def _variants(rank: int) -> dict:
    return {"plain": _run(rank), "fused": _run(rank, fused=True), "reconfigured": _run(rank, reconfigure=True)}


def test_warm_up_then_one_bit_the_same_fused_and_whatever_the_buckets_and_segments():
    results = run_ranks(_variants, 2, timeout=120)
    for r in results:
        for variant in ("fused", "reconfigured"):
            for step, (a, b) in enumerate(zip(r[variant]["trace"], r["plain"]["trace"])):
                assert torch.equal(a, b), f"{variant}: step {step + 1} differs"
            mine, plain = r[variant]["residuals"]["worker"], r["plain"]["residuals"]["worker"]
            assert mine.keys() == plain.keys() and all(torch.equal(mine[k], plain[k]) for k in mine)
        assert torch.equal(r["plain"]["trace"][-1], results[0]["plain"]["trace"][-1])  # identical replicas
        exact, onebit = r["plain"]["sent"][WARMUP - 1], r["plain"]["sent"][WARMUP]
        assert 24 < exact / onebit < 32, r["plain"]["sent"]  # scales and per-tensor tails: a bit under 32x
    # a server residual lives on its element's reducer, which the layout decides: their sum
    for variant in ("fused", "reconfigured"):
        for name in results[0]["plain"]["residuals"]["server"]:
            total = [sum(r[v]["residuals"]["server"][name] for r in results) for v in (variant, "plain")]
            assert torch.equal(*total), (variant, name)


def _uneven(rank: int) -> torch.Tensor:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ddp = bagua.DistributedDataParallel(model, [opt], "onebit_grad", warmup_steps=1)
    with ddp.join():
        for x, y in rank_batches(rank, 3 + 2 * rank):  # rank 1 trains two steps more, 1-bit
            opt.zero_grad()
            F.cross_entropy(ddp(x), y).backward()
            opt.step()
    ddp.close()
    return flat_params(model)


def test_join_on_uneven_inputs_ends_with_identical_replicas():
    results = run_ranks(_uneven, 2, timeout=120)
    assert torch.equal(results[0], results[1])


def test_hierarchical_ranks_stay_identical():
    results = run_ranks(_run, 4, False, False, True, local_world_size=2, timeout=180)
    for r in results:
        assert torch.equal(r["trace"][-1], results[0]["trace"][-1])


def _foreign_state(rank: int, caplog_level: int) -> dict:
    logging.getLogger("bagua").setLevel(caplog_level)
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("bagua.algorithms.onebit_grad").addHandler(handler)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ddp = bagua.DistributedDataParallel(model, [opt], "onebit_grad", warmup_steps=1)
    for x, y in rank_batches(rank, 3):
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
    state = ddp.algorithm_state_dict()
    others = bagua.comm.allgather_object(state)
    ddp.load_algorithm_state_dict(others[0])  # every rank loads rank 0's state (one file for all)
    loaded = ddp.impl.state_dict()
    for x, y in rank_batches(rank, 2):  # goes on without a hang: the server residuals are handed over
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
    residuals = ddp.impl.state_dict()["worker"]
    ddp.close()
    return {"records": records, "params": flat_params(model), "kept": bool(residuals),
            "saved": state["algorithm"], "loaded": loaded}


def test_another_ranks_residuals_restart_at_zero_with_a_warning():
    results = run_ranks(_foreign_state, 2, logging.WARNING, timeout=120)
    assert not any("restart at zero" in m for m in results[0]["records"])
    assert any("residuals of rank 0 of 2, this is rank 1 of 2" in m for m in results[1]["records"])
    assert torch.equal(results[0]["params"], results[1]["params"]) and results[1]["kept"]
    for side in ("worker", "server"):
        saved, loaded = results[0]["saved"][side], results[0]["loaded"][side]  # rank 0 loaded its own: kept
        assert any(t.any() for t in saved.values()) and loaded.keys() == saved.keys(), side
        assert all(torch.equal(loaded[k], saved[k]) for k in saved), side
        assert any(t.any() for t in results[1]["saved"][side].values()), side  # rank 1 had residuals of its own...
        assert not any(t.any() for t in results[1]["loaded"][side].values()), side  # ...and restarts at zero


def _wrap_and_listen(rank: int, optimizer: str) -> list[str]:
    records: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("bagua.algorithms.onebit_grad").addHandler(handler)
    model = _model()
    opt = torch.optim.AdamW(model.parameters()) if optimizer == "adamw" else torch.optim.SGD(model.parameters(), lr=0.05)
    ddp = bagua.DistributedDataParallel(model, [bagua.optim.fuse_optimizer(opt)], "onebit_grad")
    ddp.close()
    return records


def test_an_adam_like_optimizer_is_warned_about_once_with_the_alternative():
    adamw = run_ranks(_wrap_and_listen, 2, "adamw", timeout=60)
    assert len(adamw[0]) == 1 and "AdamW" in adamw[0][0] and "algorithm='qadam' with bits=1" in adamw[0][0]
    assert adamw[1] == []  # once, by rank 0
    assert run_ranks(_wrap_and_listen, 2, "sgd", timeout=60) == [[], []]
