#!/usr/bin/env python3
"""Elastic training: restart success and recovery time under torchrun, and checkpoint cost.

Parts:

- restarts: ``torchrun --standalone --nproc-per-node 2 --max-restarts 2`` runs a job whose rank 1
  kills itself (SIGKILL) after 10 allreduces of its first attempt; the trial succeeds when the
  job exits 0 with both ranks finishing the second attempt. Bagua's job
  (``bagua.init_process_group``) and the control (plain ``torch.distributed.init_process_group``)
  alternate, ``--trials`` each. Recovery time: from the kill (the killed rank writes the time
  first) to the end of the first allreduce of the restarted attempt (rank 0), median over the
  successful trials.
- c10d: two torchrun agents on this machine (``--nnodes 1:2 --rdzv-backend c10d``, last call
  1 s, keep-alive 1 s x 3) train examples/elastic_digits.py; one agent is killed and later
  started again (``run_c10d_scale``). Recovery: from the kill to the first step at world size 1,
  and from the joining agent's launch to the first step at world size 2; median over
  ``--c10d-trials``.
- machines: the c10d part at 16 ranks, 8 agents of 2 workers (every agent a machine, as 8 x 2
  GPUs): one whole machine is killed, the job goes on at 14 ranks from its last checkpoint and
  takes the machine back (``run_machine_loss``; not in the default parts: ~5 min here).
- checkpoint: a 2-rank torchrun job trains the 10M-parameter MLP of ``benchmarks.step.ddp``
  (1024-1664x4-10, SGD with momentum, batch 64 per rank, gradient_allreduce) and times
  ``bagua.checkpoint.save_checkpoint`` against the step time; reported as the share of step
  time at a save every ``--interval`` steps.

Targets: 20/20 restarts for bagua; recovery under 5 s (standalone); checkpoint under 2% of step
time at the chosen interval.

Usage (from the repository root)::

    python -m benchmarks.scale.elastic                # every part (~8 min)
    python -m benchmarks.scale.elastic --parts restarts --trials 5
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.jobs import ROOT, free_port, loopback, run_job, worker

logger = logging.getLogger("benchmarks.scale.elastic")
MODULE = "benchmarks.scale.elastic"
CHECKPOINT_TAG = "@@elastic@@ "  # the checkpoint job's rank 0 prints its JSON after this


def restart_worker(args: argparse.Namespace) -> int:
    """One rank of a restart trial (``--worker restart --launcher bagua|torch``)."""
    import torch
    import torch.distributed as dist

    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if args.launcher == "bagua":
        import bagua

        bagua.init_process_group()
        allreduce, rank = bagua.comm.allreduce, bagua.get_rank()
    else:
        dist.init_process_group("gloo")
        allreduce, rank = dist.all_reduce, dist.get_rank()
    t = torch.ones(1000)
    for step in range(20):
        allreduce(t)
        if attempt > 0 and step == 0 and rank == 0:
            Path(args.dir, "resumed").write_text(repr(time.time()))
        if attempt == 0 and rank == 1 and step == 10:
            Path(args.dir, "killed").write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
    print(f"rank {rank} attempt {attempt} done", flush=True)
    dist.destroy_process_group()
    return 0


def run_restarts(trials: int) -> dict:
    results: dict[str, dict] = {}
    for trial in range(trials):
        for launcher in ("bagua", "torch"):
            with tempfile.TemporaryDirectory() as marks:
                cmd = loopback(2, worker(MODULE, "--worker", "restart", "--launcher", launcher, "--dir", marks),
                               "--max-restarts", "2")
                log = Path(marks, "log")
                with open(log, "w") as sink:
                    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT,
                                            start_new_session=True)
                    try:
                        ok = proc.wait(timeout=45) == 0  # a healthy trial takes ~7 s
                        out = log.read_text()
                    except subprocess.TimeoutExpired:  # a hang: the launcher and its workers go
                        _kill_matching(marks)
                        proc.wait()
                        out, ok = "timeout", False
                ok = ok and "rank 0 attempt 1 done" in out and "rank 1 attempt 1 done" in out
                entry = results.setdefault(launcher, {"ok": 0, "trials": 0, "recovery_s": [], "failures": []})
                entry["trials"] += 1
                if ok:
                    entry["ok"] += 1
                    killed, resumed = (float(Path(marks, n).read_text()) for n in ("killed", "resumed"))
                    entry["recovery_s"].append(resumed - killed)
                else:
                    reason = "connectFullMesh" if "connectFullMesh" in out else ("hang" if out == "timeout" else "exit")
                    entry["failures"].append(reason)
                print(f"trial {trial + 1} {launcher}: {'ok' if ok else 'FAILED (' + entry['failures'][-1] + ')'}", flush=True)
    for entry in results.values():
        entry["median_recovery_s"] = statistics.median(entry["recovery_s"]) if entry["recovery_s"] else None
    return results


def _kill_matching(text: str) -> None:
    """SIGKILL every process whose command line contains ``text`` (a trial's launcher and workers,
    which torchrun starts in sessions of their own)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if text.encode() in Path("/proc", pid, "cmdline").read_bytes():
                os.kill(int(pid), signal.SIGKILL)
        except (OSError, ProcessLookupError):
            pass


C10D_CONF = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3"
EXAMPLE = ROOT / "examples" / "elastic_digits.py"


def trained_samples(sample_dir: Path) -> dict[int, list[int]]:
    """Per epoch, the samples of every step that counts, from ``elastic_digits.py --sample-log``:
    a step repeated after a restart counts in the latest attempt only."""
    by_step: dict[int, dict] = {}
    for record in sample_records(sample_dir):
        kept = by_step.get(record["step"])
        if kept is None or record["attempt"] > kept["attempt"]:
            by_step[record["step"]] = kept = {"attempt": record["attempt"], "epoch": record["epoch"], "ranks": {}}
        if kept["attempt"] == record["attempt"]:
            kept["ranks"][record["rank"]] = record["samples"]
    epochs: dict[int, list[int]] = {}
    for step in sorted(by_step):
        for samples in by_step[step]["ranks"].values():
            epochs.setdefault(by_step[step]["epoch"], []).extend(samples)
    return epochs


def sample_records(sample_dir: Path) -> list[dict]:
    records = []
    for path in Path(sample_dir).glob("*.jsonl"):
        lines = path.read_text().splitlines()
        # a worker killed mid-write may leave a partial last line
        records += [json.loads(line) for line in lines if line.endswith("}")]
    return records


def run_c10d_scale(workdir: Path, epochs: int = 40, timeout: float = 120.0, agents: int = 2, nproc: int = 1,
                   global_batch: int = 48, last_call_s: int = 1) -> dict:
    """``agents`` torchrun agents on this machine, ``nproc`` workers each (``--nnodes
    {agents-1}:{agents} --rdzv-backend c10d``: every agent a machine), train
    examples/elastic_digits.py; the last agent is killed (SIGKILL, with its workers) once the job
    trains at full size, and started again once the others have trained and checkpointed without
    it. ``global_batch`` must divide by both world sizes; ``last_call_s``: how long a rendezvous
    waits for latecomers once enough agents joined.

    Returns the worlds of the attempts in order, the recovery times (kill -> first step at the
    smaller world; the joining agent's launch -> first step at full size again), and the samples
    per epoch (``trained_samples``). Raises RuntimeError naming the phase that did not happen in
    time.
    """
    port = free_port()
    samples, started = Path(workdir, "samples"), time.monotonic()
    full, less = agents * nproc, (agents - 1) * nproc
    conf = C10D_CONF.replace("last_call_timeout=1", f"last_call_timeout={last_call_s}")

    def agent(is_host: int, name: str) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", f"{max(1, agents - 1)}:{agents}",
               "--nproc-per-node", str(nproc), "--max-restarts", "5", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "scale", "--rdzv-conf", f"{conf},is_host={is_host}",
               str(EXAMPLE), "--epochs", str(epochs), "--global-batch", str(global_batch), "--checkpoint-every", "10",
               "--checkpoint-dir", str(Path(workdir, "ckpt")), "--sample-log", str(samples)]
        # A joining node hangs ~60 s without TORCH_DISABLE_SHARE_RDZV_TCP_STORE (docs/elastic.md)
        env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1"}
        sink = open(Path(workdir, f"{name}.log"), "a")
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT,
                                start_new_session=True)

    def wait_for(what: str, condition) -> list[dict]:
        while time.monotonic() - started < timeout:
            records = sample_records(samples) if samples.exists() else []
            if condition(records):
                return records
            time.sleep(0.2)
        for proc in running:
            _kill_tree(proc.pid)
        logs = "\n".join(f"--- {p.name}\n" + p.read_text()[-3000:] for p in sorted(Path(workdir).glob("*.log")))
        raise RuntimeError(f"c10d scale test: {what} did not happen within {timeout:.0f} s\n{logs}")

    def steps_at(world: int, after: float, records: list[dict]) -> list[int]:
        return sorted(r["step"] for r in records if r["world"] == world and r["time"] > after)

    running = [agent(1 if i == 0 else 0, f"agent-{i}") for i in range(agents)]
    # killed past the checkpoint of step 40 (epoch 1 at world size 2: 30 steps per epoch)
    wait_for(f"training at world size {full}", lambda rs: max(steps_at(full, 0, rs), default=0) >= 45)
    killed = time.time()
    _kill_tree(running[-1].pid)
    running[-1].wait()
    records = wait_for(f"training at world size {less}, past a checkpoint",
                       lambda rs: len(steps_at(less, killed, rs)) >= 12)
    resumed_down = min(r["time"] for r in records if r["world"] == less and r["time"] > killed)
    joined = time.time()
    running[-1] = agent(0, f"agent-{agents - 1}")
    records = wait_for(f"training at world size {full} again", lambda rs: steps_at(full, joined, rs))
    resumed_up = min(r["time"] for r in records if r["world"] == full and r["time"] > joined)
    wait_for("the end of training", lambda rs: all(p.poll() is not None for p in running))
    worlds = {}
    for r in sorted(sample_records(samples), key=lambda r: r["attempt"]):
        worlds.setdefault(r["attempt"], r["world"])
    return {
        "exit_codes": [p.returncode for p in running],
        "worlds": list(worlds.values()),
        "recovery_down_s": resumed_down - killed,
        "recovery_up_s": resumed_up - joined,
        "epochs": trained_samples(samples),
    }


def run_c10d_trials(trials: int) -> dict:
    down, up, failures = [], [], []
    for trial in range(trials):
        with tempfile.TemporaryDirectory() as workdir:
            try:
                result = run_c10d_scale(Path(workdir))
            except RuntimeError as e:
                failures.append(str(e).splitlines()[0])
                print(f"c10d trial {trial + 1}: FAILED ({failures[-1]})", flush=True)
                continue
        down.append(result["recovery_down_s"])
        up.append(result["recovery_up_s"])
        print(f"c10d trial {trial + 1}: worlds {result['worlds']}, exit codes {result['exit_codes']}, "
              f"down {down[-1]:.2f} s, up {up[-1]:.2f} s", flush=True)
    return {"trials": trials, "ok": len(down), "failures": failures, "recovery_down_s": down, "recovery_up_s": up,
            "median_down_s": statistics.median(down) if down else None,
            "median_up_s": statistics.median(up) if up else None}


def run_machine_loss(agents: int = 8, nproc: int = 2, epochs: int = 16, timeout: float = 600.0) -> dict:
    """A 16-rank job (8 agents of 2 workers: every agent a machine) loses a whole machine, goes on
    at 14 ranks and takes the machine back (``run_c10d_scale``); checks that every epoch, gathered
    over the attempts, trained every sample once up to the sampler's padding."""
    with tempfile.TemporaryDirectory() as workdir:
        started = time.monotonic()
        # 112 divides by 16 and by 14; a longer last call lets all 8 agents join the first round
        result = run_c10d_scale(Path(workdir), epochs=epochs, timeout=timeout, agents=agents, nproc=nproc,
                                global_batch=112, last_call_s=5)
    full = agents * nproc
    exact = all(sorted(set(samples)) == list(range(1437)) and len(samples) <= 1437 + full
                for samples in result["epochs"].values())
    summary = {"agents": agents, "workers_per_agent": nproc, "exit_codes": result["exit_codes"],
               "worlds": result["worlds"], "recovery_down_s": result["recovery_down_s"],
               "recovery_up_s": result["recovery_up_s"], "epochs": len(result["epochs"]),
               "every_sample_once_per_epoch": exact, "elapsed_s": time.monotonic() - started}
    print(f"machines: worlds {summary['worlds']}, exit codes {summary['exit_codes']}, down "
          f"{summary['recovery_down_s']:.1f} s, up {summary['recovery_up_s']:.1f} s, every sample once per "
          f"epoch: {exact}", flush=True)
    return summary


def _kill_tree(pid: int) -> None:
    """SIGKILL a torchrun agent and its workers (which torchrun starts in sessions of their own)."""
    children = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path("/proc", entry, "stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            children.append(int(entry))
    for victim in children + [pid]:
        try:
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:
            pass


def checkpoint_worker(args: argparse.Namespace) -> int:
    """One rank of the checkpoint-cost job (``--worker checkpoint``, under torchrun)."""
    import torch
    import torch.nn.functional as F

    import bagua
    from benchmarks.step.ddp import make_batches, make_model, parse_mlp

    torch.set_num_threads(1)
    bagua.init_process_group()
    dims = parse_mlp("1024-1664x4-10")
    model = make_model(dims)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    ddp = bagua.DistributedDataParallel(model, [opt])
    batches = make_batches(dims, 64, 4, bagua.get_rank())
    steps, saves = [], []
    directory = args.dir  # the driver's temporary directory, the same for every rank
    for i in range(args.steps):
        start = time.perf_counter()
        x, y = batches[i % len(batches)]
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
        steps.append(time.perf_counter() - start)
        if i % 5 == 4:
            start = time.perf_counter()
            bagua.checkpoint.save_checkpoint(f"{directory}/step-{i}.pt", step=i, model=ddp, optimizers=[opt])
            saves.append(time.perf_counter() - start)
    if bagua.get_rank() == 0:
        size = os.path.getsize(f"{directory}/step-{args.steps - 1}.pt")
        step_s, save_s = statistics.median(steps[2:]), statistics.median(saves)
        print(CHECKPOINT_TAG + json.dumps({"step_s": step_s, "save_s": save_s, "bytes": size}), flush=True)
    bagua.destroy_process_group()
    return 0


def run_checkpoint(interval: int) -> dict:
    with tempfile.TemporaryDirectory() as directory:
        cmd = loopback(2, worker(MODULE, "--worker", "checkpoint", "--steps", "30", "--dir", directory))
        result = run_job(cmd, 600, CHECKPOINT_TAG, logger)
    if result is None:
        raise RuntimeError("the checkpoint job failed (its output is above)")
    result["interval"] = interval
    result["share_of_step_time"] = result["save_s"] / (interval * result["step_s"])
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", nargs="+", choices=["restarts", "c10d", "machines", "checkpoint"],
                   default=["restarts", "c10d", "checkpoint"])
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--c10d-trials", type=int, default=3)
    p.add_argument("--interval", type=int, default=100, help="steps between checkpoints (checkpoint part)")
    p.add_argument("--worker", choices=["restart", "checkpoint"], help=argparse.SUPPRESS)
    p.add_argument("--launcher", choices=["bagua", "torch"], help=argparse.SUPPRESS)
    p.add_argument("--dir", help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=30, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker == "restart":
        return restart_worker(args)
    if args.worker == "checkpoint":
        return checkpoint_worker(args)
    report = {"date": time.strftime("%Y-%m-%d %H:%M")}
    if "restarts" in args.parts:
        report["restarts"] = run_restarts(args.trials)
    if "c10d" in args.parts:
        report["c10d"] = run_c10d_trials(args.c10d_trials)
    if "machines" in args.parts:
        report["machines"] = run_machine_loss()
    if "checkpoint" in args.parts:
        report["checkpoint"] = run_checkpoint(args.interval)
    print(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
