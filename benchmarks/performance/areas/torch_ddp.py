"""Plain torch DDP with bagua's hooks and striped connections, and the Hugging Face Trainer.

Each ``fig(...)`` is one figure (see ``benchmarks.performance.figure``).
"""

from __future__ import annotations

import statistics

from ..figure import Figures, at_least, at_most, ratio
from .network import MLP

FIGURES = Figures("torch")
fig = FIGURES.add

for world in ("2", "4"):
    fig(f"hook_bytegrad_100mbit_x{world}", "ddp_hooks.json",
        lambda r, w=world: r["key"][f"ddp-bytegrad-hook_speedup_100mbit_x{w}"], ratio, met=at_least(3.5),
        claim="torch DDP with bagua's 8-bit hook at least 3.5x torch DDP fp32 at 100 Mbit/s (issue 42)",
        setting=f"{MLP}, {world} ranks")
    fig(f"hook_bytegrad_over_bagua_100mbit_x{world}", "ddp_hooks.json",
        lambda r, w=world: r["key"][f"ddp-bytegrad-hook_over_bytegrad_100mbit_x{w}"], ratio, met=at_most(1.05),
        claim="its epoch within 5% of `bagua.DistributedDataParallel(algorithm=\"bytegrad\")`'s (issue 42)",
        setting=f"{MLP}, {world} ranks")
    fig(f"hook_onebit_100mbit_x{world}", "ddp_hooks.json",
        lambda r, w=world: r["key"][f"ddp-onebit-hook_speedup_100mbit_x{w}"], "{:.1f}x", met=at_least(8.0),
        claim="torch DDP with the 1-bit hook at least 8x torch DDP fp32 at 100 Mbit/s (issue 42)",
        setting=f"{MLP}, {world} ranks")
fig("hook_bytegrad_step_1gbit", "ddp_hooks.json",
    lambda r: (lambda v: v["ddp-bytegrad-hook"]["step_s"] / v["bytegrad"]["step_s"])(
        next(j for j in r["jobs"] if j["setting"] == "1gbit" and j["world"] == 2)["variants"]), ratio,
    claim="what the hook's thread costs where the link is fast: its step over bagua bytegrad's (no target)",
    setting=f"{MLP}, 2 ranks, 1 Gbit/s")


def _striped(r: dict, setting: str, variant: str) -> float:
    return next(j for j in r["jobs"] if j["setting"] == setting)["variants"][variant]["epoch_s"]


fig("striped_per_flow", "ddp_striped_backend.json",
    lambda r: r["key"]["ddp_striped_speedup_100mbit-per-flow-streams1_x2"], ratio, met=at_least(3.0),
    claim="torch DDP on the `\"bagua\"` backend at least 3x torch DDP on Gloo where each connection is capped "
          "(issue 42)", setting=f"{MLP}, 2 ranks, 8 connection sets, each capped at 100 Mbit/s under 1 Gbit/s; epochs")
fig("striped_uncapped", "ddp_striped_backend.json", lambda r: r["key"]["ddp_striped_speedup_1gbit_x2"],
    ratio, met=lambda v: 1 / v <= 1.03, claim="on an uncapped link within 3% of Gloo (issue 42): Gloo's epoch over "
                                               "the striped one's", setting=f"{MLP}, 2 ranks, 1 Gbit/s")
for setting, link in (("100mbit-per-flow-streams1", "each connection capped at 100 Mbit/s"), ("1gbit", "1 Gbit/s")):
    for variant, backend in (("ddp", "Gloo"), ("ddp-striped", "the `\"bagua\"` backend")):
        fig(f"striped_epoch_{setting.split('-')[0]}_{variant}", "ddp_striped_backend.json",
            lambda r, s=setting, v=variant: _striped(r, s, v), "{:.2f} s", claim=f"torch DDP's epoch on {backend}",
            setting=f"{MLP}, 2 ranks, {link}")


def _eval_loss(r: dict, row: str) -> float:
    return statistics.mean(r["rows"][row]["eval_loss"])


fig("hf_trainer_8bit", "hf_trainer.json", lambda r: r["key"]["bytegrad_speedup"], ratio, met=at_least(3.0),
    claim="the unchanged Hugging Face `Trainer` with bagua's 8-bit hook at least 3x faster per step than the plain "
          "Trainer (issue 42)", setting="GPT-2 byte LM 4x512 (12.7M), 2 ranks as machines, 100 Mbit/s")
fig("hf_trainer_1bit", "hf_trainer.json", lambda r: r["key"]["onebit_grad_speedup"], ratio,
    claim="the same with the 1-bit hook")
fig("hf_trainer_8bit_loss", "hf_trainer.json",
    lambda r: _eval_loss(r, "bytegrad") / _eval_loss(r, "none") - 1, "{:+.2%}",
    claim="the 8-bit hook's evaluation loss after the run, against the plain Trainer's")
