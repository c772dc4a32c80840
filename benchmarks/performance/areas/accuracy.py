"""Time to accuracy: steps and time to torch DDP's loss, the loss at its last step.

Each ``fig(...)`` is one figure (see ``benchmarks.performance.figure``).
"""

from __future__ import annotations

from typing import Optional

from ..figure import Figures, at_most, pct, ratio

FIGURES = Figures("accuracy")
fig = FIGURES.add

TTA_VARIANTS = {"torch-ddp-fp16": "torch DDP, fp16 hook", "bytegrad": "bytegrad", "decentralized": "decentralized",
                "low_precision_decentralized": "low_precision_decentralized", "async": "async", "qadam": "qadam",
                "qadam1": "qadam, bits=1", "onebit_grad": "onebit_grad"}


def _row(r: dict, variant: str, link: str = "100mbit") -> Optional[dict]:
    return r["table"].get(link, {}).get(variant)


def _steps(r: dict, variant: str, link: str) -> Optional[str]:
    row, ddp = _row(r, variant, link), _row(r, "torch-ddp", link)
    if row is None:
        return None
    return f"{row['reached'][0] / ddp['reached'][0]:.2f}x" if row["reached"] else "not in 1.5x"


def _time(r: dict, variant: str, link: str) -> Optional[str]:
    row, ddp = _row(r, variant, link), _row(r, "torch-ddp", link)
    if row is None:
        return None
    return f"{ddp['reached'][1] / row['reached'][1]:.2f}x" if row["reached"] else "never"


def _loss(r: dict, variant: str, link: str = "100mbit") -> Optional[float]:
    row = _row(r, variant, link)
    return None if row is None else row["val_at_steps"] / r["target"] - 1


def _reaching(r: dict, link: str) -> dict:
    """The bagua variants that reached DDP's loss on ``link``, by name."""
    return {n: row for n, row in r["table"][link].items() if row["reached"] and not n.startswith("torch-ddp")}


def _fastest(r: dict, link: str = "100mbit") -> tuple[str, dict]:
    return min(_reaching(r, link).items(), key=lambda kv: kv[1]["reached"][1])


for variant, label in TTA_VARIANTS.items():
    fig(f"tta_{variant}_steps", "time_to_accuracy.json", lambda r, v=variant: _steps(r, v, "100mbit"),
        grid=("tta", label, "steps to DDP's loss (decay, 4 ranks)"))
    fig(f"tta_{variant}_steps_constant", "time_to_accuracy_constant.json",
        lambda r, v=variant: _steps(r, v, r["curve_link"]), grid=("tta", label, "steps to DDP's loss (constant rate, 2 ranks)"))
    fig(f"tta_{variant}_loss", "time_to_accuracy.json", lambda r, v=variant: _loss(r, v), pct,
        grid=("tta", label, "loss at DDP's last step, vs DDP's (decay)"))
    for link, column in (("1gbit", "1 Gbit/s"), ("100mbit", "100 Mbit/s")):
        fig(f"tta_{variant}_time_{link}", "time_to_accuracy.json",
            lambda r, v=variant, ln=link: _time(r, v, ln), grid=("tta", label, f"DDP's time to its loss / this one's, {column}"))
fig("tta_async_loss_1gbit", "time_to_accuracy.json", lambda r: _loss(r, "async", "1gbit"), pct,
    claim="async's loss at DDP's last step at 1 Gbit/s (it averages on a clock, so its curve depends on the link)")
fig("tta_fastest_100mbit", "time_to_accuracy.json", lambda r: _fastest(r)[0],
    claim="the algorithm that reaches DDP's final loss soonest at 100 Mbit/s")
fig("tta_fastest_time_fraction_100mbit", "time_to_accuracy.json",
    lambda r: _fastest(r)[1]["reached"][1] / _row(r, "torch-ddp")["reached"][1], ratio, met=at_most(0.25),
    claim="at 100 Mbit/s the fastest algorithm reaches DDP's final loss in at most 0.25x DDP's time (issue 40)",
    setting="4 ranks as machines, the LM of convergence.md, cosine decay")
fig("tta_fastest_speedup_100mbit", "time_to_accuracy.json",
    lambda r: _row(r, "torch-ddp")["reached"][1] / _fastest(r)[1]["reached"][1], ratio,
    claim="the same, as DDP's time over the fastest's", setting="4 ranks as machines, the LM of convergence.md")
fig("tta_ddp_time_100mbit", "time_to_accuracy.json", lambda r: _row(r, "torch-ddp")["reached"][1],
    "{:.0f} s", claim="torch DDP's time to its own final loss at 100 Mbit/s")
fig("tta_ddp_steps", "time_to_accuracy.json", lambda r: r["steps"], "{}",
    claim="torch DDP's steps (its loss there is the target)")
fig("tta_reaching_loopback_steps", "time_to_accuracy.json",
    lambda r: (min(x["step_s"] for x in _reaching(r, r["curve_link"]).values()),
               max(x["step_s"] for x in _reaching(r, r["curve_link"]).values())), "{:.2f}-{:.2f} s",
    claim="the step of the bagua algorithms that reach DDP's loss, with no link to wait for (loopback)")
fig("tta_fastest_loopback_step", "time_to_accuracy.json",
    lambda r: min(x["step_s"] for x in _reaching(r, r["curve_link"]).values()), "{:.3f} s",
    claim="the fastest of those steps")
fig("tta_ceiling_100mbit", "time_to_accuracy.json",
    lambda r: _row(r, "torch-ddp")["reached"][1]
    / (r["steps"] * min(x["step_s"] for x in _reaching(r, r["curve_link"]).values())), ratio,
    claim="the most any of them can gain over DDP at 100 Mbit/s on this box: DDP's time over its steps at the "
          "fastest loopback step")
fig("tta_async_step_100mbit", "time_to_accuracy.json", lambda r: _row(r, "async")["step_s"], "{:.3f} s",
    claim="a step that waits for no link (async's, at 100 Mbit/s)")
fig("tta_qadam1_mb_per_step", "time_to_accuracy.json", lambda r: _row(r, "qadam1")["bytes_per_step"] / 1e6,
    "{:.2f} MB", claim="qadam bits=1's bytes sent per step and rank")
fig("tta_ddp_mb_per_step", "time_to_accuracy.json", lambda r: _row(r, "torch-ddp")["bytes_per_step"] / 1e6,
    "{:.2f} MB", claim="torch DDP's bytes per step and rank")
fig("tta_qadam1_bytes_share", "time_to_accuracy.json",
    lambda r: _row(r, "qadam1")["bytes_per_step"] / _row(r, "torch-ddp")["bytes_per_step"], "{:.0%}",
    claim="qadam bits=1's bytes per step as a share of DDP's")
fig("tta_qadam1_link_time_100mbit", "time_to_accuracy.json",
    lambda r: _row(r, "qadam1")["bytes_per_step"] * 8 / 100e6, "{:.3f} s",
    claim="what qadam bits=1's bytes take on a 100 Mbit/s link")
fig("tta_qadam1_own_machines_100mbit", "time_to_accuracy.json",
    lambda r: _row(r, "torch-ddp")["reached"][1]
    / (_row(r, "qadam1")["reached"][0] * (_row(r, "async")["step_s"] + _row(r, "qadam1")["bytes_per_step"] * 8 / 100e6)),
    "{:.1f}x", claim="an estimate, not a measurement: qadam bits=1 against DDP at 100 Mbit/s on machines of their own, "
                     "its step the compute of a step that waits for nothing plus its bytes on the link")
fig("tta_ddp_last20_gain", "time_to_accuracy.json", lambda r: r["ddp_last_20pct_gain"], "{:.1%}",
    met=at_most(0.02), claim="DDP's validation loss flat by the end: its last 20% of steps gain under 2% (issue 40)")
fig("tta_ddp_last20_gain_constant", "time_to_accuracy_constant.json",
    lambda r: r["ddp_last_20pct_gain"], "{:.1%}", met=at_most(0.02), claim="the same at a constant learning rate")
fig("tta_relaxed_adam_gap", "time_to_accuracy.json",
    lambda r: (min(_loss(r, v) for v in ("decentralized", "low_precision_decentralized", "async")) * 100,
               max(_loss(r, v) for v in ("decentralized", "low_precision_decentralized", "async")) * 100),
    "{:.1f}-{:.1f}%", claim="how far above DDP's loss decentralized, low_precision_decentralized and async end with "
                            "AdamW (100 Mbit/s)")
fig("tta_decentralized_family_gap", "time_to_accuracy.json",
    lambda r: (min(_loss(r, v) for v in ("decentralized", "low_precision_decentralized")) * 100,
               max(_loss(r, v) for v in ("decentralized", "low_precision_decentralized")) * 100),
    "{:.1f}-{:.1f}%", claim="how far above DDP's loss decentralized and low_precision_decentralized end with AdamW")
fig("tta_onebit_gap", "time_to_accuracy.json",
    lambda r: (_loss(r, "onebit_grad") * 100,
               (lambda c: _loss(c, "onebit_grad", c["curve_link"]))(
                   r["_results"]["time_to_accuracy_constant.json"]) * 100),
    lambda v: f"+{min(v):.1f}-{max(v):.1f}%", claim="how far above DDP's loss onebit_grad ends on the LM with AdamW "
                                                    "(decay and constant-rate runs)")
