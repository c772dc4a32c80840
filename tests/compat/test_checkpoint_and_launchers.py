"""``bagua.torch_api.checkpoint`` (the original's layout over the native checkpoint, and files the
original wrote) and ``python -m bagua.distributed.launch`` / ``run`` (the original's flags)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.harness import run_ranks
from tests.parallel.models import flat_params, make_model, rank_batches, train


def _save_then_load(rank: int, directory: str):
    import bagua.torch_api as bagua
    from bagua.torch_api.algorithms import decentralized
    from bagua.torch_api.checkpoint import load_checkpoint, save_checkpoint

    assert load_checkpoint(directory, make_model()) == 0  # nothing saved yet: iteration 0
    model = make_model(seed=rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model = model.with_bagua([opt], decentralized.DecentralizedAlgorithm())
    train(model, opt, rank_batches(rank, 3))
    scheduler.step()
    save_checkpoint(3, directory, model, opt, scheduler)
    saved = flat_params(model)

    fresh = make_model(seed=10 + rank)
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    fresh_scheduler = torch.optim.lr_scheduler.StepLR(fresh_opt, step_size=1, gamma=0.5)
    fresh = fresh.with_bagua([fresh_opt], decentralized.DecentralizedAlgorithm())
    iteration = load_checkpoint(directory, fresh, fresh_opt, fresh_scheduler)
    return (iteration, torch.equal(flat_params(fresh), saved), fresh_scheduler.last_epoch,
            fresh.bagua_ddp.algorithm_state_dict() == model.bagua_ddp.algorithm_state_dict(), bagua.get_rank())


def test_a_checkpoint_round_trip_keeps_each_decentralized_replica_in_the_original_layout(tmp_path):
    results = run_ranks(_save_then_load, 2, str(tmp_path))
    for iteration, same_weights, scheduler_epoch, same_algorithm_state, _ in results:
        assert (iteration, same_weights, scheduler_epoch, same_algorithm_state) == (3, True, 1, True)
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "3"
    assert (tmp_path / "iter_0000003" / "mp_rank_00_model_states.pt").is_file()


def test_a_checkpoint_the_original_wrote_loads(tmp_path):
    from bagua.torch_api.checkpoint import load_checkpoint

    model = make_model(seed=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train(model, opt, rank_batches(0, 2))
    (tmp_path / "iter_0000007").mkdir()
    torch.save({"iteration": 7, "model": model.state_dict(), "optimizer": opt.state_dict()},
               tmp_path / "iter_0000007" / "mp_rank_00_model_states.pt")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("7")
    fresh = make_model(seed=2)
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    assert load_checkpoint(str(tmp_path), fresh, fresh_opt) == 7
    assert torch.equal(flat_params(fresh), flat_params(model))
    assert fresh_opt.state_dict()["state"].keys() == opt.state_dict()["state"].keys()


def test_an_original_layout_checkpoint_that_would_run_code_is_refused_unless_trusted(tmp_path):
    from bagua.checkpoint import UntrustedCheckpointError
    from bagua.torch_api.checkpoint import load_checkpoint
    from tests.payloads import RunsCodeWhenUnpickled

    model = make_model(seed=1)
    marker = tmp_path / "marker"
    (tmp_path / "iter_0000007").mkdir()
    torch.save({"iteration": 7, "model": model.state_dict(), "args": RunsCodeWhenUnpickled(marker)},
               tmp_path / "iter_0000007" / "mp_rank_00_model_states.pt")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("7")
    with pytest.raises(UntrustedCheckpointError, match=r"tests\.payloads\.write_marker.*trust_pickled=True"):
        load_checkpoint(str(tmp_path), make_model(seed=2))
    assert not marker.exists()
    assert load_checkpoint(str(tmp_path), make_model(seed=2), trust_pickled=True) == 7
    assert marker.exists()


def test_a_tracker_file_without_an_iteration_is_a_clear_error(tmp_path):
    from bagua.checkpoint import CheckpointError
    from bagua.torch_api.checkpoint import load_checkpoint

    (tmp_path / "latest_checkpointed_iteration.txt").write_text("latest")
    with pytest.raises(CheckpointError, match="must hold an iteration number or 'release', got 'latest'"):
        load_checkpoint(str(tmp_path), make_model())


WORKER = """
import os, sys
# a file per rank: the ranks' lines on one stdout can interleave
with open(os.path.join(os.path.dirname(__file__), "rank" + os.environ["RANK"]), "w") as out:
    out.write(" ".join(["worker", os.environ["RANK"], os.environ["BAGUA_DEFAULT_BUCKET_SIZE"],
                        str(os.environ.get("BAGUA_NET_NSTREAMS")), str(os.environ.get("BAGUA_AUTOTUNE")),
                        str(sys.argv[1:])]))
"""


def _launch(tmp_path: Path, launcher: str, *flags: str) -> subprocess.CompletedProcess:
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(WORKER))
    return subprocess.run([sys.executable, "-m", f"bagua.distributed.{launcher}", *flags, str(script), "--x", "1"],
                          capture_output=True, text=True, timeout=120,
                          env={**{k: v for k, v in os.environ.items() if k not in ("BAGUA_NET_NSTREAMS", "BAGUA_AUTOTUNE")},
                               "OMP_NUM_THREADS": "1"})


def test_launch_maps_the_original_flags_onto_torchrun(tmp_path):
    done = _launch(tmp_path, "launch", "--nproc_per_node=2", "--master_port=0", "--default_bucket_size", "1048576",
                   "--set_additional_flag", "--bagua_service_port", "29501", "--autotune_level", "0",
                   "--enable_bagua_net")
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [(tmp_path / f"rank{r}").read_text() for r in range(2)]
    assert lines == [f"worker {r} 1048576 2 None ['--local-rank={r}', '--x', '1']" for r in range(2)]


def test_autotune_level_turns_in_process_autotuning_on(tmp_path):
    done = _launch(tmp_path, "run", "--nproc_per_node=1", "--master_port=0", "--autotune_level", "1",
                   "--autotune_max_samples", "10")
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "rank0").read_text() == "worker 0 10485760 None 1 ['--x', '1']"
    assert "--autotune_max_samples: not used" in done.stderr


@pytest.mark.parametrize("launcher, flags, message", [
    ("run", ["--autotune_level", "3"], "--autotune_level: invalid choice: 3"),
    ("run", ["--is_output_autotune_log"], "--is_output_autotune_log: there is nothing to log without --autotune_level 1"),
    ("launch", ["--host_list", "a,b"], "--host_list: starting hosts over ssh is not part of this bagua"),
    ("run", ["--default_bucket_size", "0"], "--default_bucket_size must be a positive number of bytes"),
])
def test_unsupported_original_flags_are_clear_errors(tmp_path, launcher, flags, message):
    done = _launch(tmp_path, launcher, *flags)
    assert done.returncode == 2 and message in done.stderr, done.stderr
