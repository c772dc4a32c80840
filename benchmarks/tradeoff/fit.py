"""Fit ``bagua.advise``'s cost model to the tradeoff study, check it on held-out settings, and
predict the paper's setting with it.

The constants (the one-way latencies each message in sequence costs, the share of the link rate
reached, and each variant's compute time per step) are fitted by
least squares on the log of the measured step times of the settings in ``FIT_KEYS`` (each
sweep's ends and middle); every other setting is predicted and its error reported. A fixed cost
per message is left at 0: on one world size a variant's message count never changes, so that cost
is part of its compute time. The 8-rank setting runs twice as many processes on the same cores: its
compute is scaled by ``bagua.advise.cpu_slowdown`` from the machine's recorded facts (its CPUs and
the load already on it when the sweep started), nothing fitted; and at every world, communication
moves at the ranks' share of a core while they compute (``bagua.advise.communication_pace``).

The measurement's own repeatability is reported beside the errors (``repeatability``): settings
that are nominally the same link (1 Gbit/s at 0 ms, bridged and through the delay line) measured in
separate jobs, and each point's standard error from its timed blocks. A step time is the mean of the
timed steps (``epoch_s`` over the steps): the JSON holds each rank's median and quartiles of its
steps, the sum of its blocks and rank 0's block times, not every step; over the nominally identical
settings the mean repeats at least as well as the median (both reported).

The paper's setting (``PAPER``): 128 ranks on 16 machines, BERT-Large (340M parameters), NCCL,
SQuAD v1.1 at 6 sequences per GPU (88,641 features: 115 steps an epoch); the compute per step is
what makes torch DDP's epoch at 100 Gbit/s the paper's 125 s; the link as the model idealizes it
(every byte at the line rate, one one-way latency per message in sequence). A prediction.

Example::

    fit = fit_results(json.load(open("benchmarks/results/tradeoff.json")))
    fit["held_out"][0]   # {"variant": ..., "setting": ..., "measured_s": ..., "predicted_s": ..., "error": ...}
"""

from __future__ import annotations

import math
from dataclasses import asdict, replace
from typing import Any, Optional, Sequence

import re
import statistics

from bagua.advise import Collective, Constants, Link, communication_pace, cpu_slowdown, default_buckets, predict

FIT_KEYS = ("bw-1gbit", "bw-100mbit", "bw-10mbit", "lat-0ms", "lat-5ms", "lat-20ms")
ADVISE_NAME = {"ddp": "torch-ddp", "ddp-fp16": "torch-ddp-fp16"}
PAPER = {
    "world_size": 128, "ranks_per_machine": 8, "params": 340e6, "backend": "nccl",
    "steps_per_epoch": 88641 / (128 * 6),
    # epoch seconds read from the paper's figures (issue 27)
    "epoch_s": {
        "100gbit 0ms": {"torch-ddp": 125, "bytegrad": 87, "decentralized": 82, "low_precision_decentralized": 76,
                        "qadam": 67, "async": 61},
        "1gbit 0ms": {"torch-ddp": 2600, "bytegrad": 690, "decentralized": 1504, "low_precision_decentralized": 736,
                      "qadam": 75, "async": 61},
        "100gbit 5ms": {"torch-ddp": 905, "bytegrad": 464, "decentralized": 413, "low_precision_decentralized": 156,
                        "qadam": 219, "async": 61},
    },
}  # fmt: skip
_LINKS = {"100gbit 0ms": Link(100e9, 0.0), "1gbit 0ms": Link(1e9, 0.0), "100gbit 5ms": Link(100e9, 0.005)}
#: fitted; backward's share of compute stays at ``Constants``' 2/3 (twice forward's arithmetic): once
#: communication's pace under the ranks' compute is modelled, this data cannot tell it apart (fitted,
#: it ran to its bound of 1, with the same errors)
_GLOBAL = ("latency_factor", "efficiency", "compressed_efficiency", "exchange_efficiency")
_BOUNDS = {"latency_factor": (0.0, 30.0), "efficiency": (0.05, 2.0), "compressed_efficiency": (0.05, 2.0),
           "exchange_efficiency": (0.05, 2.0)}


def step_time(job: dict[str, Any], row: dict[str, Any], statistic: str = "mean") -> float:
    """A variant's step in one job: the mean of its timed steps (``epoch_s`` over their count), or
    ``"median"``: the median step (each rank's, the largest over ranks)."""
    return row["step_s"] if statistic == "median" else row["epoch_s"] / (job["reps"] * job["block"])


def standard_error(job: dict[str, Any], row: dict[str, Any]) -> float:
    """Relative standard error of the mean step from rank 0's timed blocks (nan with fewer than 2)."""
    blocks = row.get("blocks_s") or []
    if len(blocks) < 2:
        return float("nan")
    return statistics.stdev(blocks) / statistics.fmean(blocks) / math.sqrt(len(blocks))


def observations(results: dict[str, Any]) -> list[dict[str, Any]]:
    """One record per (setting, variant) measured: the link, the world, the buckets, the step, its
    standard error, and communication's pace while compute runs (``communication_pace`` of the
    world on the machine's cores and load)."""
    facts, out = machine_facts(results), []
    for key, record in results["settings"].items():
        setting, job = record["setting"], record["job"]
        for name, row in job["variants"].items():
            out.append({"setting": key, "sweep": setting["sweep"], "variant": ADVISE_NAME.get(name, name),
                        "world": job["world"], "link": Link(record["rate_bit"], (setting["delay_ms"] or 0.0) / 1e3),
                        "buckets": row["buckets"], "step_s": step_time(job, row), "se": standard_error(job, row),
                        "pace": pace(facts, job["world"]),
                        "pattern": [Collective(**m) for m in row["messages"]] if "messages" in row else None})
    return out


def machine_facts(results: dict[str, Any]) -> dict[str, float]:
    """The sweep machine's CPUs and the load on it before the sweep (the 1-minute load average):
    recorded as ``cpus`` and ``load_start``, or read from the description older runs wrote."""
    machine = results.get("machine", {})
    text = machine.get("description", "")
    cpus = machine.get("cpus") or (int(m.group(1)) if (m := re.search(r"(\d+)-CPU", text)) else None)
    load = machine.get("load_start")
    if load is None:
        m = re.search(r"load average ([\d.]+)", text)
        load = float(m.group(1)) if m else 0.0
    return {"cpus": float(cpus) if cpus else float("nan"), "load_start": float(load)}


def pace(facts: dict[str, float], world: int) -> float:
    """Communication's pace during compute with ``world`` ranks on the machine of ``facts``
    (``machine_facts``; 1 where its CPUs are unknown)."""
    return communication_pace(world, facts["cpus"], facts["load_start"]) if facts["cpus"] > 0 else 1.0


def compute_scale(results: dict[str, Any], world: int, fitted_world: int, background: Optional[float] = None,
                  contention: float = 1.0) -> float:
    """How much longer a step's compute is at ``world`` ranks than at ``fitted_world`` on the sweep's
    machine (every rank there, sharing its CPUs with the load it had): ``cpu_slowdown``'s ratio.
    ``background``: the other load (default: the recorded load at the start); ``contention``:
    ``cpu_slowdown``'s exponent (1: the cores shared at no cost)."""
    facts = machine_facts(results)
    if not facts["cpus"] > 0:
        return 1.0
    load = facts["load_start"] if background is None else background
    return (cpu_slowdown(world, facts["cpus"], load, contention)
            / cpu_slowdown(fitted_world, facts["cpus"], load, contention))


def predicted(obs: dict[str, Any], compute: dict[str, float], constants: Constants, scale: float = 1.0) -> float:
    return predict(obs["variant"], obs["buckets"], obs["world"], obs["link"], compute[obs["variant"]] * scale,
                   constants, pattern=obs.get("pattern"), pace=obs["pace"]).step_s


def fit(points: Sequence[dict[str, Any]]) -> tuple[dict[str, float], Constants]:
    """Least squares on log step times: every variant's compute and the global constants."""
    import numpy as np
    from scipy.optimize import least_squares

    names = sorted({p["variant"] for p in points})
    x0 = [min(p["step_s"] for p in points if p["variant"] == n) for n in names]
    x0 += [1.0, 0.8, 0.8, 0.8]
    lower = [0.0] * len(names) + [_BOUNDS[k][0] for k in _GLOBAL]
    upper = [max(x0[:len(names)]) * 10] * len(names) + [_BOUNDS[k][1] for k in _GLOBAL]

    def unpack(x) -> tuple[dict[str, float], Constants]:
        return dict(zip(names, x[:len(names)])), Constants(**dict(zip(_GLOBAL, x[len(names):])))

    def residuals(x):
        compute, constants = unpack(x)
        return np.array([math.log(max(predicted(p, compute, constants), 1e-9) / p["step_s"]) for p in points])

    solution = least_squares(residuals, np.clip(x0, lower, upper), bounds=(lower, upper), x_scale="jac",
                             ftol=1e-12, xtol=1e-12, gtol=1e-12)
    return unpack(solution.x)


def repeatability(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Settings measured in separate jobs on what is nominally the same link (same ranks, rate and
    one-way latency: 1 Gbit/s at 0 ms bridged, and through the delay line at 0 ms): per variant the
    second's step over the first's - 1, by the mean and by the median step, and the common shift
    (geometric mean over the variants). What two measurements of one point differ by, the floor
    under any model's error."""
    groups: dict[tuple, list[str]] = {}
    for key, record in results["settings"].items():
        s = record["setting"]
        groups.setdefault((s["ranks"], record["rate_bit"], s["delay_ms"] or 0.0), []).append(key)
    out = []
    for keys in groups.values():
        for i, a in enumerate(keys):
            for b in keys[i + 1:]:
                ja, jb = results["settings"][a]["job"], results["settings"][b]["job"]
                common = sorted(set(ja["variants"]) & set(jb["variants"]))
                if not common:
                    continue
                pair: dict[str, Any] = {"a": a, "b": b}
                for stat in ("mean", "median"):
                    if stat == "median" and not all("step_s" in j["variants"][v] for j in (ja, jb) for v in common):
                        continue
                    diffs = {ADVISE_NAME.get(v, v): step_time(jb, jb["variants"][v], stat) / step_time(ja, ja["variants"][v], stat) - 1
                             for v in common}
                    logs = [math.log1p(d) for d in diffs.values()]
                    pair[stat] = {"diffs": diffs, "median_abs": statistics.median(abs(d) for d in diffs.values()),
                                  "max_abs": max(abs(d) for d in diffs.values()),
                                  "common": math.expm1(statistics.fmean(logs)),
                                  "spread": statistics.pstdev(logs) if len(logs) > 1 else 0.0}
                out.append(pair)
    return out


def setting_shifts(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per setting, the error all its variants share (geometric mean of predicted / measured - 1)
    and what is left per variant once that is taken out (root mean square of the log): a shift
    common to every variant of one job is the machine's load in those minutes, not the network."""
    by: dict[str, list[float]] = {}
    for r in rows:
        by.setdefault(r["setting"], []).append(math.log1p(r["error"]))
    return {k: {"common": math.expm1(statistics.fmean(v)),
                "residual": math.sqrt(statistics.fmean([(x - statistics.fmean(v)) ** 2 for x in v]))}
            for k, v in by.items()}


def fit_results(results: dict[str, Any]) -> dict[str, Any]:
    """Fit on ``FIT_KEYS``; every other point predicted, with its error and its standard error;
    the measurement's repeatability beside them."""
    points = observations(results)
    keys = FIT_KEYS
    fitted_world = min(p["world"] for p in points)
    training = [p for p in points if p["setting"] in keys and p["world"] == fitted_world]
    if len({p["setting"] for p in training}) < 2:
        raise ValueError(f"fewer than two of the fit settings {', '.join(keys)} measured; run them first")
    compute, constants = fit(training)
    rows = []
    worlds = sorted({p["world"] for p in points})
    scales = {w: compute_scale(results, w, fitted_world) for w in worlds}
    idle_scales = {w: compute_scale(results, w, fitted_world, background=0.0) for w in worlds}
    for p in points:
        if p["variant"] not in compute:
            continue
        guess = predicted(p, compute, constants, scales[p["world"]])
        row = {"variant": p["variant"], "setting": p["setting"], "fitted": p in training,
               "measured_s": p["step_s"], "predicted_s": guess, "error": guess / p["step_s"] - 1, "se": p["se"]}
        if scales[p["world"]] != idle_scales[p["world"]]:  # the same without the load that was on the machine
            row["error_idle_cores"] = predicted(p, compute, constants, idle_scales[p["world"]]) / p["step_s"] - 1
        rows.append(row)
    held = [r for r in rows if not r["fitted"]]
    return {"constants": asdict(constants), "compute_s": compute, "fit_settings": list(keys),
            "machine": machine_facts(results), "compute_scale": {str(w): s for w, s in scales.items()},
            "compute_scale_idle_cores": {str(w): s for w, s in idle_scales.items()},
            "fit": [r for r in rows if r["fitted"]], "held_out": held,
            "worst_held_out": max((abs(r["error"]) for r in held), default=float("nan")),
            "repeatability": repeatability(results), "held_out_shifts": setting_shifts(held),
            "paper": predict_paper(constants)}


SCENARIOS = {
    "A": "compute from DDP's 100 Gbit/s epoch, an ideal link (every byte at the line rate)",
    "B": "compute from async's epoch (61 s: its step is compute alone), each link capped at the rate that "
         "makes DDP's 100 Gbit/s epoch the paper's 125 s (what TCP sockets reached on the 100 Gbit/s NICs)",
    "C": "as B, each message in sequence costing the one-way latencies it cost on this sweep (fitted; "
         "TCP here, not an ideal link)",
}


def _solve(f, low: float, high: float, target: float) -> float:
    """x in [low, high] with f(x) = target, f monotone (bisection)."""
    rising = f(high) > f(low)
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if (f(mid) < target) == rising else (low, mid)
    return (low + high) / 2


def paper_epoch(algo: str, link: Link, case: dict[str, Any]) -> float:
    """Epoch seconds of ``algo`` in the paper's setting on ``link`` under one scenario's
    assumptions (``case``: compute_s, constants, ceiling_bit_s, as ``predict_paper`` gives)."""
    capped = Link(min(link.bandwidth_bit_s, case["ceiling_bit_s"]), link.latency_s)
    return predict(algo, default_buckets(PAPER["params"]), PAPER["world_size"], capped, case["compute_s"],
                   Constants(**case["constants"]), PAPER["ranks_per_machine"], PAPER["backend"]).step_s * PAPER["steps_per_epoch"]


def predict_paper(fitted: Constants) -> dict[str, Any]:
    """The paper's setting on paper under ``SCENARIOS`` (the fitted backward share in each, C's
    latency factor fitted too): epoch seconds per algorithm and link beside the paper's, and
    seconds per ms of latency."""
    steps = PAPER["steps_per_epoch"]
    ideal = asdict(replace(Constants(), backward_share=fitted.backward_share))

    def case(compute: float, ceiling: float = math.inf, **constants) -> dict[str, Any]:
        return {"compute_s": compute, "ceiling_bit_s": ceiling, "constants": {**ideal, **constants}}

    ddp_fast, link_fast = PAPER["epoch_s"]["100gbit 0ms"]["torch-ddp"], _LINKS["100gbit 0ms"]
    compute_a = _solve(lambda c: paper_epoch("torch-ddp", link_fast, case(c)), 0.0, ddp_fast / steps, ddp_fast)
    compute_b = PAPER["epoch_s"]["100gbit 0ms"]["async"] / steps
    ceiling = _solve(lambda r: paper_epoch("torch-ddp", link_fast, case(compute_b, r)), 1e8, 100e9, ddp_fast)
    cases = {"A": case(compute_a), "B": case(compute_b, ceiling),
             "C": case(compute_b, ceiling, latency_factor=fitted.latency_factor)}
    table: dict[str, dict[str, Any]] = {}
    for name, link in _LINKS.items():
        table[name] = {}
        for algo, paper_s in PAPER["epoch_s"][name].items():
            p = predict(algo, default_buckets(PAPER["params"]), PAPER["world_size"], link, compute_a,
                        Constants(**ideal), PAPER["ranks_per_machine"], PAPER["backend"])
            table[name][algo] = {"paper_s": paper_s, "hops": p.hops, "bytes": p.nbytes,
                                 **{c: paper_epoch(algo, link, how) for c, how in cases.items()}}
    slopes = {}
    for algo, paper_s in PAPER["epoch_s"]["100gbit 5ms"].items():
        slopes[algo] = {"paper": (paper_s - PAPER["epoch_s"]["100gbit 0ms"][algo]) / 5}
        for c, how in cases.items():
            at = [paper_epoch(algo, Link(100e9, ms / 1e3), how) for ms in (0, 5)]
            slopes[algo][c] = (at[1] - at[0]) / 5
    return {"setting": {k: v for k, v in PAPER.items() if k != "epoch_s"}, "scenarios": SCENARIOS, "cases": cases,
            "epochs": table, "latency_slopes": slopes}
