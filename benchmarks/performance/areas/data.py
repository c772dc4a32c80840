"""Data: the cached dataset and the load-balanced sampler.

Each ``fig(...)`` is one figure (see ``benchmarks.performance.figure``).
"""

from __future__ import annotations

from ..figure import Figures, at_least, at_most, grab, md_cell, ratio

FIGURES = Figures("data")
fig = FIGURES.add

fig("cache_lmdb_epoch2", "cache.md", lambda t: grab(t, r"lmdb epoch-2 speedup ([\d.]+)x"), "{:.1f}x",
    met=at_least(20), claim="a second epoch from the LMDB cache at least 20x faster than no cache (issue 4)",
    setting="1000 samples of 2 ms each, `DataLoader` batch 32")
for size in ("3KB", "600KB"):
    fig(f"cache_lmdb_hits_{size}", "cache.md",
        lambda t, s=size: grab(t, rf"lmdb hits / raw, ds\[i\]:.*?\b{s} ([\d.]+)"), "{:.2f}", met=at_least(0.8),
        claim="LMDB cache hits at least 0.80 of raw LMDB reads (issue 4)", setting=f"{size} samples, `ds[i]`")
for conn, label in (("tcp", "TCP"), ("unix", "Unix socket")):
    fig(f"cache_redis_{conn}_3KB", "cache.md",
        lambda t, c=conn: grab(t, rf"redis __getitems__ / GET:.*?\b{c} 3KB ([\d.]+)x"), "{:.1f}x", met=at_least(10),
        claim="Redis `__getitems__` at least 10x one GET per sample (issue 4)", setting=f"3 KB samples, {label}")
fig("cache_redis_tcp_600KB", "cache.md",
    lambda t: grab(t, r"redis __getitems__ / GET:.*?\btcp 3KB [\d.]+x, 600KB ([\d.]+)x"), "{:.1f}x",
    claim="the same with 600 KB samples, which are bound by bytes, not round trips", setting="600 KB samples, TCP")
for ranks in ("8", "64"):
    fig(f"sampler_straggler_x{ranks}", "sampler.md",
        lambda t, n=ranks: (float(md_cell(t, "straggler unpadded", ranks=n, sampler="LB sampler")),
                            float(md_cell(t, "straggler padded", ranks=n, sampler="LB sampler"))),
        "{:.4f} / {:.4f}", met=lambda v: v[0] <= 1.02 and v[1] <= 1.05,
        claim="straggler ratio at most 1.02 unpadded / 1.05 padded (issue 5)",
        setting=f"{ranks} ranks, 1M samples of lognormal lengths")
    fig(f"sampler_padding_x{ranks}", "sampler.md",
        lambda t, n=ranks: float(md_cell(t, "padding efficiency", ranks=n, sampler="LB sampler + batch sampler")),
        "{:.3f}", met=at_least(0.9), claim="padding efficiency at least 0.90 with the batch sampler (issue 5)",
        setting=f"{ranks} ranks, 1M samples")
fig("sampler_construction_s", "sampler.md",
    lambda t: float(md_cell(t, "construction", complexities="integer lengths").rstrip(" s")), "{:.2f} s",
    met=at_most(5), claim="10M complexities: construction under 5 s (issue 5)", setting="10M integer lengths, 8 replicas")
fig("sampler_construction_mb", "sampler.md",
    lambda t: float(md_cell(t, "peak (construction)", complexities="integer lengths").rstrip(" MB")), "{:.0f} MB",
    claim="10M complexities: a few hundred MB at most (issue 5)", setting="traced peak at construction")
fig("sampler_lm_epoch_ratio", "sampler.md",
    lambda t: grab(t, r"LB sampler \+ batch sampler / torch: \*\*([\d.]+)\*\*"), ratio,
    claim="an LM's epoch with the load-balanced batch sampler over torch's `DistributedSampler`'s",
    setting="2 ranks, a byte-level GRU on the standard library's source lines")
