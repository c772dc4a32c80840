#!/usr/bin/env python3
"""``torch.compile`` and communication overlap: a compiled model's step, bagua against torch DDP.

A compiled backward hands every gradient over at its end unless the graph is split at the bucket
boundaries (dynamo's ``DDPOptimizer``, which bagua's wrapper enables as torch DDP does:
``bagua.parallel.compiled``). Each job trains ``ddp.py``'s 10M-parameter MLP (as a module of user
code, which dynamo compiles) wrapped by torch DDP and by bagua (``gradient_allreduce``,
``bytegrad``), every wrapper ``torch.compile``d, interleaved as ``ddp.py`` times them, on 2 ranks
each behind its own shaped link. Each round runs two jobs: with the graphs split (torch's default), and with
``torch._dynamo.config.optimize_ddp = False`` (one graph: communication after backward), so
"split / one graph" is what the overlap buys; the rounds alternate the two, since the machine's
load moves from job to job.

Example (root, iproute2; from the repository root)::

    python -m benchmarks.step.compiled_overlap                 # 1 Gbit/s, 2 rounds, ~3 minutes
    python -m benchmarks.step.compiled_overlap --rounds 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path
from typing import Optional, Sequence

from benchmarks.jobs import emulated, run, worker

VARIANTS = ("ddp", "gradient_allreduce", "bytegrad")
LABELS = {"ddp": "torch DDP", "gradient_allreduce": "bagua gradient_allreduce", "bytegrad": "bagua bytegrad"}


def run_worker(args: argparse.Namespace) -> int:
    import torch
    import torch.nn.functional as F

    import bagua
    from benchmarks.step.ddp import make_batches, make_model, parse_mlp
    from benchmarks.step.timing import Variant, time_interleaved

    torch.set_num_threads(1)
    torch._dynamo.config.optimize_ddp = args.split
    bagua.init_process_group()
    rank = bagua.get_rank()
    dims = parse_mlp(args.mlp)

    class MLP(torch.nn.Module):  # user code: dynamo compiles its forward (nn.Sequential's is torch's own)
        def __init__(self):
            super().__init__()
            self.layers = make_model(dims)

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    variants = []
    for name in VARIANTS:
        model = MLP()
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        v = Variant(name, model, opt, lambda m, batch: F.cross_entropy(m(batch[0]), batch[1]))
        v.model = torch.compile(v.model)
        variants.append(v)
    batches = make_batches(dims, args.batch, 8, rank)
    log = (lambda msg: print(f"[split={args.split}] {msg}", flush=True)) if rank == 0 else (lambda msg: None)
    rows, diverged = time_interleaved(variants, batches, args.warmup, args.reps, args.block, log)
    if rank == 0:
        Path(args.out).write_text(json.dumps({"split": args.split, "step_s": {n: r["step_s"] for n, r in rows.items()},
                                              "diverged": diverged}))
    for v in variants:
        v.close()
    bagua.destroy_process_group()
    return 0


def report(rounds: list[dict[bool, dict]], args: argparse.Namespace) -> str:
    """Medians over the rounds (a round: one job split, one not); each round's split / one graph."""
    def median(split: bool, name: str) -> float:
        return statistics.median(r[split]["step_s"][name] for r in rounds)

    lines = [f"Compiled MLP {args.mlp}, 2 ranks as machines at {args.rate}, step medians in ms "
             f"(median of {len(rounds)} rounds; a round is one job each way):", "",
             "| wrapper (compiled) | graphs split at the buckets | one graph | split / one graph (each round) "
             "| / torch DDP, split |", "|---|---:|---:|---:|---:|"]
    for name in VARIANTS:
        split, whole = median(True, name), median(False, name)
        each = ", ".join(f"{r[True]['step_s'][name] / r[False]['step_s'][name]:.2f}" for r in rounds)
        lines.append(f"| {LABELS[name]} | {split * 1e3:.0f} | {whole * 1e3:.0f} | {split / whole:.2f} ({each}) | "
                     f"{split / median(True, 'ddp'):.2f} |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--split", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--rate", default="1gbit", help="each rank's link (default 1gbit)")
    p.add_argument("--mlp", default="1024-1664x4-10", help="ddp.py's network model (10.0M params)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per variant (the first compiles)")
    p.add_argument("--reps", type=int, default=4)
    p.add_argument("--block", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2, help="pairs of jobs, split and not, alternating (default 2)")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--json", help="also write both jobs' step times here")
    args = p.parse_args(argv)
    if args.worker:
        args.split = bool(args.split)
        return run_worker(args)
    rounds: list[dict[bool, dict]] = []
    with tempfile.TemporaryDirectory() as tmp:
        os.chmod(tmp, 0o777)
        for k in range(args.rounds):
            rounds.append({})
            for split in (True, False):
                out = Path(tmp) / f"round{k}-split{int(split)}.json"
                command = worker("benchmarks.step.compiled_overlap", "--worker", "--split", int(split),
                                 "--out", out, "--mlp", args.mlp, "--batch", args.batch, "--warmup", args.warmup,
                                 "--reps", args.reps, "--block", args.block)
                run(emulated(command, "--ranks", "2", "--rate", args.rate, "--timeout", str(args.timeout)),
                    args.timeout + 60)
                rounds[-1][split] = json.loads(out.read_text())
    text = report(rounds, args)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps({"rate": args.rate, "mlp": args.mlp,
                                               "rounds": [{str(k): v for k, v in r.items()} for r in rounds]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
