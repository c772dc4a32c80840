"""The fused optimizer on CPU.

Each ``fig(...)`` is one figure (see ``benchmarks.performance.figure``).
"""

from __future__ import annotations

from ..figure import Figures, grab, ratio

FIGURES = Figures("optimizer")
fig = FIGURES.add

fig("fused_adam_cpu_ms", "fused_optimizer.md",
    lambda t: grab(t, r"CPU key ratio: Adam fuse_step ([\d.]+) ms"), "{:.1f} ms",
    claim="Adam's `fuse_step` on CPU (issue 6)", setting="406 tensors, 9.60M fp32 values, minimum of 15 rounds")
fig("fused_torch_fused_cpu_ms", "fused_optimizer.md",
    lambda t: grab(t, r"CPU key ratio: .*? vs torch fused=True ([\d.]+) ms"), "{:.1f} ms",
    claim="torch Adam `fused=True`, per parameter, on the same tensors")
fig("fused_adam_vs_torch_fused", "fused_optimizer.md",
    lambda t: grab(t, r"CPU key ratio: .*: ([\d.]+)x"), ratio, claim="the one over the other")
fig("fused_torch_loop_cpu_ms", "fused_optimizer.md",
    lambda t: grab(t, r"torch Adam foreach=False \(per-param loop\)\s+([\d.]+)"), "{:.1f} ms",
    claim="torch Adam's per-parameter loop (its CPU default) on the same tensors")
