"""Time to accuracy: every algorithm against torch DDP on a real workload, ranks as machines.

The workload is ``examples/train_lm.py``: a GPT-2-architecture byte-level language model on the
Python standard library's source, AdamW (qadam: its own ``QAdamOptimizer``) with the same peak
learning rate 1e-3, warm-up and cosine schedule, seeds, data order (the load-balanced batch
sampler) for every variant. 4 ranks, each in its own network namespace (``benchmarks/netns.py``),
on each link of ``--links`` (default 1 Gbit/s, then 100 Mbit/s).

The target is the validation loss torch DDP reaches after its steps (200; the others train 1.3x
as many on the same schedule, which ends its decay at DDP's last step, to show whether and when
they reach it; a loss within 1e-4 relative of the target counts as reaching it). A deterministic
algorithm's loss after k steps does not depend on the link, so its curve is trained once, on the
first link, and on the other links only its step time is measured (``--timing-steps``, median,
data loading included, evaluation excluded): its time to the target there is its steps to the
target times that step time. ``async`` averages in the background on a clock, so it trains in
full on every link. Per variant and link: steps to the target, training time to the target,
validation loss after ``--steps`` and at DDP's training time.

    python benchmarks/time_to_accuracy.py              # about 20 minutes on 2 cores (root, iproute2)
    python benchmarks/time_to_accuracy.py --quick      # a few minutes: a tiny model, 60 steps

Writes ``benchmarks/results/time_to_accuracy.json`` and the plot
``benchmarks/figures/time_to_accuracy.png`` (validation loss against training time, one panel
per link). The last line printed is the key ratio: at the slowest link, DDP's time to its own
target over the fastest bagua algorithm's.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "examples"))
sys.path.insert(0, str(HERE.parent))

from benchmarks._jobs import import_netns, run_job  # noqa: E402

logger = logging.getLogger("time_to_accuracy")
JSON_TAG = "@@tta@@ "
BASELINE = "torch-ddp"
VARIANTS = [BASELINE, "gradient_allreduce", "bytegrad", "decentralized", "low_precision_decentralized", "async", "qadam",
            "qadam1", "onebit_grad"]  # qadam1: qadam with a 1-bit momentum (bits=1)
TIMED_ON_EVERY_LINK = {"async"}  # results depend on timing: trained in full on every link
LONGER = 1.3  # the other variants train this many times DDP's steps: the bound for "reaches the target"
# steps of a first phase that runs otherwise (qadam's and onebit_grad's fp32 warm-up: train_lm's
# --warmup-steps): a timed run covers them, then timing steps of the steady phase
PHASE_STEPS = {"qadam": 50, "qadam1": 50, "onebit_grad": 50}
TIE = 1e-4  # a loss within this relative distance of the target reaches it (exact algorithms differ in last bits on 4 ranks)
# model and run sizes: (flags for train_lm.py, steps, eval every, timing steps)
SIZES = {
    # 3.2M parameters (13 MB of fp32 gradients) over short documents: communication-heavy enough
    # that the link matters, small enough that 4 ranks on 2 cores train all variants in ~20 min
    "full": (["--layers", "4", "--width", "256", "--heads", "4", "--context", "64", "--batch-size", "4",
              "--val-docs", "256"], 200, 25, 20),
    "quick": (["--layers", "2", "--width", "64", "--heads", "2", "--context", "64", "--batch-size", "4",
               "--val-docs", "64", "--max-files", "150"], 60, 20, 8),
}  # fmt: skip


# ---- worker: one job of 4 ranks on one link ----------------------------------------------------

def run_worker(args: argparse.Namespace) -> int:
    import torch

    import bagua
    import train_lm

    bagua.init_process_group()
    torch.set_num_threads(1)
    rank = bagua.get_rank()
    flags, steps, eval_every, _ = SIZES[args.size]
    _warm_cache(train_lm, flags, args.cache_dir, rank)
    results = {}
    for name, n_steps in zip(args.variants, args.steps):
        lm_args = train_lm.parse_args([*flags, "--algorithm", name, "--steps", str(n_steps), "--schedule-steps", str(steps),
                                       "--eval-every", str(min(eval_every, n_steps)), "--no-progress",
                                       "--cache-dir", args.cache_dir, "--out-dir", args.cache_dir])  # fmt: skip
        t0 = time.monotonic()
        log = (lambda line: print(f"[{args.link} {name}] {line}", flush=True)) if rank == 0 else (lambda line: None)
        result = train_lm.train(lm_args, log)
        results[name] = {k: result[k] for k in ("curve", "final_val_loss", "wall_s", "step_times", "parameters")}
        log(f"done in {time.monotonic() - t0:.0f} s")
    if rank == 0:
        print(JSON_TAG + json.dumps({"link": args.link, "results": results}), flush=True)
    bagua.destroy_process_group()
    return 0


def _warm_cache(train_lm, flags: list[str], cache_dir: str, rank: int) -> None:
    """Every training document read once through the LMDB cache (rank 0), so that no variant pays
    the first reads from the files and the first variant is not the slow one."""
    import bagua

    if rank == 0:
        cached, _, _ = train_lm.datasets(train_lm.parse_args([*flags, "--cache-dir", cache_dir]), rank)
        for start in range(0, len(cached), 256):
            cached.__getitems__(list(range(start, min(start + 256, len(cached)))))
        cached.close()
    bagua.comm.barrier()


# ---- driver ---------------------------------------------------------------------------------------

def first_reaching(curve: list, target: float) -> Optional[tuple[int, float]]:
    """(step, training seconds) of the first evaluation at or below ``target`` (within TIE); None if never."""
    for step, secs, _, _, val in curve:
        if val <= target * (1 + TIE):
            return step, secs
    return None


def loss_at_step(curve: list, step: int) -> float:
    return next(val for st, _, _, _, val in curve if st == step)


def loss_at_time(curve: list, seconds: float) -> float:
    """The last evaluated validation loss at or before ``seconds`` of training."""
    seen = [val for _, secs, _, _, val in curve if secs <= seconds]
    return seen[-1] if seen else curve[0][4]


def _timed_curve(curve: list, step_times: list[float], steady: float, warmup: int) -> list:
    """A curve trained on another link, put on this link's clock: step k ends at the sum of this
    link's first k step times (the timed run's, its first ``warmup`` steps and any beyond it taken
    as ``steady``), so a phase like qadam's fp32 warm-up costs what it cost here."""
    last = curve[-1][0]
    times = [steady] * warmup + list(step_times[warmup:]) + [steady] * max(0, last - len(step_times))
    ends = [0.0]
    for t in times[:last]:
        ends.append(ends[-1] + t)
    return [(st, ends[st], tok, tr, val) for st, _, tok, tr, val in curve]


def analyse(jobs: dict[str, dict], links: list[str], steps: int, warmup: int, timing: int) -> dict[str, Any]:
    """Per link and variant: the curve in training seconds and the time-to-target figures."""
    curve_link = links[0]
    base = jobs[curve_link][BASELINE]
    target = base["curve"][-1][4]
    table: dict[str, dict[str, dict]] = {}
    for link in links:
        table[link] = {}
        for name, own in jobs[link].items():
            trained = own if (link == curve_link or name in TIMED_ON_EVERY_LINK) else jobs[curve_link][name]
            step_s = statistics.median(own["step_times"][-timing:] if trained is not own else own["step_times"][warmup:])
            curve = trained["curve"] if trained is own else _timed_curve(trained["curve"], own["step_times"], step_s, warmup)
            table[link][name] = {"curve": curve, "step_s": step_s, "val_at_steps": loss_at_step(curve, steps),
                                 "reached": first_reaching(curve, target), "timed_only": trained is not own}  # fmt: skip
        ddp_time = table[link][BASELINE]["curve"][-1][1]
        for row in table[link].values():
            row["val_at_ddp_time"] = loss_at_time(row["curve"], ddp_time)
    return {"target": target, "steps": steps, "curve_link": curve_link, "table": table}


def report(result: dict[str, Any]) -> float:
    target, steps = result["target"], result["steps"]
    print(f"\ntarget: torch DDP's validation loss after {steps} steps = {target:.4f} nats/byte "
          f"(curves trained on {result['curve_link']}; deterministic variants timed on the other links)")
    key = float("nan")
    for link, rows in result["table"].items():
        ddp = rows[BASELINE]
        ddp_t = ddp["reached"][1] if ddp["reached"] else float("nan")
        print(f"\n## {link}\n")
        print("| variant | step (s) | steps to target | x DDP steps | time to target (s) | DDP time / this | "
              f"val loss at {steps} steps | val loss at DDP's time |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        speedups = []
        for name, row in rows.items():
            hit = row["reached"]
            steps_txt = f"{hit[0]}" if hit else f"not in {row['curve'][-1][0]}"
            ratio_steps = f"{hit[0] / ddp['reached'][0]:.2f}" if hit and ddp["reached"] else "-"
            time_txt = f"{hit[1]:.0f}" if hit else "-"
            speedup = ddp_t / hit[1] if hit and hit[1] > 0 else float("nan")
            if name != BASELINE and hit:
                speedups.append(speedup)
            print(f"| {name}{' (timed)' if row['timed_only'] else ''} | {row['step_s']:.3f} | {steps_txt} | {ratio_steps} "
                  f"| {time_txt} | {speedup:.2f}x | {row['val_at_steps']:.4f} | {row['val_at_ddp_time']:.4f} |")
        key = max(speedups, default=float("nan"))
    print(f"key ratio: at {list(result['table'])[-1]}, DDP's time to its target / the fastest bagua algorithm's = {key:.2f}x")
    return key


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    links = list(result["table"])
    fig, axes = plt.subplots(1, len(links), figsize=(6 * len(links), 4.5), squeeze=False)
    for ax, link in zip(axes[0], links):
        for name, row in result["table"][link].items():
            _, secs, _, _, vals = zip(*row["curve"])
            ax.plot(secs, vals, marker=".", label=name, linewidth=2.5 if name == BASELINE else 1.2)
        ax.axhline(result["target"], color="gray", linestyle=":", label="target (DDP at the last step)")
        ax.set(title=f"4 ranks, {link}", xlabel="training time (s)", ylabel="validation loss (nats/byte)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def run_driver(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="tta: %(levelname)s %(message)s")
    netns = import_netns()
    netns.check_requirements()
    flags, steps, _, timing_steps = SIZES[args.size]
    jobs: dict[str, dict] = {}
    t0 = time.monotonic()
    for i, link in enumerate(args.links):
        longer = int(steps * LONGER)
        plan = [(v, timing_steps + PHASE_STEPS.get(v, 0) if (i and v not in TIMED_ON_EVERY_LINK)
                 else steps if v == BASELINE else longer) for v in args.variants]  # fmt: skip
        cmd = [sys.executable, str(HERE / "netns.py"), "--ranks", str(args.ranks), "--rate", link,
               "--timeout", str(args.timeout), "--", sys.executable, str(Path(__file__)), "--worker",
               "--link", link, "--size", args.size, "--cache-dir", args.cache_dir,
               "--variants", *[v for v, _ in plan], "--steps", *[str(n) for _, n in plan]]  # fmt: skip
        print(f"\n### {link} x{args.ranks} ({time.monotonic() - t0:.0f} s elapsed)", flush=True)
        job = run_job(cmd, args.timeout + 60, JSON_TAG, logger)
        if job is None:
            logger.error("the %s job failed; no report", link)
            return 1
        jobs[link] = job["results"]
    result = analyse(jobs, args.links, steps, warmup=3, timing=timing_steps)
    result.update(ranks=args.ranks, size=args.size, model_flags=flags, elapsed_s=time.monotonic() - t0,
                  date=time.strftime("%Y-%m-%d %H:%M"), jobs=jobs)  # fmt: skip (jobs: every run as measured)
    out = HERE / "results" / f"time_to_accuracy{'_quick' if args.size == 'quick' else ''}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    plot(result, HERE / "figures" / f"time_to_accuracy{'_quick' if args.size == 'quick' else ''}.png")
    report(result)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model and 60 steps: a first look in minutes")
    parser.add_argument("--links", nargs="+", default=["1gbit", "100mbit"],
                        help="tbf rates; the first one's curves serve the others (default 1gbit 100mbit)")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--variants", nargs="+", default=VARIANTS, choices=VARIANTS)
    parser.add_argument("--timeout", type=float, default=3600.0, help="per link job, seconds")
    parser.add_argument("--cache-dir", default="/tmp/bagua-tta-cache")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--link", help=argparse.SUPPRESS)
    parser.add_argument("--size", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--steps", nargs="+", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.size = args.size or ("quick" if args.quick else "full")
    if BASELINE not in args.variants:
        parser.error(f"--variants must include {BASELINE}: it sets the target")
    return run_worker(args) if args.worker else run_driver(args)


if __name__ == "__main__":
    sys.exit(main())
