"""The wrapper's step: host time against torch DDP's, the loopback step.

Each ``fig(...)`` is one figure (see ``benchmarks.performance.figure``).
"""

from __future__ import annotations

from ..figure import Figures, at_most, grab, ratio

FIGURES = Figures("wrapper")
fig = FIGURES.add

for tensors in ("148", "1000"):
    fig(f"wrapper_host_ratio_{tensors}", "wrapper_overhead.json",
        lambda r, t=tensors: r["summary"][t]["median_ratio"], ratio, met=at_most(0.5),
        claim="bagua's extra host time per training step at most 0.5x torch DDP's (issue 43)",
        setting=f"{tensors} parameter tensors, one rank, the variants taking 25-step turns; median of the rounds")
    fig(f"wrapper_host_us_{tensors}", "wrapper_overhead.json",
        lambda r, t=tensors: (r["summary"][t]["median_extra_us"]["bagua"], r["summary"][t]["median_extra_us"]["torch"]),
        "{:.2f} us against {:.2f} us", claim="the extra host time per parameter tensor: bagua against torch DDP",
        setting=f"{tensors} parameter tensors, over the bare model's step")
    fig(f"wrapper_host_ratio_{tensors}_every_step", "wrapper_overhead_every_step.json",
        lambda r, t=tensors: r["summary"][t]["median_ratio"], ratio, met=at_most(0.5),
        claim="the same, the variants alternating every step (every step starts with cold caches)",
        setting=f"{tensors} parameter tensors")
fig("ddp_loopback_gradient_allreduce", "ddp.md",
    lambda t: grab(t, r"KEY: loopback gradient_allreduce/DDP step ([\d.]+)"), "{:.3f}x", met=at_most(1.02),
    claim="gradient_allreduce's step at most 1.02x torch DDP's (issue 3)",
    setting="2 ranks on loopback, MLP of 4.21M parameters, median step")
