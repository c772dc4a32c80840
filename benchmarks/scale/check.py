#!/usr/bin/env python3
"""Correct at 16 and 32 ranks: every algorithm, flat and hierarchical, on emulated machines.

One job per layout (``MxR``: M machines of R ranks, torchrun's variables with
``LOCAL_WORLD_SIZE=R``, all on this machine's loopback), every rank a process. Each job trains a
small MLP (seeded, the same per-rank batches for every variant) for ``--steps`` steps under each
variant, then checks on rank 0:

- **exact** (gradient_allreduce, flat and hierarchical): the loss curve equals torch DDP's in the
  same job to the 3+ rank rounding (relative 1e-5: Gloo's ring cuts the sums elsewhere), and every
  replica holds the same bits;
- **replicas identical** (bytegrad flat and hierarchical, qadam 8- and 1-bit, onebit_grad): every
  rank's weights bit for bit equal after the last step;
- **trains** (decentralized all, shift_one and hierarchical, low_precision_decentralized flat and
  hierarchical, async): finite losses, the last below the first;
- **shift_one pairs every rank with every rank of the other half**: weights set to the rank's
  number before each communication step with a learning rate of 0, each rank reads its peer off
  the average (``ddp.impl.peer_weight``); after size/2 communication steps each rank has met
  exactly the other half (flat: of the ranks; hierarchical: of the machines, one leader each);
- **no hang**: the job ends within ``--timeout`` and every collective within the group timeout
  (``--collective-timeout``, which fails the job, not just the check).

Recorded per layout (every rank, rank 0 reports the max): ``bagua.init_process_group`` time
(which includes waiting for the slowest rank to start: on 2 cores, 32 interpreters importing torch),
the time of one ``bagua.comm.new_group`` over all ranks once all are there (wall, and the rank's own
CPU time: on 2 cores the wall time of n ranks each making n-1 connections grows as n squared),
the first wrap's time,
resident memory after init and at the end; the report prints them against the world size so
growth with scale shows.

Usage (from the repository root)::

    python -m benchmarks.scale.check                          # 8x2 and 8x4 (16 and 32 ranks)
    python -m benchmarks.scale.check --layouts 2x2 4x2 8x2 8x4 --out benchmarks/results/scale_check.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import resource
import sys
import time
from typing import Any, Optional, Sequence

from benchmarks.jobs import ROOT, RankFailedError, RankJob, free_port, worker
from benchmarks.records import save_run

MODULE = "benchmarks.scale.check"
TAG = "@@bagua-scale-check@@ "
EXACT = ("gradient_allreduce", "gradient_allreduce-hier")
IDENTICAL = ("bytegrad", "bytegrad-hier", "qadam", "qadam1", "onebit_grad")
TRAINS = ("decentralized", "decentralized-hier", "decentralized-shift_one", "low_precision_decentralized",
          "low_precision_decentralized-hier", "async")
VARIANTS = ("torch-ddp", *EXACT, *IDENTICAL, *TRAINS)
EXACT_RTOL = 1e-5
DIMS = (32, 64, 64, 10)


# --------------------------------------------------------------------------------------------
# one rank
# --------------------------------------------------------------------------------------------


def _rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _model():
    import torch

    torch.manual_seed(0)
    layers = []
    for a, b in zip(DIMS, DIMS[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def _algorithm(name: str, opt):
    from bagua import algorithms as A

    hier = name.endswith("-hier")
    base = name.removesuffix("-hier")
    if base == "gradient_allreduce":
        return A.GradientAllReduceAlgorithm(hierarchical=hier)
    if base == "bytegrad":
        return A.ByteGradAlgorithm(hierarchical=hier)
    if base == "decentralized":
        return A.DecentralizedAlgorithm(hierarchical=hier)
    if base == "decentralized-shift_one":
        return A.DecentralizedAlgorithm(peer_selection_mode="shift_one")
    if base == "low_precision_decentralized":
        return A.LowPrecisionDecentralizedAlgorithm(hierarchical=hier)
    if base == "async":
        return A.AsyncModelAverageAlgorithm(sync_interval_ms=5, warmup_steps=2)
    if base in ("qadam", "qadam1"):
        return A.QAdamAlgorithm(opt, bits=1 if base == "qadam1" else 8)
    if base == "onebit_grad":
        return A.OneBitGradAlgorithm(warmup_steps=2)
    raise ValueError(f"scale_check has no algorithm for variant {name!r}; known: {', '.join(VARIANTS[1:])}")


def _train(name: str, steps: int, rank: int, world: int) -> dict[str, Any]:
    """``steps`` steps of ``name``; the global mean loss per step and this rank's final weights."""
    import torch
    import torch.nn.functional as F

    import bagua

    model = _model()
    if name.startswith("qadam"):
        opt = bagua.optim.QAdamOptimizer(model.parameters(), lr=1e-3, warmup_steps=2)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    started = time.perf_counter()
    algorithm = None if name == "torch-ddp" else _algorithm(name, opt)
    if algorithm is None:
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
    else:
        wrapped = bagua.DistributedDataParallel(model, [opt], algorithm=algorithm)
    wrap_s = time.perf_counter() - started
    g = torch.Generator().manual_seed(1000 + rank)
    x, y = torch.randn(16, DIMS[0], generator=g), torch.randint(0, DIMS[-1], (16,), generator=g)
    losses = []
    for _ in range(steps):  # the same batch every step: the loss must fall
        opt.zero_grad()
        loss = F.cross_entropy(wrapped(x), y)
        loss.backward()
        opt.step()
        mean = loss.detach().clone()
        bagua.comm.allreduce(mean)
        losses.append(mean.item() / world)
    if name == "async":
        algorithm.abort(wrapped)  # stop its thread before the weights are compared
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = bagua.comm.allgather(weights[None])
    identical = all(torch.equal(everyone[0], row) for row in everyone)
    del wrapped
    return {"losses": losses, "replicas_identical": identical, "wrap_s": wrap_s}


def _shift_one_peers(hierarchical: bool, rank: int) -> list[int]:
    """This rank's peer at each of size/2 communication steps, read off the averaged weights.

    Flat: peers are ranks. Hierarchical: the machines' leaders pair up, so the peer of a rank is
    a machine (read as the other machine's number, each machine's weights set to its number)."""
    import torch

    import bagua

    local = bagua.get_local_size()
    who = rank // local if hierarchical else rank
    count = bagua.get_world_size() // (local if hierarchical else 1)
    model = torch.nn.Linear(4, 1, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    algo = bagua.algorithms.DecentralizedAlgorithm(hierarchical=hierarchical, peer_selection_mode="shift_one")
    ddp = bagua.DistributedDataParallel(model, [opt], algorithm=algo, init_sync=False)
    peers = []
    for _ in range(count // 2):
        with torch.no_grad():
            model.weight.fill_(float(who))
        opt.zero_grad()
        ddp(torch.ones(2, 4)).sum().backward()
        opt.step()
        averaged = ddp.impl.peer_weight(ddp.buckets[0])[0].item()
        peers.append(int(round(2 * averaged - who)))
    del ddp
    return peers


def run_worker(args: argparse.Namespace) -> int:
    import torch

    import bagua

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    started = time.perf_counter()
    bagua.init_process_group(timeout=datetime.timedelta(seconds=args.collective_timeout))
    init_s = time.perf_counter() - started  # includes waiting for the slowest rank to start
    bagua.comm.barrier()
    started, cpu = time.perf_counter(), time.process_time()
    bagua.comm.new_group(list(range(world)))  # a group's creation alone, every rank already there
    new_group_s, new_group_cpu_s = time.perf_counter() - started, time.process_time() - cpu
    rss_init = _rss_mb()
    results = {name: _train(name, args.steps, rank, world) for name in args.variants}
    pairs = {"flat": _shift_one_peers(False, rank)}
    if bagua.get_local_size() > 1 and (world // bagua.get_local_size()) % 2 == 0:
        pairs["hier"] = _shift_one_peers(True, rank)
    mine = {"init_s": init_s, "new_group_s": new_group_s, "new_group_cpu_s": new_group_cpu_s,
            "wrap_s": results[args.variants[0]]["wrap_s"],
            "rss_init_mb": rss_init,
            "rss_end_mb": _rss_mb(), "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "pairs": pairs}
    everyone = bagua.comm.allgather_object(mine)
    if rank == 0:
        record = {"world": world, "local_size": bagua.get_local_size(), "steps": args.steps, "variants": {
            name: {"losses": r["losses"], "replicas_identical": r["replicas_identical"]} for name, r in results.items()},
            "ranks": everyone}
        print(TAG + json.dumps(record), flush=True)
    bagua.destroy_process_group()
    return 0


# --------------------------------------------------------------------------------------------
# checks and report
# --------------------------------------------------------------------------------------------


def check(record: dict[str, Any]) -> list[tuple[str, bool, str]]:
    """``(what, passed, detail)`` for every check of one layout's record."""
    out = []
    world, local = record["world"], record["local_size"]
    variants = record["variants"]
    reference = variants.get("torch-ddp", {}).get("losses")
    for name, r in variants.items():
        losses = r["losses"]
        finite = all(math.isfinite(v) for v in losses)
        if name in EXACT and reference:
            worst = max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
            out.append((f"{name}: loss curve = torch DDP's", worst <= EXACT_RTOL, f"worst relative {worst:.1e}"))
        if name in EXACT or name in IDENTICAL or name == "torch-ddp":
            out.append((f"{name}: replicas identical", r["replicas_identical"], ""))
        if name in TRAINS or name in IDENTICAL:
            ok = finite and losses[-1] < losses[0]
            out.append((f"{name}: trains", ok, f"loss {losses[0]:.4f} -> {losses[-1]:.4f}"))
    for kind, count in (("flat", world), ("hier", world // local)):
        peers = [r["pairs"].get(kind) for r in record["ranks"]]
        if peers[0] is None:
            continue
        ok = True
        for rank, met in enumerate(peers):
            who = rank if kind == "flat" else rank // local
            other_half = set(range(count // 2, count)) if who < count // 2 else set(range(count // 2))
            ok &= sorted(met) == sorted(other_half)
        unit = "ranks" if kind == "flat" else "machines"
        out.append((f"shift_one ({kind}): every one of {count} {unit} met the other half", ok, ""))
    return out


def report(records: list[dict[str, Any]]) -> tuple[list[str], bool]:
    lines, all_ok = [], True
    for record in records:
        layout = f"{record['world'] // record['local_size']}x{record['local_size']}"
        lines.append(f"== {layout} ({record['world']} ranks), {record['steps']} steps per variant, "
                     f"job {record['elapsed_s']:.0f} s ==")
        for what, ok, detail in check(record):
            all_ok &= ok
            lines.append(f"  {'ok  ' if ok else 'FAIL'} {what}{(': ' + detail) if detail else ''}")
    lines.append("")
    lines.append("world  layout  init_process_group s  new_group s (CPU s)  first wrap s  RSS after init MB  "
                 "RSS at end MB  (max over ranks; init includes waiting for the slowest rank to start; a rank's "
                 "CPU time is its own work, the wall time shares 2 cores with every other rank's)")
    for record in sorted(records, key=lambda r: r["world"]):
        ranks = record["ranks"]
        layout = f"{record['world'] // record['local_size']}x{record['local_size']}"
        lines.append(f"{record['world']:5d}  {layout:6s}  {max(r['init_s'] for r in ranks):20.2f}  "
                     f"{max(r.get('new_group_s', float('nan')) for r in ranks):11.3f} "
                     f"({max(r.get('new_group_cpu_s', float('nan')) for r in ranks):.3f})  "
                     f"{max(r['wrap_s'] for r in ranks):12.3f}  {max(r['rss_init_mb'] for r in ranks):17.0f}  "
                     f"{max(r['rss_end_mb'] for r in ranks):13.0f}")
    return lines, all_ok


# --------------------------------------------------------------------------------------------
# driver
# --------------------------------------------------------------------------------------------


def run_layout(machines: int, per: int, args: argparse.Namespace) -> Optional[dict[str, Any]]:
    """Start every rank of an ``machines`` x ``per`` job on loopback; rank 0's record, or None."""
    world, port = machines * per, free_port()
    command = worker(MODULE, "--worker", "--steps", args.steps, "--collective-timeout", args.collective_timeout,
                     "--variants", *args.variants)

    def rank_env(rank: int) -> list[str]:  # torchrun's variables on a cluster of ``machines`` x ``per``
        return [f"RANK={rank}", f"WORLD_SIZE={world}", f"LOCAL_RANK={rank % per}", f"LOCAL_WORLD_SIZE={per}",
                f"GROUP_RANK={rank // per}", "MASTER_ADDR=127.0.0.1", f"MASTER_PORT={port}"]

    job = RankJob([["env", *rank_env(rank), *command] for rank in range(world)],
                  [f"rank {rank}" for rank in range(world)], "bgscale")
    started = time.monotonic()
    try:
        job.run(args.timeout, echo=False, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=ROOT)
    except RankFailedError as e:
        print(f"{machines}x{per}: FAILED after {time.monotonic() - started:.0f} s: {e}", file=sys.stderr)
        return None
    elapsed = time.monotonic() - started
    lines = [line for line in job.outputs[0].splitlines() if line.startswith(TAG)]
    if not lines:
        print(f"{machines}x{per}: FAILED after {elapsed:.0f} s (rank 0 printed no record):\n"
              f"{job.outputs[0][-3000:]}", file=sys.stderr)
        return None
    record = json.loads(lines[-1][len(TAG):])
    record["elapsed_s"] = elapsed
    return record


def parse_layout(text: str) -> tuple[int, int]:
    try:
        machines, per = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a layout is MACHINESxRANKS, e.g. 8x2; got {text!r}") from None
    if machines < 1 or per < 1:
        raise argparse.ArgumentTypeError(f"a layout needs at least 1x1, got {text!r}")
    return machines, per


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--layouts", nargs="+", type=parse_layout, default=[(8, 2), (8, 4)],
                   help="MACHINESxRANKS per job (default 8x2 8x4)")
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--steps", type=int, default=6, help="training steps per variant (default 6)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per job (default 600)")
    p.add_argument("--collective-timeout", type=float, default=120.0, help="the process group's timeout (s)")
    p.add_argument("--out", default=None, help="write the records and checks here as JSON")
    args = p.parse_args(argv)
    if args.worker:
        return run_worker(args)
    if "torch-ddp" not in args.variants:
        args.variants = ["torch-ddp", *args.variants]
    started = time.monotonic()
    records, failed = [], []
    for machines, per in args.layouts:
        record = run_layout(machines, per, args)
        (records.append(record) if record else failed.append(f"{machines}x{per}"))
    lines, ok = report(records)
    print("\n".join(lines))
    if args.out:
        checks = {f"{r['world'] // r['local_size']}x{r['local_size']}": check(r) for r in records}
        save_run(args.out, time.monotonic() - started, failed, {"all_passed": ok and not failed},
                 records=records, checks=checks)
    verdict = "every check passed" if ok and not failed else f"FAILED ({', '.join(failed) or 'a check'})"
    print(f"KEY: {' '.join(f'{m}x{r}' for m, r in args.layouts)}: {verdict}, "
          + ", ".join(f"{r['world']} ranks in {r['elapsed_s']:.0f} s" for r in records))
    return 0 if ok and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
