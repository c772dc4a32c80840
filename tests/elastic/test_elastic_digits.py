"""examples/elastic_digits.py under torchrun: a worker killed mid-epoch costs no step and no sample.

The killed run resumes from its last checkpoint and ends with weights bit-equal to an
uninterrupted run's (same seed: the sampler's position and every rank's RNG states are in the
checkpoint), and each epoch, gathered from every rank and attempt, trains on every sample once.
"""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from benchmarks.scale.elastic import trained_samples
from tests.harness import run_command

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "elastic_digits.py"
TRAIN_SAMPLES = 1437  # the digits' training split
EPOCHS = 2


def _run(tmp: Path, *extra: str) -> tuple[Path, str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", "2", str(EXAMPLE), "--epochs", str(EPOCHS), "--checkpoint-every", "10",
           "--checkpoint-dir", str(tmp / "ckpt"), "--sample-log", str(tmp / "samples"), *extra]
    run = run_command(cmd, timeout=150, cwd=ROOT)
    return tmp, run.stdout + run.stderr


def _final_weights(tmp: Path) -> dict:
    last = sorted((tmp / "ckpt").glob("step-*.pt"))[-1]
    return torch.load(last, weights_only=False)["model"]


# a stateless algorithm and one whose optimizer and phase are state; every algorithm's checkpoint
# round trip (bytegrad, onebit_grad's residuals, ...) is exact in tests/checkpoint/test_checkpoint.py
@pytest.mark.parametrize("algorithm", ["gradient_allreduce", "qadam"])
def test_a_worker_killed_mid_epoch_resumes_exactly(tmp_path, algorithm):
    # killed in epoch 1, 5 steps after a checkpoint (qadam: in its 50-step warm-up, resumed across its end)
    # the two jobs are independent: the reference runs while the killed one waits for its restart
    with ThreadPoolExecutor(2) as pool:
        killed_job = pool.submit(_run, tmp_path / "killed", "--algorithm", algorithm, "--fail-at-step", "45")
        reference_job = pool.submit(_run, tmp_path / "reference", "--algorithm", algorithm)
        (killed, output), (reference, _) = killed_job.result(), reference_job.result()
    assert "failing on purpose after step 45" in output and "resumed from" in output, output[-4000:]
    expected, got = _final_weights(reference), _final_weights(killed)
    assert all(torch.equal(expected[k], got[k]) for k in expected)
    for epoch, samples in trained_samples(killed / "samples").items():
        # torch's padding: 1437 samples on 2 ranks, one sample repeated to even them out
        assert sorted(set(samples)) == list(range(TRAIN_SAMPLES)), epoch
        assert len(samples) == TRAIN_SAMPLES + 1, epoch
    assert sorted(trained_samples(killed / "samples")) == list(range(EPOCHS))
