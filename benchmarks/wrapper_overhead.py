#!/usr/bin/env python3
"""The wrapper's host cost per parameter tensor: bagua vs torch DDP, one rank, on the CPU.

Where a step is bound by the host (small models, fast GPUs, slow VM CPUs: see "GPU check" in
RESULTS.md), what a data-parallel wrapper adds per parameter tensor to every step decides its
overhead. This measures it with the arithmetic taken away: a model of many tiny tensors
(``--layers`` Linear(8, 8) layers, two tensors each), one rank on Gloo (no network), SGD, and
each training step split into zero_grad / forward / backward / step, timed in process CPU time
(all threads of the process, so a hand-off to a communication thread counts; a busy machine
inflates it less than wall time). Variants run interleaved: the plain model, torch DDP, bagua
``gradient_allreduce``. Printed: the mean microseconds of each phase, and each wrapper's extra
time per parameter tensor over the plain model.

    python benchmarks/wrapper_overhead.py              # ~30 s
    python benchmarks/wrapper_overhead.py --layers 200 --steps 500
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist

PHASES = ("zero_grad", "forward", "backward", "step")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model(layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(layers)])


def measure(layers: int, steps: int, warmup: int = 20) -> dict[str, dict[str, float]]:
    """Mean process CPU microseconds per phase, per variant (plain, torch, bagua)."""
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
    for i in range(warmup + steps):
        for kind, (model, opt) in variants.items():
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=74, help="Linear(8, 8) layers; 2 tensors each (default 74: 148 tensors, GPT-2 12x768's count)")
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))  # fmt: skip
    torch.set_num_threads(1)
    import bagua

    bagua.init_process_group()
    results = measure(args.layers, args.steps)
    tensors = 2 * args.layers
    print(f"{tensors} parameter tensors, {args.steps} steps, mean process CPU microseconds per phase")
    print(f"{'variant':<8}" + "".join(f"{p:>11}" for p in PHASES) + f"{'total':>9}{'extra per tensor':>18}")
    plain = sum(results["plain"].values())
    for kind, phases in results.items():
        total = sum(phases.values())
        extra = "" if kind == "plain" else f"{(total - plain) / tensors:.2f} us"
        print(f"{kind:<8}" + "".join(f"{phases[p]:>11.0f}" for p in PHASES) + f"{total:>9.0f}{extra:>18}")
    ratio = (sum(results["bagua"].values()) - plain) / (sum(results["torch"].values()) - plain)
    print(f"bagua's extra host time / torch DDP's: {ratio:.2f}x")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
