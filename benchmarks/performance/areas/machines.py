"""Several ranks a machine: hierarchical against flat, the cost model on new shapes, 16 and 32 ranks.

Each ``fig(...)`` is one figure (see ``benchmarks.performance.figure``).
"""

from __future__ import annotations

from functools import lru_cache

from ..figure import Figures, at_least, at_most, ratio

FIGURES = Figures("machines")
fig = FIGURES.add


@lru_cache(maxsize=None)
def _machines():
    from benchmarks.tradeoff import machines  # imports torch and bagua: only when a machines figure is computed

    return machines


def _machines_speed(r: dict, point: str, variant: str) -> float:
    e = _machines().epochs(r["points"][point]["job"])
    return e["ddp"] / e[variant]


def _model_errors(r: dict, prediction_file: str) -> list[float]:
    """The error of the prediction in ``prediction_file`` per measured (variant, point) of ``r``."""
    prediction = r["_results"][prediction_file]
    return [prediction["points"][p]["variants"][n]["epoch_s"] / e - 1
            for p, rec in r["points"].items() for n, e in _machines().epochs(rec["job"]).items() if n != "local"]


#: each measured set of machine shapes: (its name, its prediction, committed before it; the shapes)
MACHINE_SETS = {"machines.json": ("first", "machines_prediction.json", "4 x 2 and 8 x 2 ranks"),
                "machines_heldout.json": ("heldout", "machines_heldout_prediction.json", "6 x 2 and 4 x 4 ranks"),
                "machines_fresh.json": ("fresh", "machines_fresh_prediction.json", "3 x 4 and 2 x 8 ranks")}


def _all_flat_over_hier(r: dict) -> list[float]:
    return [v for name in MACHINE_SETS for v in r["_results"][name]["key"]["bytegrad_flat_over_hier"].values()]


fig("machines_hier_comm_bound", "machines_comm_bound.json",
    lambda r: r["key"]["4x2-100mbit"]["bytegrad_flat_over_hier"], ratio, met=at_least(1.8),
    claim="hierarchical bytegrad at least 1.8x flat bytegrad at 4 machines x 2 ranks, 100 Mbit/s (issue 41)",
    setting="an LM whose step is mostly bytes (GPT-2 4x512, one 16-token document per rank)")
fig("machines_hier_comm_bound_ceiling", "machines_comm_bound.json",
    lambda r: r["key"]["4x2-100mbit"]["ceiling"], ratio, claim="what the bytes allow there: (compute + flat's "
                                                                "transfer) / (compute + hierarchical's)")
fig("machines_hier_lm_4x2", "machines.json", lambda r: r["key"]["bytegrad_flat_over_hier"]["4x2-100mbit"],
    ratio, claim="the same on the tradeoff sweep's LM, whose compute is a third of the step",
    setting="4 machines x 2 ranks, 100 Mbit/s")
fig("machines_hier_flat_100mbit_range", "machines.json",
    lambda r: (min(v for k, v in r["key"]["bytegrad_flat_over_hier"].items() if k.endswith("100mbit")),
               max(v for k, v in r["key"]["bytegrad_flat_over_hier"].items() if k.endswith("100mbit"))),
    "{:.2f}-{:.2f}x", claim="hierarchical bytegrad over flat at 100 Mbit/s, the tradeoff sweep's LM",
    setting="4 and 8 machines x 2 ranks")
fig("machines_hier_4x4", "machines_heldout.json",
    lambda r: r["key"]["bytegrad_flat_over_hier"]["4x4-100mbit"], ratio,
    claim="hierarchical bytegrad over flat with 4 ranks a machine", setting="4 machines x 4 ranks, 100 Mbit/s")
fig("machines_hier_never_slower", "machines.json", lambda r: min(_all_flat_over_hier(r)), ratio,
    met=at_least(1 / 1.05), claim="hierarchical bytegrad never more than 5% slower than flat (issue 41): the lowest "
                                  "flat / hierarchical over every point measured",
    setting="every point of " + ", ".join(MACHINE_SETS))
for variant, label in (("bytegrad-hier", "hierarchical bytegrad"),
                       ("low_precision_decentralized-hier", "hierarchical low_precision_decentralized"),
                       ("onebit_grad", "onebit_grad")):
    fig(f"machines_4x2_100mbit_{variant}", "machines.json",
        lambda r, v=variant: _machines_speed(r, "4x2-100mbit", v), ratio,
        claim=f"{label} against torch DDP", setting="4 machines x 2 ranks, 100 Mbit/s, the tradeoff sweep's LM")
fig("machines_hier_2x8", "machines_fresh.json",
    lambda r: r["key"]["bytegrad_flat_over_hier"]["2x8-100mbit"], ratio,
    claim="hierarchical bytegrad over flat with 8 ranks a machine", setting="2 machines x 8 ranks, 100 Mbit/s")
for measured, (tag, prediction, shapes) in MACHINE_SETS.items():
    fig(f"machines_model_{tag}_within_25pct", measured,
        lambda r, p=prediction: (sum(abs(e) <= 0.25 for e in _model_errors(r, p)), len(_model_errors(r, p))),
        "{} of {}", met=lambda v: v[0] == v[1],
        claim="the cost model, fitted without these points and committed before them, within 25% of each measured "
              "epoch (issue 41)", setting=f"{shapes}, shapes the model had not seen; every variant at every point")
    fig(f"machines_model_{tag}_worst", measured,
        lambda r, p=prediction: max(_model_errors(r, p), key=abs), "{:+.0%}", claim="its worst error there")
fig("machines_model_fresh_repeat_worst", "machines_fresh_repeat.json",
    lambda r: max(_model_errors(r, "machines_fresh_prediction.json"), key=abs), "{:+.0%}",
    claim="the same prediction's worst error in a second job of the fresh set's worst point (its repeatability)",
    setting="2 x 8 ranks, 1 Gbit/s + 5 ms, the job right after the first")


def _scale(r: dict, world: int) -> dict:
    return next(x for x in r["records"] if x["world"] == world)


fig("scale_checks", "scale_check.json",
    lambda r: (sum(ok for layout in r["checks"].values() for _, ok, _ in layout),
               sum(len(layout) for layout in r["checks"].values()), len(r["checks"])),
    "{} of {} checks pass over {} layouts", met=lambda v: v[0] == v[1],
    claim="every algorithm correct at 16 and 32 ranks (issue 41): loss curves, identical replicas, peers met",
    setting="2x2, 4x2, 8x2 and 8x4 ranks on loopback, 6 steps each")
fig("scale_32_ranks_s", "scale_check.json", lambda r: _scale(r, 32)["elapsed_s"], "{:.0f} s",
    met=at_most(600), claim="the 32-rank set in under 10 minutes (issue 41)")
fig("scale_init_growth", "scale_check.json",
    lambda r: max(x["init_s"] for x in _scale(r, 32)["ranks"]) / max(x["init_s"] for x in _scale(r, 16)["ranks"]),
    ratio, met=at_most(2.0), claim="`init_process_group` from 16 to 32 ranks grows no faster than linear (at most 2x)")
fig("scale_wrap_growth", "scale_check.json",
    lambda r: max(x["wrap_s"] for x in _scale(r, 32)["ranks"]) / max(x["wrap_s"] for x in _scale(r, 16)["ranks"]),
    ratio, met=at_most(2.0), claim="the first wrap from 16 to 32 ranks grows no faster than linear (at most 2x)")
