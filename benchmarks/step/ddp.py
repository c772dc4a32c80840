#!/usr/bin/env python3
"""Data-parallel training step time: torch DDP vs bagua.DistributedDataParallel, every algorithm.

Every rank builds one copy of the same MLP per variant (same seed, same per-rank data, SGD with
momentum 0.9, qadam excepted: it needs its QAdamOptimizer; ``-adam`` variants: torch Adam) and
times training steps (``zero_grad; forward; cross-entropy; backward; step``) of the variants
interleaved: each repetition runs a block of ``--block`` steps of every variant, the order rotated
from one repetition to the next (A B C ..., then B C ... A) so that drifts in machine load hit them
alike.

====================  ========================================================================
ddp                   ``torch.nn.parallel.DistributedDataParallel`` (bucket_cap_mb=25, default)
ddp-10MB              the same with bucket_cap_mb=10
ddp-fp16              torch DDP + ``default_hooks.fp16_compress_hook``
gradient_allreduce    ``bagua.DistributedDataParallel(..., algorithm="gradient_allreduce")``
gradient_allreduce-10MB  the same with ``bucket_size_bytes=10 MiB`` (default: 25 MiB, as torch DDP)
bytegrad              bagua, MinMaxUInt8-compressed gradient allreduce
bytegrad-10MB         the same with ``bucket_size_bytes=10 MiB``
decentralized         bagua, weights averaged with all peers (peer_selection_mode="all")
low_precision_decentralized  bagua, ring, 8-bit compressed weight differences
async                 bagua, background model averaging (sync_interval_ms, warmup_steps=0)
qadam                 bagua, ``QAdamAlgorithm(QAdamOptimizer(lr=1e-3, warmup_steps=<warm-up>, eps=--qadam-eps))``
                      (``overlap="auto"``: timed after its trial of both ways)
onebit_grad           bagua, 1-bit (sign1) gradient allreduce with error feedback, ``warmup_steps=<warm-up>``
local                 no wrapper, no communication: the step's compute alone (where 1 bit is compute-bound)
qadam-overlap         the same with ``overlap=True`` (always speculating during backward)
qadam-nooverlap       the same with ``overlap=False`` (the momentum averaged in ``step()``, not during backward)
qadam-clip            qadam with ``clip_grad_norm_(params, --clip-norm)`` between backward and step
qadam-nooverlap-clip  the same with ``overlap=False``
qadam1                qadam with ``bits=1`` (1-bit momentum with error feedback); ``qadam1-nooverlap``
bytegrad-adam         bytegrad with ``torch.optim.Adam(lr=1e-3)``: qadam's optimizer family, so that
                      qadam / bytegrad-adam compares the communication alone
====================  ========================================================================

The last seven run only when named (``--net-variants bytegrad bytegrad-adam qadam qadam-overlap
qadam-nooverlap qadam-clip qadam-nooverlap-clip``, ``--net-variants ddp qadam qadam1``); rank 0
then logs each qadam variant's speculation hits and misses.

Measured per variant: the median step time over all timed steps (each rank's median, then the max
over ranks), the "epoch" time (the sum of the timed blocks, i.e. ``--reps * --block`` steps; max
over ranks), and the bytes sent per step. For bagua that is ``bagua.comm.bytes_sent()``'s delta
over a block / steps (it matches ``ddp.bytes_sent_last_step`` for the synchronous algorithms and
also counts async's background thread); torch DDP is invisible to bagua's counter, so its row
shows the ring formula ``2 (n-1)/n * gradient bytes`` (fp16 hook: half that), marked ``*``. In
the network settings every rank has its own interface and "wire B/step" is what left it
(``/sys/class/net/veth0/statistics/tx_bytes``, TCP/IP headers included), for every variant.

async: its background thread is resumed (``algo.resume(ddp)``) before each of its blocks and
stopped with ``algo.abort(ddp)`` (which also averages the weights once) after it, outside the
timed region, so it never runs during the other variants' blocks. Its step time is the time of
the training loop, which never waits for the averaging; that is what async buys.

Settings (the driver, the default mode, launches one worker job per setting):

- loopback: 2 ranks, ``torchrun --standalone``, Gloo over ``lo``; a ~4.2M-parameter MLP
  (1024-1024x4-10, 16.8 MB of fp32 gradients), batch 64 per rank; all ten variants;
- network: 2 ranks on the emulated network (``benchmarks.network``: each rank in its own network
  namespace behind a tbf-capped veth), at 1gbit and 100mbit; a ~10.0M-parameter MLP (1024-1664x4-10, 40 MB);
  the eight variants without the bucket sweep; an "epoch" is 20 steps (2 blocks of 10);
- per-flow: the same network model and ranks where each TCP connection is capped at
  ``--per-flow-rates`` (default 100mbit) under a 1gbit aggregate (the network's ``--per-flow-rate``,
  as clouds cap a single flow), once with bagua's ``streams=1`` and once with ``streams=8``
  (``--streams``: the collectives striped over that many connections); torch DDP,
  gradient_allreduce and bytegrad. Key ratio: epoch time at streams=1 / streams=8 (target >= 3x
  for gradient_allreduce);
- gpu: one rank, NCCL, CUDA: plain model vs torch DDP vs bagua gradient_allreduce (the wrapper's
  overhead; with one rank bagua skips the collective, torch DDP still calls NCCL). Skipped with
  a message when CUDA is not available.

Usage (from the repository root)::

    python -m benchmarks.step.ddp                                   # everything, ~18 min on 2 shared cores
    python -m benchmarks.step.ddp --parts loopback                  # step time on loopback only, ~1-2 min
    python -m benchmarks.step.ddp --parts network --rates 100mbit   # one bandwidth
    python -m benchmarks.step.ddp --parts gpu                       # the CUDA wrapper-overhead part
    python -m benchmarks.step.ddp --from-json .bench/ddp.json       # rebuild tables and plot
    torchrun --standalone --nproc-per-node 2 -m benchmarks.step.ddp --worker   # one job by hand

The last line printed is the key ratios: bagua gradient_allreduce / torch DDP median step time
on loopback with both at their default bucket sizes (target <= 1.02), and at 100mbit the epoch
time of torch DDP fp32 / bytegrad (target >= 3x). Results: benchmarks/results/ddp.md; the plot of
epoch time per algorithm per bandwidth: benchmarks/figures/ddp_network.png.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from benchmarks.jobs import emulated, loopback, run_job, worker
from benchmarks.network import parse_rate, rank_tcp_cc, requirements_problem, tx_bytes_reader
from benchmarks.records import FIGURES, add_run_options, finish_run
from benchmarks.step.ddp_report import (
    ALL_VARIANTS, BUFFER_VARIANTS, HOOK_VARIANTS, STRIPED_VARIANTS, LABELS, NETWORK_VARIANTS, QADAM_VARIANTS, format_gpu, format_job, key_summary, plot,
)
from benchmarks.step.timing import Variant, time_interleaved

logger = logging.getLogger("benchmarks.step.ddp")

MODULE = "benchmarks.step.ddp"
JSON_TAG = "@@bagua-ddp-bench@@ "  # workers print one line "<tag><json>" per job on rank 0
DEFAULT_PLOT = FIGURES / "ddp_network.png"
#: QAdamOptimizer's eps in every qadam variant: with the optimizer's own 1e-8, a short warm-up on
#: this benchmark's random labels diverges within ~12-24 steps (see RESULTS.md)
QADAM_EPS = 1e-3



# --------------------------------------------------------------------------------------------
# model and data
# --------------------------------------------------------------------------------------------


def parse_mlp(spec: str) -> list[int]:
    """``"1024-1664x4-10"`` -> [1024, 1664, 1664, 1664, 1664, 10] (layer widths)."""
    dims: list[int] = []
    try:
        for part in spec.split("-"):
            if "x" in part:
                w, n = part.split("x")
                dims += [int(w)] * int(n)
            else:
                dims.append(int(part))
    except ValueError:
        raise argparse.ArgumentTypeError(f"MLP spec must look like 1024-1664x4-10, got {spec!r}") from None
    if len(dims) < 2 or min(dims) < 1:
        raise argparse.ArgumentTypeError(f"MLP spec needs >= 2 positive widths, got {spec!r}")
    return dims


def mlp_params(dims: Sequence[int]) -> int:
    return sum(a * b + b for a, b in zip(dims[:-1], dims[1:]))


def make_model(dims: Sequence[int], seed: int = 0, batchnorm: bool = False):
    import torch

    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for i, (a, b) in enumerate(zip(dims[:-1], dims[1:])):
        layers.append(torch.nn.Linear(a, b))
        if i < len(dims) - 2:
            if batchnorm:
                layers.append(torch.nn.BatchNorm1d(b))
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


def make_batches(dims: Sequence[int], batch: int, count: int, rank: int, device: str = "cpu"):
    import torch

    g = torch.Generator().manual_seed(1000 + rank)
    out = []
    for _ in range(count):
        x = torch.randn(batch, dims[0], generator=g)
        y = torch.randint(0, dims[-1], (batch,), generator=g)
        out.append((x.to(device), y.to(device)))
    return out


def make_variant(name: str, dims: Sequence[int], warmup: int, async_interval_ms: int, device: str = "cpu",
                 qadam_eps: float = QADAM_EPS, clip_norm: float = 1.0) -> Variant:
    """One of this benchmark's variants: the MLP (with BatchNorm for ``-bn``), SGD with momentum 0.9 (qadam:
    ``QAdamOptimizer`` past ``warmup`` steps; ``-adam``: torch Adam), cross-entropy on ``(x, y)``
    batches (``-clip``: ``clip_grad_norm_(clip_norm)`` before each step)."""
    import torch
    import torch.nn.functional as F

    import bagua

    model = make_model(dims, batchnorm="-bn" in name).to(device)
    if name.startswith("qadam"):
        opt = bagua.optim.QAdamOptimizer(model.parameters(), lr=1e-3, warmup_steps=max(1, warmup), eps=qadam_eps)
    elif name.endswith("-adam"):
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    return Variant(name, model, opt, lambda m, batch: F.cross_entropy(m(batch[0]), batch[1]), async_interval_ms, device,
                   warmup=warmup, clip_norm=clip_norm if name.endswith("-clip") else None)


def run_worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    import bagua

    torch.set_num_threads(args.threads)
    tcp_cc = rank_tcp_cc(args.tcp_cc, args.link == "netns")  # before Gloo connects
    bagua.init_process_group(**({"streams": args.job_streams} if args.job_streams else {}))
    rank, world = bagua.get_rank(), bagua.get_world_size()
    dims = parse_mlp(args.mlp)
    tx_bytes = tx_bytes_reader()
    t_start = time.monotonic()

    def log(msg: str) -> None:
        if rank == 0:
            print(f"[{args.setting}] {msg} ({time.monotonic() - t_start:.0f}s)", flush=True)

    variants = [make_variant(name, dims, args.warmup, args.async_interval_ms, qadam_eps=args.qadam_eps,
                             clip_norm=args.clip_norm) for name in args.variants]
    log(f"built {len(variants)} variants of a {mlp_params(dims) / 1e6:.2f}M-parameter MLP {args.mlp}")
    batches = make_batches(dims, args.batch, args.num_batches, rank)
    rows, diverged = time_interleaved(variants, batches, args.warmup, args.reps, args.block, log, tx_bytes)
    for v in variants:
        if v.name.startswith("qadam") and not v.is_torch:
            log(f"{v.name}: speculation {v.model.impl.speculation.stats}")
        if v.name not in diverged or v.is_torch:  # a torch DDP goes before the groups: Variant.close
            v.close()
    if rank == 0:
        job = {
            "setting": args.setting, "link": args.link, "rate": args.rate, "world": world,
            "per_flow_rate": args.per_flow_rate, "streams": args.job_streams or 1,
            "backend": str(dist.get_backend()), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "tcp_cc": tcp_cc,
            "mlp": args.mlp, "params": mlp_params(dims), "batch": args.batch, "block": args.block,
            "reps": args.reps, "warmup": args.warmup, "async_interval_ms": args.async_interval_ms,
            "elapsed_s": time.monotonic() - t_start, "variants": rows, "diverged": diverged,
            "qadam_eps": args.qadam_eps,
        }
        print(format_job(job), flush=True)
        print(JSON_TAG + json.dumps(job), flush=True)
    dist.barrier()
    bagua.destroy_process_group()
    return 0


# --------------------------------------------------------------------------------------------
# GPU part: one rank, NCCL
# --------------------------------------------------------------------------------------------


def run_gpu(args: argparse.Namespace) -> Optional[dict[str, Any]]:
    """Plain model vs torch DDP vs bagua gradient_allreduce on one CUDA device, one rank."""
    import torch

    if not torch.cuda.is_available():
        print("GPU part skipped: torch.cuda.is_available() is False (no CUDA device or a CPU build of "
              f"torch {torch.__version__}); result: blocked, no GPU", flush=True)
        return None
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import bagua

    for k, val in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "1")):
        os.environ.setdefault(k, val)
    bagua.init_process_group()
    dims = parse_mlp(args.gpu_mlp)
    batches = make_batches(dims, args.gpu_batch, 8, 0, "cuda")
    models = {}
    opts = {}
    for name in ("plain", "ddp", "gradient_allreduce"):
        m = make_model(dims).cuda()
        opts[name] = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
        if name == "ddp":
            m = TorchDDP(m, device_ids=[torch.cuda.current_device()])
        elif name == "gradient_allreduce":
            m = bagua.DistributedDataParallel(m, [opts[name]], algorithm="gradient_allreduce")
        models[name] = m
    names = list(models)

    def steps(name: str, k: int) -> float:
        m, o = models[name], opts[name]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(k):
            x, y = batches[i % len(batches)]
            o.zero_grad(set_to_none=True)
            F.cross_entropy(m(x), y).backward()
            o.step()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / k

    for name in names:
        steps(name, 20)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.gpu_reps):
        for j in range(len(names)):
            name = names[(r + j) % len(names)]
            times[name].append(steps(name, args.gpu_block))
    res = {n: statistics.median(t) for n, t in times.items()}
    job = {"setting": "gpu", "device": torch.cuda.get_device_name(), "backend": str(dist.get_backend()),
           "mlp": args.gpu_mlp, "params": mlp_params(dims), "batch": args.gpu_batch, "step_s": res,
           "reps": args.gpu_reps, "block": args.gpu_block}
    models["gradient_allreduce"].close()
    models.clear()  # torch DDP before the groups (see timing.Variant.close)
    bagua.destroy_process_group()
    return job


# --------------------------------------------------------------------------------------------
# driver
# --------------------------------------------------------------------------------------------


def _worker_args(setting: str, link: str, rate: Optional[str], mlp: str, batch: int, reps: int, block: int,
                 warmup: int, variants: Sequence[str], args: argparse.Namespace) -> list[str]:
    out = [MODULE, "--worker", "--setting", setting, "--link", link, "--mlp", mlp,
           "--batch", str(batch), "--reps", str(reps), "--block", str(block), "--warmup", str(warmup),
           "--threads", str(args.threads), "--async-interval-ms", str(args.async_interval_ms),
           "--qadam-eps", str(args.qadam_eps), "--clip-norm", str(args.clip_norm),
           "--variants", *variants]
    if rate:
        out += ["--rate", rate]
        if args.tcp_cc:
            out += ["--tcp-cc", args.tcp_cc]
    return out


def _per_flow_plans(args: argparse.Namespace) -> list[tuple[str, int, list[str]]]:
    """(setting, world, command) of the per-connection-capped settings: each per-flow rate under
    --per-flow-under, once per --streams value, the streams values alternating."""
    plans = []
    for world in args.netns_ranks:
        for flow in args.per_flow_rates:
            for streams in args.streams:
                setting = f"{flow}-per-flow-streams{streams}"
                worker_args = _worker_args(setting, "netns", args.per_flow_under, args.net_mlp, args.net_batch,
                                      args.net_reps, args.net_block, args.net_warmup,
                                      args.per_flow_variants, args)
                worker_args += ["--job-streams", str(streams), "--per-flow-rate", flow]
                cmd = emulated(worker(*worker_args), "--ranks", str(world), "--rate", args.per_flow_under,
                               "--per-flow-rate", flow, "--timeout", str(args.timeout))
                plans.append((setting, world, cmd))
    return plans


def run_driver(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="ddp-bench: %(levelname)s %(message)s")
    t0 = time.monotonic()
    jobs: list[dict[str, Any]] = []
    failed: list[str] = []
    gpu = None
    if "loopback" in args.parts:
        cmd = loopback(args.loopback_ranks, worker(*_worker_args(
            "loopback", "loopback", None, args.mlp, args.batch, args.reps, args.block, args.warmup,
            args.variants or ALL_VARIANTS, args)))
        print(f"\n### loopback x{args.loopback_ranks}", flush=True)
        job = run_job(cmd, args.timeout, JSON_TAG, logger)
        (jobs.append(job) if job else failed.append("loopback"))
    if "network" in args.parts and (args.rates or args.per_flow_rates):
        problem = requirements_problem()
        if problem:
            logger.warning("skipping the bandwidth-capped settings %s: %s", " ".join(args.rates), problem)
            failed += [f"{r} (skipped: {problem})" for r in args.rates + args.per_flow_rates]
        else:
            for world in args.netns_ranks:
                for rate in args.rates:
                    setting = f"{rate}-{args.tcp_cc}" if args.tcp_cc else rate
                    cmd = emulated(worker(*_worker_args(setting, "netns", rate, args.net_mlp, args.net_batch,
                                                        args.net_reps, args.net_block, args.net_warmup,
                                                        args.net_variants or NETWORK_VARIANTS, args)),
                                   "--ranks", str(world), "--rate", rate, "--timeout", str(args.timeout))
                    print(f"\n### {setting} x{world} ({time.monotonic() - t0:.0f}s elapsed)", flush=True)
                    job = run_job(cmd, args.timeout + 60, JSON_TAG, logger)
                    if job is None:
                        failed.append(f"{setting} x{world}")
                        continue
                    job["rate_bit"] = parse_rate(rate)
                    jobs.append(job)
            for setting, world, cmd in _per_flow_plans(args):
                print(f"\n### {setting} x{world} ({time.monotonic() - t0:.0f}s elapsed)", flush=True)
                job = run_job(cmd, args.timeout + 60, JSON_TAG, logger)
                if job is None:
                    failed.append(f"{setting} x{world}")
                    continue
                job["rate_bit"] = parse_rate(args.per_flow_under)
                jobs.append(job)
    if "gpu" in args.parts:
        print("\n### gpu", flush=True)
        gpu = run_gpu(args)  # in this process: one rank, no launcher
    return report(jobs, gpu, args, failed, time.monotonic() - t0)


def report(jobs: list[dict[str, Any]], gpu: Optional[dict[str, Any]], args: argparse.Namespace,
           failed: Sequence[str], elapsed: float) -> int:
    print("\n" + "=" * 110)
    print(f"Training step time, torch DDP vs bagua.DistributedDataParallel; step: median over timed steps, "
          f"max over ranks; {elapsed:.0f}s total")
    for n in ALL_VARIANTS + BUFFER_VARIANTS + QADAM_VARIANTS + HOOK_VARIANTS:
        print(f"  {n:<28} {LABELS[n]}")
    for job in jobs:
        print()
        print(format_job(job))
    if gpu is not None:
        print()
        print(format_gpu(gpu))
    lines, key_line, key = key_summary(jobs, gpu)
    drawn = not args.no_plot and any(j["link"] == "netns" for j in jobs)
    status = finish_run(args.out, elapsed, failed, key, (lambda path: plot(jobs, path)) if drawn else None, args.plot,
                        jobs=jobs, gpu=gpu)
    print()
    print("\n".join(lines))
    print(key_line)
    return status


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=f"examples:\n  python -m {MODULE}\n"
                                       f"  python -m {MODULE} --parts network --rates 100mbit")
    p.add_argument("--parts", nargs="+", default=["loopback", "network", "gpu"],
                   choices=["loopback", "network", "gpu"], help="what to run (default all)")
    p.add_argument("--worker", action="store_true", help="run as one rank (under torchrun or the emulated network)")
    p.add_argument("--gpu-worker", action="store_true", help=argparse.SUPPRESS)
    # loopback
    p.add_argument("--loopback-ranks", type=int, default=2, help="ranks on loopback (default 2)")
    p.add_argument("--mlp", default="1024-1024x4-10", help="loopback model widths (default 1024-1024x4-10, 4.2M params)")
    p.add_argument("--batch", type=int, default=64, help="loopback batch per rank (default 64)")
    p.add_argument("--reps", type=int, default=10, help="loopback repetitions (default 10)")
    p.add_argument("--block", type=int, default=5, help="loopback steps per block (default 5)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per variant first (default 3)")
    p.add_argument("--variants", nargs="+", choices=ALL_VARIANTS + BUFFER_VARIANTS + QADAM_VARIANTS + HOOK_VARIANTS + STRIPED_VARIANTS, default=None,
                   help="variants (loopback / worker; default all ten)")
    # network
    p.add_argument("--rates", nargs="*", default=["1gbit", "100mbit"], help="tbf rates (default 1gbit 100mbit)")
    p.add_argument("--netns-ranks", nargs="+", type=int, default=[2], help="ranks in the network settings (default 2)")
    p.add_argument("--net-mlp", default="1024-1664x4-10", help="network model (default 1024-1664x4-10, 10.0M params)")
    p.add_argument("--net-batch", type=int, default=64, help="network batch per rank (default 64)")
    p.add_argument("--net-reps", type=int, default=2, help="network repetitions (default 2)")
    p.add_argument("--net-block", type=int, default=10, help="network steps per block (default 10: epoch = 20 steps)")
    p.add_argument("--net-warmup", type=int, default=1, help="network untimed steps per variant (default 1)")
    p.add_argument("--net-variants", nargs="+", choices=ALL_VARIANTS + BUFFER_VARIANTS + QADAM_VARIANTS + HOOK_VARIANTS + STRIPED_VARIANTS, default=None,
                   help="network variants (default the eight without the bucket sweep)")
    p.add_argument("--per-flow-rates", nargs="*", default=["100mbit"],
                   help="per-TCP-connection caps, each a setting under --per-flow-under (default 100mbit; none: skip)")
    p.add_argument("--per-flow-under", default="1gbit", help="the aggregate rate of the per-flow settings (default 1gbit)")
    p.add_argument("--streams", nargs="+", type=int, default=[1, 8],
                   help="bagua streams of the per-flow settings, one job each (default 1 8)")
    p.add_argument("--per-flow-variants", nargs="+", choices=ALL_VARIANTS + STRIPED_VARIANTS, default=["ddp", "gradient_allreduce", "bytegrad"],
                   help="variants of the per-flow settings (default ddp gradient_allreduce bytegrad)")
    # common
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1: 2 ranks on 2 cores)")
    p.add_argument("--async-interval-ms", type=int, default=500, help="async sync_interval_ms (default 500, bagua's default)")
    p.add_argument("--tcp-cc", default=None, metavar="NAME",
                   help="network settings only: TCP congestion control inside the ranks' namespaces (e.g. "
                        "reno, bbr); default: the harness's (cubic, benchmarks/network). See results/ddp.md")
    p.add_argument("--qadam-eps", type=float, default=QADAM_EPS,
                   help=f"QAdamOptimizer eps (default {QADAM_EPS}: with the optimizer's own 1e-8, a 3-step warm-up "
                        "on this benchmark's random labels still diverges within ~12 steps; see RESULTS.md)")
    p.add_argument("--clip-norm", type=float, default=1.0,
                   help="max_norm of clip_grad_norm_ in the qadam-*clip variants (default 1.0)")
    add_run_options(p, 900.0, DEFAULT_PLOT, "tables, key line and plot")
    # gpu
    p.add_argument("--gpu-mlp", default="4096-4096x4-1000", help="GPU model (default 4096-4096x4-1000)")
    p.add_argument("--gpu-batch", type=int, default=256)
    p.add_argument("--gpu-reps", type=int, default=10)
    p.add_argument("--gpu-block", type=int, default=20)
    # worker-only
    p.add_argument("--setting", default="loopback", help=argparse.SUPPRESS)
    p.add_argument("--link", default="loopback", choices=["loopback", "netns"], help=argparse.SUPPRESS)
    p.add_argument("--rate", default=None, help=argparse.SUPPRESS)
    p.add_argument("--per-flow-rate", default=None, help=argparse.SUPPRESS)
    p.add_argument("--job-streams", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--num-batches", type=int, default=8, help=argparse.SUPPRESS)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    if args.reps < 1 or args.block < 1 or args.net_reps < 1 or args.net_block < 1 or args.warmup < 0:
        raise SystemExit("need --reps, --block, --net-reps, --net-block >= 1 and --warmup >= 0")
    if args.worker:
        args.variants = args.variants or list(ALL_VARIANTS)
        return run_worker(args)
    if args.gpu_worker:
        job = run_gpu(args)
        if job is not None:
            print(format_gpu(job), flush=True)
            print(JSON_TAG + json.dumps(job), flush=True)
        return 0
    if args.from_json:
        jobs: list[dict[str, Any]] = []
        gpu = None
        for path in args.from_json:
            data = json.loads(Path(path).read_text())
            jobs += data["jobs"]
            gpu = data.get("gpu") or gpu
        return report(jobs, gpu, args, [], sum(j.get("elapsed_s", 0) for j in jobs))
    return run_driver(args)


if __name__ == "__main__":
    sys.exit(main())
