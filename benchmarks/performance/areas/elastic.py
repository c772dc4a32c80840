"""Elastic training at 16 ranks.

Each ``fig(...)`` is one figure (see ``benchmarks.performance.figure``).
"""

from __future__ import annotations

from ..figure import Figures

FIGURES = Figures("elastic")
fig = FIGURES.add

fig("elastic_machines_worlds", "elastic_machines.json",
    lambda r: (" -> ".join(map(str, r["machines"]["worlds"])), r["machines"]["agents"],
               sum(c == 0 for c in r["machines"]["exit_codes"])), "{0} ranks, {1} agents, {2} of {1} exit 0",
    met=lambda v: v[1] == v[2], claim="elastic at 16 ranks: agents leave and join a running job (issue 41)",
    setting="8 agents of 2 workers on this box")
fig("elastic_machines_recovery_s", "elastic_machines.json",
    lambda r: (r["machines"]["recovery_down_s"], r["machines"]["recovery_up_s"]), "{:.1f} s / {:.1f} s",
    claim="from a kill to the first step of the smaller world / from a join to the first step of the larger")
fig("elastic_machines_samples", "elastic_machines.json",
    lambda r: (r["machines"]["every_sample_once_per_epoch"], r["machines"]["epochs"]),
    lambda v: f"{'every' if v[0] else 'not every'} sample once in each of {v[1]} epochs", met=lambda v: v[0],
    claim="the data across the changes: each epoch trains every sample once")
