"""The tradeoff study's report, from its results JSON alone: tables, shape targets, figures, the
fitted cost model, and the generated parts of ``benchmarks/RESULTS.md`` and
``docs/choosing_an_algorithm.md`` (between ``<!-- tradeoff:begin -->`` and ``<!-- tradeoff:end -->``).

    python -m benchmarks.tradeoff.report                       # the full run's JSON, else the quick run's
    python -m benchmarks.tradeoff.report --results benchmarks/results/tradeoff_quick.json

Writes ``figures/tradeoff[_quick].png`` (the paper's two panels: epoch time against bandwidth,
log-log, and against latency; the fitted model dotted), ``figures/tradeoff_paper.png`` (the
model at the paper's scale beside the paper's numbers) and ``results/tradeoff_model[_quick].json``
(the fit, which ``python -m bagua.advise --constants`` reads). A quick run's report leaves
RESULTS.md and the guide alone once a full run's results exist.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence

from benchmarks.jobs import ROOT
from benchmarks.records import BENCHMARKS, FIGURES, RESULTS
from benchmarks.step.ddp_report import COLORS, LABELS
from benchmarks.tradeoff.fit import ADVISE_NAME, fit_results, machine_facts, pace
from benchmarks.tradeoff.sweep import EPOCH_STEPS, SETTINGS, VARIANTS, results_path

if TYPE_CHECKING:
    from matplotlib.figure import Figure

GUIDE = ROOT / "docs" / "choosing_an_algorithm.md"
RESULTS_MD = BENCHMARKS / "RESULTS.md"
BEGIN, END = "<!-- tradeoff:begin -->", "<!-- tradeoff:end -->"
COMPRESSED = ("bytegrad", "low_precision_decentralized", "qadam")


def epochs(results: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Epoch seconds (``EPOCH_STEPS`` steps at the mean timed step) per setting and variant."""
    out: dict[str, dict[str, float]] = {}
    for key, record in results["settings"].items():
        job = record["job"]
        out[key] = {name: row["epoch_s"] / (job["reps"] * job["block"]) * EPOCH_STEPS
                    for name, row in job["variants"].items()}
    return out


def _ordered(results: dict[str, Any]) -> list[str]:
    known = [s.key for s in SETTINGS]
    return [k for k in known if k in results["settings"]] + sorted(set(results["settings"]) - set(known))


def latency_sweep(results: dict[str, Any]) -> list[tuple[float, str]]:
    """(one-way ms, setting) of the 4-rank settings through the delay line, by latency."""
    return sorted((r["setting"]["delay_ms"], k) for k, r in results["settings"].items()
                  if r["setting"]["sweep"] == "latency")


def latency_slopes(results: dict[str, Any]) -> dict[str, float]:
    """Seconds of epoch per ms of one-way latency: a least-squares line over the latency sweep."""
    table, sweep = epochs(results), latency_sweep(results)
    slopes = {}
    for name in VARIANTS:
        pts = [(ms, table[k][name]) for ms, k in sweep if name in table[k]]
        if len(pts) >= 2:
            mx, my = sum(x for x, _ in pts) / len(pts), sum(y for _, y in pts) / len(pts)
            slopes[name] = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
    return slopes


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's shape targets, each measured: what, the bound, the value, met or not (None: not run)."""
    e = epochs(results)
    lo, hi = e.get("bw-100mbit", {}), e.get("bw-10mbit", {})
    out = []
    slope = math.log(hi["ddp"] / lo["ddp"]) / math.log(10 / 100) if "ddp" in lo and "ddp" in hi else None
    out.append({"what": "DDP log-log slope, 100 -> 10 Mbit/s", "bound": "-1.1 .. -0.85", "value": slope,
                "met": None if slope is None else -1.1 <= slope <= -0.85})
    wire = {n: r.get("wire_per_step") for n, r in results["settings"].get("bw-10mbit", {}).get("job", {})
            .get("variants", {}).items()}
    for name in COMPRESSED:
        ratio = hi["ddp"] / hi[name] if "ddp" in hi and name in hi else None
        allows = wire["ddp"] / wire[name] if wire.get("ddp") and wire.get(name) else None
        out.append({"what": f"{name}: DDP / it at 10 Mbit/s", "bound": ">= 3.5x", "value": ratio,
                    "met": None if ratio is None else ratio >= 3.5, "bytes_allow": allows})
    fast = e.get("bw-1gbit", {})
    ratio = hi["async"] / fast["async"] if "async" in hi and "async" in fast else None
    out.append({"what": "async: its 10 Mbit/s / its 1 Gbit/s", "bound": "<= 1.5x", "value": ratio,
                "met": None if ratio is None else ratio <= 1.5})
    return out


def _fmt(value: Optional[float], digits: int = 2) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def _label(results: dict[str, Any], key: str) -> str:
    s = results["settings"][key]["setting"]
    rate = s["rate"].replace("gbit", " Gbit/s").replace("mbit", " Mbit/s")
    where = f"{s['delay_ms']:g} ms" if s["delay_ms"] is not None else "0 ms (bridged)"
    return f"{rate}, {where}" + (f", {s['ranks']} ranks" if s["ranks"] != 4 else "")


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def epoch_markdown(results: dict[str, Any]) -> str:
    e, keys = epochs(results), _ordered(results)
    rows = [[LABELS[v]] + [_fmt(e[k].get(v), 1) for k in keys] for v in measured_variants(results)]
    table = _table(["variant"] + [_label(results, k) for k in keys], rows)
    missing = [v for v in VARIANTS if v not in measured_variants(results)]
    if missing:
        table += (f"\n\nNot measured in this run: {', '.join(missing)} (in `VARIANTS` since; "
                  f"`python -m benchmarks.tradeoff.sweep --only {' '.join(missing)}` measures it, merged into the JSON).")
    return table


def measured_variants(results: dict[str, Any]) -> list[str]:
    """``VARIANTS`` that some setting of ``results`` measured, in their order."""
    seen = {name for r in results["settings"].values() for name in r["job"]["variants"]}
    return [v for v in VARIANTS if v in seen]


def _facts(results: dict[str, Any]) -> str:
    records = list(results["settings"].values())
    job = records[0]["job"]
    dates = sorted(r["date"] for r in records)
    steps = ", ".join(f"{k} {r['job']['reps'] * r['job']['block']}" for k, r in results["settings"].items())
    machine = results.get("machine", {})
    measured = {name for r in records for name in r["job"]["variants"]}
    onebit = f"; onebit_grad: {job['warmup']} exact warm-up step" if "onebit_grad" in measured else ""
    return (f"{'Quick run' if results.get('size') == 'quick' else 'Full run'}, {dates[0]} to {dates[-1]}, "
            f"{machine.get('description', 'this machine')}. GPT-2 {job['params'] / 1e6:.2f}M parameters "
            f"(`examples/train_lm.py` {' '.join(job['model_flags'])}), {job['tokens_per_batch'][0]} tokens per rank "
            f"and step, fused AdamW (qadam: `QAdamOptimizer`, {job['warmup']} warm-up step{onebit}), TCP {job['tcp_cc']}; "
            f"an epoch is {EPOCH_STEPS} steps at the mean of the timed steps per variant ({steps}), "
            f"the variants interleaved in one job per setting.")


def slopes_markdown(results: dict[str, Any]) -> str:
    slopes, sweep = latency_slopes(results), latency_sweep(results)
    ref = results["settings"][sweep[0][1]]["job"]["variants"] if sweep else {}
    rows = []
    for name in sorted(slopes, key=slopes.get, reverse=True):
        row = ref.get(name, {})
        wire = row.get("wire_per_step")
        hops = row.get("hops_per_step") or 0
        per_message = slopes[name] * 1e3 / EPOCH_STEPS / hops if hops else None  # latencies each message cost
        rows.append([LABELS[name], _fmt(slopes[name], 2), str(row.get("hops_per_step", "-")), _fmt(per_message, 1),
                     _fmt(row.get("model_bytes_per_step", 0) / 1e6, 2), _fmt(wire / 1e6 if wire else None, 2),
                     ", ".join(f"{m['what']} ({m['hops']})" for m in row.get("messages", [])) or "-"])
    return _table(["variant (most latency-sensitive first)", "s of epoch per ms", "messages in sequence per step",
                   "one-way latencies per message", "MB per step (model)", "MB per step (wire, measured)", "collectives (hops each)"], rows)


def _pct(x: float) -> str:
    return f"{x * 100:+.0f}%"


def fit_markdown(fit: dict[str, Any]) -> str:
    c = fit["constants"]
    eff = {k: c.get(k) if c.get(k) is not None else c["efficiency"] for k in ("compressed_efficiency", "exchange_efficiency")}
    machine, scale = fit.get("machine", {}), fit.get("compute_scale", {})
    lines = [f"Fitted on {', '.join(fit['fit_settings'])} (log least squares; the split as first chosen, each sweep's ends "
             f"and middle, unchanged): latency factor {c['latency_factor']:.2f} (what each one-way latency that "
             "`bagua.advise.one_way_delays` counts really cost: on Gloo 2 per message in sequence, a round trip, unless "
             "its receive was posted ahead); share of the "
             f"link rate reached by an exact ring allreduce {c['efficiency']:.2f}, by the compressed allreduce "
             f"{eff['compressed_efficiency']:.2f}, by the ring exchange {eff['exchange_efficiency']:.2f}; backward "
             f"{c['backward_share']:.2f} of compute (not fitted: twice forward's arithmetic); communication during compute "
             f"at the ranks' share of the cores (`bagua.advise.communication_pace`, {pace(machine, 4):.2f} at 4 ranks "
             f"here, {pace(machine, 8):.2f} at 8); compute per step: "
             + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in sorted(fit["compute_s"].items())) + ". "
             "Each point is predicted with the collectives its job recorded (the code that was measured). "]
    if any(w != "4" for w in scale):
        lines[0] += ("Other rank counts: compute scaled by `bagua.advise.cpu_slowdown` from the machine's recorded "
                     f"facts ({machine.get('cpus', 0):.0f} CPUs, load {machine.get('load_start', 0):.1f} before the "
                     "sweep: the ranks share the cores with it), nothing fitted: "
                     + ", ".join(f"{w} ranks x{s:.2f}" for w, s in scale.items() if w != "4") + ".")
    lines.append("")
    held = fit["held_out"]
    settings = [k for k in [s.key for s in SETTINGS] if k in {r["setting"] for r in held}]
    settings += sorted({r["setting"] for r in held} - set(settings))
    by = {(r["variant"], r["setting"]): r for r in held}
    rows = [[v] + [_pct(by[(v, s)]["error"]) if (v, s) in by else "-" for s in settings]
            for v in sorted({r["variant"] for r in held})]
    shifts = fit.get("held_out_shifts", {})
    if shifts:
        rows.append(["*shared by all variants*"] + [_pct(shifts[s]["common"]) for s in settings])
        rows.append(["*left per variant (rms)*"] + [f"{shifts[s]['residual'] * 100:.0f}%" for s in settings])
    lines.append(_table(["held out: predicted / measured - 1"] + settings, rows))
    inside = sum(abs(r["error"]) <= 0.2 for r in held)
    worst = max(held, key=lambda r: abs(r["error"]), default=None)
    lines += ["", f"**{inside} of {len(held)} held-out points within 20%; worst {fit['worst_held_out'] * 100:.0f}%"
              + (f" ({worst['variant']}, {worst['setting']})" if worst else "") + ".**"]
    lines += ["", noise_markdown(fit)]
    return "\n".join(lines)


def noise_markdown(fit: dict[str, Any]) -> str:
    """What the measurement itself repeats to, beside the model's errors."""
    held, parts = fit["held_out"], []
    for pair in fit.get("repeatability", []):
        mean, median = pair["mean"], pair.get("median")
        diffs = ", ".join(f"{v} {_pct(d)}" for v, d in sorted(mean["diffs"].items(), key=lambda kv: kv[1]))
        parts.append(
            f"- **Repeatability.** {pair['a']} and {pair['b']} are the same nominal link (4 ranks, 1 Gbit/s, 0 ms; "
            f"bridged, and through the delay line at 0 ms) measured in separate jobs minutes apart: {pair['b']} over "
            f"{pair['a']} per variant {diffs}; median |difference| {mean['median_abs'] * 100:.0f}%, worst "
            f"{mean['max_abs'] * 100:.0f}%, {_pct(mean['common'])} shared by all variants. "
            + (f"By the median step instead of the mean: median |difference| {median['median_abs'] * 100:.0f}%, worst "
               f"{median['max_abs'] * 100:.0f}%; the mean of the timed steps is the statistic used"
               + (", the one that repeats better" if mean["median_abs"] <= median["median_abs"] else "")
               + " (the JSON holds each "
               "rank's median and quartiles and rank 0's block times, not every step). " if median else "")
            + "No model can be held closer than this on the 1 Gbit/s "
            "settings, where a step is mostly CPU time shared with the other sessions' jobs.")
    sync = [r["se"] for r in held if r["variant"] != "async" and r.get("se") == r.get("se")]
    asy = [r["se"] for r in held if r["variant"] == "async" and r.get("se") == r.get("se")]
    if sync:
        parts.append(
            f"- **Within one job** the timed blocks repeat better: the standard error of a point's mean step "
            f"(rank 0's blocks) is {statistics.median(sync) * 100:.0f}% (median, synchronous variants), "
            + (f"async's {min(asy) * 100:.0f}-{max(asy) * 100:.0f}% (its steps run with or without an averaging "
               "round on the same cores). " if asy else "")
            + "So most of the noise is between jobs: the machine's load in the minutes a setting ran shifts all its "
            "variants together (the table's shared row).")
    rows = fit["fit"] + held
    sweep = sorted((float(m.group(1)), k) for k in {r["setting"] for r in rows} if (m := re.match(r"lat-([\d.]+)ms$", k)))
    measured = {(r["variant"], r["setting"]): r["measured_s"] for r in rows}
    for (_, before), (ms, after) in zip(sweep, sweep[1:]):
        both = [v for v in {r["variant"] for r in rows} if (v, before) in measured and (v, after) in measured]
        faster = [v for v in both if measured[(v, after)] < measured[(v, before)]]
        if both and len(faster) == len(both):
            drops = [measured[(v, after)] / measured[(v, before)] - 1 for v in both]
            parts.append(f"- **{after}** measured every variant faster than {before} did ({_pct(max(drops))} to "
                         f"{_pct(min(drops))}), which more latency cannot cause: most likely quieter minutes on the machine (this sweep did not record the load "
                         "per setting; the next one does).")
    misses = [r for r in held if abs(r["error"]) > 0.2]
    if misses:
        shifts = fit.get("held_out_shifts", {})
        listed = "; ".join(f"{r['variant']} {r['setting']} {_pct(r['error'])}"
                           f" (shared {_pct(shifts[r['setting']]['common'])}, own standard error {r['se'] * 100:.0f}%)"
                           for r in sorted(misses, key=lambda r: (r["setting"], r["variant"])))
        parts.append(f"- **The misses**: {listed}.")
    idle = [(r["variant"], r["error_idle_cores"]) for r in held if "error_idle_cores" in r]
    if idle:
        scale = fit.get("compute_scale_idle_cores", {})
        parts.append("- **Ranks per core.** Taking the cores as idle (8 ranks on them: "
                     + ", ".join(f"x{s:.2f}" for w, s in scale.items() if w != "4")
                     + " the compute of 4) instead of shared with the recorded load, the 8-rank errors would be "
                     + ", ".join(f"{v} {_pct(e)}" for v, e in idle) + ".")
    return "\n".join(parts)


def paper_markdown(fit: dict[str, Any]) -> str:
    paper, cases = fit["paper"], list(fit["paper"]["scenarios"])
    s = paper["setting"]
    rows = [[algo, link, f"{row['paper_s']:.0f}", *[f"{row[c]:.0f}" for c in cases], str(row["hops"])]
            for link, table in paper["epochs"].items() for algo, row in table.items()]
    slope_rows = [[algo, f"{v['paper']:.0f}", *[f"{v[c]:.0f}" for c in cases]] for algo, v in paper["latency_slopes"].items()]
    a, b = paper["cases"]["A"], paper["cases"]["B"]
    head = (f"A prediction, not a measurement: {s['world_size']} ranks on {s['world_size'] // s['ranks_per_machine']} "
            f"machines, {s['params'] / 1e6:.0f}M parameters in 25 MiB buckets, NCCL, bagua's algorithms hierarchical "
            f"(exact within a machine), {s['steps_per_epoch']:.0f} steps an epoch, backward "
            f"{a['constants']['backward_share']:.2f} of compute (twice forward's); compute per step A "
            f"{a['compute_s'] * 1e3:.0f} ms, B to D {b['compute_s'] * 1e3:.0f} ms; B to D's link ceiling "
            f"{b['ceiling_bit_s'] / 1e9:.1f} Gbit/s; C: latency factor {paper['cases']['C']['constants']['latency_factor']:.1f} "
            "(fitted on this sweep's Gloo, applied to NCCL's one latency a message).")
    return "\n\n".join([head, _table(["algorithm", "link", "paper, s", *[f"model {c}, s" for c in cases],
                                       "messages in sequence per step"], rows),
                         "Seconds of epoch per ms of one-way latency (0 to 5 ms at 100 Gbit/s):",
                         _table(["algorithm", "paper", *[f"model {c}" for c in cases]], slope_rows)])


def target_markdown(results: dict[str, Any]) -> str:
    rows = [[t["what"], t["bound"], _fmt(t["value"]), {None: "not run", True: "met", False: "not met"}[t["met"]],
             _fmt(t.get("bytes_allow"))] for t in targets(results)]
    return (_table(["shape target", "bound", "measured", "status", "bytes allow (DDP's wire bytes / its)"], rows)
            + "\n\nA compressed variant's ratio is bounded by its bytes on the wire (measured per rank, TCP/IP "
            "included); below that, compute (which every variant pays) dilutes the ratio, and so does what a step "
            "cannot hide: the low-precision ring exchange runs after the optimizer step (and sends the whole model to "
            "each of its two ring neighbours, so on 4 ranks its bytes allow only ~3x), qadam's Adam step is heavier than "
            "the others' and checks its speculation, and every compressed variant spends CPU on its codec that the "
            "exact ones do not.")


def plot(results: dict[str, Any], fit: Optional[dict[str, Any]], path: Path) -> Figure:
    """The paper's two panels: epoch against bandwidth (0 ms, log-log) and against latency (1 Gbit/s),
    saved to ``path``; returns the figure (closed: its axes and lines hold what was drawn)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bagua.advise import Collective, Constants, Link, predict

    e = epochs(results)
    bw = sorted((r["rate_bit"], k) for k, r in results["settings"].items() if r["setting"]["sweep"] == "bandwidth")
    lat = latency_sweep(results)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    for name in measured_variants(results):
        style = {"color": COLORS[name], "label": LABELS[name], "marker": "o", "linewidth": 2.2 if name == "ddp" else 1.3}
        left.plot([b / 1e6 for b, k in bw if name in e[k]], [e[k][name] for b, k in bw if name in e[k]], **style)
        right.plot([ms for ms, k in lat if name in e[k]], [e[k][name] for ms, k in lat if name in e[k]], **style)
        if fit is None or ADVISE_NAME.get(name, name) not in fit["compute_s"] or not bw:
            continue
        algo, constants = ADVISE_NAME.get(name, name), Constants(**fit["constants"])
        row = results["settings"][bw[0][1]]["job"]["variants"].get(name)
        if row is None:
            continue
        pattern = [Collective(**m) for m in row["messages"]] if "messages" in row else None  # the code measured
        world = results["settings"][bw[0][1]]["job"]["world"]
        model = lambda link: predict(algo, row["buckets"], world, link, fit["compute_s"][algo], constants,  # noqa: E731
                                     pattern=pattern, pace=pace(machine_facts(results), world)).step_s * EPOCH_STEPS
        rates = [bw[0][0] * (bw[-1][0] / bw[0][0]) ** (i / 40) for i in range(41)]
        left.plot([r / 1e6 for r in rates], [model(Link(r)) for r in rates], ":", color=COLORS[name], linewidth=1)
        if lat:
            right.plot([i / 2 for i in range(2 * int(lat[-1][0]) + 1)],
                       [model(Link(1e9, i / 2e3)) for i in range(2 * int(lat[-1][0]) + 1)], ":", color=COLORS[name], linewidth=1)
    left.set(xscale="log", yscale="log", xlabel="bandwidth per machine, Mbit/s (0 ms)",
             ylabel=f"epoch time, s ({EPOCH_STEPS} steps)", title="epoch time vs bandwidth")
    right.set(xlabel="one-way latency, ms (1 Gbit/s)", ylabel=f"epoch time, s ({EPOCH_STEPS} steps)",
              title="epoch time vs latency")
    for ax in (left, right):
        ax.grid(True, which="both", alpha=0.3)
    right.legend(fontsize=7)
    fig.suptitle(f"4 ranks as machines, {results['settings'][_ordered(results)[0]]['job']['params'] / 1e6:.2f}M-parameter LM "
                 f"(dotted: the fitted cost model)", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return fig


def plot_paper(fit: dict[str, Any], path: Path) -> Figure:
    """The model at the paper's scale (scenario A solid, B dashed) and the paper's epoch times (dots),
    saved to ``path``; returns the figure (closed: its axes and lines hold what was drawn)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bagua.advise import Link
    from benchmarks.tradeoff.fit import PAPER, paper_epoch

    cases = fit["paper"]["cases"]
    inverse = {v: k for k, v in ADVISE_NAME.items()}
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    gbits, ms = [10 ** (i / 20) for i in range(41)], [i / 4 for i in range(21)]
    for algo in PAPER["epoch_s"]["1gbit 0ms"]:
        color = COLORS[inverse.get(algo, algo)]
        for name, style in (("A", "-"), ("B", "--")):
            label = f"{algo} (model {name})"
            left.plot(gbits, [paper_epoch(algo, Link(g * 1e9), cases[name]) for g in gbits], style, color=color, label=label)
            right.plot(ms, [paper_epoch(algo, Link(100e9, m / 1e3), cases[name]) for m in ms], style, color=color, label=label)
        left.plot([1, 100], [PAPER["epoch_s"]["1gbit 0ms"][algo], PAPER["epoch_s"]["100gbit 0ms"][algo]], "o", color=color)
        right.plot([0, 5], [PAPER["epoch_s"]["100gbit 0ms"][algo], PAPER["epoch_s"]["100gbit 5ms"][algo]], "o", color=color)
    left.set(xscale="log", yscale="log", xlabel="bandwidth per machine, Gbit/s (0 ms)", ylabel="epoch time, s",
             title="BERT-Large, 128 GPUs: model A (solid), B (dashed), paper (dots)")
    right.set(xlabel="one-way latency, ms (100 Gbit/s)", ylabel="epoch time, s", title="the same against latency")
    for ax in (left, right):
        ax.grid(True, which="both", alpha=0.3)
    right.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return fig


def replace_section(path: Path, text: str, begin: str = BEGIN, end: str = END) -> None:
    """Put ``text`` between the markers ``begin`` and ``end`` in ``path`` (appended with them if absent)."""
    body = path.read_text() if path.exists() else ""
    block = f"{begin}\n{text.strip()}\n{end}"
    if begin in body and end in body:
        body = re.sub(re.escape(begin) + r".*?" + re.escape(end), lambda _: block, body, flags=re.S)
    else:
        body = body.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(body)


def paper_notes(fit: dict[str, Any]) -> str:
    """Where the model and the paper part, and which assumption explains each."""
    e, slopes = fit["paper"]["epochs"], fit["paper"]["latency_slopes"]
    b = {link: {a: row["B"] for a, row in rows.items()} for link, rows in e.items()}
    return "\n".join([
        f"- **Compute (A vs B).** Taking all of DDP's 125 s at 100 Gbit/s as compute (A: "
        f"{fit['paper']['cases']['A']['compute_s'] * 1e3:.0f} ms a step) makes every algorithm at least 125 s there; "
        f"the paper's async (61 s, no communication on its step) says compute is half that, so DDP's 100 Gbit/s link "
        f"delivered about {fit['paper']['cases']['B']['ceiling_bit_s'] / 1e9:.0f} Gbit/s (B). With that, 100 Gbit/s comes out as "
        f"bytegrad {b['100gbit 0ms']['bytegrad']:.0f}, low-precision decentralized "
        f"{b['100gbit 0ms']['low_precision_decentralized']:.0f}, decentralized {b['100gbit 0ms']['decentralized']:.0f} s "
        f"(paper 87, 76, 82), and 1 Gbit/s DDP {b['1gbit 0ms']['torch-ddp']:.0f}, bytegrad {b['1gbit 0ms']['bytegrad']:.0f}, "
        f"low-precision decentralized {b['1gbit 0ms']['low_precision_decentralized']:.0f} s (paper 2600, 690, 736).",
        f"- **qadam at 1 Gbit/s** (model {b['1gbit 0ms']['qadam']:.0f} s, paper 75): the paper ran QAdam with 1-bit "
        "momentum (Bagua's benchmark page: \"QAdam 1-bit\"); ours sends 8 bits, 8x the bytes.",
        f"- **decentralized at 1 Gbit/s** (model {b['1gbit 0ms']['decentralized']:.0f} s, paper 1504): the model takes "
        "`peer_selection_mode=\"all\"` (an allreduce of the weights: DDP's bytes); one peer per step "
        f"(`shift_one`) sends half of that: about {(b['1gbit 0ms']['decentralized'] + b['1gbit 0ms']['async']) / 2:.0f} s in the same model.",
        f"- **Latency, DDP** ({slopes['torch-ddp']['A']:.0f} s per ms modelled, paper {slopes['torch-ddp']['paper']:.0f}): "
        "NCCL's ring crosses each machine boundary twice per allreduce, 2 x 15 one-way latencies per 25 MiB bucket, "
        "52 buckets a step, nothing to hide them behind once backward has ended; the count alone gives the paper's slope.",
        f"- **Latency, low-precision decentralized** ({slopes['low_precision_decentralized']['A']:.0f} s per ms "
        f"modelled, paper {slopes['low_precision_decentralized']['paper']:.0f}): its exchange is one message per "
        "bucket to both neighbours at once, the fewest in sequence of the synchronous algorithms.",
        f"- **Latency, bytegrad and qadam** (model {slopes['bytegrad']['A']:.0f} and {slopes['qadam']['A']:.0f} s per ms, "
        f"paper {slopes['bytegrad']['paper']:.0f} and {slopes['qadam']['paper']:.0f}): the model lets both send 2 "
        "messages per bucket hidden behind backward (qadam's momentum goes bucket by bucket during backward, then one "
        "small verdict allreduce); the paper's slopes say each bucket's messages were paid in full. On this sweep "
        f"each one-way latency the model counts cost {fit['constants']['latency_factor']:.1f} of the delay (the "
        "fitted latency factor, over Gloo's round trip per message; within its noise of 1); with that factor (C) the "
        f"slopes become {slopes['bytegrad']['C']:.0f} (bytegrad), "
        f"{slopes['qadam']['C']:.0f} (qadam), {slopes['torch-ddp']['C']:.0f} (DDP) and "
        f"{slopes['low_precision_decentralized']['C']:.0f} (low-precision decentralized) s per ms.",
        f"- **Latency, decentralized** (model {slopes['decentralized']['A']:.0f}, paper "
        f"{slopes['decentralized']['paper']:.0f} s per ms): the same ring count as DDP under `all`; `shift_one` is one "
        "message per bucket.",
    ])


def order_explained(results: dict[str, Any]) -> str:
    """The latency order, explained by the messages in sequence the step cannot hide."""
    slopes, sweep = latency_slopes(results), latency_sweep(results)
    rows = results["settings"][sweep[0][1]]["job"]["variants"] if sweep else {}
    per = [s * 1e3 / EPOCH_STEPS / rows[n]["hops_per_step"] for n, s in slopes.items()
           if n in rows and rows[n]["hops_per_step"] and s > 0]
    lpd = rows.get("low_precision_decentralized", {}).get("messages", [])
    checks = sum(m["hops"] for m in lpd if m["what"] == "agreement check")
    text = (f"By these slopes a message in sequence cost {min(per):.1f} to {max(per):.1f} one-way latencies, but "
            "each slope runs through 6 jobs and carries the noise between jobs (see the repeatability under the cost "
            "model: a shift of 10-20% of a ~0.45 s step moves a point by 0.05-0.09 s, what 20 ms adds to a "
            "2-message step), so only the many-message variants' slopes are resolved; a restart of TCP's slow start "
            "after the idle compute phase would cost ~10 one-way latencies per connection and step for a 1 MB "
            "message, which the 1- and 2-message variants do not show. The count orders the resolved slopes: "
            if per else "")
    text += ("a Gloo ring allreduce keeps two 1 MiB segments in flight, so an exact allreduce of a bucket is many "
             "messages in sequence, a compressed allreduce 2, the low-precision ring exchange 1")
    if checks:
        text += (f", and here {checks} more for the agreement check before each bucket's exchange (a public "
                 "collective, as this sweep's code still checked; bagua now trusts the exchange and sends the "
                 "fewest)")
    return text + "."


def results_section(results: dict[str, Any], fit: Optional[dict[str, Any]], figure: str) -> str:
    """The RESULTS.md section: the study, its targets, latency and message counts, the fit, the paper."""
    slopes = latency_slopes(results)
    order = sorted(slopes, key=slopes.get, reverse=True)
    sync = [v for v in order if v != "async"]
    first_ddp = bool(sync) and sync[0] in ("ddp", "gradient_allreduce", "decentralized")
    lpd_least = bool(sync) and sync[-1] == "low_precision_decentralized"
    parts = [
        "## Bandwidth x latency — `benchmarks/tradeoff/sweep.py` (issue 27, parts 2 and 3)", "",
        f"_Generated by `python -m benchmarks.tradeoff.sweep --report` from `results/{Path(results_path(results.get('size', 'full'))).name}`; "
        "do not edit by hand._", "", _facts(results), "",
        f"Epoch time, seconds ({EPOCH_STEPS} steps), 4 ranks each its own machine unless said:", "",
        epoch_markdown(results), "", f"Plot: `figures/{figure}` (the paper's two panels; dotted: the fitted model).", "",
        target_markdown(results), "",
        "Latency: the slope of a line through each variant's epoch times over the latency sweep, beside the "
        "messages in sequence per step that `bagua.advise.message_pattern` counts from the code and the bucket "
        "layout the job recorded (both in the JSON):", "", slopes_markdown(results), "",
        f"Measured order: {' > '.join(order)}. The paper's order (DDP degrades fastest, low-precision decentralized "
        f"least, async aside): DDP-like first {'reproduced' if first_ddp else 'not reproduced'}, low-precision "
        f"decentralized least {'reproduced' if lpd_least else 'not reproduced'}. " + order_explained(results),
    ]
    if fit is not None:
        parts += ["", "### The cost model (`bagua/advise.py`, fitted by `benchmarks/tradeoff/fit.py`)", "",
                  fit_markdown(fit), "", "### The paper's setting, predicted", "", paper_markdown(fit), "",
                  "Scenarios: " + "; ".join(f"**{k}**: {v}" for k, v in fit["paper"]["scenarios"].items()) + ".", "",
                  paper_notes(fit), "", "Plot: `figures/tradeoff_paper.png` (scenarios A and B)."]
    return "\n".join(parts)


def accuracy_markdown(path: Path = RESULTS / "time_to_accuracy.json") -> str:
    """What each algorithm did to the loss: ``time_to_accuracy.py``'s run, if there is one."""
    if not path.exists():
        return "(no time-to-accuracy results: run `python -m benchmarks.accuracy.time_to_accuracy`)"
    tta = json.loads(path.read_text())
    rows_in = tta["table"][tta["curve_link"]]
    inverse = {v: k for k, v in ADVISE_NAME.items()}
    base = rows_in["torch-ddp"]["val_at_steps"]
    ddp_steps = rows_in["torch-ddp"]["reached"][0]
    rows = [[LABELS.get(inverse.get(name, name), f"bagua {name}"),
             f"{row['reached'][0]} ({row['reached'][0] / ddp_steps:.2f}x)" if row["reached"]
             else f"not in {row['curve'][-1][0]}",
             f"{row['val_at_steps']:.4f}", f"{(row['val_at_steps'] / base - 1) * 100:+.1f}%"] for name, row in rows_in.items()]
    return (f"The accuracy side (`benchmarks/accuracy/time_to_accuracy.py`, {tta['date']}, {tta['ranks']} ranks, the LM of "
            f"[convergence.md](convergence.md): 0.84M parameters, ~1K tokens per rank and step, cosine decay): steps to "
            f"torch DDP's validation loss after its {tta['steps']} steps ({tta['target']:.4f} nats/byte), and each one's "
            f"loss after {tta['steps']} steps.\n\n"
            + _table(["variant", "steps to DDP's loss", f"loss after {tta['steps']} steps", "vs DDP"], rows))


def async_note(results: dict[str, Any], fit: Optional[dict[str, Any]]) -> str:
    """How often async's replicas can be averaged on each link (the model's round time over its step)."""
    from bagua.advise import Constants, Link, predict

    constants = Constants(**fit["constants"]) if fit else Constants()
    seen = []
    for key in ("bw-1gbit", "bw-10mbit", "lat-20ms"):
        record = results["settings"].get(key)
        row = record["job"]["variants"].get("async") if record else None
        if row is None:
            continue
        link = Link(record["rate_bit"], (record["setting"]["delay_ms"] or 0) / 1e3)
        step = row["epoch_s"] / (record["job"]["reps"] * record["job"]["block"])
        round_s = predict("async", row["buckets"], record["job"]["world"], link, step, constants).comm_s
        seen.append(f"{_label(results, key)}: a round takes {round_s:.2f} s, {round_s / step:.1f} of its steps")
    return ("async never waits, but its replicas are averaged only as often as the link allows (" + "; ".join(seen)
            + "; the cost model's round time): its speed is paid in accuracy." if seen else "")


def guide_section(results: dict[str, Any], fit: Optional[dict[str, Any]], figure: str) -> str:
    """The numbers of docs/choosing_an_algorithm.md: measured here, and modelled at the paper's scale."""
    e = epochs(results)
    cols = [k for k in ("bw-1gbit", "bw-10mbit", "lat-20ms") if k in e]
    rows = [[LABELS[v]] + [f"{e[k]['ddp'] / e[k][v]:.2f}x" if v in e[k] else "-" for k in cols]
            for v in measured_variants(results)]
    parts = [f"_Generated from `benchmarks/results/{Path(results_path(results.get('size', 'full'))).name}` by "
             "`python -m benchmarks.tradeoff.sweep --report`._", "", _facts(results), "",
             f"![epoch time against bandwidth and latency](figures/{figure})", "",
             "Speed against torch DDP (its epoch time over the variant's; above 1x is faster):", "",
             _table(["variant"] + [_label(results, k) for k in cols], rows), "", async_note(results, fit), "",
             accuracy_markdown()]
    if fit is not None:
        held = fit["held_out"]
        pairs = fit.get("repeatability", [])
        floor = (f"; two measurements of the same nominal link here differ by up to "
                 f"{max(p['mean']['max_abs'] for p in pairs) * 100:.0f}% per variant" if pairs else "")
        parts += ["", f"The cost model fitted on this sweep predicts {sum(abs(r['error']) <= 0.2 for r in held)} of "
                  f"{len(held)} held-out points within 20% (worst {fit['worst_held_out'] * 100:.0f}%){floor} "
                  "(`benchmarks/RESULTS.md`, \"The cost model\")."]
        paper = fit["paper"]["epochs"]
        rows = [[a] + [f"{paper[ln][a]['paper_s']:.0f} / {paper[ln][a]['B']:.0f}" for ln in paper] for a in paper["100gbit 0ms"]]
        parts += ["", "At the paper's scale (128 GPUs on 16 machines, BERT-Large), epoch seconds, the paper's / the "
                  "model's (scenario B of RESULTS.md; a prediction):", "",
                  _table(["algorithm", *[f"{ln}" for ln in paper]], rows), "",
                  "![the model at the paper's scale](figures/tradeoff_paper.png)"]
    return "\n".join(parts)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", default=None, help="the study's JSON (default: the full run's, else the quick run's)")
    args = parser.parse_args(argv)
    path = Path(args.results) if args.results else next(
        (p for p in (results_path("full"), results_path("quick")) if p.exists()), results_path("full"))
    if not path.exists():
        raise SystemExit(f"no results at {path}: run python -m benchmarks.tradeoff.sweep (or --quick) first")
    results = json.loads(path.read_text())
    if not results.get("settings"):
        raise SystemExit(f"{path} holds no setting yet")
    quick = results.get("size") == "quick"
    suffix = "_quick" if quick else ""
    # a results file elsewhere (an experiment's --results) is reported, never written into the project's files
    own = path.resolve() == results_path(results.get("size", "full")).resolve()
    try:
        fit = fit_results(results)
    except ValueError as e:  # not enough settings yet for a fit
        print(f"no fit: {e}")
        fit = None
    if fit is not None and own:
        (RESULTS / f"tradeoff_model{suffix}.json").write_text(json.dumps(fit, indent=1))
        plot_paper(fit, FIGURES / "tradeoff_paper.png")
    figure = f"tradeoff{suffix}.png"
    if own:
        plot(results, fit, FIGURES / figure)
    section = results_section(results, fit, figure)
    print(section)
    if not own:
        print(f"\n{path} is not the project's results file: RESULTS.md, the guide, the figures and the fit left as they are")
    elif not quick or not results_path("full").exists():
        replace_section(RESULTS_MD, section)
        replace_section(GUIDE, guide_section(results, fit, figure))
        print(f"\nwrote the generated parts of {RESULTS_MD.relative_to(ROOT)} and {GUIDE.relative_to(ROOT)}")
    e = epochs(results).get("bw-10mbit", {})
    key = e["ddp"] / e["bytegrad"] if "ddp" in e and "bytegrad" in e else float("nan")
    print(f"key ratio: at 10 Mbit/s, DDP's epoch / bytegrad's = {key:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
