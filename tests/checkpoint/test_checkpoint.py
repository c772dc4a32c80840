"""bagua.checkpoint: exact round trips for every algorithm (fused and unfused optimizers, real
2-rank jobs), atomic writes, RNG states, truncated and foreign files."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import bagua
from bagua.checkpoint import (
    CheckpointError,
    UntrustedCheckpointError,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from tests.harness import run_ranks
from tests.payloads import RunsCodeWhenUnpickled
from tests.parallel.models import flat_params, make_model, rank_batches, train

# Under xdist (`--dist loadgroup`) one worker runs the module: its module-scoped jobs run once, not once per worker.
pytestmark = pytest.mark.xdist_group("checkpoint")

ALGORITHMS = ["gradient_allreduce", "bytegrad", "decentralized", "low_precision_decentralized", "async", "qadam", "qadam_1bit",
              "onebit_grad"]


def _wrapped(rank: int, algorithm: str, fused: bool, seed: int):
    model = make_model(seed=seed)
    if algorithm.startswith("qadam"):
        opt = bagua.optim.QAdamOptimizer(model.parameters(), lr=0.01, warmup_steps=2)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if fused:
        opt = bagua.optim.fuse_optimizer(opt)
    algo = {
        "qadam": lambda: bagua.algorithms.QAdamAlgorithm(opt),
        "qadam_1bit": lambda: bagua.algorithms.QAdamAlgorithm(opt, bits=1),  # residuals of step 3 saved
        "async": lambda: bagua.algorithms.AsyncModelAverageAlgorithm(sync_interval_ms=1, warmup_steps=2),
        "onebit_grad": lambda: bagua.algorithms.OneBitGradAlgorithm(warmup_steps=1),  # residuals of 2 steps saved
    }.get(algorithm, lambda: algorithm)()
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return bagua.DistributedDataParallel(model, [opt], algorithm=algo), opt, scheduler


def _train_steps(ddp, opt, scheduler, batches):
    for x, y in batches:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x) + 0.01 * torch.randn(1), y).backward()  # RNG in the loss
        opt.step()
        scheduler.step()


def _round_trips(rank: int, directory: str):
    out = {}
    batches = rank_batches(rank, 6)
    for algorithm in ALGORITHMS:
        for fused in (False, True):
            path = f"{directory}/{algorithm}-{int(fused)}.pt"
            torch.manual_seed(rank)
            ddp, opt, scheduler = _wrapped(rank, algorithm, fused, seed=0)
            _train_steps(ddp, opt, scheduler, batches[:3])
            save_checkpoint(path, step=3, model=ddp, optimizers=[opt], lr_schedulers=[scheduler], extra={"k": 1})
            saved = flat_params(ddp.module)
            _train_steps(ddp, opt, scheduler, batches[3:])
            straight = flat_params(ddp.module)
            ddp.close()

            ddp, opt, scheduler = _wrapped(rank, algorithm, fused, seed=7)  # other weights: all must come from the file
            torch.manual_seed(1234)  # other RNG state too
            extra = {}
            step = load_checkpoint(path, model=ddp, optimizers=[opt], lr_schedulers=[scheduler], extra=extra)
            loaded = flat_params(ddp.module)
            _train_steps(ddp, opt, scheduler, batches[3:])
            out[algorithm, fused] = {"step": step, "extra": extra["extra"], "saved": saved, "loaded": loaded,
                                     "straight": straight, "resumed": flat_params(ddp.module),
                                     "bagua_step": ddp.step, "lr": scheduler.get_last_lr()}
            if algorithm == "async":
                ddp.impl.stop_and_synchronize()
            ddp.close()
    return out


@pytest.fixture(scope="module")
def round_trips(tmp_path_factory):
    return run_ranks(_round_trips, 2, str(tmp_path_factory.mktemp("ckpt")), timeout=240)


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_round_trip_resumes_exactly(round_trips, algorithm, fused):
    for rank in round_trips:
        r = rank[algorithm, fused]
        assert r["step"] == 3 and r["extra"] == {"k": 1} and r["bagua_step"] == 6
        assert torch.equal(r["loaded"], r["saved"])  # each rank's own replica
        if algorithm != "async":  # async's rounds depend on timing
            assert torch.equal(r["resumed"], r["straight"])
    if algorithm in ("decentralized", "low_precision_decentralized"):
        assert not torch.equal(round_trips[0][algorithm, fused]["saved"], round_trips[1][algorithm, fused]["saved"])


# --- one process ------------------------------------------------------------------------------------
def _simple(seed: int = 0):
    model = make_model(seed=seed)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    train(model, opt, rank_batches(0, 2))
    return model, opt


def test_rng_states_and_state_are_restored(tmp_path):
    model, opt = _simple()
    save_checkpoint(tmp_path / "a.pt", step=2, model=model, optimizers=[opt])
    expected = (torch.rand(3), np.random.rand(), random.random())
    other, other_opt = _simple(seed=5)
    torch.manual_seed(99)
    assert load_checkpoint(tmp_path / "a.pt", model=other, optimizers=[other_opt]) == 2
    assert torch.equal(flat_params(other), flat_params(model))
    assert other_opt.state_dict()["state"][0]["exp_avg"].equal(opt.state_dict()["state"][0]["exp_avg"])
    assert torch.equal(torch.rand(3), expected[0])  # the draws after the save, repeated
    assert np.random.rand() == expected[1] and random.random() == expected[2]


def test_a_failed_write_leaves_the_previous_checkpoint(tmp_path):
    model, opt = _simple()
    save_checkpoint(tmp_path / "c.pt", step=1, model=model, optimizers=[opt])
    before = (tmp_path / "c.pt").read_bytes()
    with pytest.raises(Exception):
        save_checkpoint(tmp_path / "c.pt", step=2, model=model, optimizers=[opt], extra=lambda: None)  # unpicklable
    assert (tmp_path / "c.pt").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.pt"]  # no temporary file left


def test_truncated_and_foreign_files_are_clear_errors_and_skipped(tmp_path, caplog):
    model, opt = _simple()
    save_checkpoint(tmp_path / "step-1.pt", step=1, model=model, optimizers=[opt])
    save_checkpoint(tmp_path / "step-2.pt", step=2, model=model, optimizers=[opt])
    data = (tmp_path / "step-2.pt").read_bytes()
    (tmp_path / "step-2.pt").write_bytes(data[: len(data) // 2])
    torch.save({"weights": 1}, tmp_path / "other.pt")
    with pytest.raises(CheckpointError, match=r"step-2\.pt is not a readable checkpoint"):
        load_checkpoint(tmp_path / "step-2.pt", model=model, optimizers=[opt])
    with pytest.raises(CheckpointError, match=r"other\.pt is not a bagua checkpoint"):
        load_checkpoint(tmp_path / "other.pt", model=model, optimizers=[opt])
    with caplog.at_level("WARNING"):
        assert latest_checkpoint(tmp_path) == str(tmp_path / "step-1.pt")
    assert "step-2.pt" in caplog.text and "other.pt" in caplog.text
    assert latest_checkpoint(tmp_path / "missing") is None


def test_a_samplers_state_after_a_world_size_change_loads(tmp_path):
    """Its mask of samples consumed before the change is a NumPy uint8 array (np.packbits)."""
    import itertools

    from tests.data.test_sampler_resume import _make

    first = _make("budget", 3)
    for s in first:
        list(itertools.islice(iter(s), 2))
    sampler = _make("budget", 2)[0]
    sampler.load_state_dict(first[0].state_dict())
    list(itertools.islice(iter(sampler), 1))
    assert sampler.state_dict()["consumed_before"].dtype == np.uint8
    model, opt = _simple()
    save_checkpoint(tmp_path / "s.pt", step=1, model=model, optimizers=[opt], sampler=sampler)
    resumed, expected = _make("budget", 2)[0], _make("budget", 2)[0]
    load_checkpoint(tmp_path / "s.pt", model=model, optimizers=[opt], sampler=resumed)
    expected.load_state_dict(sampler.state_dict())
    assert list(resumed) == list(expected) and list(expected)


def test_a_checkpoint_that_would_run_code_is_refused_unless_trusted(tmp_path, caplog):
    model, opt = _simple()
    marker = tmp_path / "marker"
    save_checkpoint(tmp_path / "step-1.pt", step=1, model=model, optimizers=[opt], extra=RunsCodeWhenUnpickled(marker))
    refused = r"step-1\.pt holds the type\(s\) tests\.payloads\.write_marker, .* pass trust_pickled=True"
    with pytest.raises(UntrustedCheckpointError, match=refused):
        load_checkpoint(tmp_path / "step-1.pt", model=model, optimizers=[opt])
    with pytest.raises(UntrustedCheckpointError, match=refused):  # not skipped: that would resume an older one
        latest_checkpoint(tmp_path)
    with caplog.at_level("WARNING"):  # keep_last leaves what it may not read
        save_checkpoint(tmp_path / "step-2.pt", step=2, model=model, optimizers=[opt], keep_last=1)
    assert (tmp_path / "step-1.pt").is_file() and "left alone" in caplog.text
    assert not marker.exists()

    assert latest_checkpoint(tmp_path, trust_pickled=True) == str(tmp_path / "step-2.pt")
    extra = {}
    assert load_checkpoint(tmp_path / "step-1.pt", model=model, optimizers=[opt], extra=extra, trust_pickled=True) == 1
    assert marker.exists() and extra["extra"] == str(marker)  # trusted: fully unpickled, the code ran


def test_mismatched_optimizers_and_bad_step_are_clear_errors(tmp_path):
    model, opt = _simple()
    with pytest.raises(ValueError, match="step must be an int >= 0"):
        save_checkpoint(tmp_path / "d.pt", step=-1, model=model, optimizers=[opt])
    save_checkpoint(tmp_path / "d.pt", step=1, model=model, optimizers=[opt])
    with pytest.raises(CheckpointError, match=r"holds 1 optimizer\(s\).*got 2"):
        load_checkpoint(tmp_path / "d.pt", model=model, optimizers=[opt, opt])


def test_keep_last_removes_older_checkpoints_with_their_replica_files(tmp_path):
    model, opt = _simple()
    for step in (1, 2, 3):
        save_checkpoint(tmp_path / f"step-{step}.pt", step=step, model=model, optimizers=[opt])
    (tmp_path / "step-1.pt.rank1").write_bytes(b"replica")  # as a run with differing replicas leaves
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    save_checkpoint(tmp_path / "step-4.pt", step=4, model=model, optimizers=[opt], keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "step-3.pt", "step-4.pt"]
    with pytest.raises(ValueError, match="keep_last must be an int >= 1"):
        save_checkpoint(tmp_path / "step-5.pt", step=5, model=model, optimizers=[opt], keep_last=0)


@pytest.mark.parametrize("call", ["save_checkpoint", "load_checkpoint"])
def test_torch_distributed_sampler_is_refused_with_the_sampler_to_use(tmp_path, call):
    sampler = torch.utils.data.DistributedSampler(range(8), num_replicas=2, rank=0)
    args = dict(model=torch.nn.Linear(2, 2), optimizers=[], sampler=sampler)
    if call == "save_checkpoint":
        args["step"] = 0
    with pytest.raises(TypeError) as error:
        getattr(bagua.checkpoint, call)(tmp_path / "step-0.pt", **args)
    assert str(error.value) == (
        f"{call}: sampler=torch.utils.data.distributed.DistributedSampler has no state_dict()/load_state_dict(), "
        "so it cannot resume mid-epoch (torch's DistributedSampler cannot); use bagua.data.ElasticDistributedSampler "
        "(DistributedSampler's arguments and order, resumable) or a bagua.data.LoadBalancingDistributedSampler")
