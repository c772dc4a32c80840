"""Time to accuracy: every algorithm against torch DDP on a run that looks like training.

The workload is ``examples/train_lm.py``: a GPT-2-architecture byte-level language model (0.84M
parameters: 4 layers x 128, context 128) on the Python standard library's source, 8 documents of
at most 129 bytes per rank and step (~1,000 tokens per rank and step, as a per-GPU batch of real
pre-training has thousands), the load-balanced batch sampler, AdamW (betas 0.9/0.95, decoupled weight
decay 0.01; qadam: ``QAdamOptimizer`` with the same), peak learning rate ``--lr`` after 50 warm-up
steps, the same seeds and data order for every variant. As torchtitan checks that a technique
converges (its docs/converging.md): a trusted control job (torch DDP), the same data and batch per
rank, loss curves over the whole run.

Two measurements (``--measure``):

* ``decay`` (default): 4 ranks, each in its own network namespace (``benchmarks.network``) for
  the timed steps, a cosine decay to a tenth of the peak at DDP's last step (800; the report
  prints how much DDP's last 20% of steps gained); the others train 1.5x as many steps on the
  same schedule (a tenth of the peak after DDP's last step).
* ``constant``: 2 ranks, the peak rate throughout after warm-up (a run stopped early, or a schedule
  that never decays to zero, must not carry a hidden loss): steps to the target only, the curves
  on loopback, no link timed.

The target is the validation loss torch DDP reaches at its last step; a loss within 1e-4 relative
of it counts as reaching it. A deterministic algorithm's loss after k steps does not depend on the
link, so its curve is trained once, every rank on this machine's loopback (the fastest link, and a
job that may share the cores with others: no time is read from it), and on each link only its
step time is measured (20 steps after any first phase, median, data loading included, evaluation
excluded, in a job of its own): its time to the target there is the sum of those step times up to
its steps to the target. ``async`` averages in the background on a clock, so it trains in full on
every link. Per variant and link: steps to the target ("not in 1.5x" beyond), the final loss, the
bytes sent per step, and the training time to the target.

A variant is an algorithm of ``train_lm.py`` with options: ``qadam``, ``"qadam[variance=frozen]"``,
``"bytegrad[block_size=256,error_feedback=True]"`` (``train_lm.py --option``), so an experiment
that isolates a cause runs through the same script.

    python -m benchmarks.accuracy.time_to_accuracy                      # the decay run (root, iproute2)
    python -m benchmarks.accuracy.time_to_accuracy --measure constant   # the constant-rate run
    python -m benchmarks.accuracy.time_to_accuracy --quick              # a few minutes: a tiny model, 60 steps

Writes ``benchmarks/results/time_to_accuracy[_constant|_quick].json`` and the plot
``benchmarks/figures/time_to_accuracy[...].png`` (validation loss against training time, one panel
per link, and against steps). The last line printed is the key ratio: at the last link, DDP's
time to its own target over the fastest bagua algorithm's.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

from benchmarks.jobs import ROOT, emulated, loopback, run_job, worker
from benchmarks.network import check_requirements
from benchmarks.records import FIGURES, RESULTS

logger = logging.getLogger("time_to_accuracy")
JSON_TAG = "@@tta@@ "
BASELINE = "torch-ddp"
VARIANTS = [BASELINE, "torch-ddp-fp16", "gradient_allreduce", "bytegrad", "decentralized", "low_precision_decentralized",
            "async", "qadam", "qadam1", "onebit_grad"]  # qadam1: qadam with a 1-bit momentum (bits=1)
TIMED_ON_EVERY_LINK = {"async"}  # results depend on timing: trained in full on every link
LONGER = 1.5  # the other variants train this many times DDP's steps: "reaches the target" within 1.5x
# steps of a first phase that runs otherwise (qadam's and onebit_grad's fp32 warm-up: train_lm's
# --warmup-steps): a timed run covers them, then timing steps of the steady phase
PHASE_STEPS = {"qadam": 50, "qadam1": 50, "onebit_grad": 50}
CURVES = "loopback"  # the curves' job: every rank on this machine's loopback, the fastest link there is
TIE = 1e-4  # a loss within this relative distance of the target reaches it (exact algorithms differ in last bits on 4 ranks)
LM = ["--layers", "4", "--width", "128", "--heads", "4", "--context", "128", "--batch-size", "8", "--val-docs", "512"]
# each run: (flags for train_lm.py, ranks, steps, eval every, timing steps)
RUNS = {
    # 0.84M parameters (3.4 MB of fp32 gradients) and ~1K tokens per rank and step: 4 ranks on 2
    # cores train every variant in about 80 minutes; communication still matters at 100 Mbit/s
    "decay": ([*LM, "--lr-schedule", "cosine"], 4, 800, 25, 20),
    "constant": ([*LM, "--lr-schedule", "constant"], 2, 800, 50, 20),
    "quick": (["--layers", "2", "--width", "64", "--heads", "2", "--context", "64", "--batch-size", "4",
               "--val-docs", "64", "--max-files", "150"], 4, 60, 20, 8),
}  # fmt: skip
_SPEC = re.compile(r"^([a-z0-9_-]+)(?:\[(.*)\])?$")


def parse_variant(spec: str) -> tuple[str, list[str]]:
    """``"qadam[variance=frozen,bits=1]"`` -> ``("qadam", ["variance=frozen", "bits=1"])``."""
    match = _SPEC.match(spec.strip())
    if match is None or match.group(1) not in VARIANTS:
        raise ValueError(f"a variant is one of {VARIANTS}, optionally with options in brackets "
                         f"(e.g. 'qadam[variance=frozen]'), got {spec!r}")
    options = [o.strip() for o in (match.group(2) or "").split(",") if o.strip()]
    bad = [o for o in options if "=" not in o]
    if bad:
        raise ValueError(f"variant {spec!r}: options are KEY=VALUE, got {bad}")
    return match.group(1), options


# ---- worker: one job of 4 ranks on one link ----------------------------------------------------

def run_worker(args: argparse.Namespace) -> int:
    import torch

    import bagua
    from examples import train_lm

    bagua.init_process_group()
    torch.set_num_threads(1)
    rank = bagua.get_rank()
    flags, _, steps, eval_every, _ = RUNS[args.run]
    flags = [*flags, "--lr", str(args.lr)]
    _warm_cache(train_lm, flags, args.cache_dir, rank)
    results = {}
    for spec, n_steps in zip(args.variants, args.steps):
        name, options = parse_variant(spec)
        lm_args = train_lm.parse_args([*flags, "--algorithm", name, *(f"--option={o}" for o in options),
                                       "--steps", str(n_steps), "--schedule-steps", str(steps),
                                       "--eval-every", str(min(eval_every, n_steps)), "--no-progress",
                                       "--cache-dir", args.cache_dir, "--out-dir", args.cache_dir])  # fmt: skip
        t0 = time.monotonic()
        log = (lambda line: print(f"[{args.link} {spec}] {line}", flush=True)) if rank == 0 else (lambda line: None)
        result = train_lm.train(lm_args, log)
        results[spec] = {k: result[k] for k in ("curve", "final_val_loss", "wall_s", "step_times", "parameters",
                                                "bytes_per_step")}
        if name.startswith(BASELINE):  # torch DDP's ring allreduce of every gradient (fp32, or fp16 with the hook)
            world = bagua.get_world_size()
            results[spec]["bytes_per_step"] = 2 * (world - 1) / world * result["parameters"] * (2 if "fp16" in name else 4)
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


def flattening(curve: list) -> float:
    """How much the loss fell over the last 20% of the curve's steps, relative to where it stood."""
    last = curve[-1][0]
    before = [val for st, _, _, _, val in curve if st <= 0.8 * last]
    return (before[-1] - curve[-1][4]) / before[-1]


def analyse(jobs: dict[str, dict], links: list[str], steps: int, warmup: int, timing: int) -> dict[str, Any]:
    """Per link (the curves' own, ``CURVES``, first) and variant: the curve in training seconds
    and the time-to-target figures."""
    base = jobs[CURVES][BASELINE]
    target = base["curve"][-1][4]
    table: dict[str, dict[str, dict]] = {}
    for link in [CURVES, *links]:
        table[link] = {}
        for spec, own in jobs[link].items():
            trained = own if (link == CURVES or parse_variant(spec)[0] in TIMED_ON_EVERY_LINK) else jobs[CURVES][spec]
            step_s = statistics.median(own["step_times"][-timing:] if trained is not own else own["step_times"][warmup:])
            curve = trained["curve"] if trained is own else _timed_curve(trained["curve"], own["step_times"], step_s, warmup)
            table[link][spec] = {"curve": curve, "step_s": step_s, "val_at_steps": loss_at_step(curve, steps),
                                 "final": curve[-1][4], "reached": first_reaching(curve, target),
                                 "timed_only": trained is not own, "bytes_per_step": trained.get("bytes_per_step")}  # fmt: skip
        ddp_time = table[link][BASELINE]["curve"][-1][1]
        for row in table[link].values():
            row["val_at_ddp_time"] = loss_at_time(row["curve"], ddp_time)
    return {"target": target, "steps": steps, "curve_link": CURVES, "table": table,
            "ddp_last_20pct_gain": flattening(base["curve"])}


def report(result: dict[str, Any]) -> tuple[str, float]:
    """The run's tables (markdown) and its key ratio: at the last link, DDP's time to its target
    over the fastest bagua algorithm's."""
    target, steps = result["target"], result["steps"]
    lines = [f"Target: torch DDP's validation loss after {steps} steps, {target:.4f} nats/byte (its last 20% of steps "
             f"gained {result['ddp_last_20pct_gain']:.2%}). {result['ranks']} ranks, peak learning rate {result['lr']:g}, "
             f"{result['date']}; curves trained on {result['curve_link']}"
             + (", the deterministic variants timed on each link." if len(result["table"]) > 1 else "; no link timed.")]
    key = float("nan")
    longest = max(row["curve"][-1][0] for rows in result["table"].values() for row in rows.values())
    for link, rows in result["table"].items():
        ddp = rows[BASELINE]
        ddp_t = ddp["reached"][1] if ddp["reached"] else float("nan")
        timed = link != result["curve_link"]  # the curves' job may share the cores: its times are no link's
        lines += ["", f"#### {link}" + ("" if timed else " (the curves; its times are not a link's)"), "",
                  f"| variant | MB sent per step | step (s) | steps to target | x DDP's steps | time to target (s) | "
                  f"DDP's time / this | val loss at {steps} steps | vs DDP | final val loss ({longest} steps) |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        speedups = []
        for spec, row in rows.items():
            hit = row["reached"]
            speedup = ddp_t / hit[1] if hit and hit[1] > 0 else float("nan")
            if spec != BASELINE and hit:
                speedups.append(speedup)
            sent = f"{row['bytes_per_step'] / 1e6:.2f}" if row.get("bytes_per_step") else "-"
            to_target = f"{hit[0]}" if hit else f"not in {LONGER}x"
            times = f"{hit[0] / ddp['reached'][0]:.2f}" if hit and ddp["reached"] else "-"
            seconds = f"{hit[1]:.0f}" if hit else "-"
            faster = f"{speedup:.2f}x" if timed and hit else "-"
            seconds = seconds if timed else "-"
            lines.append(f"| {spec} | {sent} | {row['step_s']:.3f} | {to_target} | {times} | {seconds} | {faster} | "
                         f"{row['val_at_steps']:.4f} | {row['val_at_steps'] / target - 1:+.2%} | {row['final']:.4f} |")
        key = max(speedups, default=float("nan"))
    if len(result["table"]) > 1:
        lines.append(f"\nkey ratio: at {list(result['table'])[-1]}, DDP's time to its target / the fastest bagua "
                     f"algorithm's = {key:.2f}x")
    else:
        lines.append("\nSteps only: this run trains the curves on loopback and times no link (its step times share the "
                     "cores with other jobs).")
    return "\n".join(lines), key


MEASURED_MODULE = ROOT / "bagua" / "measured_accuracy.py"
ADVISE_NAME = {"qadam1": "qadam-1bit"}  # bagua.advise's names of the variants whose names differ
#: exact algorithms, bit-equal to torch DDP on 2 ranks (and within the last bits on more): the
#: runs may leave them out, and bagua.advise takes torch DDP's figures for them
EXACT_AS_DDP = ("gradient_allreduce",)


def measured_module(result: dict[str, Any], results_file: str) -> str:
    """The text of ``bagua/measured_accuracy.py``: each plain variant's steps to DDP's final loss
    over DDP's (None: not within the run) and its loss at DDP's steps against DDP's, from the
    curves of ``result`` (a decay run)."""
    rows = dict(result["table"][result["curve_link"]])
    last = list(result["table"])[-1]  # async trains on each link: its curve on the slowest
    rows.update((spec, row) for spec, row in result["table"][last].items() if parse_variant(spec)[0] in TIMED_ON_EVERY_LINK)
    ddp_steps = rows[BASELINE]["reached"][0]
    measured = {}
    for spec, row in rows.items():
        name, options = parse_variant(spec)
        if options:
            continue  # an experiment's variant: not what the algorithm's defaults do
        hit = row["reached"]
        measured[ADVISE_NAME.get(name, name)] = {
            "steps_multiplier": round(hit[0] / ddp_steps, 3) if hit else None,
            "loss_vs_ddp": round(row["val_at_steps"] / result["target"] - 1, 4)}
    for name in EXACT_AS_DDP:  # not trained again: torch DDP's figures (see EXACT_AS_DDP)
        measured.setdefault(name, dict(measured[BASELINE]))
    lines = [f"    {name!r}: {values!r}," for name, values in measured.items()]
    workload = (f"the GPT-2 byte LM of benchmarks.accuracy.time_to_accuracy ({result['ranks']} ranks, ~1K tokens "
                f"per rank and step, AdamW {result['lr']:g}, cosine decay over DDP's {result['steps']} steps)")
    return "\n".join([
        '"""What each algorithm did to the training, measured: generated by',
        "``python -m benchmarks.accuracy.time_to_accuracy --report`` from its results file (do not edit by hand).",
        "``bagua.advise`` ranks the algorithms by it.",
        "",
        "``steps_multiplier``: steps to torch DDP's final validation loss over DDP's steps (None: not there",
        f"within {LONGER}x DDP's steps); ``loss_vs_ddp``: the validation loss at DDP's last step, relative to DDP's.",
        f"{', '.join(EXACT_AS_DDP)}: exact, bit-equal to torch DDP on 2 ranks (tests/algorithms/test_conformance.py),",
        f"given torch DDP's figures where the run did not train it; {', '.join(sorted(TIMED_ON_EVERY_LINK))}: its run on "
        f"{last}.",
        "",
        "Example::",
        "",
        "    from bagua.measured_accuracy import MEASURED",
        '    MEASURED["qadam"]["steps_multiplier"]',
        '"""',
        "",
        f"WORKLOAD = {workload!r}",
        f"RESULTS = {results_file + ', ' + result['date']!r}",
        f"LONGEST = {f'{LONGER}x'!r}",
        "MEASURED = {",
        *lines,
        "}",
        "",
    ])


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = [link for link in result["table"] if link != CURVES]
    panels = [(CURVES, True)] + [(link, False) for link in (timed or [CURVES])]
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    for ax, (link, by_steps) in zip(axes[0], panels):
        for spec, row in result["table"][link].items():
            st, secs, _, _, vals = zip(*row["curve"])
            ax.plot(st if by_steps else secs, vals, marker=".", label=spec, linewidth=2.5 if spec == BASELINE else 1.2)
        ax.axhline(result["target"], color="gray", linestyle=":", label="target (DDP at its last step)")
        ax.set(title=f"{result['ranks']} ranks, " + ("validation loss by step" if by_steps else link),
               xlabel="step" if by_steps else "training time (s)", ylabel="validation loss (nats/byte)")
        lows = [row["final"] for row in result["table"][link].values()]
        ax.set_ylim(min(lows) - 0.05, result["target"] + 0.6)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def run_driver(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="tta: %(levelname)s %(message)s")
    flags, ranks, steps, _, timing_steps = RUNS[args.run]
    links = [] if args.run == "constant" else args.links
    if links:
        check_requirements()
    longer = int(steps * LONGER)
    full = {v: steps if v == BASELINE else longer for v in args.variants}
    jobs: dict[str, dict] = {}
    t0 = time.monotonic()
    for link in [CURVES, *links]:
        if link == CURVES:  # every curve, in full; async too in a run without links
            plan = [(v, n) for v, n in full.items() if not links or parse_variant(v)[0] not in TIMED_ON_EVERY_LINK]
        else:  # the step times of the deterministic ones on this link (a first phase included); async in full
            plan = [(v, n if parse_variant(v)[0] in TIMED_ON_EVERY_LINK else timing_steps + PHASE_STEPS.get(parse_variant(v)[0], 0))
                    for v, n in full.items()]  # fmt: skip
        command = worker("benchmarks.accuracy.time_to_accuracy", "--worker", "--link", link, "--measure", args.run,
                         "--lr", args.lr, "--cache-dir", args.cache_dir,
                         "--variants", *[v for v, _ in plan], "--steps", *[n for _, n in plan])  # fmt: skip
        cmd = (loopback(ranks, command) if link == CURVES
               else emulated(command, "--ranks", str(ranks), "--rate", link, "--timeout", str(args.timeout)))
        print(f"\n### {link} x{ranks} ({time.monotonic() - t0:.0f} s elapsed)", flush=True)
        job = run_job(cmd, args.timeout + 60, JSON_TAG, logger)
        if job is None:
            logger.error("the %s job failed; no report", link)
            return 1
        jobs[link] = job["results"]
    result = analyse(jobs, links, steps, warmup=3, timing=timing_steps)
    result.update(ranks=ranks, run=args.run, lr=args.lr, model_flags=flags, elapsed_s=time.monotonic() - t0,
                  date=time.strftime("%Y-%m-%d %H:%M"), jobs=jobs)  # fmt: skip (jobs: every run as measured)
    return save(result, args)


def results_path(run: str, tag: str = "") -> Path:
    return RESULTS / f"time_to_accuracy{'' if run == 'decay' else '_' + run}{tag}.json"


def save(result: dict[str, Any], args: argparse.Namespace) -> int:
    """Write the results file and the plot, the reports (untagged runs), and print the tables."""
    out = results_path(args.run, args.tag)
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    plot(result, FIGURES / f"{out.stem}.png")
    if not args.tag:
        write_reports()
    text, _ = report(result)
    print("\n" + text)
    return 0


def replace_curves(args: argparse.Namespace, other_path: Path) -> int:
    """The run's results with the curves of the variants that ``other_path``'s run trained again
    (its loopback job) in place of its own, analysed anew. Only where the two are the same run:
    the same kind, learning rate and model, and torch DDP's curves equal value for value (the
    same code and seeds train the same curve). The step times on the links stay this run's."""
    mine, other = json.loads(results_path(args.run, args.tag).read_text()), json.loads(other_path.read_text())
    same = all(mine[k] == other[k] for k in ("run", "lr", "model_flags", "ranks"))
    ddp_mine, ddp_other = (r["jobs"][CURVES][BASELINE]["curve"] for r in (mine, other))
    if not same or [row[4] for row in ddp_mine] != [row[4] for row in ddp_other]:
        raise SystemExit(f"{other_path}: not the same run as {results_path(args.run, args.tag)} (its settings, or "
                         f"torch DDP's curve, differ): its curves cannot stand in for this run's")
    jobs = mine["jobs"]
    replaced = [spec for spec in other["jobs"][CURVES] if spec != BASELINE]
    for spec in replaced:
        jobs[CURVES][spec] = other["jobs"][CURVES][spec]
    _, _, steps, _, timing_steps = RUNS[mine["run"]]
    result = analyse(jobs, [link for link in jobs if link != CURVES], steps, warmup=3, timing=timing_steps)
    result.update({k: mine[k] for k in ("ranks", "run", "lr", "model_flags", "elapsed_s", "date")}, jobs=jobs,
                  curves_replaced={"from": other_path.name, "date": other["date"], "variants": replaced})
    return save(result, args)


GUIDE = ROOT / "docs" / "convergence.md"
BEGIN, END = "<!-- time_to_accuracy:begin -->", "<!-- time_to_accuracy:end -->"


def generated() -> tuple[str, Optional[str]]:
    """From the results files: the guide's generated part (both runs' tables and plots) and, from
    the decay run, the text of ``bagua/measured_accuracy.py`` (None without one)."""
    parts, module = [], None
    for run, title in (("decay", "With the learning rate decayed (4 ranks as machines)"),
                       ("constant", "At a constant learning rate (2 ranks)")):
        path = results_path(run)
        if not path.exists():
            parts.append(f"### {title}\n\n(not measured yet: `python -m benchmarks.accuracy.time_to_accuracy --measure "
                         f"{run}`)")
            continue
        result = json.loads(path.read_text())
        text, _ = report(result)
        if "curves_replaced" in result:
            replaced = result["curves_replaced"]
            text += (f"\n\nThe curves of {', '.join(replaced['variants'])} are those of a second run of the same settings "
                     f"({replaced['from']}, {replaced['date']}), which evaluated the replicas' average; torch DDP's curve "
                     f"was the same in both, value for value.")
        parts.append(f"### {title}\n\n_Generated from `benchmarks/results/{path.name}` by `python -m "
                     f"benchmarks.accuracy.time_to_accuracy --report`._\n\n![validation loss](figures/{path.stem}.png)"
                     f"\n\n{text}")
        if run == "decay":
            module = measured_module(result, f"benchmarks/results/{path.name}")
    return "\n\n".join(parts), module


def write_reports() -> None:
    """Write ``generated()`` into the guide (between its markers) and ``bagua/measured_accuracy.py``,
    which ``bagua.advise`` ranks by."""
    guide, module = generated()
    if module is not None:
        MEASURED_MODULE.write_text(module)
    from benchmarks.tradeoff.report import replace_section  # (imports bagua.advise, which reads the module)

    replace_section(GUIDE, guide, BEGIN, END)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.split("\n\n")[0])
    parser.add_argument("--measure", dest="run", choices=tuple(RUNS), default="decay",
                        help="decay: 4 ranks, cosine decay, on every link; constant: 2 ranks, constant rate, first "
                             "link; quick: a tiny model and 60 steps")
    parser.add_argument("--quick", action="store_true", help="--measure quick: a first look in minutes")
    parser.add_argument("--links", nargs="+", default=["1gbit", "100mbit"],
                        help="tbf rates; the first one's curves serve the others (default 1gbit 100mbit)")
    parser.add_argument("--variants", nargs="+", default=VARIANTS,
                        help=f"of {VARIANTS}, each optionally with options, e.g. 'qadam[variance=frozen]'")
    parser.add_argument("--lr", type=float, default=3e-3, help="the peak learning rate of every variant (default 3e-3)")
    parser.add_argument("--tag", default="", help="appended to the results' file names (an experiment's own)")
    parser.add_argument("--timeout", type=float, default=7200.0, help="per link job, seconds")
    parser.add_argument("--cache-dir", default="/tmp/bagua-tta-cache")
    parser.add_argument("--replace-curves", type=Path, metavar="RESULTS_JSON",
                        help="put the curves another run of the same settings trained (its loopback job) in place of "
                             "this run's (--measure, --tag), analyse again and rewrite its results")
    parser.add_argument("--report", action="store_true",
                        help="only rewrite the guide's tables and bagua/measured_accuracy.py from the results files")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--link", help=argparse.SUPPRESS)
    parser.add_argument("--steps", nargs="+", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.run = "quick"
    try:
        for spec in args.variants:
            parse_variant(spec)
    except ValueError as e:
        parser.error(str(e))
    if BASELINE not in args.variants:
        parser.error(f"--variants must include {BASELINE}: it sets the target")
    if args.tag and not re.fullmatch(r"[A-Za-z0-9_-]+", args.tag):
        parser.error(f"--tag takes letters, digits, - and _, got {args.tag!r}")
    if args.report:
        write_reports()
        return 0
    if args.replace_curves is not None:
        return replace_curves(args, args.replace_curves)
    return run_worker(args) if args.worker else run_driver(args)


if __name__ == "__main__":
    sys.exit(main())
