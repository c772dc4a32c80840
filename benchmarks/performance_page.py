"""docs/performance.md and every performance figure in README.md and docs/, from benchmarks/results/.

Each figure is one entry of ``FIGURES``: the results file it is computed from, how (a function of
the file's parsed content: a dict for ``.json``, the text for ``.md``), how it is written, the area
of the page it belongs to and the claim it supports. Its date, machine and command come from the
results file where the file records them, else from ``RECORDED`` (one entry per results file, which
also names the section of ``benchmarks/RESULTS.md`` that holds the file's history and reasoning).

The generator writes:

- ``docs/performance.md``, whole (never edit it by hand);
- every generated block ``<!-- BEGIN GENERATED: NAME (python benchmarks/performance_page.py; do not
  edit) -->`` ... ``<!-- END GENERATED: NAME -->`` in README.md and docs/*.md (``BLOCKS``: the
  README's ``headline``);
- every inline figure ``<!--fig:NAME-->VALUE<!--/fig-->`` there (VALUE rewritten from the registry);
- ``docs/figures/``: a copy of each plot of ``benchmarks/figures/`` that a page of docs/ links as
  ``figures/NAME.png`` (the site is built from docs/ alone).

``--check`` writes nothing and exits 1 naming every stale figure, block and plot copy, and every
generated block of the other generators (``python benchmarks/tradeoff.py --report``, ``python
benchmarks/time_to_accuracy.py --report``) that no longer matches their output.

    python benchmarks/performance_page.py            # write
    python benchmarks/performance_page.py --check    # compare (tests/docs/test_figures.py runs it)

Adding a figure is one entry (``fig(...)`` below), e.g.::

    fig("hier_flat_4x4", "machines", "machines_heldout.json",
        lambda r: r["key"]["bytegrad_flat_over_hier"]["4x4-100mbit"], "{:.2f}x",
        claim="hierarchical bytegrad against flat", setting="4 machines x 4 ranks, 100 Mbit/s")

and then ``<!--fig:hier_flat_4x4-->1.96x<!--/fig-->`` may stand anywhere in README.md or docs/.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

BEGIN = "<!-- BEGIN GENERATED: {name} (python benchmarks/performance_page.py; do not edit) -->"
END = "<!-- END GENERATED: {name} -->"
BLOCK_RE = re.compile(r"<!-- BEGIN GENERATED: ([\w.-]+) \(python benchmarks/performance_page\.py; do not edit\) -->"
                      r"(.*?)<!-- END GENERATED: \1 -->", re.S)
FIG_RE = re.compile(r"<!--fig:([\w.-]+)-->(.*?)<!--/fig-->", re.S)
PLOT_LINK_RE = re.compile(r"\]\(figures/([\w.-]+\.png)\)")
PAGE = "docs/performance.md"
CPU_BOX = ("the 2-vCPU shared KVM guest (AMD EPYC), torch 2.13.0+cpu on Gloo "
           "(RESULTS.md, \"Machine\")")


# ---------------------------------------------------------------------------------------------
# The registry
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Area:
    """A section of the page."""

    key: str
    title: str
    intro: str


@dataclass(frozen=True)
class Recorded:
    """What a results file does not record about itself. ``section``: its history in RESULTS.md;
    ``script``: the benchmark that wrote it (its recorded ``argv`` is that script's); ``command``,
    ``date``: used where the file records none (a file that names no machine ran on ``CPU_BOX``);
    ``plot``: under benchmarks/figures/."""

    section: str
    script: Optional[str] = None
    command: Optional[str] = None
    date: Optional[str] = None
    plot: Optional[str] = None


@dataclass(frozen=True)
class Figure:
    """One figure: ``value(parsed results file)`` written with ``fmt`` (a format string, applied to a
    tuple's items in order, or a function); ``grid``: (grid, row, column) to be shown in that grid
    of its area instead of as a row; ``met``: whether the value meets the claim's target."""

    name: str
    area: str
    source: str
    value: Callable[[Any], Any]
    fmt: Union[str, Callable[[Any], str]] = "{}"
    claim: str = ""
    setting: str = ""
    met: Optional[Callable[[Any], bool]] = None
    grid: Optional[tuple[str, str, str]] = None

    def text(self, value: Any) -> str:
        if value is None:
            return "not measured"
        if callable(self.fmt):
            return self.fmt(value)
        return self.fmt.format(*value) if isinstance(value, tuple) else self.fmt.format(value)


AREAS = [
    Area("network", "Algorithms at network speeds",
         "How fast each algorithm trains at a link speed: **the grid below is the figure to quote** (one sweep, "
         "every algorithm, every rank its own machine behind an emulated link). The targets after it were set on "
         "other workloads and are measured on those."),
    Area("accuracy", "Time to accuracy",
         "Speed that costs accuracy is not speed: each algorithm's steps and time to torch DDP's final validation "
         "loss, and its loss at DDP's last step ([convergence.md](convergence.md) has the method and every table)."),
    Area("wrapper", "The wrapper's step",
         "What `bagua.DistributedDataParallel` adds to a training step against torch DDP, where the link is "
         "not the bottleneck."),
    Area("machines", "Several ranks a machine",
         "Machines of several ranks each (`LOCAL_WORLD_SIZE`), emulated: hierarchical algorithms against flat, "
         "the cost model on shapes it never saw, and correctness at 16 and 32 ranks."),
    Area("torch", "Plain torch DDP with bagua's hooks and connections",
         "No bagua wrapper: torch's `DistributedDataParallel` (or the Hugging Face `Trainer`) with `bagua.comm_hooks` "
         "or the `\"bagua\"` torch backend ([striped_connections.md](striped_connections.md))."),
    Area("data", "Data: cached dataset and sampler", "`bagua.data`'s cache and load-balanced sampling."),
    Area("optimizer", "Fused optimizer", "`bagua.optim.fuse_step` on CPU."),
    Area("elastic", "Elastic training", "Agents leaving and joining a running job."),
    Area("communication", "Communication core", "`bagua.comm`'s collectives against torch's."),
    Area("lightning", "Lightning", "`BaguaStrategy` against Lightning's DDP strategy."),
    Area("autotune", "Autotuning", "The autotuner against the exhaustive grid."),
    Area("gpu", "GPU",
         "No GPU figure is kept in a results file: `make gpu-check` writes `gpu_check.json` on a lent machine, "
         "and the H100 and H200 runs of earlier sessions are recorded in RESULTS.md only."),
]

RECORDED = {
    "tradeoff.json": Recorded("Bandwidth x latency", command="python benchmarks/tradeoff.py", plot="tradeoff.png"),
    "tradeoff_model.json": Recorded("Bandwidth x latency", command="python benchmarks/tradeoff.py --report",
                                    date="fitted to tradeoff.json's sweep"),
    "ddp_hooks.json": Recorded("Data-parallel algorithms", script="ddp.py"),
    "ddp_striped_backend.json": Recorded("Striped collectives", script="ddp.py"),
    "ddp.md": Recorded("Data-parallel algorithms",
                       command=".venv/bin/python benchmarks/ddp.py --out .bench/ddp-final2.json"),
    "wrapper_overhead.json": Recorded(
        "Readiness per bucket", command="python benchmarks/wrapper_overhead.py --rounds 7 --steps 400 --floor "
                                        "--out benchmarks/results/wrapper_overhead.json"),
    "wrapper_overhead_every_step.json": Recorded(
        "Readiness per bucket", command="python benchmarks/wrapper_overhead.py --rounds 5 --steps 400 --floor --block 1 "
                                        "--out benchmarks/results/wrapper_overhead_every_step.json"),
    "time_to_accuracy.json": Recorded("Speed without losing accuracy", command="python benchmarks/time_to_accuracy.py",
                                      plot="time_to_accuracy.png"),
    "time_to_accuracy_constant.json": Recorded(
        "Speed without losing accuracy", plot="time_to_accuracy_constant.png",
        command="python benchmarks/time_to_accuracy.py --measure constant --variants torch-ddp bytegrad qadam qadam1 "
                "onebit_grad"),
    "machines.json": Recorded("Many ranks, several a machine", command="python benchmarks/machines.py",
                              plot="machines.png"),
    "machines_heldout.json": Recorded("Many ranks, several a machine", command="python benchmarks/machines.py --held-out",
                                      plot="machines_heldout.png"),
    "machines_fresh_repeat.json": Recorded("Many ranks, several a machine"),  # its command is not recorded
    "machines_fresh.json": Recorded("Many ranks, several a machine", command="python benchmarks/machines.py --fresh",
                                    plot="machines_fresh.png"),
    "machines_comm_bound.json": Recorded("Many ranks, several a machine",
                                         command="python benchmarks/machines.py --size comm-bound"),
    "scale_check.json": Recorded("Many ranks, several a machine", script="scale_check.py"),
    "elastic_machines.json": Recorded("Many ranks, several a machine"),
    "hf_trainer.json": Recorded("Data-parallel algorithms", script="hf_trainer.py"),
    "cache.md": Recorded("Cached dataset"),
    "sampler.md": Recorded("Load-balanced sampler"),
    "fused_optimizer.md": Recorded("Fused optimizer"),
}

#: results files no figure is taken from, and why (a test fails on a results file in neither place)
NOT_SHOWN = {
    "tradeoff_quick.json": "the quick sweep (a 0.44M model), superseded by tradeoff.json",
    "tradeoff_model_quick.json": "the quick sweep's fit, superseded by tradeoff_model.json",
    "time_to_accuracy_quick.json": "the 60-step first look, superseded by time_to_accuracy.json",
}

#: claims whose figures live in RESULTS.md's prose only (no results file holds them): (area, claim, section)
PROSE_ONLY = [
    ("wrapper", "gradient_allreduce's step against torch DDP after the wrapper's rework (issue 11) and with "
                "`broadcast_buffers`; later runs of the loopback target above", "The wrapper and the algorithms in everyday loops"),
    ("wrapper", "compiled wrappers (`torch.compile`), split at the buckets or one graph", "torch.compile and overlap"),
    ("network", "qadam with `bits=1` at 100 Mbit/s, and qadam with gradient clipping (issue 28)",
     "The 8-bit path at the wire's limit"),
    ("accuracy", "onebit_grad's and qadam `bits=1`'s validation loss in `examples/train_lm.py` runs (issue 28); "
                 "the load-balanced sampler's tokens/s in LM training (issue 26)", "1-bit gradients"),
    ("data", "decoding cached samples with the restricted unpickler (issue 24)", "Cached dataset"),
    ("elastic", "restart success over kill -9 trials, recovery time and checkpoint cost (issue 14)",
     "Elastic restarts and checkpoints"),
    ("communication", "uncompressed allreduce against raw torch, MinMaxUInt8 allreduce at 100 Mbit/s (issue 2)",
     "Communication core"),
    ("communication", "striped collectives (`streams=K`) under per-flow caps (issue 16)", "Striped collectives"),
    ("lightning", "`BaguaStrategy` epoch time on loopback and at 100 Mbit/s (issue 13)", "Lightning strategy"),
    ("autotune", "autotuned step against the grid's best, steps to tune (issue 17)", "Autotuning"),
    ("gpu", "codec and fused-optimizer kernels' share of copy bandwidth, Sign1 kernels, the wrapper on one GPU, "
            "`make gpu-check`'s time (issues 2, 3, 6, 28, 29)", "GPU check"),
    ("gpu", "issue 43's re-measure of the wrapper on one GPU: not measured, no GPU was lent to that session",
     "Readiness per bucket"),
]

FIGURES: list[Figure] = []


def fig(name: str, area: str, source: str, value: Callable[[Any], Any], fmt: Union[str, Callable] = "{}",
        **kw: Any) -> None:
    """Register one figure (see ``Figure``)."""
    FIGURES.append(Figure(name, area, source, value, fmt, **kw))


# --- parsing helpers for the results files written as markdown --------------------------------

def grab(text: str, pattern: str) -> float:
    """The number of ``pattern``'s first group in ``text``; a clear error when absent."""
    m = re.search(pattern, text)
    if m is None:
        raise ValueError(f"no match for {pattern!r}")
    return float(m.group(1))


def md_cell(text: str, column: str, **match: str) -> str:
    """The ``column`` cell of the first row of a markdown table whose cells in ``match``'s columns
    (underscores for spaces) equal the given text; bold marks dropped."""
    lines = text.splitlines()
    for i, line in enumerate(lines[:-1]):
        if not (line.startswith("|") and re.match(r"^\|[\s:|-]+\|$", lines[i + 1].strip())):
            continue
        header = [c.strip() for c in line.strip().strip("|").split("|")]
        wanted = {k.replace("_", " "): v for k, v in match.items()}
        if column not in header or any(k not in header for k in wanted):
            continue
        for row in lines[i + 2:]:
            if not row.startswith("|"):
                break
            cells = [c.strip().replace("**", "") for c in row.strip().strip("|").split("|")]
            if all(cells[header.index(k)] == v for k, v in wanted.items()):
                return cells[header.index(column)]
    raise ValueError(f"no table row with {match} and a column {column!r}")


def _ratio(x: float) -> str:
    return f"{x:.2f}x"


def _pct(x: float) -> str:
    return f"{x * 100:+.1f}%"


def at_least(bound: float) -> Callable[[float], bool]:
    return lambda v: v >= bound


def at_most(bound: float) -> Callable[[float], bool]:
    return lambda v: v <= bound


# --- the wrapper's step -------------------------------------------------------------------------

for tensors in ("148", "1000"):
    fig(f"wrapper_host_ratio_{tensors}", "wrapper", "wrapper_overhead.json",
        lambda r, t=tensors: r["summary"][t]["median_ratio"], _ratio, met=at_most(0.5),
        claim="bagua's extra host time per training step at most 0.5x torch DDP's (issue 43)",
        setting=f"{tensors} parameter tensors, one rank, the variants taking 25-step turns; median of the rounds")
    fig(f"wrapper_host_us_{tensors}", "wrapper", "wrapper_overhead.json",
        lambda r, t=tensors: (r["summary"][t]["median_extra_us"]["bagua"], r["summary"][t]["median_extra_us"]["torch"]),
        "{:.2f} us against {:.2f} us", claim="the extra host time per parameter tensor: bagua against torch DDP",
        setting=f"{tensors} parameter tensors, over the bare model's step")
    fig(f"wrapper_host_ratio_{tensors}_every_step", "wrapper", "wrapper_overhead_every_step.json",
        lambda r, t=tensors: r["summary"][t]["median_ratio"], _ratio, met=at_most(0.5),
        claim="the same, the variants alternating every step (every step starts with cold caches)",
        setting=f"{tensors} parameter tensors")
fig("ddp_loopback_gradient_allreduce", "wrapper", "ddp.md",
    lambda t: grab(t, r"KEY: loopback gradient_allreduce/DDP step ([\d.]+)"), "{:.3f}x", met=at_most(1.02),
    claim="gradient_allreduce's step at most 1.02x torch DDP's (issue 3)",
    setting="2 ranks on loopback, MLP of 4.21M parameters, median step")

# --- algorithms at network speeds ---------------------------------------------------------------

TRADEOFF_VARIANTS = {"ddp-fp16": "torch DDP, fp16 hook", "gradient_allreduce": "gradient_allreduce",
                     "bytegrad": "bytegrad", "decentralized": "decentralized",
                     "low_precision_decentralized": "low_precision_decentralized", "async": "async",
                     "qadam": "qadam (Adam)", "onebit_grad": "onebit_grad"}
TRADEOFF_SETTINGS = {"bw-1gbit": "1 Gbit/s", "bw-300mbit": "300 Mbit/s", "bw-100mbit": "100 Mbit/s",
                     "bw-30mbit": "30 Mbit/s", "bw-10mbit": "10 Mbit/s", "lat-20ms": "1 Gbit/s + 20 ms"}


@lru_cache(maxsize=None)
def _tradeoff_report():
    import tradeoff_report  # imports torch and bagua: only when a tradeoff figure is computed

    return tradeoff_report


def _speed(results: dict, variant: str, setting: str) -> Optional[float]:
    e = _tradeoff_report().epochs(results).get(setting, {})
    return e["ddp"] / e[variant] if variant in e and "ddp" in e else None


def _target(results: dict, what: str) -> dict:
    return next(t for t in _tradeoff_report().targets(results) if t["what"].startswith(what))


for variant, label in TRADEOFF_VARIANTS.items():
    for setting, column in TRADEOFF_SETTINGS.items():
        fig(f"speed_{variant}_{setting}", "network", "tradeoff.json", lambda r, v=variant, s=setting: _speed(r, v, s),
            _ratio, grid=("speed", label, column),
            setting=f"{column}, 4 ranks each its own machine, the tradeoff sweep's GPT-2 LM; DDP's epoch over {variant}'s")
fig("tradeoff_ddp_slope", "network", "tradeoff.json", lambda r: _target(r, "DDP log-log slope")["value"], "{:.2f}",
    met=lambda v: -1.1 <= v <= -0.85, claim="torch DDP's epoch time scales with the bandwidth: its log-log slope from "
                                           "100 to 10 Mbit/s within -1.1 .. -0.85 (issue 27)")
for variant in ("bytegrad", "qadam", "low_precision_decentralized"):
    fig(f"tradeoff_{variant}_10mbit_target", "network", "tradeoff.json",
        lambda r, v=variant: (_target(r, v)["value"], _target(r, v)["bytes_allow"]),
        "{:.2f}x (its bytes allow {:.2f}x)", met=lambda v: v[0] >= 3.5,
        claim=f"{variant} at least 3.5x torch DDP at 10 Mbit/s (issue 27)", setting="the grid's 10 Mbit/s column")
fig("tradeoff_async_10mbit_over_1gbit", "network", "tradeoff.json",
    lambda r: _target(r, "async")["value"], _ratio, met=at_most(1.5),
    claim="async's epoch at 10 Mbit/s at most 1.5x its epoch at 1 Gbit/s (issue 27)")
fig("cost_model_within_20pct", "network", "tradeoff_model.json",
    lambda m: (sum(abs(r["error"]) <= 0.2 for r in m["held_out"]), len(m["held_out"])), "{} of {}",
    met=lambda v: v[0] == v[1], claim="the cost model (`bagua.advise`) predicts held-out grid points within 20% "
                                      "(issue 27)", setting="fitted on 6 of the grid's settings, checked on the others")
fig("cost_model_worst", "network", "tradeoff_model.json", lambda m: m["worst_held_out"], "{:.0%}",
    claim="the cost model's worst held-out error")

MLP = "the 10M-parameter MLP of `ddp.py`, each rank its own machine"
for world, bound in (("2", 3.75), ("4", 3.5)):
    for variant in ("bytegrad", "qadam"):
        fig(f"mlp_{variant}_100mbit_x{world}", "network", "ddp_hooks.json",
            lambda r, v=variant, w=world: r["key"][f"100mbit_x{w}_ddp_over_{v}"], _ratio, met=at_least(bound),
            claim=f"{variant} at least {bound}x torch DDP fp32 at 100 Mbit/s, {world} ranks (issue 28)",
            setting=f"{MLP}, {world} ranks, torch DDP's epoch over {variant}'s")
    fig(f"mlp_onebit_grad_100mbit_x{world}", "network", "ddp_hooks.json",
        lambda r, w=world: r["key"][f"100mbit_x{w}_ddp_over_onebit_grad"], "{:.1f}x", met=at_least(8.0),
        claim=f"onebit_grad at least 8x torch DDP fp32 at 100 Mbit/s, {world} ranks (issue 28)",
        setting=f"{MLP}, {world} ranks")
fig("mlp_qadam_over_bytegrad_1gbit", "network", "ddp_hooks.json",
    lambda r: r["key"]["1gbit_x2_qadam_over_bytegrad"], "{:.2f}", met=at_most(1.10),
    claim="qadam's step within 10% of bytegrad's at 1 Gbit/s, 2 ranks (issue 28)",
    setting=f"{MLP}; qadam's step time over bytegrad's (SGD), medians")
fig("mlp_qadam_over_bytegrad_adam_1gbit", "network", "ddp_hooks.json",
    lambda r: r["key"]["1gbit_x2_qadam_over_bytegrad-adam"], "{:.2f}",
    claim="the same against bytegrad stepping torch Adam (qadam's optimizer family)", setting=MLP)

# --- time to accuracy ---------------------------------------------------------------------------

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
    fig(f"tta_{variant}_steps", "accuracy", "time_to_accuracy.json", lambda r, v=variant: _steps(r, v, "100mbit"),
        grid=("tta", label, "steps to DDP's loss (decay, 4 ranks)"))
    fig(f"tta_{variant}_steps_constant", "accuracy", "time_to_accuracy_constant.json",
        lambda r, v=variant: _steps(r, v, r["curve_link"]), grid=("tta", label, "steps to DDP's loss (constant rate, 2 ranks)"))
    fig(f"tta_{variant}_loss", "accuracy", "time_to_accuracy.json", lambda r, v=variant: _loss(r, v), _pct,
        grid=("tta", label, "loss at DDP's last step, vs DDP's (decay)"))
    for link, column in (("1gbit", "1 Gbit/s"), ("100mbit", "100 Mbit/s")):
        fig(f"tta_{variant}_time_{link}", "accuracy", "time_to_accuracy.json",
            lambda r, v=variant, ln=link: _time(r, v, ln), grid=("tta", label, f"DDP's time to its loss / this one's, {column}"))
fig("tta_async_loss_1gbit", "accuracy", "time_to_accuracy.json", lambda r: _loss(r, "async", "1gbit"), _pct,
    claim="async's loss at DDP's last step at 1 Gbit/s (it averages on a clock, so its curve depends on the link)")
fig("tta_fastest_100mbit", "accuracy", "time_to_accuracy.json", lambda r: _fastest(r)[0],
    claim="the algorithm that reaches DDP's final loss soonest at 100 Mbit/s")
fig("tta_fastest_time_fraction_100mbit", "accuracy", "time_to_accuracy.json",
    lambda r: _fastest(r)[1]["reached"][1] / _row(r, "torch-ddp")["reached"][1], _ratio, met=at_most(0.25),
    claim="at 100 Mbit/s the fastest algorithm reaches DDP's final loss in at most 0.25x DDP's time (issue 40)",
    setting="4 ranks as machines, the LM of convergence.md, cosine decay")
fig("tta_fastest_speedup_100mbit", "accuracy", "time_to_accuracy.json",
    lambda r: _row(r, "torch-ddp")["reached"][1] / _fastest(r)[1]["reached"][1], _ratio,
    claim="the same, as DDP's time over the fastest's", setting="4 ranks as machines, the LM of convergence.md")
fig("tta_ddp_time_100mbit", "accuracy", "time_to_accuracy.json", lambda r: _row(r, "torch-ddp")["reached"][1],
    "{:.0f} s", claim="torch DDP's time to its own final loss at 100 Mbit/s")
fig("tta_ddp_steps", "accuracy", "time_to_accuracy.json", lambda r: r["steps"], "{}",
    claim="torch DDP's steps (its loss there is the target)")
fig("tta_reaching_loopback_steps", "accuracy", "time_to_accuracy.json",
    lambda r: (min(x["step_s"] for x in _reaching(r, r["curve_link"]).values()),
               max(x["step_s"] for x in _reaching(r, r["curve_link"]).values())), "{:.2f}-{:.2f} s",
    claim="the step of the bagua algorithms that reach DDP's loss, with no link to wait for (loopback)")
fig("tta_fastest_loopback_step", "accuracy", "time_to_accuracy.json",
    lambda r: min(x["step_s"] for x in _reaching(r, r["curve_link"]).values()), "{:.3f} s",
    claim="the fastest of those steps")
fig("tta_ceiling_100mbit", "accuracy", "time_to_accuracy.json",
    lambda r: _row(r, "torch-ddp")["reached"][1]
    / (r["steps"] * min(x["step_s"] for x in _reaching(r, r["curve_link"]).values())), _ratio,
    claim="the most any of them can gain over DDP at 100 Mbit/s on this box: DDP's time over its steps at the "
          "fastest loopback step")
fig("tta_async_step_100mbit", "accuracy", "time_to_accuracy.json", lambda r: _row(r, "async")["step_s"], "{:.3f} s",
    claim="a step that waits for no link (async's, at 100 Mbit/s)")
fig("tta_qadam1_mb_per_step", "accuracy", "time_to_accuracy.json", lambda r: _row(r, "qadam1")["bytes_per_step"] / 1e6,
    "{:.2f} MB", claim="qadam bits=1's bytes sent per step and rank")
fig("tta_ddp_mb_per_step", "accuracy", "time_to_accuracy.json", lambda r: _row(r, "torch-ddp")["bytes_per_step"] / 1e6,
    "{:.2f} MB", claim="torch DDP's bytes per step and rank")
fig("tta_qadam1_bytes_share", "accuracy", "time_to_accuracy.json",
    lambda r: _row(r, "qadam1")["bytes_per_step"] / _row(r, "torch-ddp")["bytes_per_step"], "{:.0%}",
    claim="qadam bits=1's bytes per step as a share of DDP's")
fig("tta_qadam1_link_time_100mbit", "accuracy", "time_to_accuracy.json",
    lambda r: _row(r, "qadam1")["bytes_per_step"] * 8 / 100e6, "{:.3f} s",
    claim="what qadam bits=1's bytes take on a 100 Mbit/s link")
fig("tta_qadam1_own_machines_100mbit", "accuracy", "time_to_accuracy.json",
    lambda r: _row(r, "torch-ddp")["reached"][1]
    / (_row(r, "qadam1")["reached"][0] * (_row(r, "async")["step_s"] + _row(r, "qadam1")["bytes_per_step"] * 8 / 100e6)),
    "{:.1f}x", claim="an estimate, not a measurement: qadam bits=1 against DDP at 100 Mbit/s on machines of their own, "
                     "its step the compute of a step that waits for nothing plus its bytes on the link")
fig("tta_ddp_last20_gain", "accuracy", "time_to_accuracy.json", lambda r: r["ddp_last_20pct_gain"], "{:.1%}",
    met=at_most(0.02), claim="DDP's validation loss flat by the end: its last 20% of steps gain under 2% (issue 40)")
fig("tta_ddp_last20_gain_constant", "accuracy", "time_to_accuracy_constant.json",
    lambda r: r["ddp_last_20pct_gain"], "{:.1%}", met=at_most(0.02), claim="the same at a constant learning rate")
fig("tta_relaxed_adam_gap", "accuracy", "time_to_accuracy.json",
    lambda r: (min(_loss(r, v) for v in ("decentralized", "low_precision_decentralized", "async")) * 100,
               max(_loss(r, v) for v in ("decentralized", "low_precision_decentralized", "async")) * 100),
    "{:.1f}-{:.1f}%", claim="how far above DDP's loss decentralized, low_precision_decentralized and async end with "
                            "AdamW (100 Mbit/s)")
fig("tta_decentralized_family_gap", "accuracy", "time_to_accuracy.json",
    lambda r: (min(_loss(r, v) for v in ("decentralized", "low_precision_decentralized")) * 100,
               max(_loss(r, v) for v in ("decentralized", "low_precision_decentralized")) * 100),
    "{:.1f}-{:.1f}%", claim="how far above DDP's loss decentralized and low_precision_decentralized end with AdamW")
fig("tta_onebit_gap", "accuracy", "time_to_accuracy.json",
    lambda r: (_loss(r, "onebit_grad") * 100,
               (lambda c: _loss(c, "onebit_grad", c["curve_link"]))(
                   r["_results"]["time_to_accuracy_constant.json"]) * 100),
    lambda v: f"+{min(v):.1f}-{max(v):.1f}%", claim="how far above DDP's loss onebit_grad ends on the LM with AdamW "
                                                    "(decay and constant-rate runs)")

# --- several ranks a machine --------------------------------------------------------------------


@lru_cache(maxsize=None)
def _machines():
    import machines  # imports torch and bagua: only when a machines figure is computed

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


fig("machines_hier_comm_bound", "machines", "machines_comm_bound.json",
    lambda r: r["key"]["4x2-100mbit"]["bytegrad_flat_over_hier"], _ratio, met=at_least(1.8),
    claim="hierarchical bytegrad at least 1.8x flat bytegrad at 4 machines x 2 ranks, 100 Mbit/s (issue 41)",
    setting="an LM whose step is mostly bytes (GPT-2 4x512, one 16-token document per rank)")
fig("machines_hier_comm_bound_ceiling", "machines", "machines_comm_bound.json",
    lambda r: r["key"]["4x2-100mbit"]["ceiling"], _ratio, claim="what the bytes allow there: (compute + flat's "
                                                                "transfer) / (compute + hierarchical's)")
fig("machines_hier_lm_4x2", "machines", "machines.json", lambda r: r["key"]["bytegrad_flat_over_hier"]["4x2-100mbit"],
    _ratio, claim="the same on the tradeoff sweep's LM, whose compute is a third of the step",
    setting="4 machines x 2 ranks, 100 Mbit/s")
fig("machines_hier_flat_100mbit_range", "machines", "machines.json",
    lambda r: (min(v for k, v in r["key"]["bytegrad_flat_over_hier"].items() if k.endswith("100mbit")),
               max(v for k, v in r["key"]["bytegrad_flat_over_hier"].items() if k.endswith("100mbit"))),
    "{:.2f}-{:.2f}x", claim="hierarchical bytegrad over flat at 100 Mbit/s, the tradeoff sweep's LM",
    setting="4 and 8 machines x 2 ranks")
fig("machines_hier_4x4", "machines", "machines_heldout.json",
    lambda r: r["key"]["bytegrad_flat_over_hier"]["4x4-100mbit"], _ratio,
    claim="hierarchical bytegrad over flat with 4 ranks a machine", setting="4 machines x 4 ranks, 100 Mbit/s")
fig("machines_hier_never_slower", "machines", "machines.json", lambda r: min(_all_flat_over_hier(r)), _ratio,
    met=at_least(1 / 1.05), claim="hierarchical bytegrad never more than 5% slower than flat (issue 41): the lowest "
                                  "flat / hierarchical over every point measured",
    setting="every point of " + ", ".join(MACHINE_SETS))
for variant, label in (("bytegrad-hier", "hierarchical bytegrad"),
                       ("low_precision_decentralized-hier", "hierarchical low_precision_decentralized"),
                       ("onebit_grad", "onebit_grad")):
    fig(f"machines_4x2_100mbit_{variant}", "machines", "machines.json",
        lambda r, v=variant: _machines_speed(r, "4x2-100mbit", v), _ratio,
        claim=f"{label} against torch DDP", setting="4 machines x 2 ranks, 100 Mbit/s, the tradeoff sweep's LM")
fig("machines_hier_2x8", "machines", "machines_fresh.json",
    lambda r: r["key"]["bytegrad_flat_over_hier"]["2x8-100mbit"], _ratio,
    claim="hierarchical bytegrad over flat with 8 ranks a machine", setting="2 machines x 8 ranks, 100 Mbit/s")
for measured, (tag, prediction, shapes) in MACHINE_SETS.items():
    fig(f"machines_model_{tag}_within_25pct", "machines", measured,
        lambda r, p=prediction: (sum(abs(e) <= 0.25 for e in _model_errors(r, p)), len(_model_errors(r, p))),
        "{} of {}", met=lambda v: v[0] == v[1],
        claim="the cost model, fitted without these points and committed before them, within 25% of each measured "
              "epoch (issue 41)", setting=f"{shapes}, shapes the model had not seen; every variant at every point")
    fig(f"machines_model_{tag}_worst", "machines", measured,
        lambda r, p=prediction: max(_model_errors(r, p), key=abs), "{:+.0%}", claim="its worst error there")
fig("machines_model_fresh_repeat_worst", "machines", "machines_fresh_repeat.json",
    lambda r: max(_model_errors(r, "machines_fresh_prediction.json"), key=abs), "{:+.0%}",
    claim="the same prediction's worst error in a second job of the fresh set's worst point (its repeatability)",
    setting="2 x 8 ranks, 1 Gbit/s + 5 ms, the job right after the first")


def _scale(r: dict, world: int) -> dict:
    return next(x for x in r["records"] if x["world"] == world)


fig("scale_checks", "machines", "scale_check.json",
    lambda r: (sum(ok for layout in r["checks"].values() for _, ok, _ in layout),
               sum(len(layout) for layout in r["checks"].values()), len(r["checks"])),
    "{} of {} checks pass over {} layouts", met=lambda v: v[0] == v[1],
    claim="every algorithm correct at 16 and 32 ranks (issue 41): loss curves, identical replicas, peers met",
    setting="2x2, 4x2, 8x2 and 8x4 ranks on loopback, 6 steps each")
fig("scale_32_ranks_s", "machines", "scale_check.json", lambda r: _scale(r, 32)["elapsed_s"], "{:.0f} s",
    met=at_most(600), claim="the 32-rank set in under 10 minutes (issue 41)")
fig("scale_init_growth", "machines", "scale_check.json",
    lambda r: max(x["init_s"] for x in _scale(r, 32)["ranks"]) / max(x["init_s"] for x in _scale(r, 16)["ranks"]),
    _ratio, met=at_most(2.0), claim="`init_process_group` from 16 to 32 ranks grows no faster than linear (at most 2x)")
fig("scale_wrap_growth", "machines", "scale_check.json",
    lambda r: max(x["wrap_s"] for x in _scale(r, 32)["ranks"]) / max(x["wrap_s"] for x in _scale(r, 16)["ranks"]),
    _ratio, met=at_most(2.0), claim="the first wrap from 16 to 32 ranks grows no faster than linear (at most 2x)")

# --- plain torch DDP with bagua's hooks and connections ------------------------------------------

for world in ("2", "4"):
    fig(f"hook_bytegrad_100mbit_x{world}", "torch", "ddp_hooks.json",
        lambda r, w=world: r["key"][f"ddp-bytegrad-hook_speedup_100mbit_x{w}"], _ratio, met=at_least(3.5),
        claim="torch DDP with bagua's 8-bit hook at least 3.5x torch DDP fp32 at 100 Mbit/s (issue 42)",
        setting=f"{MLP}, {world} ranks")
    fig(f"hook_bytegrad_over_bagua_100mbit_x{world}", "torch", "ddp_hooks.json",
        lambda r, w=world: r["key"][f"ddp-bytegrad-hook_over_bytegrad_100mbit_x{w}"], _ratio, met=at_most(1.05),
        claim="its epoch within 5% of `bagua.DistributedDataParallel(algorithm=\"bytegrad\")`'s (issue 42)",
        setting=f"{MLP}, {world} ranks")
    fig(f"hook_onebit_100mbit_x{world}", "torch", "ddp_hooks.json",
        lambda r, w=world: r["key"][f"ddp-onebit-hook_speedup_100mbit_x{w}"], "{:.1f}x", met=at_least(8.0),
        claim="torch DDP with the 1-bit hook at least 8x torch DDP fp32 at 100 Mbit/s (issue 42)",
        setting=f"{MLP}, {world} ranks")
fig("hook_bytegrad_step_1gbit", "torch", "ddp_hooks.json",
    lambda r: (lambda v: v["ddp-bytegrad-hook"]["step_s"] / v["bytegrad"]["step_s"])(
        next(j for j in r["jobs"] if j["setting"] == "1gbit" and j["world"] == 2)["variants"]), _ratio,
    claim="what the hook's thread costs where the link is fast: its step over bagua bytegrad's (no target)",
    setting=f"{MLP}, 2 ranks, 1 Gbit/s")


def _striped(r: dict, setting: str, variant: str) -> float:
    return next(j for j in r["jobs"] if j["setting"] == setting)["variants"][variant]["epoch_s"]


fig("striped_per_flow", "torch", "ddp_striped_backend.json",
    lambda r: r["key"]["ddp_striped_speedup_100mbit-per-flow-streams1_x2"], _ratio, met=at_least(3.0),
    claim="torch DDP on the `\"bagua\"` backend at least 3x torch DDP on Gloo where each connection is capped "
          "(issue 42)", setting=f"{MLP}, 2 ranks, 8 connection sets, each capped at 100 Mbit/s under 1 Gbit/s; epochs")
fig("striped_uncapped", "torch", "ddp_striped_backend.json", lambda r: r["key"]["ddp_striped_speedup_1gbit_x2"],
    _ratio, met=lambda v: 1 / v <= 1.03, claim="on an uncapped link within 3% of Gloo (issue 42): Gloo's epoch over "
                                               "the striped one's", setting=f"{MLP}, 2 ranks, 1 Gbit/s")
for setting, link in (("100mbit-per-flow-streams1", "each connection capped at 100 Mbit/s"), ("1gbit", "1 Gbit/s")):
    for variant, backend in (("ddp", "Gloo"), ("ddp-striped", "the `\"bagua\"` backend")):
        fig(f"striped_epoch_{setting.split('-')[0]}_{variant}", "torch", "ddp_striped_backend.json",
            lambda r, s=setting, v=variant: _striped(r, s, v), "{:.2f} s", claim=f"torch DDP's epoch on {backend}",
            setting=f"{MLP}, 2 ranks, {link}")


def _eval_loss(r: dict, row: str) -> float:
    return statistics.mean(r["rows"][row]["eval_loss"])


fig("hf_trainer_8bit", "torch", "hf_trainer.json", lambda r: r["key"]["bytegrad_speedup"], _ratio, met=at_least(3.0),
    claim="the unchanged Hugging Face `Trainer` with bagua's 8-bit hook at least 3x faster per step than the plain "
          "Trainer (issue 42)", setting="GPT-2 byte LM 4x512 (12.7M), 2 ranks as machines, 100 Mbit/s")
fig("hf_trainer_1bit", "torch", "hf_trainer.json", lambda r: r["key"]["onebit_grad_speedup"], _ratio,
    claim="the same with the 1-bit hook")
fig("hf_trainer_8bit_loss", "torch", "hf_trainer.json",
    lambda r: _eval_loss(r, "bytegrad") / _eval_loss(r, "none") - 1, "{:+.2%}",
    claim="the 8-bit hook's evaluation loss after the run, against the plain Trainer's")

# --- data ---------------------------------------------------------------------------------------

fig("cache_lmdb_epoch2", "data", "cache.md", lambda t: grab(t, r"lmdb epoch-2 speedup ([\d.]+)x"), "{:.1f}x",
    met=at_least(20), claim="a second epoch from the LMDB cache at least 20x faster than no cache (issue 4)",
    setting="1000 samples of 2 ms each, `DataLoader` batch 32")
for size in ("3KB", "600KB"):
    fig(f"cache_lmdb_hits_{size}", "data", "cache.md",
        lambda t, s=size: grab(t, rf"lmdb hits / raw, ds\[i\]:.*?\b{s} ([\d.]+)"), "{:.2f}", met=at_least(0.8),
        claim="LMDB cache hits at least 0.80 of raw LMDB reads (issue 4)", setting=f"{size} samples, `ds[i]`")
for conn, label in (("tcp", "TCP"), ("unix", "Unix socket")):
    fig(f"cache_redis_{conn}_3KB", "data", "cache.md",
        lambda t, c=conn: grab(t, rf"redis __getitems__ / GET:.*?\b{c} 3KB ([\d.]+)x"), "{:.1f}x", met=at_least(10),
        claim="Redis `__getitems__` at least 10x one GET per sample (issue 4)", setting=f"3 KB samples, {label}")
fig("cache_redis_tcp_600KB", "data", "cache.md",
    lambda t: grab(t, r"redis __getitems__ / GET:.*?\btcp 3KB [\d.]+x, 600KB ([\d.]+)x"), "{:.1f}x",
    claim="the same with 600 KB samples, which are bound by bytes, not round trips", setting="600 KB samples, TCP")
for ranks in ("8", "64"):
    fig(f"sampler_straggler_x{ranks}", "data", "sampler.md",
        lambda t, n=ranks: (float(md_cell(t, "straggler unpadded", ranks=n, sampler="LB sampler")),
                            float(md_cell(t, "straggler padded", ranks=n, sampler="LB sampler"))),
        "{:.4f} / {:.4f}", met=lambda v: v[0] <= 1.02 and v[1] <= 1.05,
        claim="straggler ratio at most 1.02 unpadded / 1.05 padded (issue 5)",
        setting=f"{ranks} ranks, 1M samples of lognormal lengths")
    fig(f"sampler_padding_x{ranks}", "data", "sampler.md",
        lambda t, n=ranks: float(md_cell(t, "padding efficiency", ranks=n, sampler="LB sampler + batch sampler")),
        "{:.3f}", met=at_least(0.9), claim="padding efficiency at least 0.90 with the batch sampler (issue 5)",
        setting=f"{ranks} ranks, 1M samples")
fig("sampler_construction_s", "data", "sampler.md",
    lambda t: float(md_cell(t, "construction", complexities="integer lengths").rstrip(" s")), "{:.2f} s",
    met=at_most(5), claim="10M complexities: construction under 5 s (issue 5)", setting="10M integer lengths, 8 replicas")
fig("sampler_construction_mb", "data", "sampler.md",
    lambda t: float(md_cell(t, "peak (construction)", complexities="integer lengths").rstrip(" MB")), "{:.0f} MB",
    claim="10M complexities: a few hundred MB at most (issue 5)", setting="traced peak at construction")
fig("sampler_lm_epoch_ratio", "data", "sampler.md",
    lambda t: grab(t, r"LB sampler \+ batch sampler / torch: \*\*([\d.]+)\*\*"), _ratio,
    claim="an LM's epoch with the load-balanced batch sampler over torch's `DistributedSampler`'s",
    setting="2 ranks, a byte-level GRU on the standard library's source lines")

# --- fused optimizer ----------------------------------------------------------------------------

fig("fused_adam_cpu_ms", "optimizer", "fused_optimizer.md",
    lambda t: grab(t, r"CPU key ratio: Adam fuse_step ([\d.]+) ms"), "{:.1f} ms",
    claim="Adam's `fuse_step` on CPU (issue 6)", setting="406 tensors, 9.60M fp32 values, minimum of 15 rounds")
fig("fused_torch_fused_cpu_ms", "optimizer", "fused_optimizer.md",
    lambda t: grab(t, r"CPU key ratio: .*? vs torch fused=True ([\d.]+) ms"), "{:.1f} ms",
    claim="torch Adam `fused=True`, per parameter, on the same tensors")
fig("fused_adam_vs_torch_fused", "optimizer", "fused_optimizer.md",
    lambda t: grab(t, r"CPU key ratio: .*: ([\d.]+)x"), _ratio, claim="the one over the other")
fig("fused_torch_loop_cpu_ms", "optimizer", "fused_optimizer.md",
    lambda t: grab(t, r"torch Adam foreach=False \(per-param loop\)\s+([\d.]+)"), "{:.1f} ms",
    claim="torch Adam's per-parameter loop (its CPU default) on the same tensors")

# --- elastic ------------------------------------------------------------------------------------

fig("elastic_machines_worlds", "elastic", "elastic_machines.json",
    lambda r: (" -> ".join(map(str, r["machines"]["worlds"])), r["machines"]["agents"],
               sum(c == 0 for c in r["machines"]["exit_codes"])), "{0} ranks, {1} agents, {2} of {1} exit 0",
    met=lambda v: v[1] == v[2], claim="elastic at 16 ranks: agents leave and join a running job (issue 41)",
    setting="8 agents of 2 workers on this box")
fig("elastic_machines_recovery_s", "elastic", "elastic_machines.json",
    lambda r: (r["machines"]["recovery_down_s"], r["machines"]["recovery_up_s"]), "{:.1f} s / {:.1f} s",
    claim="from a kill to the first step of the smaller world / from a join to the first step of the larger")
fig("elastic_machines_samples", "elastic", "elastic_machines.json",
    lambda r: (r["machines"]["every_sample_once_per_epoch"], r["machines"]["epochs"]),
    lambda v: f"{'every' if v[0] else 'not every'} sample once in each of {v[1]} epochs", met=lambda v: v[0],
    claim="the data across the changes: each epoch trains every sample once")

#: the README's headline table: (figure, what it says), in order; ``{NAME}`` in a label is figure NAME
HEADLINE = [
    ("wrapper_host_ratio_148", "bagua's extra host time per training step, against torch DDP's"),
    ("speed_bytegrad_bw-100mbit", "bytegrad against torch DDP, 100 Mbit/s"),
    ("speed_bytegrad_bw-10mbit", "bytegrad against torch DDP, 10 Mbit/s"),
    ("speed_onebit_grad_bw-10mbit", "onebit_grad against torch DDP, 10 Mbit/s"),
    ("tta_fastest_speedup_100mbit", "time to torch DDP's validation loss, 100 Mbit/s, the fastest ({tta_fastest_100mbit})"),
    ("machines_hier_comm_bound", "hierarchical bytegrad against flat, 4 machines x 2 ranks, 100 Mbit/s"),
    ("striped_per_flow", "plain torch DDP on striped connections, each connection capped"),
    ("hf_trainer_8bit", "Hugging Face `Trainer` with bagua's 8-bit hook, 100 Mbit/s"),
    ("cache_lmdb_epoch2", "a second epoch from the LMDB cache, against no cache"),
]
HEADLINE_PLOT = "tradeoff.png"


# ---------------------------------------------------------------------------------------------
# Computing
# ---------------------------------------------------------------------------------------------

class Results:
    """The parsed results files under ``root``/benchmarks/results, each read once; ``read`` names
    those read. A JSON file's dict carries ``_results`` (this), for the figures that read a second
    file beside it."""

    def __init__(self, root: Path = ROOT):
        self.dir = root / "benchmarks" / "results"
        self._cache: dict[str, Any] = {}
        self.read: set[str] = set()

    def __getitem__(self, name: str) -> Any:
        self.read.add(name)
        if name not in self._cache:
            path = self.dir / name
            if not path.exists():
                raise FileNotFoundError(f"benchmarks/results/{name} does not exist")
            if name.endswith(".json"):
                self._cache[name] = {**json.loads(path.read_text()), "_results": self}
            else:
                self._cache[name] = path.read_text()
        return self._cache[name]

    def values(self) -> tuple[dict[str, str], list[str]]:
        """Every figure's text, by name, and the errors of those that could not be computed."""
        texts, errors = {}, []
        for f in FIGURES:
            try:
                texts[f.name] = f.text(f.value(self[f.source]))
            except Exception as e:  # noqa: BLE001 - named with its figure and file, not hidden
                errors.append(f"figure {f.name}: benchmarks/results/{f.source}: {type(e).__name__}: {e}")
        return texts, errors

    def status(self, f: Figure) -> str:
        if f.met is None:
            return ""
        try:
            return "met" if f.met(f.value(self[f.source])) else "not met"
        except Exception:  # noqa: BLE001 - values() reports it
            return ""

    def facts(self, name: str) -> dict[str, str]:
        """Date, machine, command, plot and RESULTS.md section of one results file."""
        doc, rec = self[name], RECORDED.get(name, Recorded(""))
        if isinstance(doc, str):
            date = re.search(r"Date:\s*(\d{4}-\d{2}-\d{2})", doc)
            machine = re.search(r"Machine:\s*(.+?)(?:\.\s|\n\n|\n- )", doc, re.S)
            command = re.search(r"Command:\s*`([^`]+)`", doc)
            plot = re.search(r"Plot:\s*`benchmarks/figures/([\w.-]+)`", doc)
            facts = {"date": date and date.group(1), "machine": machine and " ".join(machine.group(1).split()),
                     "command": command and command.group(1), "plot": plot and plot.group(1)}
        else:
            dates = sorted({doc["date"]} if "date" in doc else {
                w["date"] for v in doc.values() if isinstance(v, dict)
                for w in v.values() if isinstance(w, dict) and "date" in w})
            machine = doc.get("machine")
            if isinstance(machine, dict):
                machine = machine.get("description")
            if isinstance(machine, str) and "torch" in doc:
                machine += f", torch {doc['torch']}"
            command = doc.get("command")
            if command is None and rec.script and "argv" in doc:
                argv = list(doc["argv"])
                if "--out" in argv:  # where the run wrote it then; the file lives here now
                    argv[argv.index("--out") + 1] = f"benchmarks/results/{name}"
                command = " ".join(["python", f"benchmarks/{rec.script}", *argv])
            facts = {"date": " to ".join(dict.fromkeys([dates[0], dates[-1]])) if dates else None,
                     "machine": machine, "command": command, "plot": None}
        for key in ("date", "command", "plot"):
            facts[key] = facts[key] or getattr(rec, key)
        facts["machine"] = facts["machine"] or CPU_BOX
        facts["section"] = rec.section
        return facts


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------

def marked(name: str, text: str) -> str:
    return f"<!--fig:{name}-->{text}<!--/fig-->"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


GRID_TITLES = {
    "speed": "Speed against torch DDP fp32: its epoch time over the variant's (above 1x is faster). 4 ranks, each its "
             "own machine; the tradeoff sweep's GPT-2 LM; each column one job with the variants interleaved.",
    "tta": "Against torch DDP on the LM of convergence.md (AdamW): steps and time to DDP's validation loss after its "
           "own run, and the loss at DDP's last step. Times are the deterministic curves' steps timed on each link.",
}


def page(results: Results, texts: dict[str, str]) -> str:
    """docs/performance.md."""
    out = ["# Performance figures", "",
           "_Generated from `benchmarks/results/` by `python benchmarks/performance_page.py`; do not edit. "
           "`benchmarks/RESULTS.md` keeps the dated history of every figure and the reasoning behind it._", "",
           "One figure per claim: the latest run kept in a results file. Each group of figures names the run it comes "
           "from: its date, the machine, the command that wrote it (its `--out` pointed at the results file named) "
           "and its plot. Every bandwidth-limited setting is emulated on one machine (`benchmarks/netns.py`: each "
           "emulated machine in its own network namespace behind a shaped link), so CPU is shared by all ranks: the "
           "ratios hold for the setting named, not for every cluster.", "",
           "How fast is an algorithm at a link speed? One grid answers it: [Algorithms at network speeds]"
           "(#algorithms-at-network-speeds).", ""]
    out += ["Contents: " + " · ".join(f"[{a.title}](#{_slug(a.title)})" for a in AREAS), ""]
    for area in AREAS:
        out += [f"## {area.title}", "", area.intro, ""]
        figures = [f for f in FIGURES if f.area == area.key]
        for source in dict.fromkeys(f.source for f in figures):
            facts = results.facts(source)
            here = [f for f in figures if f.source == source]
            out += [f"### From `{source}`", "",
                    f"- **Date:** {facts['date'] or 'not recorded'}",
                    f"- **Machine:** {facts['machine']}",
                    f"- **Command:** `{facts['command']}`" if facts["command"] else "- **Command:** not recorded",
                    f"- **Results:** `benchmarks/results/{source}`; history: RESULTS.md, \"{facts['section']}\"",
                    f"- **Plot:** [{facts['plot']}](figures/{facts['plot']})" if facts["plot"] else "- **Plot:** none",
                    ""]
            for grid in dict.fromkeys(f.grid[0] for f in here if f.grid):
                cells = [f for f in here if f.grid and f.grid[0] == grid]
                at = {(f.grid[1], f.grid[2]): f for f in cells}
                columns = list(dict.fromkeys(f.grid[2] for f in cells))
                rows = [row for row in dict.fromkeys(f.grid[1] for f in cells)  # a variant this run did not measure: no row
                        if any(texts.get(at[row, c].name) != "not measured" for c in columns if (row, c) in at)]
                out += [GRID_TITLES[grid], "",
                        _table(["variant", *columns], [[row] + [marked(at[row, c].name, texts.get(at[row, c].name, "?"))
                                                               if (row, c) in at else "" for c in columns]
                                                      for row in rows]), ""]
            plain = [f for f in here if not f.grid]
            if plain:
                out += [_table(["claim", "figure", "setting", "status"],
                               [[f.claim, marked(f.name, texts.get(f.name, "?")), f.setting, results.status(f)]
                                for f in plain]), ""]
            if facts["plot"]:
                out += [f"![{source}](figures/{facts['plot']})", ""]
        prose = [(claim, section) for a, claim, section in PROSE_ONLY if a == area.key]
        if prose:
            out += ["Recorded in `benchmarks/RESULTS.md` only (no results file holds these figures):", ""]
            out += [f"- {claim}: \"{section}\"." for claim, section in prose] + [""]
    return "\n".join(out).rstrip() + "\n"


def _slug(title: str) -> str:
    """The anchor both GitHub and MkDocs give a heading of plain words."""
    return re.sub(r"[^\w\- ]", "", title.lower()).strip().replace(" ", "-")


def headline(texts: dict[str, str]) -> str:
    """The README's block: the headline figures and one plot."""
    by = {f.name: f for f in FIGURES}
    rows = [[re.sub(r"\{([\w.-]+)\}", lambda m: marked(m.group(1), texts.get(m.group(1), "?")), label),
             marked(name, texts.get(name, "?")), by[name].setting or by[name].claim,
             f"[{_area(by[name].area).title}](docs/performance.md#{_slug(_area(by[name].area).title)})"]
            for name, label in HEADLINE]
    return "\n".join([_table(["", "figure", "setting", "more"], rows), "",
                      f"![epoch time of every algorithm against bandwidth and latency](benchmarks/figures/{HEADLINE_PLOT})",
                      "", "Every figure with its date, machine and command: [docs/performance.md](docs/performance.md)."])


def _area(key: str) -> Area:
    return next(a for a in AREAS if a.key == key)


BLOCKS: dict[str, Callable[[dict[str, str]], str]] = {"headline": headline}


def _foreign_blocks() -> list[tuple[str, str, str, Callable[[], str], str]]:
    """The other generators' blocks in docs/: (file, begin, end, their text now, the command that writes it)."""
    import time_to_accuracy

    def tradeoff_text() -> str:
        tr = _tradeoff_report()
        results = json.loads((HERE / "results" / "tradeoff.json").read_text())
        fit = json.loads((HERE / "results" / "tradeoff_model.json").read_text())
        return tr.guide_section(results, fit, "tradeoff.png")

    return [("docs/choosing_an_algorithm.md", "<!-- tradeoff:begin -->", "<!-- tradeoff:end -->", tradeoff_text,
             "python benchmarks/tradeoff.py --report"),
            ("docs/convergence.md", time_to_accuracy.BEGIN, time_to_accuracy.END, lambda: time_to_accuracy.generated()[0],
             "python benchmarks/time_to_accuracy.py --report")]


def fill(text: str, texts: dict[str, str], where: str, problems: list[str]) -> str:
    """``text`` with its generated blocks and inline figures rewritten; unknown names go to ``problems``."""
    def block(m: re.Match) -> str:
        name = m.group(1)
        if name not in BLOCKS:
            problems.append(f"{where}: unknown generated block {name!r} (known: {', '.join(BLOCKS)})")
            return m.group(0)
        return f"{BEGIN.format(name=name)}\n{BLOCKS[name](texts)}\n{END.format(name=name)}"

    def figure(m: re.Match) -> str:
        if m.group(1) not in texts:
            problems.append(f"{where}: unknown figure {m.group(1)!r} (not in benchmarks/performance_page.py's FIGURES)")
            return m.group(0)
        return marked(m.group(1), texts[m.group(1)])

    return FIG_RE.sub(figure, BLOCK_RE.sub(block, text))


def targets(root: Path) -> list[Path]:
    """The files whose figures the generator fills: README.md and every docs page but its own."""
    return [p for p in [root / "README.md", *sorted((root / "docs").rglob("*.md"))]
            if p.exists() and p != root / PAGE]


def expected(root: Path = ROOT) -> tuple[dict[Path, Union[str, bytes]], list[str]]:
    """Every file the generator writes, with the content it should have, and the problems found."""
    results = Results(root)
    texts, problems = results.values()
    files: dict[Path, Union[str, bytes]] = {}
    if not problems:
        files[root / PAGE] = page(results, texts)
    for path in targets(root):
        files[path] = fill(path.read_text(), texts, str(path.relative_to(root)), problems)
    if (root / "README.md").exists() and "headline" not in dict(BLOCK_RE.findall((root / "README.md").read_text())):
        problems.append(f"README.md: no generated block headline ({BEGIN.format(name='headline')} ... "
                        f"{END.format(name='headline')})")
    plots = sorted({m for path, text in files.items() if path.parent == root / "docs" and isinstance(text, str)
                    for m in PLOT_LINK_RE.findall(text)})
    for plot in plots:
        source = root / "benchmarks" / "figures" / plot
        if source.exists():
            files[root / "docs" / "figures" / plot] = source.read_bytes()
        else:
            problems.append(f"docs/ links figures/{plot}, which benchmarks/figures/ does not have")
    return files, problems


def stale(root: Path = ROOT) -> list[str]:
    """What is out of date, each named; empty when everything matches its results file."""
    files, problems = expected(root)
    for path, want in files.items():
        where = str(path.relative_to(root))
        have = (path.read_bytes() if isinstance(want, bytes) else path.read_text()) if path.exists() else None
        if have == want:
            continue
        if isinstance(want, bytes):
            problems.append(f"{where}: missing or not the same as benchmarks/figures/{path.name}")
            continue
        if have is None:
            problems.append(f"{where}: missing")
            continue
        old, new = dict(FIG_RE.findall(have)), dict(FIG_RE.findall(want))
        named = [f"{where}: figure {n} says {old[n]!r}, its results file gives {v!r} "
                 f"(benchmarks/results/{_source(n)})" for n, v in new.items() if n in old and old[n] != v]
        blocks_old, blocks_new = dict(BLOCK_RE.findall(have)), dict(BLOCK_RE.findall(want))
        named += [f"{where}: generated block {n} is stale" for n in blocks_new if blocks_old.get(n) != blocks_new[n]]
        problems += named or [f"{where}: stale (not what python benchmarks/performance_page.py writes)"]
    figures_dir = root / "docs" / "figures"
    if figures_dir.exists():
        problems += [f"docs/figures/{p.name}: no page of docs/ links it" for p in sorted(figures_dir.iterdir())
                     if p not in files]
    if root == ROOT:  # the other generators read this checkout's results files only
        for name, begin, end, text, command in _foreign_blocks():
            doc = (root / name).read_text()
            if begin not in doc or end not in doc:
                problems.append(f"{name}: its generated part ({begin}) is missing: run {command}")
            elif doc.split(begin, 1)[1].split(end, 1)[0].strip() != text().strip():
                problems.append(f"{name}: the part between {begin} and {end} is stale: run {command}")
    return problems


def _source(name: str) -> str:
    return next(f.source for f in FIGURES if f.name == name)


def write(root: Path = ROOT) -> list[str]:
    """Write every generated file; returns what still does not match (the other generators' parts)."""
    files, problems = expected(root)
    if problems:
        return problems
    for path, content in files.items():
        have = path.read_bytes() if path.exists() else None
        data = content if isinstance(content, bytes) else content.encode()
        if have != data:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            print(f"wrote {path.relative_to(root)}")
    figures_dir = root / "docs" / "figures"
    for extra in (p for p in figures_dir.iterdir() if p not in files) if figures_dir.exists() else ():
        extra.unlink()
        print(f"removed {extra.relative_to(root)} (no page links it)")
    return stale(root)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 naming every stale figure")
    args = parser.parse_args(argv)
    problems = stale() if args.check else write()
    for line in problems:
        print(line)
    if problems and args.check:
        print(f"{len(problems)} stale: python benchmarks/performance_page.py rewrites its own; the others name their "
              "command")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
