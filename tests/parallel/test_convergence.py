"""Every algorithm, 2 ranks, on scikit-learn's digits: test accuracy within 1 point of torch DDP."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from tests.harness import run_ranks

# Under xdist (`--dist loadgroup`) one worker runs the module: its module-scoped jobs run once, not once per worker.
pytestmark = pytest.mark.xdist_group("convergence")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_digits.py"
EPOCHS = 20


def _example():
    if str(EXAMPLE.parent) not in sys.path:  # the example imports its sibling replicas.py
        sys.path.insert(0, str(EXAMPLE.parent))
    spec = importlib.util.spec_from_file_location("train_digits", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _bagua_run(rank: int, algorithm: str, cache_dir: str) -> dict:
    example = _example()
    args = ["--epochs", str(EPOCHS), "--algorithm", algorithm, "--cache-dir", cache_dir]  # the job's own cache:
    return example.train(example.parse_args(args), log=lambda line: None)  # its rank 0 empties it at start


def _torch_ddp_run(rank: int) -> float:
    """The same data, model, optimizer and batches as the example, under torch DDP."""
    example = _example()
    args = example.parse_args(["--epochs", str(EPOCHS)])
    train_set, test_set = example.load_data()
    train_set = example.materialize(train_set)  # the same samples the example caches
    sampler = torch.utils.data.DistributedSampler(train_set, shuffle=True, seed=args.seed)
    loader = torch.utils.data.DataLoader(train_set, batch_size=args.batch_size // 2, sampler=sampler)
    torch.manual_seed(args.seed)
    model = example.make_model()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = example.make_optimizer("gradient_allreduce", ddp.parameters(), None)
    for epoch in range(1, EPOCHS + 1):
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
            optimizer.step()
    return example.accuracy(model, test_set)


@pytest.fixture(scope="module")
def torch_ddp_accuracy() -> float:
    accuracies = run_ranks(_torch_ddp_run, 2, timeout=180)
    assert accuracies[0] == accuracies[1]
    return accuracies[0]


@pytest.mark.parametrize(
    "algorithm", ["gradient_allreduce", "bytegrad", "decentralized", "low_precision_decentralized", "async", "qadam",
                  "qadam1", "onebit_grad"]
)
def test_algorithm_converges_like_torch_ddp(algorithm, torch_ddp_accuracy, tmp_path):
    results = run_ranks(_bagua_run, 2, algorithm, str(tmp_path / "cache"), timeout=240)
    assert results[0]["identical"] and results[1]["identical"]
    assert results[0]["test_acc"] == results[1]["test_acc"]
    assert torch_ddp_accuracy >= 0.95
    # "within 1 point": at most 1 point below torch DDP (doing better is allowed)
    assert results[0]["test_acc"] >= torch_ddp_accuracy - 0.01, (algorithm, results[0], torch_ddp_accuracy)
