#!/usr/bin/env python3
"""Every benchmark once, at its smallest, to show that none has gone stale: not a measurement.

Each script runs with tiny models and one repetition in a scratch copy of the checked-out files
(tracked and untracked, not ignored), so nothing in this tree changes: no figure, no results JSON,
no RESULTS.md. A script fails the run when it exits non-zero or runs past its deadline; its
output's tail is printed. The network-namespace ones need root and iproute2 and are reported as
skipped without them. The GPU ones (``benchmarks.gpu.check``, ``benchmarks.gpu.codec``) are
``make gpu-check``'s; the fused optimizer's GPU section runs here through Triton's interpreter.

Usage (from the repository root)::

    python -m benchmarks.smoke               # all, ~10 minutes on 2 cores
    python -m benchmarks.smoke --only ddp-loopback comm
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from benchmarks.jobs import ROOT, worker
from benchmarks.network import requirements_problem

TINY_MLP = "64-64x2-10"


@dataclass(frozen=True)
class Smoke:
    """One benchmark's smallest run: ``args`` after ``python -m <module>``."""

    name: str
    module: str
    args: tuple[str, ...]
    netns: bool = False  # needs root and iproute2 (shaped links)
    env: dict[str, str] = field(default_factory=dict)
    timeout_s: float = 300.0


SMOKES = (
    # data
    Smoke("cache", "benchmarks.data.cache", ("--quick", "--repeat", "1")),
    Smoke("sampler", "benchmarks.data.sampler", ("--quick",)),
    Smoke("lm_sampler", "benchmarks.data.lm_sampler",
          ("--ranks", "2", "--steps", "3", "--layers", "1", "--width", "32", "--context", "16")),
    # optim
    Smoke("fused_optimizer", "benchmarks.optim.fused",
          ("--section", "cpu", "--reps", "2", "--cpu-tensors", "14", "--cpu-elems", "20000")),
    Smoke("fused_optimizer-gpu-interpreted", "benchmarks.optim.fused",
          ("--section", "gpu", "--gpu-dry-run-cpu", "--gpu-tensors", "14", "--gpu-elems", "2000"),
          env={"TRITON_INTERPRET": "1"}),
    # step
    Smoke("wrapper_overhead", "benchmarks.step.wrapper_overhead", ("--steps", "5", "--rounds", "1")),
    Smoke("lightning_strategy", "benchmarks.step.lightning_strategy",
          ("--parts", "loopback", "--steps", "3", "--reps", "1", "--epochs", "2", "--mlp", TINY_MLP)),
    Smoke("ddp-loopback", "benchmarks.step.ddp",
          ("--parts", "loopback", "--mlp", TINY_MLP, "--reps", "1", "--block", "2")),
    Smoke("ddp-network", "benchmarks.step.ddp",
          ("--parts", "network", "--rates", "100mbit", "--net-mlp", TINY_MLP, "--net-reps", "1", "--net-block", "2"),
          netns=True),
    Smoke("autotune", "benchmarks.step.autotune",
          ("--rates", "100mbit", "--algorithms", "bytegrad", "--grid-steps", "1", "--check-steps", "1",
           "--check-rounds", "1", "--mlp", TINY_MLP), netns=True),
    Smoke("compiled_overlap", "benchmarks.step.compiled_overlap",
          ("--mlp", TINY_MLP, "--rounds", "1", "--reps", "1", "--block", "2", "--warmup", "2"), netns=True),
    Smoke("hf_trainer", "benchmarks.step.hf_trainer",
          ("--hooks", "none", "bytegrad", "--steps", "3", "--skip", "1", "--reps", "1", "--max-files", "20"),
          netns=True),
    # scale
    Smoke("elastic", "benchmarks.scale.elastic", ("--trials", "1", "--c10d-trials", "1", "--interval", "2")),
    Smoke("scale_check", "benchmarks.scale.check",
          ("--layouts", "2x2", "--steps", "2", "--variants", "torch-ddp", "gradient_allreduce-hier", "bytegrad-hier",
           "decentralized-shift_one")),
    # comm
    Smoke("stripes", "benchmarks.comm.stripes",
          ("--settings", "loopback", "--sizes", "1MB", "--calls", "1", "--repeat", "1")),
    Smoke("comm", "benchmarks.comm.allreduce",
          ("--sizes", "64KB", "--ranks", "2", "--rates", "100mbit", "--netns-ranks", "2", "--seconds-per-size", "1",
           "--min-reps", "1", "--max-reps", "2"), netns=True),
    Smoke("p2p_pieces", "benchmarks.network.netns",
          ("--ranks", "2", "--rate", "100mbit", "--", "{python}", "-m", "benchmarks.comm.p2p_pieces", "--rate-mbit",
           "100", "--repeat", "1"), netns=True),
    Smoke("compressed_breakdown", "benchmarks.comm.compressed_breakdown",
          ("--ranks", "4", "--rate", "100mbit", "--algorithm", "qadam", "--mlp", "256-256x2-10", "--reps", "1"),
          netns=True),
    # accuracy, tradeoff
    Smoke("time_to_accuracy", "benchmarks.accuracy.time_to_accuracy",
          ("--quick", "--links", "1gbit", "--variants", "torch-ddp", "qadam1"), netns=True),
    Smoke("tradeoff", "benchmarks.tradeoff.sweep",
          ("--quick", "--fresh", "--settings", "bw-100mbit", "--only", "ddp", "bytegrad"), netns=True),
    Smoke("machines_prediction", "benchmarks.tradeoff.machines_prediction", ("--held-out",)),
    Smoke("machines", "benchmarks.tradeoff.machines", ("--size", "comm-bound", "--reps", "1", "--block", "1"),
          netns=True),
)


def scratch_copy(dest: Path) -> None:
    """The checked-out files (tracked, and untracked but not ignored) copied under ``dest``."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            check=True, capture_output=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def run_one(smoke: Smoke, copy: Path) -> tuple[str, float, str]:
    """(status, seconds, output tail) of one smoke run in ``copy``."""
    cmd = worker(smoke.module, *(a.replace("{python}", sys.executable) for a in smoke.args))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **smoke.env}
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=copy, env=env, capture_output=True, text=True, timeout=smoke.timeout_s)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        return f"TIMEOUT after {smoke.timeout_s:.0f} s", time.monotonic() - t0, out[-3000:]
    status = "ok" if proc.returncode == 0 else f"FAILED (exit {proc.returncode})"
    return status, time.monotonic() - t0, (proc.stdout + proc.stderr)[-3000:]


def main(argv: Optional[list[str]] = None) -> int:
    names = [s.name for s in SMOKES]
    p = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="+", choices=names, metavar="NAME", help=f"run only these: {' '.join(names)}")
    args = p.parse_args(argv)
    chosen = [s for s in SMOKES if args.only is None or s.name in args.only]
    problem = requirements_problem() if any(s.netns for s in chosen) else None
    failed = []
    with tempfile.TemporaryDirectory(prefix="bagua-bench-smoke-") as tmp:
        copy = Path(tmp)
        scratch_copy(copy)
        for smoke in chosen:
            if smoke.netns and problem:
                print(f"{smoke.name:<32} skipped: {problem}", flush=True)
                continue
            status, seconds, tail = run_one(smoke, copy)
            print(f"{smoke.name:<32} {status:<20} {seconds:6.1f} s", flush=True)
            if status != "ok":
                failed.append(smoke.name)
                print("    | " + tail.replace("\n", "\n    | "), flush=True)
    if failed:
        print(f"stale or broken: {' '.join(failed)}")
        return 1
    print("every benchmark ran")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
