"""The README's snippets, run as written (the names they leave to the reader are given here)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

import bagua
from tests.harness import run_ranks
from tests.parallel.models import make_model

README = Path(__file__).resolve().parents[2] / "README.md"
SAMPLES, BATCH, EPOCHS = 32, 4, 3  # 4 steps per epoch on each of 2 ranks


def readme_snippet(heading: str) -> str:
    """The first python block under ``## heading``."""
    section = README.read_text().split(f"\n## {heading}\n", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


class _Interrupted(Exception):
    """The job dies before this step."""


def _attempt(code, checkpoint_every: int, stop_at) -> dict:
    """One run of the recipe, as a fresh job would start it; interrupted before step ``stop_at``."""
    x = torch.randn(SAMPLES, 12, generator=torch.Generator().manual_seed(0))
    x[:, 0] = torch.arange(SAMPLES)  # the sample's index rides along as a feature
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    ns = {"bagua": bagua, "ds": torch.utils.data.TensorDataset(x, x[:, 1:4].argmax(1)), "opt": opt,
          "ddp": bagua.DistributedDataParallel(model, [opt]), "sched": torch.optim.lr_scheduler.StepLR(opt, 10),
          "epochs": EPOCHS, "checkpoint_every": checkpoint_every}
    seen, evaluated = [], []

    def train_step(x, y):
        if ns["step"] + 1 == stop_at:
            raise _Interrupted
        loss = torch.nn.functional.cross_entropy(ns["ddp"](x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        ns["sched"].step()
        seen.append((ns["step"] + 1, ns["epoch"], x[:, 0].long().tolist()))

    ns.update(train_step=train_step, evaluate=evaluated.append)
    try:
        exec(code, ns)
    except _Interrupted:
        pass
    ns["ddp"].close()
    return {"seen": seen, "evaluated": evaluated}


def _checkpoints_and_restarts(rank: int, workdir: str) -> dict:
    code = compile(readme_snippet("Checkpoints and restarts"), "README.md", "exec")
    out = {}
    for case, checkpoint_every in (("end_of_epoch", 4), ("mid_epoch", 3)):
        os.chdir(os.path.join(workdir, case))  # the snippet's "ckpt" directory is relative
        out[case] = [_attempt(code, checkpoint_every, stop_at=5), _attempt(code, checkpoint_every, stop_at=None)]
    return out


def test_the_checkpoint_recipe_resumes_every_sample_once_and_never_reenters_a_finished_epoch(tmp_path):
    for case in ("end_of_epoch", "mid_epoch"):
        (tmp_path / case).mkdir()
    ranks = run_ranks(_checkpoints_and_restarts, 2, str(tmp_path))
    for case, saved_at, evaluated_after in (("end_of_epoch", 4, [1, 2]), ("mid_epoch", 3, [0, 1, 2])):
        per_epoch = {e: [] for e in range(EPOCHS)}
        for first, resumed in (r[case] for r in ranks):
            assert first["evaluated"] == [0]  # interrupted at the first step of epoch 1
            assert resumed["evaluated"] == evaluated_after, f"{case}: the resumed run's epochs"
            assert resumed["seen"][0][0] == saved_at + 1, "steps count on from the checkpoint"
            for step, epoch, indices in [s for s in first["seen"] if s[0] <= saved_at] + resumed["seen"]:
                per_epoch[epoch] += indices
        for epoch, indices in per_epoch.items():
            assert sorted(indices) == list(range(SAMPLES)), f"{case}: epoch {epoch} trains every sample once"


def _as_written(rank: int, heading: str) -> dict:
    """Run the snippet under ``heading`` (it calls ``bagua.init_process_group()`` itself)."""
    from tests.parallel.models import flat_params, rank_batches

    ns = {"MyModel": make_model, "loader": rank_batches(rank, 4)}
    exec(compile(readme_snippet(heading), "README.md", "exec"), ns)
    return {name: flat_params(value) if isinstance(value, torch.nn.Module) else value
            for name, value in ns.items() if name in ("model", "everything")}


def test_the_distributed_training_loop_runs_as_written():
    rank0, rank1 = run_ranks(_as_written, 2, "Distributed training", init=False)
    assert torch.equal(rank0["model"], rank1["model"]), "bytegrad keeps the replicas identical"


def test_the_communication_core_snippet_runs_as_written():
    rank0, rank1 = run_ranks(_as_written, 2, "The communication core", init=False)
    assert torch.equal(rank0["everything"], torch.tensor([0.5] * 2000))
    assert torch.equal(rank1["everything"], rank0["everything"])


def _already_on_torch_ddp(rank: int) -> dict:
    """The torch DDP lines of "Already on torch DDP, ..." in a plain torch job, then a step; the
    Lightning line builds its Trainer (a fit of it is tests/lightning's)."""
    import lightning.pytorch as pl
    import torch.distributed as dist
    import torch.nn.functional as F

    from tests.parallel.models import flat_params, rank_batches

    dist.init_process_group("gloo")
    ns = {"model": make_model(), "torch": torch, "bagua": bagua, "pl": pl}
    exec(compile(readme_snippet("Already on torch DDP, Hugging Face or Lightning"), "README.md", "exec"), ns)
    model = ns["model"]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in rank_batches(rank, 3):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return {"weights": flat_params(model.module), "steps": ns["hook_state"].steps,
            "callbacks": [type(c).__name__ for c in ns["trainer"].callbacks]}


def test_the_torch_ddp_hook_snippet_runs_as_written():
    rank0, rank1 = run_ranks(_already_on_torch_ddp, 2, init=False, timeout=120)
    assert rank0["steps"] == 3 and torch.equal(rank0["weights"], rank1["weights"])
    assert "CommHook" in rank0["callbacks"]
