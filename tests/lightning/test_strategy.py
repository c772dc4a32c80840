"""BaguaStrategy in real Lightning runs: 2 CPU ranks launched by Lightning (and by torchrun), each
scenario a real fit (tests/lightning/_fit_job.py) whose per-rank results are compared here."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# Under xdist (`--dist loadgroup`) one worker runs the module: its module-scoped jobs run once, not once per worker.
pytestmark = pytest.mark.xdist_group("lightning_strategy")

pytest.importorskip("lightning")

JOB = Path(__file__).with_name("_fit_job.py")
ALGORITHMS = ["gradient_allreduce", "bytegrad", "decentralized", "low_precision_decentralized", "async", "qadam"]
SYNCHRONOUS = {"gradient_allreduce", "bytegrad", "qadam"}
SCENARIOS = [f"algo_{name}" for name in ALGORITHMS] + [
    "by_name", "resume_sgd", "resume_qadam", "switch_algorithm", "accumulate", "manual", "bf16", "raises",
    "qadam_wrong_optimizer", "collectives", "autotune", "ddp_comm_hook",
]


def run_job(command: list[str], deadline_s: float) -> subprocess.CompletedProcess:
    """Run a launcher and its workers in a session of their own; kill them all at the deadline."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=deadline_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{' '.join(command[-3:])} did not finish in {deadline_s} s:\n{out[-4000:]}")
    return subprocess.CompletedProcess(command, proc.returncode, out, None)


class Results:
    def __init__(self, outdir: Path, run: subprocess.CompletedProcess):
        self.outdir, self.run = outdir, run

    def __call__(self, scenario: str) -> tuple[dict, dict]:
        ranks = []
        for rank in (0, 1):
            path = self.outdir / f"{scenario}.rank{rank}.pt"
            if not path.exists():
                pytest.fail(f"no result from rank {rank} for {scenario} (exit {self.run.returncode}):\n{self.run.stdout[-4000:]}")
            result = torch.load(path, weights_only=False)
            assert "error" not in result, f"{scenario} failed on rank {rank}:\n{result['error']}"
            assert result["world_size"] == 2
            ranks.append(result)
        return ranks[0], ranks[1]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Results:
    outdir = tmp_path_factory.mktemp("lightning")
    run = run_job([sys.executable, str(JOB), str(outdir), *SCENARIOS], deadline_s=280)
    assert run.returncode == 0, run.stdout[-4000:]
    return Results(outdir, run)


def max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def assert_trained(result: dict) -> None:
    losses = result["losses"]
    quarter = len(losses) // 4
    first, last = sum(losses[:quarter]) / quarter, sum(losses[-quarter:]) / quarter
    assert last < 0.7 * first, f"the loss did not fall: {first:.3f} -> {last:.3f}"
    assert all(torch.isfinite(w.double()).all() for w in result["weights"].values())
    assert result["unwrapped"], "after fit the strategy must hold the LightningModule itself, unwrapped"


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_every_algorithm_fits_with_validation_and_synced_logging(results, algorithm):
    rank0, rank1 = results(f"algo_{algorithm}")
    assert_trained(rank0)
    assert_trained(rank1)
    assert rank0["metrics"]["val_loss"] == rank1["metrics"]["val_loss"]  # sync_dist=True: one value
    assert rank0["metrics"]["val_loss"] < 1.0
    if algorithm in SYNCHRONOUS or algorithm == "async":  # async: teardown averages the replicas
        assert max_difference(rank0["weights"], rank1["weights"]) == 0.0
    else:  # decentralized replicas differ after fit; validate() evaluates rank 0's on every rank
        assert max_difference(rank0["weights"], rank1["weights"]) > 0.0
    assert max_difference(rank0["weights_after_validate"], rank1["weights_after_validate"]) == 0.0
    assert max_difference(rank0["weights_after_validate"], rank0["weights"]) == 0.0


def test_strategy_by_name_and_checkpoints_hold_the_plain_module(results):
    from tests.lightning._fit_job import Net

    rank0, _ = results("by_name")
    assert rank0["strategy"] == "BaguaStrategy"
    final = rank0["weights"]
    for name, expected in (("last.ckpt", final), ("after.ckpt", final), ("mid.ckpt", rank0["mid_weights"])):
        checkpoint = torch.load(results.outdir / name, weights_only=False)
        assert set(checkpoint["state_dict"]) == set(final), name  # no wrapper prefix
        model = Net.load_from_checkpoint(results.outdir / name)
        assert not hasattr(model, "_bagua_wrapper")
        assert max_difference({k: v for k, v in model.state_dict().items()}, expected) == 0.0, name
    mid = torch.load(results.outdir / "mid.ckpt", weights_only=False)
    assert mid["bagua"]["step"] == 8  # saved while wrapped: the wrapper's step and algorithm state


def test_autotune_through_the_strategy_changes_no_weight(results):
    tuned, untuned = results("autotune"), results("algo_bytegrad")
    for rank in (0, 1):
        assert tuned[rank]["trials"] == 3 and tuned[rank]["tuned"]
        assert max_difference(tuned[rank]["weights"], untuned[rank]["weights"]) == 0.0


@pytest.mark.parametrize("optimizer", ["sgd", "qadam"])
def test_resume_from_checkpoint_equals_the_uninterrupted_fit(results, optimizer):
    for rank in results(f"resume_{optimizer}"):
        assert max_difference(rank["straight"], rank["resumed"]) <= 1e-5


def test_resume_under_another_algorithm_carries_the_step_count(results):
    for rank in results("switch_algorithm"):  # saved after one epoch (8 steps) under bytegrad
        assert rank["steps_at_start"] == [8] and len(rank["losses"]) == 8
        assert all(torch.isfinite(w.double()).all() for w in rank["weights"].values())


def test_gradient_accumulation_communicates_once_per_optimizer_step(results):
    rank0, rank1 = results("accumulate")
    plain, accumulated, double = rank0["plain"], rank0["accumulated"], rank0["double_batch"]
    assert accumulated["bytes_per_sample"] == pytest.approx(plain["bytes_per_sample"] / 2, rel=0.02)
    assert accumulated["bytes_per_sample"] == pytest.approx(double["bytes_per_sample"], rel=0.02)
    assert max_difference(accumulated["weights"], double["weights"]) <= 1e-5
    assert max_difference(accumulated["weights"], rank1["accumulated"]["weights"]) == 0.0


def test_lightnings_own_ddp_strategy_with_bagua_hook_sends_bytegrads_bits(results):
    rank0, rank1 = results("ddp_comm_hook")
    assert_trained(rank0)
    assert rank0["hook_steps"] == len(rank0["losses"]) and rank0["bytes"] > 0  # the hook averaged every step
    assert max_difference(rank0["weights"], rank1["weights"]) == 0.0
    # torch DDP + the hook, and BaguaStrategy("bytegrad"): the same fit to the last bit
    assert max_difference(rank0["weights"], results("algo_bytegrad")[0]["weights"]) == 0.0


def test_manual_optimization_with_two_backwards_per_step(results):
    rank0, rank1 = results("manual")
    assert_trained(rank0)
    assert max_difference(rank0["weights"], rank1["weights"]) == 0.0  # both backwards synced, and the buffers


def test_bf16_mixed_precision_on_cpu(results):
    rank0, rank1 = results("bf16")
    assert_trained(rank0)
    assert max_difference(rank0["weights"], rank1["weights"]) == 0.0


def test_a_step_that_raises_ends_the_fit_promptly_and_unwraps(results):
    for rank in results("raises"):
        assert rank["message"] == "planned failure at step 3"
        assert rank["unwrapped"]
        assert rank["seconds"] < 30
    # the scenarios after it ran in the same processes: the group survived the failure
    results("qadam_wrong_optimizer")


def test_qadam_by_name_needs_one_qadam_optimizer(results):
    rank0, _ = results("qadam_wrong_optimizer")
    assert ("needs exactly one bagua.optim.qadam.QAdamOptimizer (returned by configure_optimizers; LR schedulers "
            "allowed), got [SGD]") in rank0["message"]


def test_lightning_collectives_go_through_bagua(results):
    rank0, rank1 = results("collectives")
    for rank in (rank0, rank1):
        assert rank["mean"] == 1.5 and rank["sum"] == 3.0 and rank["max"] == 2.0 and rank["int_mean"] == 1
        assert rank["torch_op_sum"] == 3.0
        assert rank["gathered"] == [[1.0, 1.0], [2.0, 2.0]]
        assert rank["broadcast"] == {"from": 0}
    assert rank0["gather_grad"] == [2.0, 2.0] and rank1["gather_grad"] == [2.0, 2.0]


def test_torchrun_launch_with_an_algorithm_instance(tmp_path):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    run = run_job([*torchrun, str(JOB), str(tmp_path), "torchrun_instance"], deadline_s=120)
    assert run.returncode == 0, run.stdout[-4000:]
    rank0, rank1 = Results(tmp_path, run)("torchrun_instance")
    assert_trained(rank0)
    assert max_difference(rank0["weights"], rank1["weights"]) == 0.0


# --- before any process is launched -------------------------------------------------------------
def test_bad_arguments_fail_before_launch():
    from bagua.algorithms import GradientAllReduceAlgorithm
    from bagua.lightning import BaguaStrategy

    with pytest.raises(ValueError, match=r"unknown algorithm 'allreduce'; registered: async, bytegrad"):
        BaguaStrategy("allreduce")
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'hierarchy': it is no option of algorithm "
                                        r"'bytegrad' \(bagua.algorithms.bytegrad.ByteGradAlgorithm accepts hierarchical"):
        BaguaStrategy("bytegrad", hierarchy=True)
    with pytest.raises(ValueError, match="'hierarchical': algorithm is already an instance"):
        BaguaStrategy(GradientAllReduceAlgorithm(), hierarchical=True)
    with pytest.raises(TypeError, match=r"'warmup': it is no option of algorithm 'qadam'"):
        BaguaStrategy("qadam", warmup=10)
    # bad values too, naming the option, the value and the choices, before any rank starts
    with pytest.raises(ValueError, match=r"BaguaStrategy: peer_selection_mode must be one of \['all', 'shift_one'\], "
                                         r"got 'everyone'"):
        BaguaStrategy(algorithm="decentralized", peer_selection_mode="everyone")
    with pytest.raises(ValueError, match=r"BaguaStrategy: QAdamAlgorithm: bits must be one of \[8, 1\].*got 3"):
        BaguaStrategy("qadam", bits=3)
    with pytest.raises(ValueError, match="BaguaStrategy: block_size must be a power of two"):
        BaguaStrategy("bytegrad", block_size=3)
    with pytest.raises(TypeError, match="must be a name"):
        BaguaStrategy(3)
    with pytest.raises(ValueError, match="bucket_size_bytes must be a positive int"):
        BaguaStrategy(bucket_size_bytes=0)


def test_the_import_registers_the_name_once():
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import StrategyRegistry

    import bagua.lightning

    bagua.lightning.BaguaStrategy.register_strategies(StrategyRegistry)  # idempotent
    trainer = pl.Trainer(strategy="bagua", accelerator="cpu", devices=1, logger=False)
    assert isinstance(trainer.strategy, bagua.lightning.BaguaStrategy)
    assert "ddp" in StrategyRegistry and StrategyRegistry.get("ddp").__class__.__name__ == "DDPStrategy"


@pytest.mark.parametrize("module", ["bagua.lightning", "lightning_bagua"])
def test_bagua_does_not_import_lightning_and_says_how_to_install_it(module):
    check = "import sys, bagua; assert 'lightning' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", check], capture_output=True).returncode == 0
    blocked = f"import sys; sys.modules['lightning'] = None; import {module}"
    run = subprocess.run([sys.executable, "-c", blocked], capture_output=True, text=True)
    assert ("ImportError: Bagua's Lightning strategy (bagua.lightning, lightning_bagua) needs Lightning 2.6 or newer: "
            "pip install 'bagua-torch[lightning]' (in a clone: pip install -e '.[lightning]')") in run.stderr


# --- the spellings of Lightning's documentation, each in its own import order, each a real fit ----------
SPELLING_JOB = Path(__file__).with_name("_spelling_job.py")


@pytest.mark.parametrize("spelling", ["lightning_bagua", "lightning_then_bagua", "bagua_then_lightning"])
def test_each_documented_spelling_fits_on_two_ranks(tmp_path, spelling):
    run = run_job([sys.executable, str(SPELLING_JOB), str(tmp_path), spelling], deadline_s=120)
    assert run.returncode == 0, run.stdout[-4000:]
    rank0, rank1 = Results(tmp_path, run)(spelling)
    assert rank0["strategy"] == "bagua.lightning.BaguaStrategy"
    if spelling != "lightning_bagua":  # the name worked through what `import bagua` did, not an import of the strategy
        assert not rank0["strategy_module_before_trainer"]
    assert len(rank0["losses"]) == 8 and all(torch.isfinite(torch.tensor(rank0["losses"])))
    assert max_difference(rank0["weights"], rank1["weights"]) == 0.0



def test_the_standalone_pytorch_lightning_trainer_is_told_which_trainer_to_import():
    """pytorch_lightning's Trainer cannot take a lightning.pytorch strategy: the name says so."""
    script = "import bagua, pytorch_lightning as pl; pl.Trainer(strategy='bagua', accelerator='cpu', devices=1)"
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert ("ImportError: Trainer(strategy='bagua') is a strategy of the lightning package's Trainer "
            "(lightning.pytorch), not of the standalone pytorch_lightning package's: import the Trainer with "
            "`import lightning.pytorch as pl` (or `from lightning import Trainer`)") in run.stderr
