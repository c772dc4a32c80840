"""The report side of ``ddp.py``: the variants' names and labels, the tables, the key ratios
and the network plot (also for runs read back with ``ddp.py --from-json``).

Example::

    print(format_job(job)); lines, key_line, key = key_summary(jobs, gpu)
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any, Optional

from benchmarks.records import fmt_bytes

ALL_VARIANTS = (
    "ddp", "ddp-10MB", "ddp-fp16", "gradient_allreduce", "gradient_allreduce-10MB", "bytegrad",
    "bytegrad-10MB", "decentralized", "low_precision_decentralized", "async", "qadam", "onebit_grad", "local",
)
# A BatchNorm after every hidden layer, with the buffers broadcast every step (both wrappers'
# default) and without (-nobuf): what broadcast_buffers costs each of them.
BUFFER_VARIANTS = ("ddp-bn", "ddp-bn-nobuf", "gradient_allreduce-bn", "gradient_allreduce-bn-nobuf")
# qadam (the default overlap="auto") always speculating (overlap=True), with its momentum averaged in
# step() (overlap=False) instead of during backward, and each
# with clip_grad_norm_ before every step: what the overlap buys, and what clipping costs it; qadam1:
# its 1-bit momentum (bits=1), against qadam's 8 bits; bytegrad with torch Adam: qadam's optimizer
# family, against which qadam's step differs by its communication alone.
QADAM_VARIANTS = ("qadam-overlap", "qadam-nooverlap", "qadam-clip", "qadam-nooverlap-clip", "qadam1",
                  "qadam1-nooverlap", "bytegrad-adam")
# torch's own DDP wrapper with bagua's compression as its communication hook (bagua.comm_hooks)
HOOK_VARIANTS = ("ddp-bytegrad-hook", "ddp-onebit-hook")
# torch's own DDP wrapper on bagua's striping torch backend ("bagua"), 8 connection sets
STRIPED_VARIANTS = ("ddp-striped",)
NETWORK_VARIANTS = (
    "ddp", "ddp-fp16", "gradient_allreduce", "bytegrad", "decentralized",
    "low_precision_decentralized", "async", "qadam", "onebit_grad",
)
LABELS = {
    "ddp": "torch DDP fp32",
    "ddp-10MB": "torch DDP fp32, 10MB buckets",
    "ddp-fp16": "torch DDP fp16 hook",
    "ddp-bytegrad-hook": "torch DDP + bagua.comm_hooks bytegrad (8-bit)",
    "ddp-onebit-hook": "torch DDP + bagua.comm_hooks onebit_grad (1 bit)",
    "ddp-striped": "torch DDP fp32 on the 'bagua' torch backend (8 connection sets)",
    "gradient_allreduce": "bagua gradient_allreduce",
    "gradient_allreduce-10MB": "bagua gradient_allreduce, 10MB buckets",
    "bytegrad": "bagua bytegrad",
    "bytegrad-10MB": "bagua bytegrad, 10MB buckets",
    "decentralized": "bagua decentralized",
    "low_precision_decentralized": "bagua low_precision_decentralized",
    "async": "bagua async",
    "qadam": "bagua qadam (Adam; overlap=auto)",
    "onebit_grad": "bagua onebit_grad (1 bit, error feedback)",
    "local": "no communication (one rank's compute)",
    "qadam-overlap": "bagua qadam, overlap=True (always speculating during backward)",
    "qadam-nooverlap": "bagua qadam, overlap=False (momentum averaged in step())",
    "qadam-clip": "bagua qadam, clip_grad_norm_(--clip-norm) before each step",
    "qadam-nooverlap-clip": "bagua qadam, overlap=False, clip_grad_norm_(--clip-norm) before each step",
    "qadam1": "bagua qadam, bits=1 (1-bit momentum, error feedback)",
    "qadam1-nooverlap": "bagua qadam, bits=1, overlap=False",
    "bytegrad-adam": "bagua bytegrad, torch Adam (qadam's optimizer family)",
    "ddp-bn": "torch DDP, BatchNorm, buffers broadcast",
    "ddp-bn-nobuf": "torch DDP, BatchNorm, broadcast_buffers=False",
    "gradient_allreduce-bn": "bagua gradient_allreduce, BatchNorm, buffers broadcast",
    "gradient_allreduce-bn-nobuf": "bagua gradient_allreduce, BatchNorm, broadcast_buffers=False",
}


def format_gpu(job: dict[str, Any]) -> str:
    s = job["step_s"]
    lines = [f"== gpu: 1 rank, {job['backend']}, {job['device']}, MLP {job['mlp']} "
             f"({job['params'] / 1e6:.1f}M params), batch {job['batch']} ==",
             f"{'variant':<22} {'step ms':>9} {'x plain':>8} {'x ddp':>7}"]
    for n, t in s.items():
        lines.append(f"{n:<22} {t * 1e3:>9.3f} {t / s['plain']:>8.3f} {t / s['ddp']:>7.3f}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# tables
# --------------------------------------------------------------------------------------------


def _title(job: dict[str, Any]) -> str:
    how = "torchrun, Gloo over lo" if job["link"] == "loopback" else f"netns.py, tbf {job['rate']} per veth"
    if job.get("per_flow_rate"):
        how = (f"netns.py, {job['per_flow_rate']} per TCP connection under {job['rate']} per veth, "
               f"bagua streams={job.get('streams', 1)}")
    how += f", TCP {job.get('tcp_cc', '?')}"
    return (f"{job['setting']}: {job['world']} ranks ({how}), MLP {job['mlp']} = {job['params'] / 1e6:.2f}M params, "
            f"batch {job['batch']}/rank, {job['reps']}x{job['block']} timed steps/variant, {job['threads']} thread(s)/rank")


def format_job(job: dict[str, Any]) -> str:
    vs = job["variants"]
    ref = vs.get("ddp", {}).get("step_s")
    ref_e = vs.get("ddp", {}).get("epoch_s")
    head = (f"{'variant':<28} {'step ms':>9} {'p25..p75 ms':>15} {'x ddp':>6} {'epoch s':>8} {'ddp/this':>8} "
            f"{'sent B/step':>11} {'wire B/step':>11}")
    lines = [f"== {_title(job)} ==", head, "-" * len(head)]
    for name, r in vs.items():
        sent = fmt_bytes(r["ring_formula_per_step"]) + "*" if r["ring_formula_per_step"] else fmt_bytes(r["bagua_sent_per_step"])
        lines.append(
            f"{name:<28} {r['step_s'] * 1e3:>9.1f} {r['p25_s'] * 1e3:>7.1f}..{r['p75_s'] * 1e3:<7.1f} "
            f"{r['step_s'] / ref if ref else float('nan'):>6.3f} {r['epoch_s']:>8.2f} "
            f"{ref_e / r['epoch_s'] if ref_e else float('nan'):>7.2f}x {sent:>11} {fmt_bytes(r['wire_per_step']):>11}"
        )
    for name, why in job.get("diverged", {}).items():
        lines.append(f"{name:<28} DIVERGED, no timing: {why}")
    lines.append("(* torch DDP: ring formula 2(n-1)/n x gradient bytes, not measured by bagua; "
                 "epoch = sum of the timed blocks)")
    return "\n".join(lines)


def _paired_ratio(job: dict[str, Any], a: str, b: str) -> Optional[float]:
    """Median over repetitions of block(a) / block(b) (same repetition: close in time)."""
    vs = job["variants"]
    if a not in vs or b not in vs:
        return None
    return statistics.median(x / y for x, y in zip(vs[a]["blocks_s"], vs[b]["blocks_s"]))


def key_summary(jobs: list[dict[str, Any]], gpu: Optional[dict[str, Any]]) -> tuple[list[str], str, dict[str, Any]]:
    lines: list[str] = []
    key: dict[str, Any] = {}
    parts: list[str] = []
    loop = [j for j in jobs if j["link"] == "loopback"]
    if loop:
        j = loop[-1]
        vs = j["variants"]
        if "ddp" in vs and "gradient_allreduce" in vs:
            r = vs["gradient_allreduce"]["step_s"] / vs["ddp"]["step_s"]
            paired = _paired_ratio(j, "gradient_allreduce", "ddp")
            key["ga_over_ddp"] = r
            key["ga_over_ddp_paired"] = paired
            ok = "met" if r <= 1.02 else "NOT met"
            parts.append(f"loopback gradient_allreduce/DDP step {r:.3f} (paired blocks {paired:.3f}; target <=1.02: {ok})")
            for a, b in (("gradient_allreduce-10MB", "ddp"), ("gradient_allreduce", "ddp-10MB"),
                         ("gradient_allreduce-10MB", "ddp-10MB")):
                if a in vs and b in vs:
                    rr = vs[a]["step_s"] / vs[b]["step_s"]
                    key[f"{a}_over_{b}"] = rr
                    lines.append(f"  loopback {a}/{b} step time: {rr:.3f} (paired blocks {_paired_ratio(j, a, b):.3f})")
        if all(n in vs for n in BUFFER_VARIANTS):  # what broadcasting the buffers adds to a step
            for who in ("ddp", "gradient_allreduce"):
                extra = vs[f"{who}-bn"]["step_s"] - vs[f"{who}-bn-nobuf"]["step_s"]
                key[f"{who}_broadcast_buffers_ms"] = extra * 1e3
            ours, theirs = key["gradient_allreduce_broadcast_buffers_ms"], key["ddp_broadcast_buffers_ms"]
            lines.append(f"  loopback broadcast_buffers adds {ours:.2f} ms to a bagua step, {theirs:.2f} ms to a torch DDP step "
                         f"(BatchNorm model; bn/bn-nobuf paired: bagua {_paired_ratio(j, 'gradient_allreduce-bn', 'gradient_allreduce-bn-nobuf'):.3f}, "
                         f"torch {_paired_ratio(j, 'ddp-bn', 'ddp-bn-nobuf'):.3f})")
    for j in jobs:
        if j["link"] != "netns":
            continue
        vs = j["variants"]
        for name in vs:
            if name != "ddp" and "ddp" in vs:
                key[f"{j['setting']}_x{j['world']}_ddp_over_{name}"] = vs["ddp"]["epoch_s"] / vs[name]["epoch_s"]
        for a, b, target in (("qadam", "bytegrad", 1.10), ("qadam-overlap", "bytegrad", None),
                             ("qadam-nooverlap", "bytegrad", None), ("qadam", "bytegrad-adam", None),
                             ("bytegrad-adam", "bytegrad", None),
                             ("qadam-clip", "qadam-nooverlap-clip", 1.0), ("qadam1", "qadam", None)):
            if a in vs and b in vs:
                r = vs[a]["step_s"] / vs[b]["step_s"]
                key[f"{j['setting']}_x{j['world']}_{a}_over_{b}"] = r
                ok = "" if target is None else f" (target <= {target:.2f}: {'met' if r <= target else 'NOT met'})"
                lines.append(f"  {j['setting']} x{j['world']}: {a}/{b} step {r:.3f}, paired blocks "
                             f"{_paired_ratio(j, a, b):.3f}{ok}")
        if "ddp" in vs and "bytegrad" in vs:
            sp = vs["ddp"]["epoch_s"] / vs["bytegrad"]["epoch_s"]
            lines.append(f"  {j['setting']} x{j['world']}: DDP fp32 / bytegrad epoch time {sp:.2f}x; "
                         f"DDP fp32 / DDP fp16 {vs['ddp']['epoch_s'] / vs['ddp-fp16']['epoch_s']:.2f}x"
                         if "ddp-fp16" in vs else f"  {j['setting']}: DDP/bytegrad {sp:.2f}x")
            if j["rate"] == "100mbit" and j["world"] == 2:
                key[f"bytegrad_speedup_{j['setting']}"] = sp
                if j["setting"] != "100mbit":
                    parts.append(f"{j['setting']} (TCP {j.get('tcp_cc')}) DDP fp32/bytegrad epoch {sp:.2f}x")
            if j["setting"] == "100mbit" and j["world"] == 2:
                key["bytegrad_speedup_100mbit"] = sp
                ok = "met" if sp >= 3.0 else "NOT met"
                parts.append(f"100mbit DDP fp32/bytegrad epoch {sp:.2f}x (target >=3x: {ok})")
        for hook, native, target in (("ddp-bytegrad-hook", "bytegrad", 3.5), ("ddp-onebit-hook", "onebit_grad", 8.0)):
            if "ddp" in vs and hook in vs:
                sp = vs["ddp"]["epoch_s"] / vs[hook]["epoch_s"]
                key[f"{hook}_speedup_{j['setting']}_x{j['world']}"] = sp
                vs_native = ""
                if native in vs:
                    r = vs[hook]["epoch_s"] / vs[native]["epoch_s"]
                    key[f"{hook}_over_{native}_{j['setting']}_x{j['world']}"] = r
                    vs_native = f", {r:.3f}x bagua {native}'s epoch (target <= 1.05)" if hook.startswith("ddp-byte") \
                        else f", {r:.3f}x bagua {native}'s epoch"
                lines.append(f"  {j['setting']} x{j['world']}: DDP fp32 / {LABELS[hook]} epoch {sp:.2f}x{vs_native}")
                if j["setting"] == "100mbit":
                    parts.append(f"100mbit x{j['world']} DDP fp32/{hook} epoch {sp:.2f}x "
                                 f"(target >={target:g}x: {'met' if sp >= target else 'NOT met'})")
        if "ddp" in vs and "ddp-striped" in vs:
            sp = vs["ddp"]["epoch_s"] / vs["ddp-striped"]["epoch_s"]
            key[f"ddp_striped_speedup_{j['setting']}_x{j['world']}"] = sp
            if j.get("per_flow_rate"):
                verdict = f"target >=3x: {'met' if sp >= 3.0 else 'NOT met'}"
            else:  # no flow capped: striping must cost nothing
                verdict = f"target: striped within 3% of unstriped: {'met' if 1 / sp <= 1.03 else 'NOT met'}"
            lines.append(f"  {j['setting']} x{j['world']}: torch DDP fp32 Gloo / 'bagua' backend epoch {sp:.2f}x ({verdict})")
            parts.append(f"{j['setting']} x{j['world']} torch DDP Gloo/'bagua' backend epoch {sp:.2f}x ({verdict})")
        if "ddp" in vs and "onebit_grad" in vs:
            sp = vs["ddp"]["epoch_s"] / vs["onebit_grad"]["epoch_s"]
            compute = (f"; its step is {vs['local']['step_s'] / vs['onebit_grad']['step_s']:.0%} compute "
                       f"(no-communication step {vs['local']['step_s'] * 1e3:.0f} ms)") if "local" in vs else ""
            lines.append(f"  {j['setting']} x{j['world']}: DDP fp32 / onebit_grad epoch time {sp:.2f}x{compute}")
            key[f"onebit_speedup_{j['setting']}_x{j['world']}"] = sp
            if j["setting"] == "100mbit":
                parts.append(f"100mbit x{j['world']} DDP fp32/onebit_grad epoch {sp:.2f}x "
                             f"(target >=8x: {'met' if sp >= 8.0 else 'NOT met'})")
    for flow in sorted({j["per_flow_rate"] for j in jobs if j.get("per_flow_rate")}):
        by_streams = {j["streams"]: j["variants"] for j in jobs if j.get("per_flow_rate") == flow and j["world"] == 2}
        if 1 not in by_streams:
            continue
        for streams in sorted(k for k in by_streams if k > 1):
            for name in ("gradient_allreduce", "bytegrad"):
                if name in by_streams[1] and name in by_streams[streams]:
                    sp = by_streams[1][name]["epoch_s"] / by_streams[streams][name]["epoch_s"]
                    key[f"{name}_streams{streams}_speedup_{flow}_per_flow"] = sp
                    target = " (target >=3x: " + ("met" if sp >= 3.0 else "NOT met") + ")" \
                        if name == "gradient_allreduce" and streams == 8 else ""
                    parts.append(f"{flow}/flow {name} streams=1/streams={streams} epoch {sp:.2f}x{target}")
    if not any("100mbit" in p for p in parts):
        parts.append("100mbit bytegrad speedup: not measured")
    if gpu is not None:
        r = gpu["step_s"]["gradient_allreduce"] / gpu["step_s"]["ddp"]
        key["gpu_ga_over_ddp"] = r
        parts.append(f"gpu 1-rank gradient_allreduce/DDP step {r:.3f}")
    else:
        parts.append("gpu: blocked (no CUDA device)")
    return lines, "KEY: " + "; ".join(parts), key


# --------------------------------------------------------------------------------------------
# plot
# --------------------------------------------------------------------------------------------

COLORS = {
    "ddp": "black", "ddp-fp16": "dimgray", "gradient_allreduce": "tab:blue", "bytegrad": "tab:red",
    "decentralized": "tab:green", "low_precision_decentralized": "tab:olive", "async": "tab:purple",
    "qadam": "tab:orange", "ddp-10MB": "silver", "gradient_allreduce-10MB": "tab:cyan",
    "bytegrad-10MB": "tab:pink", "onebit_grad": "tab:brown", "local": "lightgray", "qadam1": "gold",
}


def _tick(job: dict[str, Any]) -> str:
    if job.get("per_flow_rate"):
        return f"{job['per_flow_rate']}/flow under {job['rate']}, streams={job['streams']}"
    return f"{job['rate']}, {job['world']} ranks, TCP {job.get('tcp_cc', '?')}"


def plot(jobs: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    net = [j for j in jobs if j["link"] == "netns"]
    if not net:
        return
    net.sort(key=lambda j: (j["world"], bool(j.get("per_flow_rate")), -(j.get("rate_bit") or 0), j["setting"]))
    names = [n for n in NETWORK_VARIANTS if any(n in j["variants"] for j in net)]
    fig, ax = plt.subplots(figsize=(max(8, 2.8 * len(net) + 2), 5.6))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        xs, ys = [], []
        for g, j in enumerate(net):
            if name in j["variants"]:
                xs.append(g - 0.4 + width * (i + 0.5))
                ys.append(j["variants"][name]["epoch_s"])
        bars = ax.bar(xs, ys, width, label=LABELS[name], color=COLORS[name])
        for b, y in zip(bars, ys):
            ax.text(b.get_x() + b.get_width() / 2, y, f"{y:.0f}" if y >= 10 else f"{y:.1f}",
                    ha="center", va="bottom", fontsize=6)
    ax.set_xticks(range(len(net)), [_tick(j) for j in net])
    ax.set_ylabel(f"epoch time, s ({net[0]['reps'] * net[0]['block']} steps)")
    ax.set_yscale("log")
    ax.set_title(f"Epoch time per algorithm vs bandwidth (lower is better)\nMLP {net[0]['params'] / 1e6:.1f}M "
                 f"params, batch {net[0]['batch']}/rank, Gloo on CPU, tbf-capped veth per rank", fontsize=10)
    ax.grid(True, axis="y", which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.1))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
