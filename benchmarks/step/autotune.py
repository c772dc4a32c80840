#!/usr/bin/env python3
"""Autotuning: the autotuned step time against the exhaustive grid of the same search space.

Settings: 2 ranks on the emulated network (``benchmarks.network``: each rank in its own network
namespace behind a tbf-capped veth) at 100mbit and 1gbit; algorithms bytegrad and gradient_allreduce;
the 10M-parameter MLP of ``ddp.py`` (1024-1664x4-10, 40 MB of fp32 gradients), batch 64
per rank, SGD with momentum (``--algorithms qadam``: its ``QAdamOptimizer``, eps 1e-3, past a
1-step warm-up, as ``ddp.py``'s). The search space is ``ddp.tunables()`` for that algorithm on that
job (both ranks are one-rank nodes without stripes: the bucket size, and bytegrad's and qadam's
segment size; qadam's ``overlap`` too), with the segment sizes cut to three values so that the
grid stays a few minutes long.

One job per (link, algorithm), all in one worker process per rank:

1. grid: every configuration of the space, applied with ``ddp.configure``: one settling step and
   ``--grid-steps`` timed steps; the median, max over ranks;
2. autotuned: a fresh wrapper with ``autotune=AutotuneConfig(space=<the same>)``, trained until
   tuning ends (the steps it took are counted);
3. check: the default configuration, the grid's best and the autotuned one, ``--check-steps``
   timed steps each, in ``--check-rounds`` interleaved rounds (A B C, B C A, ...), so that
   drifts in machine load hit them alike. The key ratios come from this part: the median over
   rounds of the ratio within a round.

Targets: autotuned / grid best <= 1.05; tuning done within 60 steps; default / autotuned >= 1.15
where the grid says the default is that far off.

Usage (from the repository root)::

    python -m benchmarks.step.autotune                 # everything (root, iproute2), ~15 min
    python -m benchmarks.step.autotune --rates 1gbit --algorithms gradient_allreduce
    python -m benchmarks.step.autotune --rates 1gbit --algorithms qadam   # overlap or not, where cores are scarce
    python -m benchmarks.step.autotune --from-json .bench/autotune.json   # tables and plot again

The last line printed is the key ratios per job. Plot: step time of every trial with the grid's
best as a line, ``benchmarks/figures/autotune_trials.png``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from benchmarks.jobs import emulated, run_job, worker
from benchmarks.network import check_requirements
from benchmarks.records import FIGURES, add_run_options, finish_run
from benchmarks.step.ddp import make_batches, make_model, mlp_params, parse_mlp

logger = logging.getLogger("benchmarks.step.autotune")

MODULE = "benchmarks.step.autotune"
JSON_TAG = "@@bagua-autotune-bench@@ "
DEFAULT_PLOT = FIGURES / "autotune_trials.png"
SEGMENTS = (1 << 18, 1 << 20, 1 << 22)  # the benchmark's cut of bytegrad's segment sizes


# --------------------------------------------------------------------------------------------
# worker (one rank)
# --------------------------------------------------------------------------------------------


class Trainer:
    """One rank's model, optimizer, data and wrapper; ``steps(k)`` returns the k step times."""

    def __init__(self, args: argparse.Namespace, autotune: Any = False):
        import torch

        import bagua

        dims = parse_mlp(args.mlp)
        self.model = make_model(dims, seed=0)
        if args.algorithm == "qadam":  # past its 1-step warm-up (the first settling step), as ddp.py's
            self.opt = bagua.optim.QAdamOptimizer(self.model.parameters(), lr=1e-3, warmup_steps=1, eps=1e-3)
        else:
            self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.ddp = bagua.DistributedDataParallel(self.model, [self.opt], args.algorithm, autotune=autotune)
        self.batches = make_batches(dims, args.batch, 4, bagua.get_rank())
        self.cursor = 0

    def steps(self, k: int) -> list[float]:
        import torch

        times = []
        for _ in range(k):
            x, y = self.batches[self.cursor % len(self.batches)]
            self.cursor += 1
            t0 = time.perf_counter()
            self.opt.zero_grad()
            torch.nn.functional.cross_entropy(self.ddp(x), y).backward()
            self.opt.step()
            times.append(time.perf_counter() - t0)
        return times

    def measure(self, config: dict[str, Any], timed: int) -> float:
        """Apply ``config``, one settling step, then the median of ``timed`` steps (max over ranks)."""
        self.ddp.configure(**config)
        self.steps(1)
        return slowest(statistics.median(self.steps(timed)))


def slowest(seconds: float) -> float:
    import torch

    import bagua

    t = torch.tensor([seconds], dtype=torch.float64)
    bagua.comm.allreduce(t, op="max")
    return float(t.item())


def search_space(ddp) -> dict[str, tuple]:
    """The benchmark's space: every tunable with its own choices, segment sizes cut to three."""
    return {name: (SEGMENTS if name == "segment_elems" else t.choices) for name, t in ddp.tunables().items()}


def run_worker(args: argparse.Namespace) -> int:
    import torch

    import bagua

    torch.set_num_threads(1)
    bagua.init_process_group()
    rank = bagua.get_rank()
    t_start = time.monotonic()

    def log(msg: str) -> None:
        if rank == 0:
            print(f"[{args.setting}] {msg} ({time.monotonic() - t_start:.0f}s)", flush=True)

    grid_trainer = Trainer(args)
    default = {name: t.current for name, t in grid_trainer.ddp.tunables().items()}
    space = search_space(grid_trainer.ddp)
    log(f"{args.algorithm} on a {mlp_params(parse_mlp(args.mlp)) / 1e6:.1f}M-parameter MLP; space {space}")
    grid_trainer.steps(2)  # warm up
    grid = []
    for values in itertools.product(*space.values()):
        config = dict(zip(space, values))
        seconds = grid_trainer.measure(config, args.grid_steps)
        grid.append({"config": config, "step_time_s": seconds})
        log(f"grid {config}: {seconds * 1e3:.0f} ms")
    grid_default = grid_trainer.measure(default, args.grid_steps)
    grid_trainer.ddp.close()

    config = bagua.AutotuneConfig(space=space, seed=args.seed)
    tuned_trainer = Trainer(args, autotune=config)
    steps = 0
    while tuned_trainer.ddp.autotune_result is None and steps < args.max_tuning_steps:
        tuned_trainer.steps(1)
        steps += 1
    result = tuned_trainer.ddp.autotune_result
    if result is None:
        raise SystemExit(f"tuning did not end within {args.max_tuning_steps} steps")
    log(result.describe())

    best = min(grid, key=lambda g: g["step_time_s"])
    contenders = {"default": default, "grid best": best["config"], "autotuned": result.config}
    check: dict[str, list[float]] = {name: [] for name in contenders}
    names = list(contenders)
    for r in range(args.check_rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            check[name].append(tuned_trainer.measure(contenders[name], args.check_steps))
    medians = {name: statistics.median(v) for name, v in check.items()}
    log("check: " + ", ".join(f"{n} {m * 1e3:.0f} ms" for n, m in medians.items()))
    job = {
        "setting": args.setting, "algorithm": args.algorithm, "mlp": args.mlp, "space": {k: list(v) for k, v in space.items()},
        "default": default, "grid": grid, "grid_default_s": grid_default, "grid_best": best,
        "trials": tuned_trainer.ddp.autotune_log, "result": {**vars(result), "speedup": result.speedup},
        "tuning_steps": steps, "check": check, "check_median_s": medians, "contenders": contenders,
        "elapsed_s": time.monotonic() - t_start,
    }
    tuned_trainer.ddp.close()
    if rank == 0:
        print(JSON_TAG + json.dumps(job), flush=True)
    return 0


# --------------------------------------------------------------------------------------------
# driver, report, plot
# --------------------------------------------------------------------------------------------


def paired(job: dict[str, Any], a: str, b: str) -> float:
    """The median over check rounds of a's time / b's time in the same round."""
    return statistics.median(x / y for x, y in zip(job["check"][a], job["check"][b]))


def key_ratios(job: dict[str, Any]) -> dict[str, Any]:
    grid_times = [g["step_time_s"] for g in job["grid"]]
    chosen = next((g["step_time_s"] for g in job["grid"] if g["config"] == job["result"]["config"]), float("nan"))
    return {
        "autotuned_vs_grid_best": paired(job, "autotuned", "grid best"),
        "default_vs_autotuned": paired(job, "default", "autotuned"),
        "grid_chosen_vs_best": chosen / min(grid_times),
        "grid_default_vs_best": job["grid_default_s"] / min(grid_times),
        "tuning_steps": job["tuning_steps"],
        "trials": job["result"]["trials"],
    }


def format_job(job: dict[str, Any]) -> str:
    lines = [f"## {job['setting']}, {job['algorithm']} (MLP {job['mlp']}): grid of {len(job['grid'])} configurations"]
    for g in sorted(job["grid"], key=lambda g: g["step_time_s"]):
        lines.append(f"  grid   {g['step_time_s'] * 1e3:8.1f} ms  {g['config']}")
    lines.append(f"  grid   {job['grid_default_s'] * 1e3:8.1f} ms  default {job['default']}")
    for t in job["trials"]:
        lines.append(f"  trial {t['trial']:2d} at step {t['step']:3d}: {t.get('step_time_s', float('nan')) * 1e3:8.1f} ms "
                     f"{t.get('outcome', '-'):8s} {t['config']}")
    r = job["result"]
    lines.append(f"  tuned: {r['config']} after {job['tuning_steps']} steps ({r['trials']} trials)")
    for name, values in job["check"].items():
        lines.append(f"  check {name:10s} median {job['check_median_s'][name] * 1e3:8.1f} ms  "
                     f"rounds {', '.join(f'{v * 1e3:.0f}' for v in values)}")
    k = key_ratios(job)
    lines.append(f"  autotuned / grid best {k['autotuned_vs_grid_best']:.3f} paired over check rounds (target <= 1.05; "
                 f"in the grid the chosen configuration is {k['grid_chosen_vs_best']:.3f} of the best); default / "
                 f"autotuned {k['default_vs_autotuned']:.2f}x (grid: default / best {k['grid_default_vs_best']:.2f}x); "
                 f"{k['tuning_steps']} tuning steps (target <= 60)")
    return "\n".join(lines)


def plot(jobs: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(jobs), figsize=(4.2 * len(jobs), 3.6), squeeze=False)
    for ax, job in zip(axes[0], jobs):
        trials = [t for t in job["trials"] if "step_time_s" in t]
        colors = ["tab:red" if t["outcome"] == "cut" else "tab:blue" for t in trials]
        ax.scatter([t["trial"] for t in trials], [t["step_time_s"] * 1e3 for t in trials], c=colors, zorder=3)
        best = job["grid_best"]["step_time_s"] * 1e3
        ax.axhline(best, color="tab:green", label=f"grid best {best:.0f} ms")
        ax.axhline(job["grid_default_s"] * 1e3, color="gray", linestyle="--", label="default (grid)")
        ax.set_title(f"{job['algorithm']}, {job['setting']}", fontsize=9)
        ax.set_xlabel("trial (red: cut short)")
        ax.set_ylabel("step time (ms)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def report(jobs: list[dict[str, Any]], args: argparse.Namespace, failed: Sequence[str], elapsed: float) -> int:
    print("\n" + "=" * 100)
    print(f"Autotuning vs the exhaustive grid; step time: median over timed steps, max over ranks; {elapsed:.0f}s total")
    for job in jobs:
        print()
        print(format_job(job))
    key = {f"{j['setting']}/{j['algorithm']}": key_ratios(j) for j in jobs}
    status = finish_run(args.out, elapsed, failed, key, (lambda path: plot(jobs, path)) if jobs and not args.no_plot else None,
                        args.plot, jobs=jobs)
    print("\nkey: " + "; ".join(
        f"{name}: tuned/best {k['autotuned_vs_grid_best']:.3f}, default/tuned {k['default_vs_autotuned']:.2f}x, "
        f"{k['tuning_steps']} steps" for name, k in key.items()))
    return status


def run_driver(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="autotune-bench: %(levelname)s %(message)s")
    check_requirements()
    t0 = time.monotonic()
    jobs, failed = [], []
    for rate in args.rates:
        for algorithm in args.algorithms:
            setting = rate
            command = worker(MODULE, "--worker", "--setting", setting, "--algorithm", algorithm,
                             "--mlp", args.mlp, "--batch", args.batch, "--grid-steps", args.grid_steps,
                             "--check-steps", args.check_steps, "--check-rounds", args.check_rounds,
                             "--seed", args.seed, "--max-tuning-steps", args.max_tuning_steps)
            cmd = emulated(command, "--ranks", "2", "--rate", rate, "--timeout", str(args.timeout))
            print(f"\n### {setting} {algorithm} ({time.monotonic() - t0:.0f}s elapsed)", flush=True)
            job = run_job(cmd, args.timeout + 60, JSON_TAG, logger)
            (jobs.append(job) if job else failed.append(f"{setting} {algorithm}"))
    return report(jobs, args, failed, time.monotonic() - t0)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n\n")[0])
    p.add_argument("--rates", nargs="+", default=["100mbit", "1gbit"], help="tbf rates (default 100mbit 1gbit)")
    p.add_argument("--algorithms", nargs="+", default=["bytegrad", "gradient_allreduce"])
    p.add_argument("--mlp", default="1024-1664x4-10", help="model widths (default 1024-1664x4-10, 10.0M params)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--grid-steps", type=int, default=3, help="timed steps per grid point (default 3)")
    p.add_argument("--check-steps", type=int, default=4, help="timed steps per check (default 4)")
    p.add_argument("--check-rounds", type=int, default=6, help="interleaved check rounds (default 6)")
    p.add_argument("--seed", type=int, default=0, help="the sampler's seed")
    p.add_argument("--max-tuning-steps", type=int, default=200, help="give up on a tuning that runs longer")
    add_run_options(p, 1200.0, DEFAULT_PLOT, "the report and plot")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--setting", default="", help=argparse.SUPPRESS)
    p.add_argument("--algorithm", default="gradient_allreduce", help=argparse.SUPPRESS)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    if args.worker:
        return run_worker(args)
    if args.from_json:
        jobs = [j for path in args.from_json for j in json.loads(Path(path).read_text())["jobs"]]
        return report(jobs, args, [], sum(j.get("elapsed_s", 0) for j in jobs))
    return run_driver(args)


if __name__ == "__main__":
    sys.exit(main())
