"""examples/train_digits.py end to end under torchrun: 2 ranks and a single process agree."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from tests.harness import run_command

# Under xdist (`--dist loadgroup`) one worker runs the module: its module-scoped jobs run once, not once per worker.
pytestmark = pytest.mark.xdist_group("train_digits")

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train_digits.py"
TORCHRUN = Path(sys.executable).parent / "torchrun"
EPOCHS = "5"
TIMEOUT_S = 180
FINAL = re.compile(r"final test accuracy: (\d+\.\d+) \(world size (\d+), algorithm (\S+)\)")


def _run(*args: str, ranks: int, cache_dir: Path) -> tuple[float, str]:
    """Run the example (under torchrun when ranks > 1) with its own cache (rank 0 empties it at
    start: a job sharing it would slow this one's cached epochs); return its final test accuracy
    and output."""
    args = (*args, "--cache-dir", str(cache_dir))
    if ranks > 1:
        cmd = [str(TORCHRUN), "--standalone", f"--nproc-per-node={ranks}", str(EXAMPLE)]
    else:
        cmd = [sys.executable, str(EXAMPLE)]
    cmd += ["--epochs", EPOCHS, *args]
    proc = run_command(cmd, timeout=TIMEOUT_S, cwd=ROOT)
    output = proc.stdout + proc.stderr
    found = FINAL.findall(proc.stdout)
    assert len(found) == 1, f"expected one 'final test accuracy' line (rank 0 only), got {found}:\n{output}"
    accuracy, world, algorithm = found[0]
    assert int(world) == ranks, output
    assert algorithm == (args[args.index("--algorithm") + 1] if "--algorithm" in args else "gradient_allreduce")
    assert "parameters identical on all ranks: True" in proc.stdout, output
    return float(accuracy), output


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> tuple[float, str]:
    return _run(ranks=2, cache_dir=tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory) -> tuple[float, str]:
    return _run(ranks=1, cache_dir=tmp_path_factory.mktemp("cache"))


def test_two_ranks_learn(two_ranks):
    accuracy, output = two_ranks
    assert accuracy >= 0.9, output


def test_single_process_learns(one_rank):
    accuracy, output = one_rank
    assert accuracy >= 0.9, output


def test_two_ranks_match_single_process(two_ranks, one_rank):
    # Same global batch, same shuffles: data parallelism must not change what is learned.
    assert abs(two_ranks[0] - one_rank[0]) <= 0.03, (two_ranks[0], one_rank[0])


def test_decentralized_run_learns_and_ends_identical(tmp_path):
    accuracy, output = _run("--algorithm", "decentralized", ranks=2, cache_dir=tmp_path)
    assert accuracy >= 0.9, output
    assert "averaged once for evaluation" in output


def test_cached_epochs_read_their_data_faster(two_ranks):
    # epochs 2+ read the transformed samples back from the LMDB cache instead of recomputing
    _, output = two_ranks
    assert output.count("(computed once, now cached)") == 1, output  # epoch 1 compares with nothing
    speedups = [float(s) for s in re.findall(r"\((\d+\.\d+)x faster than epoch 1, from the cache\)", output)]
    assert len(speedups) == int(EPOCHS) - 1, output
    assert min(speedups) >= 3.0, output
