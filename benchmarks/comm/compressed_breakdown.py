#!/usr/bin/env python3
"""Where a compressed gradient allreduce's step goes: a per-thread timeline of bagua's 8-bit path.

Runs ``benchmarks.step.ddp``'s 10M-parameter MLP on the emulated network (each rank its own machine
behind a shaped link), times ``local`` (no communication), torch DDP and one bagua algorithm (``bytegrad`` by
default) interleaved, then records a timeline of the bagua variant's steps: on the training
thread forward, backward (its end includes the wait for the last bucket) and the optimizer step;
on the thread that runs the buckets' allreduces, per bucket and per pipelined segment, the CPU
work (encode, then decode + reduce + encode, then decode of the results) and the waits for the
network (phase 1, the chunks to their reducers; phase 2, the reduced chunks to everyone).

The report splits the step into what the link could not hide: the link's busy time (this rank's
bytes on the wire at the link's rate), forward, the backward compute before the first bucket's
launch, the tail after backward's compute (the last bucket's exchange and decode), and codec work
that ran while the link had nothing to send. Message sizes per phase come from the chunks.

Example (root, iproute2; from the repository root)::

    python -m benchmarks.comm.compressed_breakdown --ranks 4 --rate 100mbit          # bytegrad
    python -m benchmarks.comm.compressed_breakdown --ranks 4 --rate 100mbit --algorithm qadam
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Optional, Sequence

from benchmarks.jobs import emulated, run, worker
from benchmarks.network import parse_rate


class Timeline:
    """Spans ``(thread, label, t0, t1, info)`` recorded by wrapped functions while ``on``."""

    def __init__(self):
        self.spans: list[tuple[str, str, float, float, dict]] = []
        self.on = False
        self._lock = threading.Lock()

    def add(self, label: str, t0: float, t1: float, **info) -> None:
        if self.on:
            with self._lock:
                self.spans.append((threading.current_thread().name, label, t0, t1, info))

    def wrap(self, owner, name: str, label: str, info=None) -> None:
        """Replace ``owner.name`` by a timed call of it (``info(*args)``: extra fields)."""
        original = getattr(owner, name)
        timeline = self

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                timeline.add(label, t0, time.perf_counter(), **(info(*args) if info else {}))

        setattr(owner, name, timed)


def instrument(timeline: Timeline) -> None:
    """Time the compressed allreduce's phases and the buckets' ops (bagua's private classes: a
    diagnostic, not an API)."""
    from bagua.algorithms import gradient_allreduce
    from bagua.comm import compressed, p2p

    def seg_info(seg, *_):
        rank = seg.pg.rank
        return {"tag": seg.tag, "p1_msg": [c.wire_numel * seg.send[0].element_size() for j, c in enumerate(seg.chunks) if j != rank],
                "p2_msg": seg.chunks[rank].wire_numel * seg.send[0].element_size()}

    timeline.wrap(compressed._Segment, "send_chunks", "encode+send", seg_info)
    timeline.wrap(compressed._Segment, "reduce_and_share", "reduce+share", seg_info)
    timeline.wrap(compressed._Segment, "result_into", "decode results", seg_info)
    timeline.wrap(p2p.Requests, "wait", "wait", lambda req: {"what": getattr(req, "label", "handle")})
    init = compressed._Segment.__init__

    def labelled_init(seg, *args, **kwargs):
        init(seg, *args, **kwargs)
        seg.phase1.label, seg.phase2.label = "phase 1", "phase 2"

    compressed._Segment.__init__ = labelled_init
    timeline.wrap(gradient_allreduce, "allreduce_bucket", "bucket",
                  lambda bucket, *_: {"bucket": bucket.name, "numel": bucket.flat.numel()})


def analyse(spans: list[tuple], steps: list[tuple[float, float, float, float]], rate_bit: float, wire_per_step: float
            ) -> dict[str, Any]:
    """Per step (``(t_start, t_forward_end, t_backward_end, t_end)``), medians over steps of the
    step's parts: see the module docstring."""
    per: dict[str, list[float]] = defaultdict(list)
    for t0, tf, tb, t1 in steps:
        inside = [s for s in spans if t0 <= s[2] < t1]
        comm = [s for s in inside if s[0] != "MainThread"]
        buckets = sorted((s for s in comm if s[1] == "bucket"), key=lambda s: s[2])
        cpu = defaultdict(float)
        waits = defaultdict(float)
        for _, label, a, b, info in comm:
            if label == "wait":
                waits[info["what"]] += b - a
        for _, label, a, b, info in comm:
            if label in ("encode+send", "reduce+share", "decode results"):
                cpu[label] += b - a
        # the waits inside reduce+share (phase 1) and decode results (phase 2) are not CPU work
        cpu["reduce+share"] -= waits["phase 1"]
        cpu["decode results"] -= waits["phase 2"]
        first = buckets[0][2] if buckets else tb
        last_end = max((s[3] for s in buckets), default=tb)
        per["step"].append(t1 - t0)
        per["forward"].append(tf - t0)
        per["backward (wall, incl. the wait for the buckets)"].append(tb - tf)
        per["optimizer step"].append(t1 - tb)
        per["backward compute before the first bucket launches"].append(first - tf)
        per["first bucket launch -> last bucket done"].append(last_end - first)
        if buckets:
            per["last bucket: launch -> done"].append(buckets[-1][3] - buckets[-1][2])
        per["codec CPU: encode (phase 1)"].append(cpu["encode+send"])
        per["codec CPU: decode + reduce + encode (phase 2)"].append(cpu["reduce+share"])
        per["codec CPU: decode results"].append(cpu["decode results"])
        per["waiting for phase 1"].append(waits["phase 1"])
        per["waiting for phase 2"].append(waits["phase 2"])
        per["buckets"].append(len(buckets))
    out = {k: statistics.median(v) for k, v in per.items()}
    out["link busy (this rank's wire bytes at the link rate)"] = wire_per_step * 8 / rate_bit if rate_bit else 0.0
    return out


def run_worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    import bagua
    from benchmarks.network import tx_bytes_reader
    from benchmarks.step.ddp import make_batches, make_variant, parse_mlp
    from benchmarks.step.timing import time_interleaved

    torch.set_num_threads(args.threads)
    Path("/proc/sys/net/ipv4/tcp_congestion_control").write_text(args.tcp_cc)
    bagua.init_process_group()
    rank = bagua.get_rank()
    dims = parse_mlp(args.mlp)
    tx = tx_bytes_reader()

    def log(msg: str) -> None:
        if rank == 0:
            print(f"[breakdown] {msg}", flush=True)

    names = ["local", "ddp", args.algorithm]
    variants = [make_variant(n, dims, args.warmup, 500) for n in names]
    batches = make_batches(dims, args.batch, 8, rank)
    rows, diverged = time_interleaved(variants, batches, args.warmup, args.reps, args.block, log, tx)
    if diverged:
        raise SystemExit(f"diverged: {diverged}")

    timeline = Timeline()
    instrument(timeline)
    v = variants[-1]
    steps = []
    dist.barrier()
    w0 = tx() if tx else 0
    for k in range(args.traced_steps):
        batch = batches[k % len(batches)]
        t0 = time.perf_counter()
        timeline.on = True
        v.opt.zero_grad(set_to_none=True)
        loss = v.loss(v.model, batch)
        tf = time.perf_counter()
        loss.backward()
        tb = time.perf_counter()
        v.opt.step()
        t1 = time.perf_counter()
        timeline.on = False
        steps.append((t0, tf, tb, t1))
    dist.barrier()
    wire = ((tx() - w0) / args.traced_steps) if tx else 0.0
    mine = analyse(timeline.spans, steps, args.rate_bit, wire)
    msg = next((s[4] for s in timeline.spans if s[1] == "encode+send"), {})
    out = Path(args.out_dir) / f"rank{rank}.json"
    out.write_text(json.dumps({"rank": rank, "parts": mine, "messages": msg, "wire_per_step": wire,
                               "rows": {n: rows[n]["step_s"] for n in names} if rank == 0 else None,
                               "timeline": [s for s in timeline.spans if steps[-1][0] <= s[2] < steps[-1][3]],
                               "last_step": steps[-1]}))
    for vv in variants:
        vv.close()
    dist.barrier()
    bagua.destroy_process_group()
    return 0


def report(results: list[dict], args: argparse.Namespace) -> str:
    rows = results[0]["rows"]
    lines = [f"## {args.algorithm} at {args.rate}, {args.ranks} ranks as machines (`python -m benchmarks.comm.compressed_breakdown`)", "",
             f"Step medians of the interleaved run: local (no communication) {rows['local'] * 1e3:.0f} ms, "
             f"torch DDP {rows['ddp'] * 1e3:.0f} ms, {args.algorithm} {rows[args.algorithm] * 1e3:.0f} ms: "
             f"DDP / {args.algorithm} = {rows['ddp'] / rows[args.algorithm]:.2f}x.", "",
             f"Traced {args.algorithm} steps ({args.traced_steps}), median per rank, ms:", "",
             "| part | " + " | ".join(f"rank {r['rank']}" for r in results) + " |",
             "|---|" + "---:|" * len(results)]
    for key in results[0]["parts"]:
        vals = [r["parts"][key] for r in results]
        fmt = (lambda x: f"{x:.0f}") if key == "buckets" else (lambda x: f"{x * 1e3:.0f}")
        lines.append(f"| {key} | " + " | ".join(fmt(x) for x in vals) + " |")
    m = results[0]["messages"]
    if m:
        lines += ["", f"Messages of one segment (rank 0): phase 1 {m['p1_msg']} bytes to each other rank, "
                      f"phase 2 {m['p2_msg']} bytes to each."]
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out-dir", help=argparse.SUPPRESS)
    p.add_argument("--rate-bit", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--rate", default="100mbit")
    p.add_argument("--algorithm", default="bytegrad")
    p.add_argument("--mlp", default="1024-1664x4-10", help="benchmarks.step.ddp's network model (10.0M params)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--block", type=int, default=4)
    p.add_argument("--traced-steps", type=int, default=6)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--tcp-cc", default="cubic")
    p.add_argument("--timeout", type=float, default=1500)
    p.add_argument("--json", help="also write the ranks' results here")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    if args.worker:
        return run_worker(args)
    with tempfile.TemporaryDirectory() as out_dir:
        os.chmod(out_dir, 0o777)
        command = worker("benchmarks.comm.compressed_breakdown", "--worker", "--out-dir", out_dir,
                         "--rate-bit", parse_rate(args.rate), "--algorithm", args.algorithm, "--mlp", args.mlp,
                         "--batch", args.batch, "--warmup", args.warmup, "--reps", args.reps, "--block", args.block,
                         "--traced-steps", args.traced_steps, "--threads", args.threads, "--tcp-cc", args.tcp_cc)
        run(emulated(command, "--ranks", str(args.ranks), "--rate", args.rate, "--timeout", str(args.timeout)),
            args.timeout + 60)
        results = [json.loads((Path(out_dir) / f"rank{r}.json").read_text()) for r in range(args.ranks)]
    print(report(results, args))
    if args.json:
        Path(args.json).write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
