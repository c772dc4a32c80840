#!/usr/bin/env python3
"""Allreduce bus bandwidth: raw torch.distributed vs bagua.comm (checked, unchecked, compressed).

For fp32 tensors of 4KB, 64KB, 1MB, 16MB and 64MB, every rank times five variants of one
allreduce, interleaved within each repetition (A B C D E, then B C D E A, ...) so that drifts in
machine load hit them alike:

==============  =================================================================================
torch           ``torch.distributed.all_reduce(t)`` (SUM): the yardstick
bagua           ``bagua.comm.allreduce(t, op=SUM)`` with the default cross-rank agreement check
bagua-nocheck   the same with the check off (``init_process_group(check_collectives=False)``)
fp16            ``bagua.comm.allreduce(t, op=AVG, compression="fp16")`` (check on, the default)
uint8           ``bagua.comm.allreduce(t, op=AVG, compression="minmax_uint8")`` (check on)
==============  =================================================================================

Each timed block starts with a barrier and runs k calls (k and the number of repetitions adapt
to the measured call time, so slow links get few calls); a rank's time is the median over the
repetitions of block time / k, and the job's time is the max over ranks of that median. Bus
bandwidth follows nccl-tests: ``algbw = bytes / time``, ``busbw = algbw * 2 (n-1) / n``, always
with the fp32 byte count, so compressed variants show the effective speed the caller gets.
"sent B/call" is ``bagua.comm.bytes_sent()``'s delta per call (bagua's own count; torch's calls
are invisible to it); "wire B/call" is what actually left the rank's network interface (TCP/IP
headers and ACKs included), read from ``/sys/class/net/<if>/statistics/tx_bytes`` in the shaped
settings, where every rank has its own interface.

Settings (the driver, the default mode, launches one worker job per setting):

- loopback, 2 and 4 ranks: ``torchrun --standalone`` on this machine, Gloo over ``lo``;
- 1gbit and 100mbit, 2 and 4 ranks: the emulated network (``benchmarks.network``), every rank in
  its own network namespace behind a tbf-capped veth link (needs root and iproute2; skipped with a warning
  otherwise). Sizes whose uncompressed allreduce would take longer than ``--max-call-s`` at the
  link rate are skipped unless ``--sizes`` names them (64MB at 100mbit takes ~5 s a call).

Usage (from the repository root)::

    python -m benchmarks.comm.allreduce                        # everything, ~5-8 min
    python -m benchmarks.comm.allreduce --ranks 2 --rates 100mbit --sizes 16MB 64MB --repeat 2
    python -m benchmarks.comm.allreduce --rates --out .bench/comm.json   # loopback only, JSON of results
    torchrun --standalone --nproc-per-node 2 -m benchmarks.comm.allreduce --worker   # one job by hand

The last line printed is the key ratios: uncompressed bagua / raw torch bus bandwidth at >= 16MB
(worst over settings; target >= 0.95) and, at 100mbit, the speedup of minmax_uint8 over
uncompressed bagua at >= 16MB (worst over sizes and rank counts; target >= 3x). Record results
in benchmarks/RESULTS.md (date, machine); the plot goes to benchmarks/figures/comm_busbw.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from benchmarks.comm.allreduce_report import (VARIANT_HELP, VARIANTS, busbw, fmt_size, format_job, key_summary,
                                              merge_repeats, plot)
from benchmarks.jobs import emulated, loopback, run_job, worker
from benchmarks.network import parse_rate, rank_tcp_cc, requirements_problem, tx_bytes_reader
from benchmarks.records import FIGURES, add_run_options, finish_run, quantile

logger = logging.getLogger("benchmarks.comm.allreduce")

MODULE = "benchmarks.comm.allreduce"
DEFAULT_SIZES = (4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20)
JSON_TAG = "@@bagua-comm-bench@@ "  # workers print one line "<tag><json>" per job on rank 0
DEFAULT_PLOT = FIGURES / "comm_busbw.png"

# timing knobs (all ranks derive the same values from max-reduced estimates)
_TARGET_BLOCK_S = 0.025  # a timed block runs >= this long (k calls of a fast op)
_MAX_CALLS_PER_BLOCK = 50  # SUM grows values by n per call: 4**50 stays finite in fp32
_SLOW_CALL_S = 0.2  # ops slower than this are estimated from their single warmup call


# --------------------------------------------------------------------------------------------
# sizes and formatting
# --------------------------------------------------------------------------------------------

_UNITS = {"B": 1, "KB": 1 << 10, "K": 1 << 10, "MB": 1 << 20, "M": 1 << 20, "GB": 1 << 30, "G": 1 << 30}


def parse_size(text: str) -> int:
    """``"16MB" -> 16777216`` (binary units, as the table prints them); a bare number is bytes."""
    s = text.strip().upper().replace("IB", "B")
    num = s.rstrip("KMGB")
    unit = s[len(num):] or "B"
    try:
        value = int(float(num) * _UNITS[unit])
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"size must look like 4KB, 64KB, 1MB, 16MB; got {text!r}") from None
    if value < 4 or value % 4:
        raise argparse.ArgumentTypeError(f"size must be a positive multiple of 4 bytes (fp32), got {text!r}")
    return value




# --------------------------------------------------------------------------------------------
# worker: one process per rank
# --------------------------------------------------------------------------------------------


def _set_checks(enabled: bool) -> None:
    """Turn bagua's cross-rank agreement check on or off in this process.

    bagua only offers the switch at ``init_process_group(check_collectives=...)``; to interleave
    checked and unchecked calls in one job we flip the flag in its (frozen) state object.
    """
    from bagua.comm import process_group as pgmod

    state = getattr(pgmod, "_state", None)
    if state is None or not hasattr(state, "check_collectives"):
        raise RuntimeError(
            "benchmarks.comm.allreduce toggles bagua.comm.process_group._state.check_collectives to time "
            "checked and unchecked calls in one job, and that field is gone; update _set_checks()"
        )
    if state.check_collectives != enabled:
        pgmod._state = dataclasses.replace(state, check_collectives=enabled)


def run_worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    import bagua

    torch.set_num_threads(1)
    tcp_cc = rank_tcp_cc(args.tcp_cc, args.link == "netns")  # before Gloo connects
    bagua.init_process_group(check_collectives=True)
    rank, world = bagua.get_rank(), bagua.get_world_size()
    SUM, AVG = bagua.comm.ReduceOp.SUM, bagua.comm.ReduceOp.AVG
    tx_bytes = tx_bytes_reader()
    variants = [v for v in VARIANTS if v in args.variants]

    def max_over_ranks(values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    def ops_for(t: torch.Tensor) -> dict[str, Any]:
        return {
            "torch": lambda: dist.all_reduce(t),
            "bagua": lambda: bagua.comm.allreduce(t, op=SUM),
            "bagua-nocheck": lambda: bagua.comm.allreduce(t, op=SUM),
            "fp16": lambda: bagua.comm.allreduce(t, op=AVG, compression="fp16"),
            "uint8": lambda: bagua.comm.allreduce(t, op=AVG, compression="minmax_uint8"),
        }

    def timed(op, k: int) -> float:
        t0 = time.perf_counter()
        for _ in range(k):
            op()
        return time.perf_counter() - t0

    results: list[dict[str, Any]] = []
    t_start = time.monotonic()
    for nbytes in args.sizes:
        numel = nbytes // 4
        g = torch.Generator().manual_seed(1000 + rank)
        src = torch.randn(numel, generator=g)
        t = src.clone()
        ops = ops_for(t)

        def prepare(v: str) -> None:
            t.copy_(src)  # SUM grows the values by `world` per call: start each block afresh
            _set_checks(v != "bagua-nocheck")
            dist.barrier()

        # warmup: one call each (its time is the estimate for slow ops), then 3 more for fast ones
        est = []
        for v in variants:
            prepare(v)
            est.append(timed(ops[v], 1))
        est = max_over_ranks(est)
        fast = [i for i, e in enumerate(est) if e < _SLOW_CALL_S]
        if fast:
            more = [0.0] * len(variants)
            for i in fast:
                prepare(variants[i])
                more[i] = timed(ops[variants[i]], 3) / 3
            more = max_over_ranks(more)
            for i in fast:
                est[i] = more[i]
        calls = [max(1, min(_MAX_CALLS_PER_BLOCK, math.ceil(_TARGET_BLOCK_S / max(e, 1e-7)))) for e in est]
        rep_s = sum(k * e for k, e in zip(calls, est)) + 0.002 * len(variants)
        reps = max(args.min_reps, min(args.max_reps, int(args.seconds_per_size / rep_s)))

        times: dict[str, list[float]] = {v: [] for v in variants}
        sent: dict[str, list[float]] = {v: [] for v in variants}
        wire: dict[str, list[float]] = {v: [] for v in variants}
        for r in range(reps):
            for j in range(len(variants)):
                i = (r + j) % len(variants)  # rotate the order: every variant takes every slot
                v, k = variants[i], calls[i]
                prepare(v)
                b0 = bagua.comm.bytes_sent()
                w0 = tx_bytes() if tx_bytes else 0
                dt = timed(ops[v], k)
                b1 = bagua.comm.bytes_sent()
                times[v].append(dt / k)
                sent[v].append((b1 - b0) / k)
                if tx_bytes:
                    dist.barrier()  # let the block's last segments leave the qdisc (tiny traffic)
                    wire[v].append((tx_bytes() - w0) / k)
        _set_checks(True)

        local = []
        for v in variants:
            s = sorted(times[v])
            local += [statistics.median(s), quantile(s, 0.25), quantile(s, 0.75), s[0], s[-1],
                      statistics.median(wire[v]) if wire[v] else -1.0, max(sent[v])]
        agg = max_over_ranks(local)
        row: dict[str, Any] = {"bytes": nbytes, "reps": reps, "variants": {}}
        for i, v in enumerate(variants):
            med, p25, p75, lo, hi, w, b = agg[7 * i: 7 * i + 7]
            row["variants"][v] = {
                "time_s": med, "p25_s": p25, "p75_s": p75, "min_s": lo, "max_s": hi,
                "calls_per_block": calls[i],
                "busbw_Bps": busbw(nbytes, med, world),
                "bytes_sent_per_call": b if v != "torch" else None,
                "wire_bytes_per_call": w if w >= 0 else None,
            }
        results.append(row)
        if rank == 0:
            print(f"[{args.setting}] {fmt_size(nbytes)}: {reps} reps, calls/block "
                  f"{dict(zip(variants, calls))}, {time.monotonic() - t_start:.0f}s so far", flush=True)

    if rank == 0:
        job = {
            "setting": args.setting, "link": args.link, "rate": args.rate, "world": world,
            "backend": str(dist.get_backend()), "torch": torch.__version__, "tcp_cc": tcp_cc,
            "threads": torch.get_num_threads(), "elapsed_s": time.monotonic() - t_start,
            "results": results,
        }
        print(format_job(job), flush=True)
        print(JSON_TAG + json.dumps(job), flush=True)
    dist.barrier()
    bagua.destroy_process_group()
    return 0


# --------------------------------------------------------------------------------------------
# driver
# --------------------------------------------------------------------------------------------


def _rate_bits(rate: str) -> int:
    bits = parse_rate(rate)
    if bits is None:
        raise ValueError(f"--rates needs capped rates like 100mbit, got {rate!r}")
    return bits


def _worker_args(args: argparse.Namespace, setting: str, link: str, rate: Optional[str], sizes: Sequence[int]) -> list[str]:
    out = [MODULE, "--worker", "--setting", setting, "--link", link,
           "--sizes", *[str(s) for s in sizes], "--seconds-per-size", str(args.seconds_per_size),
           "--min-reps", str(args.min_reps), "--max-reps", str(args.max_reps),
           "--variants", *args.variants]
    if rate:
        out += ["--rate", rate]
        if args.tcp_cc:
            out += ["--tcp-cc", args.tcp_cc]
    return out


def run_driver(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="comm-bench: %(levelname)s %(message)s")
    plans: list[tuple[str, str, Optional[str], int, list[str]]] = []  # setting, link, rate, world, cmd
    for world in args.ranks:
        sizes = list(args.sizes or DEFAULT_SIZES)
        cmd = loopback(world, worker(*_worker_args(args, "loopback", "loopback", None, sizes)))
        plans.append(("loopback", "loopback", None, world, cmd))
    if args.rates:
        problem = requirements_problem()
        if problem:
            logger.warning("skipping the bandwidth-capped settings %s: %s", " ".join(args.rates), problem)
        else:
            for rate in args.rates:
                bits = _rate_bits(rate)
                for world in args.netns_ranks:
                    if args.sizes:
                        sizes = list(args.sizes)
                    else:  # drop sizes whose fp32 allreduce alone would exceed --max-call-s
                        sizes = [s for s in DEFAULT_SIZES
                                 if 2 * (world - 1) / world * s * 8 / bits <= args.max_call_s]
                        dropped = [fmt_size(s) for s in DEFAULT_SIZES if s not in sizes]
                        if dropped:
                            logger.info("%s x%d: skipping %s (> %.1f s per fp32 allreduce at the link "
                                        "rate; name them in --sizes to run them)",
                                        rate, world, " ".join(dropped), args.max_call_s)
                    setting = f"{rate}-{args.tcp_cc}" if args.tcp_cc else rate
                    cmd = emulated(worker(*_worker_args(args, setting, "netns", rate, sizes)),
                                   "--ranks", str(world), "--rate", rate, "--timeout", str(args.timeout))
                    plans.append((setting, "netns", rate, world, cmd))

    t0 = time.monotonic()
    jobs: list[dict[str, Any]] = []
    failed: list[str] = []
    for rnd in range(args.repeat):
        for setting, link, rate, world, cmd in plans:
            print(f"\n### round {rnd + 1}/{args.repeat}: {setting} x{world} "
                  f"({time.monotonic() - t0:.0f}s elapsed)", flush=True)
            job = run_job(cmd, args.timeout + 60, JSON_TAG, logger)
            if job is None:
                failed.append(f"{setting} x{world} (round {rnd + 1})")
                continue
            if rate:
                job["rate_bit"] = _rate_bits(rate)
            job["round"] = rnd
            jobs.append(job)
    return report(jobs, args, failed, time.monotonic() - t0)


def report(jobs: list[dict[str, Any]], args: argparse.Namespace, failed: Sequence[str], elapsed: float) -> int:
    if not jobs:
        print("no results", file=sys.stderr)
        return 1
    merged = merge_repeats(jobs)
    print("\n" + "=" * 100)
    print("Allreduce bus bandwidth, fp32 bytes; median over repetitions, max over ranks"
          + (f", median over {args.repeat} rounds" if args.repeat > 1 else "")
          + f"; {elapsed:.0f}s total")
    for v in VARIANTS:
        print(f"  {v:<13} {VARIANT_HELP[v]}")
    for job in merged:
        print()
        print(format_job(job))
    lines, key_line, key = key_summary(merged)
    status = finish_run(args.out, elapsed, failed, key, None if args.no_plot else lambda path: plot(merged, path),
                        args.plot, jobs=jobs, merged=merged)
    print()
    print("\n".join(lines))
    print(key_line)
    return status


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=f"python -m {MODULE}", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"examples:\n  python -m {MODULE}\n"
               f"  python -m {MODULE} --ranks 2 --rates 100mbit --netns-ranks 2 --sizes 16MB 64MB --repeat 2",
    )
    p.add_argument("--worker", action="store_true", help="run as one rank (under torchrun or the emulated network)")
    p.add_argument("--sizes", nargs="+", type=parse_size, default=None,
                   help="fp32 sizes in bytes, e.g. 4KB 64KB 1MB 16MB 64MB (the default); given "
                        "explicitly, every setting runs all of them")
    p.add_argument("--ranks", nargs="*", type=int, default=[2, 4], help="loopback rank counts (default 2 4)")
    p.add_argument("--rates", nargs="*", default=["1gbit", "100mbit"],
                   help="capped link rates, on the emulated network (default 1gbit 100mbit; none: skip)")
    p.add_argument("--netns-ranks", nargs="+", type=int, default=[2, 4],
                   help="rank counts for the capped settings (default 2 4)")
    p.add_argument("--max-call-s", type=float, default=3.0,
                   help="without --sizes, skip sizes whose fp32 allreduce takes longer than this at "
                        "the link rate (default 3 s: drops 64MB at 100mbit)")
    p.add_argument("--seconds-per-size", type=float, default=4.0,
                   help="time budget per size for all variants together (default 4); at least "
                        "--min-reps repetitions run regardless")
    p.add_argument("--min-reps", type=int, default=3, help="repetitions at least (default 3)")
    p.add_argument("--max-reps", type=int, default=25, help="repetitions at most (default 25)")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS,
                   help="variants to time (default all)")
    p.add_argument("--repeat", type=int, default=1,
                   help="rounds of all settings; tables show the median over rounds and the key "
                        "comparisons every round's value (default 1)")
    add_run_options(p, 900.0, DEFAULT_PLOT, "tables and plot (every round's results, pooled)")
    p.add_argument("--tcp-cc", default=None, metavar="NAME",
                   help="capped settings only: TCP congestion control to use inside the ranks' "
                        "namespaces (e.g. reno; the kernel must allow it there); default: the "
                        "harness's (cubic, benchmarks/network; an investigation knob: see RESULTS.md)")
    # worker-only
    p.add_argument("--setting", default="loopback", help=argparse.SUPPRESS)
    p.add_argument("--link", default="loopback", choices=["loopback", "netns"], help=argparse.SUPPRESS)
    p.add_argument("--rate", default=None, help=argparse.SUPPRESS)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    if args.min_reps < 1 or args.max_reps < args.min_reps:
        raise SystemExit("need 1 <= --min-reps <= --max-reps")
    if args.worker:
        if args.sizes is None:
            args.sizes = list(DEFAULT_SIZES)
        return run_worker(args)
    if args.from_json:
        jobs: list[dict[str, Any]] = []
        for path in args.from_json:
            data = json.loads(Path(path).read_text())
            jobs += data["jobs"]
        rounds = max(1, max(sum(1 for j in jobs if j["setting"] == s["setting"] and j["world"] == s["world"])
                            for s in jobs))
        args.repeat = rounds
        return report(jobs, args, [], sum(j.get("elapsed_s", 0) for j in jobs))
    return run_driver(args)


if __name__ == "__main__":
    sys.exit(main())
