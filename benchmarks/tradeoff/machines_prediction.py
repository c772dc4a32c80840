#!/usr/bin/env python3
"""The cost model's prediction for machines of several ranks, written before they are measured.

Issue 41 measures torch DDP and bagua's algorithms, flat and hierarchical, on 4 and 8 emulated
machines of 2 ranks each (``--machines M --ranks-per-machine 2``), at 100 Mbit/s and at 1 Gbit/s
with 5 ms one way, on the workload of the bandwidth x latency sweep (``sweep.py``:
``examples/train_lm.py``'s 3.24M-parameter LM, 13 MB of fp32 gradients, its buckets as recorded
there). This writes ``bagua.advise``'s epoch time for every one of those points, fitted only on
the sweep of single-rank machines (``results/tradeoff_model.json``), so that the measurement tests
a model that never saw the shape:

- the constants and each variant's compute per step are the fit's; compute at n ranks is scaled
  by ``fit.compute_scale`` (the ranks share this machine's cores with its recorded load);
- hierarchical variants: exact within a machine (free: its loopback), the pattern among the
  machines' leaders; flat ones: over every rank (``message_pattern(..., hierarchical=False)``);
- qadam and onebit_grad are predicted flat (``hierarchical=False``, their default), async is left
  out (its averaging is off the step: its epoch is its compute).

``--held-out`` writes the second prediction, ``results/machines_heldout_prediction.json``, for
shapes the first runs never touched (6 machines x 2 ranks, 4 x 4): the same fit, with compute at
n ranks scaled by ``cpu_slowdown``'s contention exponent fitted on the first runs' measured
no-communication steps (``fit_contention``), the one thing those runs showed the model lacked.

``--fresh`` writes the third, ``results/machines_fresh_prediction.json``, for shapes neither run
touched (3 x 4, 2 x 8), with what the held-out run showed the model lacked, fitted on both earlier
runs: communication that moves at the ranks' share of a core while compute runs
(``bagua.advise.communication_pace``, in the sweep's refit too) and the emulated delay line's cost
per message between machines (``fit_router``), besides the contention.

Example (from the repository root)::

    python -m benchmarks.tradeoff.machines_prediction              # writes benchmarks/results/machines_prediction.json
    python -m benchmarks.tradeoff.machines_prediction --held-out   # ... machines_heldout_prediction.json
    python -m benchmarks.tradeoff.machines_prediction --fresh      # ... machines_fresh_prediction.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional, Sequence

from bagua.advise import Constants, Link, cpu_slowdown, predict
from benchmarks.records import BENCHMARKS, RESULTS
from benchmarks.tradeoff.fit import compute_scale, machine_facts, pace
from benchmarks.tradeoff.sweep import EPOCH_STEPS

LAYOUTS = ((4, 2), (8, 2))
HELD_OUT_LAYOUTS = ((6, 2), (4, 4))  # 12 ranks and 4 a machine: neither was measured before
FRESH_LAYOUTS = ((3, 4), (2, 8))  # 4 and 8 a machine, 3 and 2 machines: neither run measured them
#: each set of shapes: its layouts, its prediction, its measurements, its plot (in benchmarks/)
SETS = {
    "first": (LAYOUTS, "results/machines_prediction.json", "results/machines.json", "figures/machines.png"),
    "held-out": (HELD_OUT_LAYOUTS, "results/machines_heldout_prediction.json", "results/machines_heldout.json",
                 "figures/machines_heldout.png"),
    "fresh": (FRESH_LAYOUTS, "results/machines_fresh_prediction.json", "results/machines_fresh.json",
              "figures/machines_fresh.png"),
}
FITTED_WORLD = 4  # the sweep's per-variant compute is at 4 ranks
LINKS = {"100mbit": Link(100e6, 0.0), "1gbit-5ms": Link(1e9, 0.005)}
#: the variants measured: (benchmark name, bagua.advise name, hierarchical)
VARIANTS = (
    ("ddp", "torch-ddp", False),
    ("gradient_allreduce", "gradient_allreduce", False),
    ("gradient_allreduce-hier", "gradient_allreduce", True),
    ("bytegrad", "bytegrad", False),
    ("bytegrad-hier", "bytegrad", True),
    ("decentralized-hier", "decentralized", True),
    ("low_precision_decentralized-hier", "low_precision_decentralized", True),
    ("qadam", "qadam", False),
    ("onebit_grad", "onebit_grad", False),
)


def predictions(fit: dict[str, Any], sweep: dict[str, Any], scales: Optional[dict[str, float]] = None,
                layouts: Sequence[tuple[int, int]] = LAYOUTS, contention: float = 1.0,
                router: Optional[dict[str, float]] = None) -> dict[str, Any]:
    """Epoch seconds per point ``"{M}x{R}-{link}"`` and variant, and what went into each.
    ``scales``: a point's compute scale, measured (its no-communication step over the fit's torch
    DDP compute at 4 ranks), instead of ``compute_scale``'s sharing of the cores (with
    ``contention``, ``cpu_slowdown``'s exponent). ``router``: per link, the emulated router's
    seconds per message between machines on an idle core (``fit_router``), slowed as the ranks'
    compute is (``cpu_slowdown``)."""
    constants = Constants(**fit["constants"])
    facts = machine_facts(sweep)
    recorded = sweep["settings"]["x8-100mbit"]["job"]["variants"]  # the LM's buckets per variant, as recorded
    points: dict[str, Any] = {}
    for machines, per in layouts:
        world = machines * per
        for link_name, link in LINKS.items():
            key = f"{machines}x{per}-{link_name}"
            if router:
                link = replace(link, message_s=router[link_name] * cpu_slowdown(world, facts["cpus"], facts["load_start"],
                                                                                contention))
            scale = (scales or {}).get(key) or compute_scale(sweep, world, FITTED_WORLD, contention=contention)
            paced = pace(facts, world)
            rows = {}
            for name, advise_name, hierarchical in VARIANTS:
                base = name.removesuffix("-hier")
                buckets = recorded[base]["buckets"]
                compute = fit["compute_s"][advise_name] * scale
                p = predict(advise_name, buckets, world, link, compute, constants, ranks_per_machine=per,
                            hierarchical=hierarchical, pace=paced)
                rows[name] = {"epoch_s": p.step_s * EPOCH_STEPS, "step_s": p.step_s, "compute_s": p.compute_s,
                              "exposed_s": p.exposed_s, "hops": p.hops, "bytes_per_step": p.nbytes}
            points[key] = {
                "machines": machines, "ranks_per_machine": per, "link": {"bandwidth_bit_s": link.bandwidth_bit_s,
                                                                         "latency_s": link.latency_s},
                "compute_scale": scale, "pace": paced, "router_message_s": link.message_s, "variants": rows}
    return points


def measured_scales(results: dict[str, Any], fit: dict[str, Any]) -> dict[str, float]:
    """Each point's compute scale as measured: its no-communication step ("local") over the fit's
    torch DDP compute at 4 ranks (points whose job ran no "local" are left out)."""
    scales = {}
    for point, record in results["points"].items():
        row = record["job"]["variants"].get("local")
        if row:
            scales[point] = row["epoch_s"] / (record["job"]["reps"] * record["job"]["block"]) / fit["compute_s"]["torch-ddp"]
    return scales


def fit_contention(results: dict[str, Any], fit: dict[str, Any], sweep: dict[str, Any]) -> float:
    """``cpu_slowdown``'s exponent that best explains the measured compute scales of ``results``
    (machines.py's runs): least squares through the origin on logs, each point's scale against its
    world's share of the sweep machine's cores over the fitted world's (at least 1: the cores are
    never shared at a gain).

    Example::

        fit_contention(json.load(open("benchmarks/results/machines.json")), fit, sweep)   # 1.3
    """
    import math

    xs, ys = [], []
    for point, scale in measured_scales(results, fit).items():
        world = results["points"][point]["job"]["world"]
        xs.append(math.log(compute_scale(sweep, world, FITTED_WORLD)))
        ys.append(math.log(scale))
    if not xs or not any(xs):
        raise ValueError("no measured compute at another world size than the fit's: run machines.py first")
    return max(1.0, sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs))


def fit_router(results: dict[str, Any], fit: dict[str, Any], sweep: dict[str, Any], contention: float) -> dict[str, float]:
    """Per link of ``LINKS``, the emulated router's seconds per message between machines on an idle
    core that best explain ``results`` (machines.py's runs): least squares on the log of every
    variant's epoch, bounded to [0, 10 ms]. The delay line that makes a link's latency is a process
    on the same cores as the ranks; what it adds grows with the messages a step sends between
    machines (``Collective.remote_messages``: ``2 n (n-R)`` for a flat compressed allreduce).

    Example::

        fit_router(json.load(open("benchmarks/results/machines.json")), fit, sweep, 1.27)   # {"100mbit": 0.0, ...}
    """
    import math

    from scipy.optimize import minimize_scalar

    from benchmarks.tradeoff.machines import epochs

    layouts = sorted({tuple(int(x) for x in k.split("-")[0].split("x")) for k in results["points"]})
    out = {}
    for link_name in LINKS:
        measured = {k: epochs(r["job"]) for k, r in results["points"].items() if k.endswith("-" + link_name)}

        def loss(c: float) -> float:
            points = predictions(fit, sweep, layouts=layouts, contention=contention, router={**dict.fromkeys(LINKS, 0.0),
                                                                                           link_name: c})
            return sum(math.log(row["epoch_s"] / measured[k][name]) ** 2
                       for k in measured for name, row in points[k]["variants"].items())

        out[link_name] = float(minimize_scalar(loss, bounds=(0.0, 0.01), method="bounded",
                                               options={"xatol": 1e-7}).x) if measured else 0.0
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.split("\n\n")[0])
    p.add_argument("--fit", default=str(RESULTS / "tradeoff_model.json"))
    p.add_argument("--sweep", default=str(RESULTS / "tradeoff.json"))
    which = p.add_mutually_exclusive_group()
    which.add_argument("--held-out", action="store_const", const="held-out", dest="set", default="first",
                       help="predict HELD_OUT_LAYOUTS with the contention fitted on results/machines.json")
    which.add_argument("--fresh", action="store_const", const="fresh", dest="set",
                       help="predict FRESH_LAYOUTS with the contention and the router fitted on both earlier runs")
    p.add_argument("--out", default=None, help="default: the set's prediction in results/ (see SETS)")
    args = p.parse_args(argv)
    fit, sweep = json.loads(Path(args.fit).read_text()), json.loads(Path(args.sweep).read_text())
    record: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M"), "fitted_on": fit["fit_settings"],
                              "constants": fit["constants"], "epoch_steps": EPOCH_STEPS}
    layouts, prediction_path = SETS[args.set][:2]
    contention, router = 1.0, None
    if args.set != "first":
        earlier = ("first",) if args.set == "held-out" else ("first", "held-out")
        measured: dict[str, Any] = {"points": {}}
        for name in earlier:
            measured["points"].update(json.loads((BENCHMARKS / SETS[name][2]).read_text())["points"])
        contention = fit_contention(measured, fit, sweep)
        record.update(contention=contention, contention_fitted_on=sorted(measured_scales(measured, fit)),
                      machine=machine_facts(sweep))
        print(f"cpu_slowdown's contention, fitted on {', '.join(record['contention_fitted_on'])}: {contention:.3f}")
        if args.set == "fresh":
            router = fit_router(measured, fit, sweep, contention)
            record.update(router=router, router_fitted_on=sorted(measured["points"]))
            print("the delay line's seconds per message between machines, on an idle core: "
                  + ", ".join(f"{k} {v * 1e6:.1f} us" for k, v in router.items()))
    points = predictions(fit, sweep, layouts=layouts, contention=contention, router=router)
    out = Path(args.out or BENCHMARKS / prediction_path)
    record["points"] = points
    out.write_text(json.dumps(record, indent=1))
    for key, point in points.items():
        ddp = point["variants"]["ddp"]["epoch_s"]
        print(f"{key} (compute x{point['compute_scale']:.2f}):")
        for name, row in point["variants"].items():
            print(f"  {name:34s} epoch {row['epoch_s']:7.1f} s  {ddp / row['epoch_s']:5.2f}x DDP  "
                  f"{row['bytes_per_step'] / 1e6:6.2f} MB/step  {row['hops']:3d} messages in sequence")
        flat, hier = point["variants"]["bytegrad"]["epoch_s"], point["variants"]["bytegrad-hier"]["epoch_s"]
        print(f"  bytegrad flat / hierarchical: {flat / hier:.2f}x")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
