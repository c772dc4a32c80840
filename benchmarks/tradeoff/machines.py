#!/usr/bin/env python3
"""Machines of several ranks, measured: torch DDP and bagua, flat and hierarchical, against the model.

Each point of ``machines_prediction.py`` (4 and 8 emulated machines of 2 ranks, at 100 Mbit/s and
at 1 Gbit/s with 5 ms one way) runs as one job of ``sweep.py``'s worker on the emulated network with
``--machines M --ranks-per-machine 2`` (a machine's ranks share its namespace and loopback; only
machines cross the shaped link), the variants interleaved in the job, the LM of the bandwidth x
latency sweep. An epoch is ``EPOCH_STEPS`` steps at the mean timed step, as there. Reported per
point: each variant's epoch, its ratio to torch DDP's in the same job, hierarchical bytegrad
against flat, and the model's epoch from ``results/machines_prediction.json`` (committed before
these runs) with the error. Results: ``results/machines.json``; plot ``figures/machines.png``.

Targets (issue 41): hierarchical bytegrad at least 1.8x faster than flat bytegrad at 4 x 2,
100 Mbit/s, and never more than 5% slower than flat at any point; the model within 25% of every
measured epoch.

``--held-out``: the shapes of the second prediction (``machines_prediction.py --held-out``, 6 x 2
and 4 x 4, with the contention the first runs showed), into ``results/machines_heldout.json``;
``--fresh``: the third's (3 x 4, 2 x 8), into ``results/machines_fresh.json``.
``--size comm-bound``: the 4 x 2, 100 Mbit/s point on a model with little compute per byte
(``sweep.MODEL``), torch DDP and bytegrad flat and hierarchical only, into
``results/machines_comm_bound.json``; reported against the ceiling its bytes allow.

Usage (from the repository root)::

    python -m benchmarks.tradeoff.machines                        # every point (~10 min here, root)
    python -m benchmarks.tradeoff.machines --points 4x2-100mbit   # one
    python -m benchmarks.tradeoff.machines --held-out             # the held-out shapes (~12 min)
    python -m benchmarks.tradeoff.machines --fresh                # the shapes after the second fix (~12 min)
    python -m benchmarks.tradeoff.machines --size comm-bound      # hierarchical bytegrad where bytes dominate
    python -m benchmarks.tradeoff.machines --report               # tables and plot from the JSON
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from benchmarks.jobs import emulated, run_job, worker
from benchmarks.records import BENCHMARKS, RESULTS
from benchmarks.tradeoff.machines_prediction import LINKS, SETS, VARIANTS, measured_scales, predictions
from benchmarks.tradeoff.sweep import EPOCH_STEPS, JSON_TAG

logger = logging.getLogger("machines")
COMM_BOUND_RESULTS = RESULTS / "machines_comm_bound.json"
COMM_BOUND_VARIANTS = ("ddp", "bytegrad", "bytegrad-hier", "local")
LINK_FLAGS = {"100mbit": ["--rate", "100mbit"], "1gbit-5ms": ["--rate", "1gbit", "--delay", "5"]}
TARGET_HIER, TARGET_NOT_SLOWER, TARGET_MODEL = 1.8, 1.05, 0.25


def worker_command(point: str, machines: int, per: int, reps: int, block: int, cache_dir: str,
                   timeout: float, size: str = "full",
                   variants: Sequence[str] = (*(name for name, _, _ in VARIANTS), "local")) -> list[str]:
    """The command line of one point's job on the emulated network."""
    link = point.split("-", 1)[1]
    command = worker("benchmarks.tradeoff.sweep", "--worker", "--setting", point, "--size", size, "--reps", reps,
                     "--block", block, "--cache-dir", cache_dir, "--ranks-per-machine", per, "--variants", *variants)
    return emulated(command, "--machines", str(machines), "--ranks-per-machine", str(per), *LINK_FLAGS[link],
                    "--timeout", str(timeout))


def epochs(job: dict[str, Any]) -> dict[str, float]:
    """Epoch seconds per variant: ``EPOCH_STEPS`` steps at its mean timed step."""
    return {name: row["epoch_s"] / (job["reps"] * job["block"]) * EPOCH_STEPS for name, row in job["variants"].items()}


def report(results: dict[str, Any], prediction: dict[str, Any],
           corrected: Optional[dict[str, Any]] = None) -> tuple[list[str], dict[str, Any]]:
    """The table per point and the targets' verdicts. ``corrected``: the model's points again with
    each point's compute measured (``measured_scales``), where the jobs measured it."""
    lines, worst, worst_corrected, verdicts, errors = [], (0.0, ""), (0.0, ""), {}, []
    for point, record in results["points"].items():
        measured = epochs(record["job"])
        predicted = prediction["points"][point]["variants"]
        again = (corrected or {}).get(point, {}).get("variants")
        ddp = measured["ddp"]
        lines.append(f"== {point} ({record['date']}, job {record['job']['elapsed_s']:.0f} s"
                     + (f"; no-communication step {measured['local'] / EPOCH_STEPS:.3f} s" if "local" in measured else "")
                     + ") ==")
        lines.append(f"  {'variant':34s} {'epoch s':>8s} {'x DDP':>6s} {'model s':>8s} {'model err':>9s}"
                     + (f" {'measured compute: model s':>26s} {'err':>5s}" if again else ""))
        for name in (n for n in measured if n != "local"):
            model = predicted[name]["epoch_s"]
            error = model / measured[name] - 1
            errors.append(error)
            if abs(error) > abs(worst[0]):
                worst = (error, f"{name} at {point}")
            line = f"  {name:34s} {measured[name]:8.1f} {ddp / measured[name]:6.2f} {model:8.1f} {error:+9.0%}"
            if again:
                error_again = again[name]["epoch_s"] / measured[name] - 1
                if abs(error_again) > abs(worst_corrected[0]):
                    worst_corrected = (error_again, f"{name} at {point}")
                line += f" {again[name]['epoch_s']:26.1f} {error_again:+5.0%}"
            lines.append(line)
        flat_over_hier = measured["bytegrad"] / measured["bytegrad-hier"]
        verdicts[point] = flat_over_hier
        lines.append(f"  bytegrad flat / hierarchical: {flat_over_hier:.2f}x (model "
                     f"{predicted['bytegrad']['epoch_s'] / predicted['bytegrad-hier']['epoch_s']:.2f}x)")
    key: dict[str, Any] = {"worst_model_error": worst[0], "worst_model_point": worst[1],
                           "bytegrad_flat_over_hier": verdicts}
    if corrected:
        key.update(worst_measured_compute_error=worst_corrected[0], worst_measured_compute_point=worst_corrected[1])
    if "4x2-100mbit" in verdicts:
        key["hier_target_met"] = verdicts["4x2-100mbit"] >= TARGET_HIER
    key["hier_never_slower"] = all(v >= 1 / TARGET_NOT_SLOWER for v in verdicts.values())
    key["model_within_25pct"] = abs(worst[0]) <= TARGET_MODEL
    within = sum(abs(e) <= TARGET_MODEL for e in errors)
    lines.append("KEY: " + (f"bytegrad flat/hierarchical at 4x2-100mbit {verdicts['4x2-100mbit']:.2f}x (target >= "
                            f"{TARGET_HIER}x); " if "4x2-100mbit" in verdicts else "")
                 + f"hierarchical bytegrad never more than 5% slower than flat: {key['hier_never_slower']}; model within "
                 f"25% at {within} of {len(errors)}, worst error {worst[0]:+.0%} ({worst[1]}; "
                 f"target within 25%)" + (f"; with each point's compute measured {worst_corrected[0]:+.0%} "
                                          f"({worst_corrected[1]})" if corrected else ""))
    return lines, key


def comm_bound_report(results: dict[str, Any]) -> tuple[list[str], dict[str, Any]]:
    """Hierarchical bytegrad against flat where bytes dominate, beside the ceiling its bytes allow:
    ``(compute + flat's transfer) / (compute + hierarchical's)``, compute the measured
    no-communication step, a transfer the bytes the model counts over a machine's link at its rate."""
    lines, key = [], {}
    for point, record in results["points"].items():
        job, rate = record["job"], LINKS[point.split("-", 1)[1]].bandwidth_bit_s
        measured = epochs(job)
        compute = measured["local"] / EPOCH_STEPS
        transfer = {n: 8 * job["variants"][n]["model_bytes_per_step"] / rate for n in ("bytegrad", "bytegrad-hier")}
        ceiling = (compute + transfer["bytegrad"]) / (compute + transfer["bytegrad-hier"])
        ratio = measured["bytegrad"] / measured["bytegrad-hier"]
        key[point] = {"bytegrad_flat_over_hier": ratio, "ceiling": ceiling, "compute_s": compute,
                      "transfer_s": transfer, "params": job["params"], "target_met": ratio >= TARGET_HIER}
        lines.append(f"== {point}, {job['params'] / 1e6:.1f}M parameters ({record['date']}, job {job['elapsed_s']:.0f} s;"
                     f" no-communication step {compute:.3f} s) ==")
        for name in (n for n in measured if n != "local"):
            lines.append(f"  {name:14s} epoch {measured[name]:7.1f} s  {measured['ddp'] / measured[name]:5.2f}x DDP")
        lines.append(f"  bytegrad flat / hierarchical: {ratio:.2f}x (target >= {TARGET_HIER}x); the bytes allow "
                     f"{ceiling:.2f}x: ({compute:.2f} + {transfer['bytegrad']:.2f}) / ({compute:.2f} + "
                     f"{transfer['bytegrad-hier']:.2f}) s")
    return lines, key


def plot(results: dict[str, Any], prediction: dict[str, Any], path: Path) -> None:
    """Epoch per variant per point: measured bars, the model's epoch as a tick."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = list(results["points"])
    fig, axes = plt.subplots(1, len(points), figsize=(4.2 * len(points), 4.2), squeeze=False)
    for ax, point in zip(axes[0], points):
        measured = epochs(results["points"][point]["job"])
        names = [n for n in measured if n != "local"]
        ax.bar(range(len(names)), [measured[n] for n in names], color="#7aa6c2", label="measured")
        ax.plot(range(len(names)), [prediction["points"][point]["variants"][n]["epoch_s"] for n in names], "k_",
                markersize=14, label="model (before the run)")
        ax.set_xticks(range(len(names)), names, rotation=75, fontsize=7)
        ax.set_title(point, fontsize=9)
        ax.set_ylabel("epoch s (100 steps)")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.split("\n\n")[0])
    p.add_argument("--points", nargs="+", default=None, help="default: every point of the chosen prediction")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--held-out", action="store_const", const="held-out", dest="set", default="first",
                       help="the held-out shapes of machines_heldout_prediction.json")
    which.add_argument("--fresh", action="store_const", const="fresh", dest="set",
                       help="the fresh shapes of machines_fresh_prediction.json")
    p.add_argument("--size", default="full", choices=("full", "comm-bound"),
                   help="comm-bound: the 4x2 100 Mbit/s point with sweep.MODEL's comm-bound model")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--block", type=int, default=2)
    p.add_argument("--timeout", type=float, default=1500.0)
    p.add_argument("--cache-dir", default="/tmp/bagua-tta-cache")
    p.add_argument("--report", action="store_true", help="no run: the tables and plot from the JSON")
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="machines: %(message)s")
    comm_bound = args.size == "comm-bound"
    layouts, prediction_path, results_path, figure = SETS[args.set]
    prediction = json.loads((BENCHMARKS / prediction_path).read_text())
    path = COMM_BOUND_RESULTS if comm_bound else BENCHMARKS / results_path
    results = json.loads(path.read_text()) if path.exists() else {"points": {}}
    points = args.points or (["4x2-100mbit"] if comm_bound else list(prediction["points"]))
    failed = []
    if not args.report:
        for point in points:
            if point not in prediction["points"]:
                p.error(f"unknown point {point!r}; known: {', '.join(prediction['points'])}")
            layout = prediction["points"][point]
            cmd = worker_command(point, layout["machines"], layout["ranks_per_machine"], args.reps, args.block,
                                 args.cache_dir, args.timeout, args.size,
                                 **({"variants": COMM_BOUND_VARIANTS} if comm_bound else {}))
            print(f"\n### {point}", flush=True)
            job = run_job(cmd, args.timeout + 60, JSON_TAG, logger)
            if job is None:
                failed.append(point)
                continue
            results["points"][point] = {"date": time.strftime("%Y-%m-%d %H:%M"), "job": job}
            path.write_text(json.dumps(results, indent=1))
    if comm_bound:
        lines, key = comm_bound_report(results)
    else:
        fit = json.loads((RESULTS / "tradeoff_model.json").read_text())
        sweep = json.loads((RESULTS / "tradeoff.json").read_text())
        scales = measured_scales(results, fit)
        corrected = ({k: v for k, v in predictions(fit, sweep, scales, layouts, router=prediction.get("router")).items()
                      if k in scales}
                     if scales else None)
        lines, key = report(results, prediction, corrected)
    results["key"] = key
    path.write_text(json.dumps(results, indent=1))
    print("\n".join(lines))
    if not comm_bound and not args.no_plot and results["points"]:
        plot(results, prediction, BENCHMARKS / figure)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
