"""The bandwidth x latency study: epoch time of torch DDP and every bagua algorithm per network.

Bagua's tradeoff exploration (its paper's BERT-Large finetune, 128 GPUs on 16 machines, links
throttled by hand) redone on emulated machines: 4 ranks, each its own machine in a network
namespace (``benchmarks.network``: tbf both ways, ``--delay`` a userspace delay line, TCP
cubic), swept over bandwidth at 0 ms (1 Gbit/s, 300, 100, 30, 10 Mbit/s; the legs bridged) and
over one-way latency at 1 Gbit/s (0, 1, 2, 5, 10, 20 ms, through the delay line), plus 8 ranks at
100 Mbit/s. The workload is ``examples/train_lm.py``'s language model (the time-to-accuracy
size: GPT-2 4 layers x 256, 3.24M parameters, 13 MB of fp32 gradients; batches of its
load-balanced sampler, its fused AdamW; qadam its ``QAdamOptimizer``). The variants are timed
interleaved in one job per setting (``benchmarks.step.timing``): torch DDP fp32 and with its fp16
compression hook, and the seven bagua algorithms (async averaging every 50 ms, as train_lm; qadam and
onebit_grad past their 1-step warm-up, the untimed step). An
epoch is ``EPOCH_STEPS`` steps: the mean timed step times that (data loading excluded).

    python -m benchmarks.tradeoff.sweep             # the sweep, ~30-45 min on 2 cores (root, iproute2), then --report
    python -m benchmarks.tradeoff.sweep --quick     # ~9 min: the same grid and steps, a 0.44M model
    python -m benchmarks.tradeoff.sweep --settings bw-10mbit lat-5ms    # (re)run these settings only
    python -m benchmarks.tradeoff.sweep --only bytegrad qadam          # (re)run these variants, merged in
    python -m benchmarks.tradeoff.sweep --report    # figures, fit, RESULTS.md, docs from the JSON

Each setting's result goes into ``benchmarks/results/tradeoff[_quick].json`` as soon as it
finishes; a run started again skips the settings already there (``--fresh``: start over). The
report (``report.py``) draws ``figures/tradeoff[_quick].png``, fits the cost model of
``bagua.advise`` (``fit.py``) and rewrites the generated parts of RESULTS.md and
``docs/choosing_an_algorithm.md``. The last line printed is the key ratio: DDP's epoch time over
bytegrad's at 10 Mbit/s.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from benchmarks.jobs import emulated, run_job, worker
from benchmarks.network import check_requirements, parse_rate, tx_bytes_reader
from benchmarks.records import RESULTS
from benchmarks.tradeoff.fit import ADVISE_NAME

logger = logging.getLogger("tradeoff")
JSON_TAG = "@@tradeoff@@ "
VARIANTS = ("ddp", "ddp-fp16", "gradient_allreduce", "bytegrad", "decentralized", "low_precision_decentralized",
            "async", "qadam", "onebit_grad")
# machines.py's own (several ranks per machine): "-hier", hierarchical=True, exact within each
# machine; "local", the step with no wrapper and no communication (the compute at that many ranks on these cores)
MACHINES_VARIANTS = ("gradient_allreduce-hier", "bytegrad-hier", "decentralized-hier",
                         "low_precision_decentralized-hier", "local")
EPOCH_STEPS = 100
WARMUP = 1  # untimed steps per variant (qadam's fp32 warm-up and onebit_grad's exact one are this long)
ASYNC_INTERVAL_MS = 50  # as examples/train_lm.py
# model flags for train_lm.py: the time-to-accuracy size, and a smaller one for a first look
MODEL = {
    "full": ["--layers", "4", "--width", "256", "--heads", "4", "--context", "64", "--batch-size", "4"],
    "quick": ["--layers", "2", "--width", "128", "--heads", "2", "--context", "64", "--batch-size", "4",
              "--max-files", "300"],
    # little compute per byte: GPT-2 4 x 512 (12.7M parameters, 51 MB of fp32 gradients), one 16-token document
    "comm-bound": ["--layers", "4", "--width", "512", "--heads", "8", "--context", "16", "--batch-size", "1"],
}  # fmt: skip
NUM_BATCHES = 4  # per rank, cycled


@dataclass(frozen=True)
class Setting:
    """One network: ``ranks`` machines, ``rate`` each way (tc syntax), ``delay_ms`` one way
    (None: legs bridged, no delay line), and ``reps`` x ``block`` timed steps per variant."""

    key: str
    ranks: int
    rate: str
    delay_ms: Optional[float]
    reps: int
    block: int
    sweep: str  # "bandwidth", "latency" or "ranks"


def _settings() -> list[Setting]:
    """The grid: the bandwidth sweep (bridged), the latency sweep (delay line), 8 ranks; timed
    steps per variant sized so that the slow links cost minutes, not hours (the quick run's
    smaller model takes the same steps). At 10 Mbit/s a step is one ~5-17 s block whose time moves
    by up to 10% from one to the next (an epoch from 3 of them was 3-7% off for the compressed
    variants), so that setting takes 6."""
    reps = 3
    blocks = {"1gbit": 4, "300mbit": 3, "100mbit": 2, "30mbit": 1, "10mbit": 1}
    reps_at = {"10mbit": 6}
    return ([Setting(f"bw-{rate}", 4, rate, None, reps_at.get(rate, reps), block, "bandwidth")
             for rate, block in blocks.items()]
            + [Setting(f"lat-{ms:g}ms", 4, "1gbit", float(ms), reps, blocks["1gbit"] - 1, "latency")
               for ms in (0, 1, 2, 5, 10, 20)]
            + [Setting("x8-100mbit", 8, "100mbit", None, 2, blocks["100mbit"], "ranks")])


SETTINGS = _settings()


def results_path(size: str) -> Path:
    return RESULTS / f"tradeoff{'_quick' if size == 'quick' else ''}.json"


# ---- worker: one setting, every variant interleaved ------------------------------------------------

def _lm_batches(train_lm, lm_args, rank: int, world: int) -> list:
    """This rank's first ``NUM_BATCHES`` batches of the example's load-balanced sampler."""
    from torch.utils.data import DataLoader

    cached, _, lengths = train_lm.datasets(lm_args, rank)
    batches, epoch_setter = train_lm.batch_sampler(lm_args, cached, lengths, rank, world)
    epoch_setter.set_epoch(0)
    out = []
    for batch in DataLoader(cached, batch_sampler=batches, collate_fn=train_lm.pad_batch):
        out.append(batch)
        if len(out) == NUM_BATCHES:
            break
    cached.close()
    return out


def bucket_layout(variant) -> list[int]:
    """Bytes of each bucket the variant communicates, in launch order (torch DDP: its reducer's)."""
    if variant.is_torch:
        sizes = variant.model._get_ddp_logging_data().get("bucket_sizes", "")
        return [int(s) for s in str(sizes).split(",") if s.strip()]
    return [b.flat.numel() * b.flat.element_size() for b in variant.model.buckets]


def messages_per_step(name: str, buckets: list[int], world: int, speculating: bool = True,
                      ranks_per_machine: int = 1) -> dict[str, Any]:
    """The variant's buckets and its step's collectives as ``bagua.advise`` counts them from the
    code: bytes, messages in sequence (hops) and what each hides behind (qadam: ``speculating``,
    what its ``overlap="auto"`` trial chose; ``-hier``: hierarchical over machines of
    ``ranks_per_machine``, else flat)."""
    from bagua.advise import message_pattern

    base = name.removesuffix("-hier")
    pattern = message_pattern(ADVISE_NAME.get(base, base), buckets, world, ranks_per_machine, backend="gloo",
                              speculating=speculating, hierarchical=name.endswith("-hier"))
    on_step = [c for c in pattern if c.overlap != "background"]
    return {"buckets": buckets, "messages": [asdict(c) for c in pattern], "hops_per_step": sum(c.hops for c in on_step),
            "model_bytes_per_step": sum(c.nbytes for c in on_step)}


def run_worker(args: argparse.Namespace) -> int:
    import torch

    import bagua
    from benchmarks.step.timing import Variant, time_interleaved
    from examples import train_lm

    bagua.init_process_group()
    torch.set_num_threads(1)
    rank, world = bagua.get_rank(), bagua.get_world_size()
    t_start = time.monotonic()

    def log(msg: str) -> None:
        if rank == 0:
            print(f"[{args.setting}] {msg} ({time.monotonic() - t_start:.0f}s)", flush=True)

    def lm_args(name: str):  # the model and optimizer ("-hier" changes neither)
        plain = name.startswith("ddp") or name == "local"  # torch's model and optimizer (the fp16 hook: Variant's)
        algorithm = train_lm.BASELINE if plain else name.removesuffix("-hier")
        return train_lm.parse_args([*MODEL[args.size], "--algorithm", algorithm, "--warmup-steps", str(WARMUP),
                                    "--cache-dir", args.cache_dir])

    batches = _lm_batches(train_lm, lm_args("ddp"), rank, world)
    def loss(model, batch):
        return train_lm.token_loss(model, batch)[0]

    variants = []
    for name in args.variants:
        model = train_lm.build_model(lm_args(name))  # seeded: identical on every rank, no broadcast needed
        opt = train_lm.make_optimizer(lm_args(name), model)
        variants.append(Variant(name, model, opt, loss, ASYNC_INTERVAL_MS, init_sync=False, warmup=WARMUP))
    params = sum(p.numel() for p in variants[0].model.parameters())
    log(f"built {len(variants)} variants of the {params / 1e6:.2f}M-parameter LM; {len(batches)} batches per rank")
    rows, diverged = time_interleaved(variants, batches, WARMUP, args.reps, args.block, log, tx_bytes_reader())
    for v in variants:
        if v.name in rows and not v.is_local:  # local: no collective to count
            speculating = rows[v.name].get("overlap_trial", (True,))[0]
            rows[v.name].update(messages_per_step(v.name, bucket_layout(v), world, speculating, args.ranks_per_machine))
        if v.name not in diverged or v.is_torch:  # a torch DDP goes before the groups: Variant.close
            v.close()
    if rank == 0:
        tokens = [int(b["attention_mask"].sum()) for b in batches]
        job = {"setting": args.setting, "world": world, "params": params, "model_flags": MODEL[args.size],
               "reps": args.reps, "block": args.block, "warmup": WARMUP, "tokens_per_batch": tokens,
               "async_interval_ms": ASYNC_INTERVAL_MS, "torch": torch.__version__,
               "tcp_cc": Path("/proc/sys/net/ipv4/tcp_congestion_control").read_text().strip(),
               "elapsed_s": time.monotonic() - t_start, "variants": rows, "diverged": diverged}
        print(JSON_TAG + json.dumps(job), flush=True)
    torch.distributed.barrier()
    bagua.destroy_process_group()
    return 0


# ---- driver ----------------------------------------------------------------------------------------

def load_results(path: Path) -> dict[str, Any]:
    """The results file (``{"settings": {key: record}}``), or an empty one."""
    if path.exists():
        return json.loads(path.read_text())
    return {"settings": {}}


def save_results(path: Path, results: dict[str, Any]) -> None:
    """Write ``results`` atomically (a killed run leaves the previous file whole)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(results, indent=1))
    os.replace(tmp, path)


def merge(results: dict[str, Any], setting: Setting, job: dict[str, Any], rate_bit: float) -> None:
    """Put one job's rows into ``results``: a new record, or (a rerun of some variants) its rows
    replacing those of the same variants, each row dated."""
    date = time.strftime("%Y-%m-%d %H:%M")
    for row in job["variants"].values():
        row["date"] = date
    known = results["settings"].get(setting.key)
    if known is not None and known["setting"] == asdict(setting):
        known["job"]["variants"].update(job["variants"])
        known["job"]["diverged"] = {**{k: v for k, v in known["job"]["diverged"].items() if k not in job["variants"]},
                                    **job["diverged"]}  # fmt: skip
        known["job"]["elapsed_s"] += job["elapsed_s"]
        return
    results["settings"][setting.key] = {"setting": asdict(setting), "rate_bit": rate_bit, "date": date, "job": job}


def plan(settings: Sequence[Setting], results: dict[str, Any], variants: Sequence[str], named: bool,
         only: bool) -> list[Setting]:
    """The settings to run: all named ones; otherwise those not yet measured with every variant."""
    if named or only:
        return list(settings)
    todo = []
    for s in settings:
        known = results["settings"].get(s.key)
        if known is None or known["setting"] != asdict(s) or set(variants) - set(known["job"]["variants"]):
            todo.append(s)
    return todo


def worker_command(setting: Setting, size: str, variants: Sequence[str], cache_dir: str, timeout: float) -> list[str]:
    """The command line that runs one setting's job on the emulated network."""
    flags = ["--ranks", str(setting.ranks), "--rate", setting.rate, "--timeout", str(timeout)]
    if setting.delay_ms is not None:
        flags += ["--delay", f"{setting.delay_ms:g}"]
    return emulated(worker("benchmarks.tradeoff.sweep", "--worker", "--setting", setting.key, "--size", size,
                           "--reps", setting.reps, "--block", setting.block, "--cache-dir", cache_dir,
                           "--variants", *variants), *flags)


def run_driver(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="tradeoff: %(levelname)s %(message)s")
    check_requirements()
    path = Path(args.results or results_path(args.size))
    results = {"settings": {}} if args.fresh else load_results(path)
    results["size"] = args.size
    results.setdefault("machine", {"description": (
        f"a {os.cpu_count()}-CPU {platform.machine()} machine, Linux {platform.release()}, Python "
        f"{platform.python_version()}, load average {os.getloadavg()[0]:.1f} at the start"),
        "cpus": os.cpu_count(), "load_start": os.getloadavg()[0]})  # the cost model's ranks-per-core facts
    by_key = {s.key: s for s in SETTINGS}
    chosen = [by_key[k] for k in args.settings] if args.settings else SETTINGS
    variants = list(args.only or VARIANTS)
    todo = plan(chosen, results, variants, bool(args.settings), bool(args.only))
    t0, failed = time.monotonic(), []
    print(f"{len(todo)} setting(s) to run: {' '.join(s.key for s in todo) or '-'}; results: {path}", flush=True)
    for setting in todo:
        print(f"\n### {setting.key}: {setting.ranks} ranks, {setting.rate}, "
              f"{'bridged' if setting.delay_ms is None else f'{setting.delay_ms:g} ms'} "
              f"({time.monotonic() - t0:.0f} s elapsed)", flush=True)
        load_before = os.getloadavg()  # 1, 5, 15 minutes: what else ran on the machine (noise between settings)
        job = run_job(worker_command(setting, args.size, variants, args.cache_dir, args.timeout),
                      args.timeout + 60, JSON_TAG, logger)
        if job is None:
            failed.append(setting.key)
            continue
        job["loadavg_before"] = list(load_before)
        merge(results, setting, job, parse_rate(setting.rate))
        save_results(path, results)
        print(f"saved {setting.key} to {path}", flush=True)
    if failed:
        logger.error("these settings failed (rerun them with --settings %s)", " ".join(failed))
    from benchmarks.tradeoff.report import main as report_main

    report_main(["--results", str(path)])
    return 1 if failed else 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n")[1])
    parser.add_argument("--quick", action="store_true", help="the same grid and steps with a 0.44M model: ~9 minutes")
    parser.add_argument("--settings", nargs="+", metavar="KEY", help="run these settings (again), others kept")
    parser.add_argument("--only", nargs="+", choices=VARIANTS, help="run only these variants, merged into the results")
    parser.add_argument("--fresh", action="store_true", help="start a new results file instead of resuming")
    parser.add_argument("--report", action="store_true", help="no run: figures, fit, RESULTS.md and docs from the JSON")
    parser.add_argument("--results", default=None, help="the results JSON (default benchmarks/results/tradeoff[_quick].json)")
    parser.add_argument("--timeout", type=float, default=1500.0, help="seconds per setting's job (default 1500)")
    parser.add_argument("--cache-dir", default="/tmp/bagua-tta-cache", help="the LM's LMDB document cache")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--setting", help=argparse.SUPPRESS)
    parser.add_argument("--size", default=None, choices=list(MODEL), help=argparse.SUPPRESS)
    parser.add_argument("--reps", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--block", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--variants", nargs="+", choices=VARIANTS + MACHINES_VARIANTS, default=list(VARIANTS),
                        help=argparse.SUPPRESS)
    # the machines the model counts the recorded pattern on (1: every rank a machine, as in the sweep and
    # on loopback; machines.py gives its layout's)
    parser.add_argument("--ranks-per-machine", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.size = args.size or ("quick" if args.quick else "full")
    if args.worker:
        return run_worker(args)
    if args.report:
        from benchmarks.tradeoff.report import main as report_main

        return report_main(["--results", args.results] if args.results else [])
    keys = {s.key for s in SETTINGS}
    unknown = sorted(set(args.settings or ()) - keys)
    if unknown:
        parser.error(f"unknown setting(s) {', '.join(unknown)} ; known: {', '.join(sorted(keys))}")
    return run_driver(args)


if __name__ == "__main__":
    sys.exit(main())
