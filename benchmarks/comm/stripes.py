#!/usr/bin/env python3
"""Striped collectives (``bagua.init_process_group(streams=K)``): allreduce time, streams=K vs 1.

Settings (2 ranks; every setting runs one job per streams value, the jobs alternating, repeated
``--repeat`` times; the time of a size is the median over calls, max over ranks, then the median
over repetitions):

- ``perflow``: the emulated network at ``--rate 1gbit --per-flow-rate 250mbit``: each TCP
  connection capped at 250 Mbit/s under a 1 Gbit/s link, as clouds cap a single flow. Targets (64 MB fp32): exact
  allreduce streams=4 >= 3.0x faster than streams=1; the uint8 compressed allreduce >= 1.5x.
- ``loopback``, ``1gbit``, ``100mbit`` (tbf): no regression, streams=4 <= 1.05x the time of
  streams=1 from 1 MB to 64 MB; below ``BAGUA_NET_MIN_CHUNKSIZE`` (1 MiB) a call is one
  operation either way.

Usage (from the repository root)::

    python -m benchmarks.comm.stripes                             # every setting (~10 min)
    python -m benchmarks.comm.stripes --settings perflow --repeat 2
    python -m benchmarks.comm.stripes --settings loopback --sizes 1MB 16MB

The last line printed is the key ratios (streams=1 time / streams=K time).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from typing import Any, Optional, Sequence

from benchmarks.comm.allreduce import parse_size
from benchmarks.comm.allreduce_report import fmt_size
from benchmarks.jobs import emulated, loopback, run_job, worker
from benchmarks.network import requirements_problem
from benchmarks.records import save_run

JSON_TAG = "@@stripes@@ "
SETTINGS = {  # name: the emulated network's flags (None: loopback under torchrun)
    "perflow": ["--rate", "1gbit", "--per-flow-rate", "250mbit"],
    "loopback": None,
    "1gbit": ["--rate", "1gbit"],
    "100mbit": ["--rate", "100mbit"],
}
logger = logging.getLogger("stripes-bench")


def run_worker(args: argparse.Namespace) -> int:
    """One rank: time exact and uint8-compressed allreduces of each size."""
    import torch

    import bagua

    torch.set_num_threads(1)
    bagua.init_process_group(streams=args.streams)
    results: dict[str, dict[str, float]] = {}
    for size in args.sizes:
        t = torch.ones(parse_size(size) // 4)
        for kind in args.kinds:
            compression = {"exact": None, "uint8": "minmax_uint8"}[kind]
            times = []
            for i in range(args.calls + 1):
                bagua.comm.barrier()
                start = time.perf_counter()
                bagua.comm.allreduce(t, op="avg", compression=compression)
                if i:  # the first call warms the connections up
                    times.append(time.perf_counter() - start)
            mine = statistics.median(times)
            worst = bagua.comm.allgather_object(mine)
            results.setdefault(size, {})[kind] = max(worst)
    if bagua.get_rank() == 0:
        print(JSON_TAG + json.dumps({"setting": args.setting, "streams": args.streams, "times": results}), flush=True)
    bagua.destroy_process_group()
    return 0


def _command(setting: str, streams: int, args: argparse.Namespace) -> list[str]:
    command = worker("benchmarks.comm.stripes", "--worker", "--setting", setting, "--streams", streams,
                     "--calls", args.calls, "--sizes", *args.sizes, "--kinds", *args.kinds)
    flags = SETTINGS[setting]
    if flags is None:
        return loopback(2, command)
    return emulated(command, "--ranks", "2", *flags)


def run_driver(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="stripes-bench: %(levelname)s %(message)s")
    t0 = time.monotonic()
    netted = [s for s in args.settings if SETTINGS[s] is not None]
    problem = requirements_problem() if netted else None
    if problem:
        logger.warning("skipping %s: %s", " ".join(netted), problem)
        args.settings = [s for s in args.settings if s not in netted]
    jobs: list[dict[str, Any]] = []
    failed: list[str] = []
    for repeat in range(args.repeat):
        for setting in args.settings:
            order = [1, args.streams] if repeat % 2 == 0 else [args.streams, 1]
            for streams in order:
                print(f"\n### {setting} streams={streams} repeat {repeat + 1} ({time.monotonic() - t0:.0f}s)", flush=True)
                job = run_job(_command(setting, streams, args), args.timeout, JSON_TAG, logger)
                (jobs.append(job) if job else failed.append(f"{setting} streams={streams}"))
    key = report(jobs, args)
    if args.out:
        save_run(args.out, time.monotonic() - t0, failed, key, jobs=jobs)
    return 0 if not failed else 1


def _median_time(jobs: list[dict[str, Any]], setting: str, streams: int, size: str, kind: str) -> Optional[float]:
    values = [j["times"][size][kind] for j in jobs
              if j["setting"] == setting and j["streams"] == streams and kind in j["times"].get(size, {})]
    return statistics.median(values) if values else None


def report(jobs: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    key: dict[str, Any] = {}
    parts = []
    print("\n" + "=" * 90)
    print(f"allreduce time, 2 ranks, median over calls (max over ranks) and over repetitions; "
          f"ratio = streams=1 / streams={args.streams}")
    print(f"{'setting':<10} {'size':>7} {'kind':>6} {'streams=1 ms':>13} {f'streams={args.streams} ms':>13} {'ratio':>7}")
    for setting in args.settings:
        for size in args.sizes:
            for kind in ("exact", "uint8"):
                one = _median_time(jobs, setting, 1, size, kind)
                many = _median_time(jobs, setting, args.streams, size, kind)
                if one is None or many is None:
                    continue
                ratio = one / many
                key[f"{setting}_{size}_{kind}"] = ratio
                print(f"{setting:<10} {fmt_size(parse_size(size)):>7} {kind:>6} {one * 1e3:>13.1f} {many * 1e3:>13.1f} "
                      f"{ratio:>6.2f}x")
    for kind, target in (("exact", 3.0), ("uint8", 1.5)):
        ratio = key.get(f"perflow_64MB_{kind}")
        if ratio is not None:
            parts.append(f"per-flow 250mbit/1gbit 64MB {kind} {ratio:.2f}x (target >={target}x: "
                         f"{'met' if ratio >= target else 'NOT met'})")
    for setting in ("loopback", "1gbit", "100mbit"):
        ratios = [key[f"{setting}_{size}_exact"] for size in args.sizes  # the range: 1 MB and up
                  if parse_size(size) >= 1 << 20 and f"{setting}_{size}_exact" in key]
        if ratios:
            worst = min(ratios)
            parts.append(f"{setting} worst streams={args.streams} time {1 / worst:.3f}x of streams=1 "
                         f"(target <=1.05: {'met' if 1 / worst <= 1.05 else 'NOT met'})")
    print("KEY: " + ("; ".join(parts) or "nothing measured"))
    return key


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.split("\n\n")[0])
    p.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
    p.add_argument("--streams", type=int, default=4, help="K compared with 1 (default 4); worker: this job's")
    p.add_argument("--sizes", nargs="+", default=["512KB", "1MB", "16MB", "64MB"])
    p.add_argument("--calls", type=int, default=5, help="timed calls per size (default 5)")
    p.add_argument("--repeat", type=int, default=2, help="jobs per setting and streams value (default 2)")
    p.add_argument("--kinds", nargs="+", choices=["exact", "uint8"], default=["exact", "uint8"],
                   help="exact and/or the uint8-compressed allreduce (default both)")
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--setting", default="loopback", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    return run_worker(args) if args.worker else run_driver(args)


if __name__ == "__main__":
    sys.exit(main())
