#!/usr/bin/env python3
"""Lightning epoch time: ``strategy="ddp"`` vs ``BaguaStrategy("gradient_allreduce")`` and ``("bytegrad")``.

Every rank fits the same LightningModule (an MLP from ``ddp.py``, SGD with momentum, a
synthetic classification set, Lightning's DistributedSampler) once per variant and repetition,
the variants interleaved and their order rotated per repetition so that machine load hits them
alike. Each fit runs ``--epochs`` epochs; an epoch's time is measured from
``on_train_epoch_start`` to ``on_train_epoch_end`` (max over ranks) and the first epoch of each
fit is dropped (Trainer set-up, first-touch allocations). Reported: each variant's median epoch
time, and the ratio to Lightning's DDP per repetition (its median).

Settings (one worker job each):

- loopback: 2 ranks under ``torchrun --standalone`` (Gloo over ``lo``); MLP 1024-1024x4-10
  (4.2M parameters), batch 64 per rank, 24 steps per epoch;
- 100mbit: 2 ranks on the emulated network (``benchmarks.network``: each in its own network
  namespace behind a tbf-capped veth); MLP 1024-768x3-10 (2.0M parameters, 8 MB of fp32 gradients), batch 64 per
  rank, 6 steps per epoch.

Targets: gradient_allreduce <= 1.05x Lightning's DDP epoch time (loopback); bytegrad >= 2.5x
faster than Lightning's DDP at 100 Mbit/s.

Usage (from the repository root)::

    python -m benchmarks.step.lightning_strategy                  # both settings (~5 min, root for netns)
    python -m benchmarks.step.lightning_strategy --parts loopback
    torchrun --standalone --nproc-per-node 2 -m benchmarks.step.lightning_strategy --worker   # one job by hand
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time

from benchmarks.jobs import emulated, loopback, run_job, worker
from benchmarks.network import requirements_problem
from benchmarks.records import save_run

TAG = "@@lightning-bench@@ "
VARIANTS = ("ddp", "gradient_allreduce", "bytegrad")
SETTINGS = {
    "loopback": {"mlp": "1024-1024x4-10", "batch": 64, "steps": 24, "reps": 7},
    "100mbit": {"mlp": "1024-768x3-10", "batch": 64, "steps": 6, "reps": 3},
}
logger = logging.getLogger("lightning_strategy")


def run_worker(args: argparse.Namespace) -> int:
    import lightning.pytorch as pl
    import torch
    import torch.nn.functional as F
    from lightning.pytorch.plugins.environments import TorchElasticEnvironment
    from lightning.pytorch.strategies import DDPStrategy
    from torch.utils.data import DataLoader, TensorDataset

    import bagua
    from bagua.lightning import BaguaStrategy
    from benchmarks.step.ddp import make_model, parse_mlp

    torch.set_num_threads(1)
    bagua.init_process_group()  # torch.distributed too: every variant finds the same default group
    dims = parse_mlp(args.mlp)
    world, local_world = int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_WORLD_SIZE"])
    g = torch.Generator().manual_seed(0)
    samples = args.batch * args.steps * world
    data = TensorDataset(torch.randn(samples, dims[0], generator=g), torch.randint(0, dims[-1], (samples,), generator=g))

    class Mlp(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = make_model(dims)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

        def train_dataloader(self):
            return DataLoader(data, batch_size=args.batch, shuffle=True)

    class EpochTimer(pl.Callback):
        def __init__(self):
            self.times: list[float] = []

        def on_train_epoch_start(self, trainer, pl_module):
            self._start = time.perf_counter()

        def on_train_epoch_end(self, trainer, pl_module):
            self.times.append(time.perf_counter() - self._start)

    def strategy(variant: str):
        env = TorchElasticEnvironment()  # torchrun's variables, which the emulated network sets too
        if variant == "ddp":
            return DDPStrategy(cluster_environment=env)
        return BaguaStrategy(variant, cluster_environment=env)

    epoch_times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for rep in range(args.reps):
        for variant in VARIANTS[rep % len(VARIANTS):] + VARIANTS[:rep % len(VARIANTS)]:
            timer = EpochTimer()
            trainer = pl.Trainer(
                strategy=strategy(variant), accelerator="cpu", devices=local_world, num_nodes=world // local_world,
                max_epochs=args.epochs, logger=False, enable_progress_bar=False, enable_model_summary=False,
                enable_checkpointing=False, callbacks=[timer],
            )
            trainer.fit(Mlp())
            times = torch.tensor(timer.times[1:], dtype=torch.float64)
            bagua.comm.allreduce(times, op="max")  # the slowest rank's epoch is the epoch
            epoch_times[variant] += times.tolist()
    if bagua.get_rank() == 0:
        print(TAG + json.dumps({"epoch_times": epoch_times, "mlp": args.mlp, "batch": args.batch,
                                "steps": args.steps, "world": world}), flush=True)
    return 0


def summarize(setting: str, job: dict) -> dict:
    times = job["epoch_times"]
    per_epoch = len(times["ddp"]) // SETTINGS[setting]["reps"]
    medians = {v: statistics.median(t) for v, t in times.items()}
    ratios = {}
    for v in VARIANTS[1:]:  # per repetition: variant / ddp, then the median over repetitions
        paired = [statistics.median(times[v][i:i + per_epoch]) / statistics.median(times["ddp"][i:i + per_epoch])
                  for i in range(0, len(times["ddp"]), per_epoch)]
        ratios[v] = statistics.median(paired)
    return {"setting": setting, "median_epoch_s": medians, "ratio_to_ddp": ratios, "epoch_times": times,
            **{k: job[k] for k in ("mlp", "batch", "steps", "world")}}


def format_summary(s: dict) -> str:
    lines = [f"\n{s['setting']}: MLP {s['mlp']}, batch {s['batch']} per rank, {s['steps']} steps per epoch, {s['world']} ranks",
             f"{'variant':<22}{'median epoch s':>16}{'x DDP':>10}"]
    for v in VARIANTS:
        ratio = s["ratio_to_ddp"].get(v, 1.0)
        lines.append(f"{v:<22}{s['median_epoch_s'][v]:>16.3f}{ratio:>10.3f}")
    return "\n".join(lines)


def run_driver(args: argparse.Namespace) -> int:
    started, failed, summaries = time.monotonic(), [], []
    for setting in args.parts:
        cfg = SETTINGS[setting]
        command = worker("benchmarks.step.lightning_strategy", "--worker", "--mlp", cfg["mlp"], "--batch", cfg["batch"],
                         "--steps", cfg["steps"], "--reps", cfg["reps"], "--epochs", args.epochs)
        if setting == "loopback":
            cmd = loopback(2, command)
        else:
            problem = requirements_problem()
            if problem:
                logger.warning("skipping %s: %s", setting, problem)
                failed.append(setting)
                continue
            cmd = emulated(command, "--ranks", "2", "--rate", setting)
        job = run_job(cmd, 1200, TAG, logger)
        if job is None:
            failed.append(setting)
            continue
        summaries.append(summarize(setting, job))
        print(format_summary(summaries[-1]), flush=True)
    key = {f"{s['setting']}_{v}_x_ddp": round(s["ratio_to_ddp"][v], 3) for s in summaries for v in VARIANTS[1:]}
    save_run(args.json, time.monotonic() - started, failed, key, summaries=summaries)
    print("key:", json.dumps(key))
    return 1 if failed else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", action="store_true", help="run as one rank (under torchrun or the emulated network)")
    p.add_argument("--parts", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
    p.add_argument("--mlp", default=SETTINGS["loopback"]["mlp"])
    p.add_argument("--batch", type=int, default=SETTINGS["loopback"]["batch"])
    p.add_argument("--steps", type=int, default=SETTINGS["loopback"]["steps"], help="steps per epoch")
    p.add_argument("--reps", type=int, default=SETTINGS["loopback"]["reps"])
    p.add_argument("--epochs", type=int, default=3, help="epochs per fit (the first is dropped)")
    p.add_argument("--json", default=".bench/lightning_strategy.json")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    return run_worker(args) if args.worker else run_driver(args)


if __name__ == "__main__":
    sys.exit(main())
