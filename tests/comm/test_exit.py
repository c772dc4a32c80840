"""Ending a job: scripts that never call destroy_process_group() exit cleanly under torchrun.

Gloo threads still holding a collective at interpreter exit abort the process ("terminate called
without an active exception", SIGABRT; pytorch#190489) and torchrun marks the finished job
failed: 4 of 20 runs of tests/comm/_exit_job.py did before init_process_group registered its
exit handler. Each job here is a real torchrun launch (fresh interpreters), so these tests take
a while: most of a launch is importing torch in four processes.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import bagua
from tests.harness import free_port

ROOT = Path(__file__).resolve().parents[2]
JOB = Path(__file__).with_name("_exit_job.py")
RUNS = 20
AT_ONCE = max(1, min(4, (os.cpu_count() or 1) // 2))  # each job keeps about two cores busy
JOB_TIMEOUT_S = 120


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def _torchrun(mode: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3", str(JOB), mode]
    return subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen, what: str) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"{what} did not finish in {JOB_TIMEOUT_S} s (a hang at exit?):\n{out[-4000:]}")
    return proc.returncode, out


@pytest.mark.timeout(RUNS * JOB_TIMEOUT_S)
def test_jobs_that_never_destroy_the_process_group_exit_0_every_time():
    failures, start = [], time.monotonic()
    for first in range(0, RUNS, AT_ONCE):
        runs = range(first, min(RUNS, first + AT_ONCE))
        procs = [_torchrun("plain") for _ in runs]
        for run, proc in zip(runs, procs):
            code, out = _finish(proc, f"torchrun job {run}")
            if code != 0 or "terminate called" in out:
                failures.append(f"run {run}: exit code {code}\n{out[-3000:]}")
    assert not failures, f"{len(failures)} of {RUNS} jobs failed:\n" + "\n".join(failures)
    print(f"{RUNS} torchrun jobs, {AT_ONCE} at a time: {time.monotonic() - start:.0f} s")


def test_destroying_twice_then_exiting_is_clean():
    code, out = _finish(_torchrun("destroy"), "torchrun job")
    assert code == 0 and "terminate called" not in out, out[-4000:]


def test_a_rank_that_raises_exits_with_its_own_code_and_traceback():
    # Plain processes rather than torchrun, so that every rank's own exit status is seen (torchrun
    # stops the others once one fails).
    env = _env()
    env.update(WORLD_SIZE="3", LOCAL_WORLD_SIZE="3", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    procs = [
        subprocess.Popen([sys.executable, str(JOB), "raise"], cwd=ROOT, env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for r in range(3)
    ]  # fmt: skip
    results = [_finish(p, f"rank {r}") for r, p in enumerate(procs)]
    codes = [code for code, _ in results]
    assert codes == [0, 1, 0], "\n".join(out[-3000:] for _, out in results)
    out = results[1][1]
    assert "Traceback" in out and "RuntimeError: bagua-exit-test: rank 1 fails on purpose" in out, out
    assert not any("terminate called" in o for _, o in results)


def _comm_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("bagua-comm")]


def test_destroy_stops_the_comm_thread_and_the_exit_handler_is_registered_once(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    callbacks = None
    for _ in range(2):
        bagua.init_process_group()
        try:
            callbacks = callbacks or atexit._ncallbacks()
            assert atexit._ncallbacks() == callbacks  # a second init registers nothing more
            ddp = bagua.DistributedDataParallel(model, optimizers=[opt])
            ddp(torch.randn(4, 3)).sum().backward()  # the step's ops run on the comm thread
            opt.step()
            assert _comm_threads()
        finally:
            bagua.destroy_process_group()
            bagua.destroy_process_group()  # a no-op
        assert not _comm_threads() and not bagua.is_initialized()
        monkeypatch.delenv("MASTER_PORT")  # the next init picks a free port again
