#!/usr/bin/env python3
"""Hugging Face ``Trainer`` step time at 100 Mbit/s: plain (torch DDP fp32) vs bagua's hooks.

``examples/hf_trainer.py`` (the byte-level GPT-2 of ``train_lm.py``, trained by the unchanged
``transformers.Trainer``) on 2 ranks of the emulated network (``benchmarks.network``), each rank a
machine of its own behind a tbf-capped link. Jobs: ``--hook none`` (the plain Trainer), ``--hook bytegrad`` and
``--hook onebit_grad`` (bagua's compression as torch DDP's communication hook, attached by a
callback), each on the ``"bagua"`` torch backend with ``--streams`` (default 4) except the plain
one (Gloo, as a Trainer user has it). The jobs alternate for ``--reps`` rounds, so load drifts hit
them alike. A job's step time is the median over its steps after ``--skip`` (set-up, first-touch
allocations), each step timed by the example (the wall time between optimizer steps, data
loading included, evaluations left out); rank 0's.

The model is sized so that the link, not the 2-core machine, sets the pace: 4 layers of width 512
(12.7M parameters, 51 MB of fp32 gradients a step: ~4 s at 100 Mbit/s), 2 documents of 64 bytes
per rank and step. That is the case the hook is for; with more compute per byte the ratio falls
toward 1 (``ddp.py`` and ``tradeoff/sweep.py`` measure that range).

Target (issue "Bagua where people already train"): bytegrad at least 3x faster per step than the
plain Trainer at 100 Mbit/s. The last line printed is that ratio.

Usage (from the repository root)::

    python -m benchmarks.step.hf_trainer                   # ~8 min, root (network namespaces)
    python -m benchmarks.step.hf_trainer --hooks none bytegrad --reps 1 --steps 12
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from benchmarks.jobs import ROOT, RankFailedError, emulated, run
from benchmarks.network import requirements_problem
from benchmarks.records import RESULTS, save_run

logger = logging.getLogger("benchmarks.step.hf_trainer")
EXAMPLE = ROOT / "examples" / "hf_trainer.py"
MODEL = ["--layers", "4", "--width", "512", "--heads", "8", "--context", "64", "--batch-size", "2"]
TARGET = 3.0


def run_hook(hook: str, args: argparse.Namespace, out_dir: Path, cache_dir: Path) -> Optional[dict[str, Any]]:
    """One job of the example on the emulated network; its rank-0 JSON, or None (logged) on failure."""
    example = [sys.executable, str(EXAMPLE), "--hook", hook, "--steps", str(args.steps), *MODEL,
               "--max-files", str(args.max_files), "--val-docs", "16", "--warmup-steps", "5",
               "--out-dir", str(out_dir), "--cache-dir", str(cache_dir)]
    if hook != "none":
        example += ["--streams", str(args.streams)]
    cmd = emulated(example, "--ranks", "2", "--rate", args.rate, "--timeout", str(args.timeout))
    started = time.monotonic()
    try:
        output, rc = run(cmd, args.timeout + 60, echo=False).outputs[0], 0
    except RankFailedError as e:
        output, rc = e.output, e.returncode
    final = [line for line in output.splitlines() if "final:" in line]
    logger.info("%s: exit %s after %.0f s; %s", hook, rc, time.monotonic() - started,
                final[-1].strip() if final else "no final line")
    result = out_dir / f"hf_trainer_{hook}.json"
    if rc != 0 or not result.exists():
        logger.warning("%s failed:\n%s", hook, output[-4000:])
        return None
    record = json.loads(result.read_text())
    result.unlink()
    return record


def summarize(runs: dict[str, list[dict[str, Any]]], skip: int) -> tuple[dict[str, Any], list[str]]:
    """Median step time per hook (each job's median after ``skip`` steps, then the median over jobs),
    the final losses, and the speed-ups over the plain Trainer."""
    rows, lines = {}, []
    for hook, records in runs.items():
        medians = [statistics.median(r["step_times"][skip:]) for r in records]
        rows[hook] = {
            "step_s": statistics.median(medians), "step_s_per_rep": medians,
            "final_train_loss": [r["final_train_loss"] for r in records], "eval_loss": [r["eval_loss"] for r in records],
            "parameters": records[0]["parameters"], "striped_calls": [r.get("striped_calls") for r in records],
            "bagua_bytes_sent": [r.get("bagua_bytes_sent") for r in records],
        }
        lines.append(f"{hook:12s} step {rows[hook]['step_s'] * 1e3:8.0f} ms  (per rep: "
                     f"{', '.join(f'{m * 1e3:.0f}' for m in medians)})  eval loss {rows[hook]['eval_loss']}")
    key = {}
    if "none" in rows:
        for hook in (h for h in rows if h != "none"):
            ratio = rows["none"]["step_s"] / rows[hook]["step_s"]
            key[f"{hook}_speedup"] = ratio
            verdict = f" (target >={TARGET:g}x: {'met' if ratio >= TARGET else 'NOT met'})" if hook == "bytegrad" else ""
            lines.append(f"plain Trainer / {hook} hook step time: {ratio:.2f}x{verdict}")
    return {"rows": rows, "key": key}, lines


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.split("\n\n")[0])
    p.add_argument("--hooks", nargs="+", default=["none", "bytegrad", "onebit_grad"],
                   choices=["none", "bytegrad", "onebit_grad"])
    p.add_argument("--rate", default="100mbit", help="the link of each emulated machine (default 100mbit)")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps per job (default 20)")
    p.add_argument("--skip", type=int, default=4, help="first steps of each job left out (default 4)")
    p.add_argument("--reps", type=int, default=2, help="rounds of all jobs, alternating (default 2)")
    p.add_argument("--streams", type=int, default=4, help="connection sets of the hooked jobs' 'bagua' backend")
    p.add_argument("--max-files", type=int, default=150, help="corpus files (default 150)")
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--out", default=str(RESULTS / "hf_trainer.json"))
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="hf-trainer-bench: %(message)s")
    problem = requirements_problem()
    if problem:
        print(f"KEY: not measured: {problem}")
        return 1
    started = time.monotonic()
    runs: dict[str, list[dict[str, Any]]] = {hook: [] for hook in args.hooks}
    failed = []
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            order = args.hooks[rep % len(args.hooks):] + args.hooks[:rep % len(args.hooks)]
            for hook in order:
                record = run_hook(hook, args, Path(tmp) / "out", Path(tmp) / "cache")
                (runs[hook].append(record) if record else failed.append(f"{hook} rep {rep}"))
    runs = {hook: records for hook, records in runs.items() if records}
    summary, lines = summarize(runs, args.skip)
    print("\n".join(lines))
    save_run(args.out, time.monotonic() - started, failed, summary["key"], rows=summary["rows"],
             settings={"rate": args.rate, "steps": args.steps, "skip": args.skip, "reps": args.reps,
                       "streams": args.streams, "model": MODEL, "ranks": 2})
    key = summary["key"].get("bytegrad_speedup")
    print(f"KEY: plain Trainer / bytegrad hook step at {args.rate}: "
          + (f"{key:.2f}x (target >={TARGET:g}x)" if key else "not measured"))
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
