"""The report side of ``allreduce.py``: the variants, the per-setting tables, the key comparisons
at >= 16MB and the bus-bandwidth plot (also for runs read back with ``allreduce.py --from-json``).

Example::

    merged = merge_repeats(jobs); print(format_job(merged[0])); lines, key_line, key = key_summary(merged)
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any, Optional

from benchmarks.records import fmt_bytes

KEY_MIN_BYTES = 16 << 20
VARIANTS = ("torch", "bagua", "bagua-nocheck", "fp16", "uint8")
VARIANT_HELP = {
    "torch": "torch.distributed.all_reduce(t), SUM",
    "bagua": "bagua.comm.allreduce(t, op=SUM), agreement check on (default)",
    "bagua-nocheck": "bagua.comm.allreduce(t, op=SUM), check_collectives=False",
    "fp16": "bagua.comm.allreduce(t, op=AVG, compression='fp16')",
    "uint8": "bagua.comm.allreduce(t, op=AVG, compression='minmax_uint8')",
}


def fmt_size(n: int) -> str:
    for unit, mult in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= mult and n % mult == 0:
            return f"{n // mult}{unit}"
    return f"{n}B"


def busbw(nbytes: int, seconds: float, world: int) -> float:
    """nccl-tests bus bandwidth in bytes/s: (bytes / time) * 2 (n-1) / n."""
    return nbytes / seconds * 2 * (world - 1) / world


def _setting_title(job: dict[str, Any]) -> str:
    how = "torchrun, Gloo over lo" if job["link"] == "loopback" else f"netns.py, tbf {job['rate']} per veth"
    how += f", TCP {job.get('tcp_cc', '?')}"
    return f"{job['setting']}: {job['world']} ranks ({how})"


def format_job(job: dict[str, Any]) -> str:
    """One setting's table: a row per size and variant."""
    world = job["world"]
    head = (f"{'size':>6}  {'variant':<13} {'time ms':>10} {'busbw MB/s':>10} {'x torch':>7} "
            f"{'sent B/call':>11} {'wire B/call':>11}")
    lines = [f"== {_setting_title(job)} ==", head, "-" * len(head)]
    for row in job["results"]:
        n = row["bytes"]
        vs = row["variants"]
        ref = vs.get("torch", {}).get("time_s")
        for j, (v, r) in enumerate(vs.items()):
            ratio = f"{ref / r['time_s']:.2f}" if ref else "-"
            sent = r["bytes_sent_per_call"]
            if v == "torch":  # invisible to bagua's counter: show the ring formula instead
                sent_s = fmt_bytes(2 * (world - 1) / world * n) + "*"
            else:
                sent_s = fmt_bytes(sent)
            lines.append(
                f"{fmt_size(n) if j == 0 else '':>6}  {v:<13} {r['time_s'] * 1e3:>10.3f} "
                f"{busbw(n, r['time_s'], world) / 1e6:>10.1f} {ratio:>7} {sent_s:>11} "
                f"{fmt_bytes(r['wire_bytes_per_call']):>11}"
            )
    lines.append("x torch: torch time / variant time (>1: faster). * torch is not counted by "
                 "bagua.comm.bytes_sent(); ring formula 2(n-1)/n*bytes shown.")
    return "\n".join(lines)


def merge_repeats(jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Jobs of the same setting from several rounds -> one job whose times are the median over
    rounds (per size and variant); each variant keeps the per-round times in ``rounds_s``."""
    by_setting: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for job in jobs:
        by_setting.setdefault((job["setting"], job["world"]), []).append(job)
    merged = []
    for group in by_setting.values():
        base = json.loads(json.dumps(group[0]))
        base["rounds"] = len(group)
        for row in base["results"]:
            for v, r in row["variants"].items():
                per_round = [
                    rr["variants"][v]["time_s"]
                    for job in group for rr in job["results"]
                    if rr["bytes"] == row["bytes"] and v in rr["variants"]
                ]
                r["rounds_s"] = per_round
                r["time_s"] = statistics.median(per_round)
                r["busbw_Bps"] = busbw(row["bytes"], r["time_s"], base["world"])
        merged.append(base)
    return merged


def _ratio(job: dict[str, Any], nbytes: int, num: str, den: str, times: Optional[int] = None) -> Optional[float]:
    """time(den) / time(num) at one size: bandwidth ratio of `num` over `den` (>1: num faster)."""
    for row in job["results"]:
        if row["bytes"] == nbytes and num in row["variants"] and den in row["variants"]:
            a, b = row["variants"][num], row["variants"][den]
            if times is not None:
                return b["rounds_s"][times] / a["rounds_s"][times]
            return b["time_s"] / a["time_s"]
    return None


class _Worst:
    """The worst (lowest) of one key ratio over settings and sizes, with every round's value."""

    def __init__(self, label: str, target: float, digits: int, unit: str = "") -> None:
        self.label, self.target, self.digits, self.unit = label, target, digits, unit
        self.value: Optional[float] = None
        self.where = ""
        self.rounds: list[float] = []

    def add(self, job: dict[str, Any], nbytes: int, num: str, den: str) -> None:
        value = _ratio(job, nbytes, num, den)
        if value is None:
            return
        rounds = job.get("rounds", 1)
        self.rounds += [_ratio(job, nbytes, num, den, times=i) for i in range(rounds)] if rounds > 1 else [value]
        if self.value is None or value < self.value:
            self.value, self.where = value, f"{job['setting']} x{job['world']} {fmt_size(nbytes)}"

    def summary(self) -> str:
        if self.value is None:
            return f"{self.label}: not measured"
        d = self.digits
        ok = "met" if self.value >= self.target else "NOT met"
        spread = f", all rounds {min(self.rounds):.{d}f}..{max(self.rounds):.{d}f}" if len(self.rounds) > 1 else ""
        return f"{self.label} worst {self.value:.{d}f}{self.unit} ({self.where}{spread}; target >={self.target:g}{self.unit}: {ok})"


def key_summary(merged: list[dict[str, Any]]) -> tuple[list[str], str, dict[str, Any]]:
    """The 16MB+ comparisons (with per-round spread) and the final key line."""
    lines = ["== key comparisons at >= 16MB (bus bandwidth ratios; per-round values in brackets) ==",
             f"{'setting':<22} {'size':>6} {'bagua/torch':>22} {'nocheck/torch':>22} {'uint8/bagua':>22} {'fp16/bagua':>22}"]
    bagua_torch = _Worst("bagua/torch busbw >=16MB", 0.95, 3)
    uint8_speedup = _Worst("100mbit uint8/fp32 bagua speedup >=16MB", 3.0, 2, unit="x")
    for job in merged:
        rounds = job.get("rounds", 1)
        for row in job["results"]:
            n = row["bytes"]
            if n < KEY_MIN_BYTES:
                continue
            cells = []
            for num, den in (("bagua", "torch"), ("bagua-nocheck", "torch"), ("uint8", "bagua"), ("fp16", "bagua")):
                med = _ratio(job, n, num, den)
                if med is None:
                    cells.append("-")
                    continue
                per = [_ratio(job, n, num, den, times=i) for i in range(rounds)] if rounds > 1 else []
                cells.append(f"{med:.3f}" + (" [" + " ".join(f"{p:.2f}" for p in per) + "]" if per else ""))
            lines.append(f"{job['setting'] + ' x' + str(job['world']):<22} {fmt_size(n):>6} " +
                         " ".join(f"{c:>22}" for c in cells))
            bagua_torch.add(job, n, "bagua", "torch")
            if job["link"] == "netns" and job["rate"] == "100mbit":
                uint8_speedup.add(job, n, "uint8", "bagua")
    key = {"bagua_over_torch_worst": bagua_torch.value, "bagua_over_torch_where": bagua_torch.where,
           "bagua_over_torch_all": bagua_torch.rounds, "uint8_speedup_100mbit_worst": uint8_speedup.value,
           "uint8_speedup_100mbit_where": uint8_speedup.where, "uint8_speedup_100mbit_all": uint8_speedup.rounds}
    return lines, f"KEY: {bagua_torch.summary()}; {uint8_speedup.summary()}", key


# --------------------------------------------------------------------------------------------
# plot
# --------------------------------------------------------------------------------------------

_STYLE = {
    "torch": dict(color="black", marker="o", linestyle="-"),
    "bagua": dict(color="tab:blue", marker="s", linestyle="--"),
    "bagua-nocheck": dict(color="tab:cyan", marker="x", linestyle=":"),
    "fp16": dict(color="tab:orange", marker="^", linestyle="-"),
    "uint8": dict(color="tab:red", marker="v", linestyle="-"),
}


def plot(merged: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    links = []
    for job in merged:
        if job["setting"] not in links:
            links.append(job["setting"])
    worlds = sorted({job["world"] for job in merged})
    fig, axes = plt.subplots(len(worlds), len(links), figsize=(5.2 * len(links), 4.2 * len(worlds)),
                             squeeze=False)
    for r, world in enumerate(worlds):
        for c, setting in enumerate(links):
            ax = axes[r][c]
            job = next((j for j in merged if j["setting"] == setting and j["world"] == world), None)
            if job is None:
                ax.set_visible(False)
                continue
            for v in VARIANTS:
                pts = [(row["bytes"], busbw(row["bytes"], row["variants"][v]["time_s"], world) / 1e6)
                       for row in job["results"] if v in row["variants"]]
                if pts:
                    xs, ys = zip(*pts)
                    ax.plot(xs, ys, label=v, markersize=5, **_STYLE[v])
            if job["link"] == "netns" and job.get("rate_bit"):
                ax.axhline(job["rate_bit"] / 8e6, color="gray", linewidth=1, linestyle="-.",
                           label=f"link {job['rate']}")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            sizes = [row["bytes"] for row in job["results"]]
            ax.set_xticks(sizes, [fmt_size(s) for s in sizes])
            ax.minorticks_off()
            ax.set_title(f"{setting}, {world} ranks")
            ax.set_xlabel("allreduce size (fp32 bytes)")
            ax.set_ylabel("bus bandwidth, MB/s (fp32 bytes)")
            ax.grid(True, which="major", alpha=0.3)
            ax.legend(fontsize=8, loc="upper left")
    fig.suptitle("Allreduce bus bandwidth (nccl-tests busbw), Gloo on CPU; higher is better", fontsize=12)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
