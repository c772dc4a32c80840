"""A checkpoint saved under one algorithm, loaded under another (2 real ranks): every ordered pair
of the algorithms that train with the same optimizer, loaded after wrapping (unfused and fused)
and before wrapping, then trained on. One spawned job runs every pair; the tests check each
pair's outcome: no error, the weights saved (bit for bit), the new algorithm's invariants, the
step count, one warning."""

from __future__ import annotations

import logging
import os

import pytest
import torch

import bagua
from bagua.checkpoint import load_checkpoint, save_checkpoint
from tests.harness import run_ranks
from tests.parallel.models import flat_params, make_model, rank_batches

# Under xdist (`--dist loadgroup`) one worker runs the module: its module-scoped jobs run once, not once per worker.
pytestmark = pytest.mark.xdist_group("algorithm_switch")

ALGORITHMS = ["gradient_allreduce", "bytegrad", "decentralized", "low_precision_decentralized", "async"]
IDENTICAL = {"gradient_allreduce", "bytegrad"}  # replicas identical after every step
# replicas apart from the first step (async's warm-up starts anew: its own state is not in another's file)
APART = {"decentralized", "low_precision_decentralized"}
CASES = [(a, b, fused, when) for fused in (False, True) for a in ALGORITHMS for b in ALGORITHMS if a != b
         for when in (("after_wrap", "before_wrap") if not fused else ("after_wrap",))]


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _optimizer(model, fused: bool):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return bagua.optim.fuse_optimizer(opt) if fused else opt


def _wrap(model, opt, name: str, **kwargs):
    algorithm = bagua.algorithms.AsyncModelAverageAlgorithm(sync_interval_ms=1, warmup_steps=2) if name == "async" else name
    return bagua.DistributedDataParallel(model, [opt], algorithm=algorithm, **kwargs)


def _train(ddp, opt, batches) -> None:
    for x, y in batches:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()


def _invariant(ddp, name: str):
    """What the algorithm promises between steps, read on this rank (compared across ranks)."""
    bucket = ddp.buckets[0]
    if name == "decentralized":  # peer mode "all": every rank replaced its weights by the same average
        return ddp.impl.peer_weight(bucket).clone()
    if name == "low_precision_decentralized":  # my weights as my neighbour knows them, and theirs
        own, left, right = ddp.impl.replicas(bucket)
        return own.clone(), left.clone(), right.clone()
    return None


def _close(ddp, name: str) -> None:
    if name == "async":
        ddp.algorithm.abort(ddp)
    ddp.close()


def _switch(rank: int, path: str, a: str, b: str, fused: bool, when: str, records: _Records) -> dict:
    model = make_model(seed=7 + rank)  # other weights on every rank: all must come from the file
    opt = _optimizer(model, fused)
    before = len(records.messages)
    if when == "before_wrap":
        load_checkpoint(path, model=model, optimizers=[opt])
        ddp = _wrap(model, opt, b)
    else:
        ddp = _wrap(model, opt, b)
        load_checkpoint(path, model=ddp, optimizers=[opt])
    loaded = {"step": ddp.step, "params": flat_params(model)}
    _train(ddp, opt, rank_batches(rank, 6)[3:])
    out = {"loaded": loaded, "step": ddp.step, "params": flat_params(model), "invariant": _invariant(ddp, b),
           "warnings": records.messages[before:]}
    _close(ddp, b)
    return out


def _saved_weights(path: str, rank: int) -> torch.Tensor:
    """The weights this rank's replica went to the file with: its own file where the writer's
    replicas differed, the one of rank 0 otherwise (read with torch, not ``load_checkpoint``)."""
    own = f"{path}.rank{rank}"
    state = torch.load(own if os.path.exists(own) else path, weights_only=False)["model"]
    return torch.cat([t.reshape(-1) for t in state.values()])


def _qadam_refuses_sgd_state(rank: int, path: str) -> str:
    model = make_model(seed=0)
    opt = bagua.optim.QAdamOptimizer(model.parameters(), lr=0.01, warmup_steps=2)
    ddp = bagua.DistributedDataParallel(model, [opt], algorithm=bagua.algorithms.QAdamAlgorithm(opt))
    try:
        load_checkpoint(path, model=ddp, optimizers=[opt])
    except ValueError as error:
        return str(error)
    finally:
        ddp.close()
    return ""


def _recorded_states(rank: int, records: _Records) -> dict:
    """States written before algorithms were recorded, of another state version, and malformed."""
    model = make_model(seed=0)
    ddp = _wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), "decentralized")
    decentralized = {"algorithm": "decentralized", "state_version": 1, "replicas_identical": False}
    out = {}
    for label, state in {
        "unrecorded_bytegrad": {"step": 4, "algorithm": {}},
        "unrecorded_decentralized": {"step": 4, "algorithm": {"comm_steps": 5}},
        "other_version": {"step": 4, "algorithm": {"comm_steps": 5},
                          "written_by": {**decentralized, "state_version": 99}},
        "same": {"step": 4, "algorithm": {"comm_steps": 6}, "written_by": decentralized},
    }.items():
        ddp.impl.comm_steps = 0
        before = len(records.messages)
        ddp.load_algorithm_state_dict(state)
        out[label] = {"step": ddp.step, "comm_steps": ddp.impl.comm_steps, "warnings": records.messages[before:]}
    for label, state in {"no_dict": [4], "bad_writer": {"step": 4, "algorithm": {}, "written_by": {"algorithm": 3}}}.items():
        try:
            ddp.load_algorithm_state_dict(state)
        except ValueError as error:
            out[label] = str(error)
    ddp.close()
    return out


def _switch_job(rank: int, directory: str) -> dict:
    records = _Records()
    logging.getLogger("bagua.parallel.algorithm_state").addHandler(records)
    out = {}
    batches = rank_batches(rank, 3)
    for fused in (False, True):
        for a in ALGORITHMS:
            path = f"{directory}/{a}-{int(fused)}.pt"
            model = make_model(seed=0)
            opt = _optimizer(model, fused)
            ddp = _wrap(model, opt, a)
            _train(ddp, opt, batches)
            save_checkpoint(path, step=3, model=ddp, optimizers=[opt])
            _close(ddp, a)
            out["saved", a, fused] = _saved_weights(path, rank)
            for b, when in [(b, w) for a_, b, f, w in CASES if a_ == a and f == fused]:
                out[a, b, fused, when] = _switch(rank, path, a, b, fused, when, records)
    out["qadam"] = _qadam_refuses_sgd_state(rank, f"{directory}/bytegrad-0.pt")
    out["recorded"] = _recorded_states(rank, records)
    return out


@pytest.fixture(scope="module")
def switched(tmp_path_factory):
    return run_ranks(_switch_job, 2, str(tmp_path_factory.mktemp("switch")), timeout=300)


@pytest.mark.parametrize("a, b, fused, when", CASES,
                         ids=[f"{a}-to-{b}-{'fused' if f else 'unfused'}-{w}" for a, b, f, w in CASES])
def test_a_checkpoint_loads_under_another_algorithm_and_trains_on(switched, a, b, fused, when):
    r0, r1 = (r[a, b, fused, when] for r in switched)
    for rank, r in enumerate((r0, r1)):
        assert torch.isfinite(r["params"]).all()
        # the saved weights, which no rank held before (other seeds): each rank's own where b keeps
        # replicas apart and loads after wrapping, else rank 0's (b keeps replicas identical now and
        # starts every rank from rank 0's; wrapping a loaded module broadcasts rank 0's)
        own = when == "after_wrap" and b in APART
        assert torch.equal(r["loaded"]["params"], switched[rank if own else 0]["saved", a, fused]), rank
        if when == "after_wrap":  # the step count carries over; one warning names both algorithms
            assert (r["loaded"]["step"], r["step"]) == (3, 6)
            assert len(r["warnings"]) == 1, r["warnings"]
            assert f"written by {a} (" in r["warnings"][0] and f"runs {b} (" in r["warnings"][0], r["warnings"]
        else:  # a bare module holds no algorithm state: the wrapper starts counting afresh
            assert (r["loaded"]["step"], r["step"]) == (0, 3) and r["warnings"] == []
    if b in IDENTICAL:  # every rank starts from rank 0's replica and stays with it
        assert torch.equal(r0["loaded"]["params"], r1["loaded"]["params"])
        assert torch.equal(r0["params"], r1["params"])
    if b == "decentralized":
        torch.testing.assert_close(r0["invariant"], r1["invariant"], rtol=0, atol=1e-6)
    if b == "low_precision_decentralized":  # replicas taken anew after the load, then kept exact
        (own0, left0, right0), (own1, left1, right1) = r0["invariant"], r1["invariant"]
        assert torch.equal(own0, left1) and torch.equal(own0, right1)
        assert torch.equal(own1, left0) and torch.equal(own1, right0)


def test_decentralized_replicas_loaded_under_bytegrad_are_rank_zeros(switched):
    """Each rank's own replica went into the checkpoint; bytegrad starts every rank from rank 0's."""
    r0, r1 = (r["decentralized", "bytegrad", False, "after_wrap"] for r in switched)
    own = [r["decentralized", "low_precision_decentralized", False, "after_wrap"]["loaded"]["params"] for r in switched]
    assert not torch.equal(own[0], own[1])  # the replicas did differ
    assert torch.equal(r0["loaded"]["params"], own[0]) and torch.equal(r1["loaded"]["params"], own[0])


def test_qadam_refuses_another_optimizers_state_clearly(switched):
    for r in switched:
        assert "QAdamOptimizer.load_state_dict" in r["qadam"] and "step_count" in r["qadam"], r["qadam"]


def test_state_of_another_version_or_unrecorded_writer_is_dropped_or_restored_by_its_keys(switched):
    for r in switched:
        got = r["recorded"]
        assert got["unrecorded_bytegrad"]["comm_steps"] == 0 and len(got["unrecorded_bytegrad"]["warnings"]) == 1
        assert "does not name" in got["unrecorded_bytegrad"]["warnings"][0]
        assert got["unrecorded_decentralized"]["comm_steps"] == 5 and got["unrecorded_decentralized"]["warnings"] == []
        assert got["other_version"]["comm_steps"] == 0 and "state version 99" in got["other_version"]["warnings"][0]
        assert got["same"]["comm_steps"] == 6 and got["same"]["warnings"] == []
        assert all(got[k]["step"] == 4 for k in ("unrecorded_bytegrad", "unrecorded_decentralized", "other_version", "same"))
        assert "expected what DistributedDataParallel.algorithm_state_dict() returns" in got["no_dict"]
        assert "'written_by' must be" in got["bad_writer"] and "{'algorithm': 3}" in got["bad_writer"]
