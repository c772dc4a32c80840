#!/usr/bin/env python3
"""The wrapper's host cost per parameter tensor: bagua vs torch DDP, one rank, on the CPU.

Where a step is bound by the host (small models, fast GPUs, slow VM CPUs: see "GPU check" in
RESULTS.md), what a data-parallel wrapper adds per parameter tensor to every step decides its
overhead. This measures it with the arithmetic taken away: a model of many tiny tensors
(Linear(8, 8) layers, two tensors each), one rank on Gloo (no network), SGD, and each training
step split into zero_grad / forward / backward / step, timed in process CPU time (all threads of
the process, so a hand-off to a communication thread counts; a busy machine inflates it less
than wall time). Variants take turns, ``--block`` steps each, so that noise falls on all three:
the plain model, torch DDP, bagua ``gradient_allreduce``. A training loop runs one model, whose
state stays in the caches; ``--block 1`` (a turn every step, as before 2026-11-29) makes every
step start from the caches the other two models left, which costs the wrapper with the most
state per tensor the most. Printed per round and tensor count: the mean microseconds of each phase,
each wrapper's extra time per parameter tensor over the plain model, and bagua's extra over torch
DDP's; then the median of the rounds. ``--out`` writes them as JSON.

Target (issue 43): bagua's extra host time per whole training step at most 0.5x torch DDP's, at
148 and at 1,000 parameter tensors.

    python -m benchmarks.step.wrapper_overhead               # 148 and 1,000 tensors, 3 rounds (~1 min)
    python -m benchmarks.step.wrapper_overhead --block 1     # a turn every step
    python -m benchmarks.step.wrapper_overhead --floor       # also the least a hook and in-place views cost
    python -m benchmarks.step.wrapper_overhead --tensors 148 --rounds 1 --steps 500
"""

from __future__ import annotations

import argparse
import json
import operator
import os
import statistics
import time
from pathlib import Path
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from benchmarks.jobs import free_port

PHASES = ("zero_grad", "forward", "backward", "step")


def _model(layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(layers)])


def in_turns(names, steps: int, block: int, warmup: int):
    """``(name, step)`` in the order the variants take their turns, ``block`` steps each, over
    ``warmup + steps`` steps (a step below ``warmup`` is not timed).

    Example::

        list(in_turns("ab", 3, 2, 0))   # [('a', 0), ('a', 1), ('b', 0), ('b', 1), ('a', 2), ('b', 2)]
    """
    total = warmup + steps
    for start in range(0, total, block):
        for name in names:
            for i in range(start, min(start + block, total)):
                yield name, i


def measure(layers: int, steps: int, block: int = 25, warmup: int = 20) -> dict[str, dict[str, float]]:
    """Mean process CPU microseconds per phase, per variant (plain, torch, bagua): the variants take
    turns, ``block`` whole steps each (1: a turn every step, which makes each step start from the
    caches the other two models left)."""
    import bagua

    variants = {}
    for kind in ("plain", "torch", "bagua"):
        model = _model(layers)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        if kind == "torch":
            model = torch.nn.parallel.DistributedDataParallel(model)
        elif kind == "bagua":
            model = bagua.DistributedDataParallel(model, optimizers=[opt], algorithm="gradient_allreduce")
        variants[kind] = (model, opt)
    x = torch.randn(4, 8)
    spent = {kind: {phase: [] for phase in PHASES} for kind in variants}
    for kind, i in in_turns(list(variants), steps, block, warmup):
        model, opt = variants[kind]
        t0 = time.process_time()
        opt.zero_grad()
        t1 = time.process_time()
        loss = model(x).sum()
        t2 = time.process_time()
        loss.backward()
        t3 = time.process_time()
        opt.step()
        t4 = time.process_time()
        if i >= warmup:
            for phase, (a, b) in zip(PHASES, ((t0, t1), (t1, t2), (t2, t3), (t3, t4))):
                spent[kind][phase].append(1e6 * (b - a))
    return {kind: {phase: statistics.mean(v) for phase, v in phases.items()} for kind, phases in spent.items()}


FLOOR_WAYS = ("hook", "zeroed views", "views and hook", "copy after")


def floor(tensors: int, steps: int, block: int = 25, warmup: int = 20) -> dict[str, float]:
    """What readiness per bucket costs per tensor at the least, on the bare model's backward (us
    per tensor over a plain backward, whose gradients autograd makes afresh): a Python hook that
    only decrements a count ("hook"); accumulating into zeroed views of one flat buffer, rebound
    before backward ("zeroed views"); both, the wrapper's way; or a copy of the fresh gradients
    into the buffer after backward and the rebinding ("copy after", torch DDP's copy in)."""
    from collections import deque
    from itertools import repeat

    grad = operator.attrgetter("grad")
    setups = {}
    for way in ("plain", *FLOOR_WAYS):
        model = _model(tensors // 2)
        params = list(model.parameters())
        flat = torch.zeros(sum(q.numel() for q in params))
        views = list(torch.split(flat, [q.numel() for q in params]))
        views = [v.view_as(q) for v, q in zip(views, params)]
        if "hook" in way:
            left = [1 << 62]

            def count(_param, left=left):
                left[0] -= 1
                if not left[0]:
                    pass

            for q in params:
                q.register_post_accumulate_grad_hook(count)
        setups[way] = (model, params, flat, views)
    x = torch.randn(4, 8)
    spent: dict[str, list[float]] = {way: [] for way in setups}
    for way, i in in_turns(list(setups), steps, block, warmup):
        model, params, flat, views = setups[way]
        for q in params:
            q.grad = None
        loss = model(x).sum()
        t0 = time.process_time()
        if "views" in way:
            flat.zero_()
            deque(map(setattr, params, repeat("grad"), views), maxlen=0)
        loss.backward()
        if way == "copy after":
            torch._foreach_copy_(views, list(map(grad, params)))
            deque(map(setattr, params, repeat("grad"), views), maxlen=0)
        if i >= warmup:
            spent[way].append(1e6 * (time.process_time() - t0))
    plain = statistics.mean(spent["plain"])
    return {way: (statistics.mean(spent[way]) - plain) / tensors for way in FLOOR_WAYS}


def extra_per_tensor(results: dict[str, dict[str, float]], tensors: int) -> dict[str, float]:
    """Each wrapper's extra microseconds per parameter tensor over the plain model, and bagua's
    extra over torch DDP's (``ratio``)."""
    plain = sum(results["plain"].values())
    extra = {kind: (sum(results[kind].values()) - plain) / tensors for kind in ("torch", "bagua")}
    return {**extra, "ratio": extra["bagua"] / extra["torch"]}


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, nargs="+", default=[148, 1000],
                        help="parameter tensors (2 per Linear(8, 8) layer); default 148 (GPT-2 12x768's count) and 1000")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3, help="rounds, each timing every tensor count anew")
    parser.add_argument("--block", type=int, default=25,
                        help="steps a variant runs before the next takes its turn (default 25; 1: a turn every step)")
    parser.add_argument("--out", default=None, help="write the rounds and medians as JSON here")
    parser.add_argument("--floor", action="store_true",
                        help="also time what readiness per bucket costs at the least, on the bare model (floor())")
    args = parser.parse_args(argv)
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))  # fmt: skip
    torch.set_num_threads(1)
    import bagua

    bagua.init_process_group()
    rounds: dict[int, list[dict]] = {n: [] for n in args.tensors}
    for r in range(args.rounds):
        for tensors in args.tensors:
            results = measure(tensors // 2, args.steps, args.block)
            extra = extra_per_tensor(results, tensors)
            rounds[tensors].append({"phases_us": results, **extra})
            print(f"round {r + 1}: {tensors} parameter tensors, {args.steps} steps, mean process CPU us per phase")
            print(f"  {'variant':<8}" + "".join(f"{p:>11}" for p in PHASES) + f"{'total':>9}{'extra per tensor':>18}")
            for kind, phases in results.items():
                more = "" if kind == "plain" else f"{extra[kind]:.2f} us"
                print(f"  {kind:<8}" + "".join(f"{phases[p]:>11.0f}" for p in PHASES)
                      + f"{sum(phases.values()):>9.0f}{more:>18}")
            print(f"  bagua's extra host time / torch DDP's: {extra['ratio']:.2f}x", flush=True)
    summary = {n: {"median_ratio": statistics.median(x["ratio"] for x in rs),
                   "median_extra_us": {k: statistics.median(x[k] for x in rs) for k in ("torch", "bagua")}}
               for n, rs in rounds.items()}
    for n, row in summary.items():
        print(f"{n} tensors: bagua's extra / torch DDP's, median of {args.rounds}: {row['median_ratio']:.2f}x "
              f"({row['median_extra_us']['bagua']:.2f} vs {row['median_extra_us']['torch']:.2f} us per tensor; "
              f"target <= 0.5x)")
    floors = {}
    if args.floor:
        for tensors in args.tensors:
            floors[str(tensors)] = floor(tensors, args.steps, args.block)
            print(f"{tensors} tensors, the bare model's backward, us per tensor: "
                  + ", ".join(f"{way} {us:+.2f}" for way, us in floors[str(tensors)].items()), flush=True)
    if args.out:
        record = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": f"{os.cpu_count()} CPUs, load "
                  f"{os.getloadavg()[0]:.1f}", "torch": torch.__version__, "steps": args.steps, "block": args.block,
                  "rounds": {str(n): rs for n, rs in rounds.items()},
                  "summary": {str(n): row for n, row in summary.items()}, "floor_us_per_tensor": floors}
        Path(args.out).write_text(json.dumps(record, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
