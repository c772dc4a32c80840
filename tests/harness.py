"""Spawn N real ranks (Gloo on CPU) for a test, with a free port and a deadline.

``run_ranks(fn, world_size, *args)`` starts ``world_size`` processes, each with
torchrun's environment, calls ``bagua.init_process_group()`` in each, then
``fn(rank, *args)``, and returns the results in rank order. A rank that raises fails
the test with its traceback; ranks that do not finish by ``timeout`` are killed and
the test fails naming them, so a hang can never block the suite.

Processes come from a forkserver that has torch, torch._dynamo and bagua preloaded: fast to start,
and safe (no fork of a process that already ran torch's thread pools).

``fn`` must be a module-level function (it is pickled by reference).
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import queue
import socket
import subprocess
import time
import traceback
from typing import Any, Callable, Optional

# Every test's ranks come from this one forkserver (tests.compat's harness too).
process_context = mp.get_context("forkserver")
process_context.set_forkserver_preload(["torch", "torch._dynamo", "bagua"])  # init_process_group imports torch._dynamo: ~2 s a rank


class RankFailure(AssertionError):
    """One or more ranks raised or hung."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn, rank, world_size, local_world_size, port, args, results, init_kwargs, comm_timeout_s):
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank % local_world_size),
        LOCAL_WORLD_SIZE=str(local_world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    try:
        import torch

        torch.set_num_threads(1)
        import bagua

        if init_kwargs is not None:
            bagua.init_process_group(timeout=datetime.timedelta(seconds=comm_timeout_s), **init_kwargs)
        result = fn(rank, *args)
        # Plain pickle: the queue's pickler would send tensors as shared-memory handles, which the
        # parent can no longer open once this process has exited.
        results.put(("ok", rank, pickle.dumps(result)))
    except BaseException:  # report everything, including SystemExit from inside fn
        results.put(("error", rank, traceback.format_exc()))
    finally:
        try:
            import bagua

            if bagua.is_initialized():
                bagua.destroy_process_group()
        except Exception:
            pass


def _launch(fn, world_size, args, timeout, local_world_size, init_kwargs, init, comm_timeout_s, fresh=False):
    """Run the ranks; return ({rank: (status, payload)}, [ranks that never reported], procs).

    ``free_port()`` only finds a port free: another process of a busy machine may take it before
    rank 0's store binds it. Such a job (a rank's error says EADDRINUSE) runs once more on a new port.
    """
    for _ in range(2):
        outcomes, missing, procs = _launch_once(fn, world_size, args, timeout, local_world_size, init_kwargs, init,
                                                comm_timeout_s, fresh)
        if not any(status == "error" and "EADDRINUSE" in str(payload) for status, payload in outcomes.values()):
            break
    return outcomes, missing, procs


def _launch_once(fn, world_size, args, timeout, local_world_size, init_kwargs, init, comm_timeout_s, fresh):
    local_world_size = local_world_size or world_size
    port = free_port()
    context = mp.get_context("spawn") if fresh else process_context
    results = context.Queue()
    kwargs = (init_kwargs or {}) if init else None
    procs = [
        context.Process(
            target=_child,
            args=(fn, r, world_size, local_world_size, port, args, results, kwargs, comm_timeout_s),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    outcomes: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout
    first_error_at: Optional[float] = None
    try:
        while len(outcomes) < world_size:
            now = time.monotonic()
            # After one rank fails, give the others a moment to report, then stop waiting.
            limit = deadline if first_error_at is None else min(deadline, first_error_at + 15.0)
            if now >= limit:
                break
            try:
                status, rank, payload = results.get(timeout=min(0.5, limit - now))
            except queue.Empty:
                if all(not p.is_alive() for p in procs) and results.empty():
                    break
                continue
            outcomes[rank] = (status, pickle.loads(payload) if status == "ok" else payload)
            if status == "error" and first_error_at is None:
                first_error_at = time.monotonic()
    finally:
        for p in procs:
            p.join(timeout=1.0 if len(outcomes) == world_size else 0)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    missing = [r for r in range(world_size) if r not in outcomes]
    return outcomes, missing, procs


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 90.0,
    local_world_size: Optional[int] = None,
    init_kwargs: Optional[dict] = None,
    init: bool = True,
    comm_timeout_s: float = 60.0,
    fresh_interpreters: bool = False,
) -> list[Any]:
    """Run ``fn(rank, *args)`` on ``world_size`` real ranks; return the results by rank.

    Args:
        timeout: seconds for the whole job; ranks still running then are killed.
        local_world_size: ranks per simulated node (default: all on one node).
        init_kwargs: extra keyword arguments for ``bagua.init_process_group``.
        init: False to leave ``init_process_group`` to ``fn``.
        comm_timeout_s: the process group's collective timeout.
        fresh_interpreters: start each rank as a new interpreter (slow), for a test of what
            happens before torch._dynamo is imported (the forkserver preloads it).
    """
    outcomes, missing, procs = _launch(fn, world_size, args, timeout, local_world_size, init_kwargs, init, comm_timeout_s,
                                       fresh_interpreters)
    errors = {r: tb for r, (status, tb) in sorted(outcomes.items()) if status == "error"}
    if errors or missing:
        parts = [f"rank {r} raised:\n{tb}" for r, tb in errors.items()]
        if missing:
            codes = {r: procs[r].exitcode for r in missing}
            parts.append(f"ranks {missing} did not finish within {timeout:.0f} s or died (killed; exit codes {codes})")
        raise RankFailure("\n".join(parts))
    return [outcomes[r][1] for r in range(world_size)]


def run_ranks_expect_errors(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 90.0, **kwargs: Any
) -> dict[int, str]:
    """For a job meant to fail: every rank must raise (none may hang); return {rank: traceback}."""
    outcomes, missing, _ = _launch(
        fn, world_size, args, timeout, kwargs.get("local_world_size"), kwargs.get("init_kwargs"),
        kwargs.get("init", True), kwargs.get("comm_timeout_s", 60.0),
    )
    if missing:
        raise RankFailure(f"ranks {missing} hung or died instead of raising")
    ok = [r for r, (status, _) in outcomes.items() if status == "ok"]
    if ok:
        raise RankFailure(f"ranks {ok} succeeded; expected every rank to raise")
    return {r: tb for r, (_, tb) in sorted(outcomes.items())}


def _descendants(pid: int) -> list[int]:
    """``pid``'s child processes and theirs (from /proc), parents before children."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(0), []):
            found.append(child)
            todo.append(child)
    return found


def _dump_stacks(proc: subprocess.Popen) -> str:
    """Every thread's stack in the stuck job's processes: native and Python frames from py-spy
    where it is installed, and Python tracebacks from faulthandler (SIGABRT; the job runs with
    PYTHONFAULTHANDLER=1), which print even when the main thread holds the GIL in a deadlock."""
    import shutil
    import signal
    import sys

    tree = [proc.pid, *_descendants(proc.pid)]
    report = []
    spy = shutil.which("py-spy") or shutil.which("py-spy", path=os.path.dirname(sys.executable))
    if spy:
        for pid in tree:
            try:
                out = subprocess.run([spy, "dump", "--native", "--pid", str(pid)], capture_output=True, text=True, timeout=30)
                report.append(f"--- py-spy dump of {pid}\n{out.stdout}{out.stderr}")
            except (OSError, subprocess.TimeoutExpired) as e:
                report.append(f"--- py-spy dump of {pid} failed: {e}")
    for pid in reversed(tree):  # workers first: their tracebacks reach the launcher's stderr
        try:
            os.kill(pid, signal.SIGABRT)
        except ProcessLookupError:
            pass
        time.sleep(0.2)
    return "\n".join(report)


def run_command(cmd: list[str], timeout: float, cwd: Optional[str] = None) -> subprocess.CompletedProcess:
    """Run a whole job (a launcher, an example) to its end: the test fails with the job's output
    if it runs past ``timeout`` seconds (a hang) or exits non-zero; returns the finished process
    (``stdout`` and ``stderr`` as text). On a hang the failure shows every thread's stack in the
    job's processes (see ``_dump_stacks``), then they are killed.

    Example::

        proc = run_command([sys.executable, "examples/train_lm.py", "--steps", "5"], timeout=120)
    """
    import pytest

    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        tree = _descendants(proc.pid)
        stacks = _dump_stacks(proc)
        try:
            stdout, stderr = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            stdout, stderr = "", ""
        for pid in [proc.pid, *tree]:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        if not stdout and not stderr:
            stdout, stderr = proc.communicate()
        pytest.fail(f"{' '.join(map(str, cmd))} did not finish in {timeout:.0f} s (a hang?)\n{stdout}\n{stderr[-20000:]}\n{stacks}", pytrace=False)
    done = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
    if done.returncode != 0:
        pytest.fail(f"{' '.join(map(str, cmd))} exited with {done.returncode}:\n{(stdout + stderr)[-5000:]}")
    return done
