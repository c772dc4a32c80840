"""examples/elastic_digits.py under torchrun: a worker killed mid-epoch costs no step and no sample.

The killed run resumes from its last checkpoint and ends with weights bit-equal to an
uninterrupted run's (same seed: the sampler's position and every rank's RNG states are in the
checkpoint), and each epoch, gathered from every rank and attempt, trains on every sample once.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "elastic_digits.py"
TRAIN_SAMPLES = 1437  # the digits' training split
EPOCHS = 2


def _run(tmp: Path, *extra: str) -> tuple[Path, str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", "2", str(EXAMPLE), "--epochs", str(EPOCHS), "--checkpoint-every", "10",
           "--checkpoint-dir", str(tmp / "ckpt"), "--sample-log", str(tmp / "samples"), *extra]
    try:
        run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=150)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"elastic_digits did not finish in 150 s (a hang?)\n{e.stdout}\n{e.stderr}")
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-4000:]
    return tmp, output


def _final_weights(tmp: Path) -> dict:
    last = sorted((tmp / "ckpt").glob("step-*.pt"))[-1]
    return torch.load(last, weights_only=False)["model"]


def _trained_samples(tmp: Path) -> dict[int, list[int]]:
    """Per epoch, the samples of every step that counts: a step repeated after a restart counts
    in the latest attempt only."""
    by_step: dict[int, dict] = {}
    for path in (tmp / "samples").glob("*.jsonl"):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            kept = by_step.get(record["step"])
            if kept is None or record["attempt"] > kept["attempt"]:
                by_step[record["step"]] = {"attempt": record["attempt"], "epoch": record["epoch"], "ranks": {}}
            if by_step[record["step"]]["attempt"] == record["attempt"]:
                by_step[record["step"]]["ranks"][record["rank"]] = record["samples"]
    epochs = defaultdict(list)
    for step in sorted(by_step):
        for samples in by_step[step]["ranks"].values():
            epochs[by_step[step]["epoch"]] += samples
    return epochs


def test_a_worker_killed_mid_epoch_resumes_exactly(tmp_path):
    killed, output = _run(tmp_path / "killed", "--fail-at-step", "45")  # epoch 1, 5 steps after a checkpoint
    assert "failing on purpose after step 45" in output and "resumed from" in output, output[-4000:]
    reference, _ = _run(tmp_path / "reference")
    expected, got = _final_weights(reference), _final_weights(killed)
    assert all(torch.equal(expected[k], got[k]) for k in expected)
    for epoch, samples in _trained_samples(killed).items():
        # torch's padding: 1437 samples on 2 ranks, one sample repeated to even them out
        assert sorted(set(samples)) == list(range(TRAIN_SAMPLES)), epoch
        assert len(samples) == TRAIN_SAMPLES + 1, epoch
    assert sorted(_trained_samples(killed)) == list(range(EPOCHS))
