"""Starting a benchmark's rank jobs: the one way every driver does it.

A driver builds its job's command from a worker (``worker``: ``python -m <module> ...``) and a
launcher: ``loopback`` (torchrun, every rank on this machine's loopback) or ``emulated`` (the
emulated network's command line, ``python -m benchmarks.network.netns``, every machine its own
network namespace behind a shaped link). ``run_job`` starts it from the repository root (so no
module path depends on the caller's directory), echoes its output and returns the JSON that
rank 0 printed after a tag. Underneath, ``RankJob`` starts processes together, watches them,
stops them all when one fails or the deadline passes, and reports each one's exit status and the
tail of its output; ``ShapedNetwork.run`` starts its ranks with it too. Standard library only.

Example::

    cmd = emulated(worker("benchmarks.comm.allreduce", "--worker"), "--ranks", "2", "--rate", "100mbit")
    job = run_job(cmd, 600, "@@bagua-comm-bench@@ ", logger)   # rank 0's JSON, or None (logged)

    RankJob([["python", "-c", "print(1)"]] * 2, ["r0", "r1"], "demo").run(timeout=30)   # [0, 0]
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Any, Mapping, Optional, Sequence

logger = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[1]
"""The repository root: every job starts here, so ``python -m benchmarks...`` finds its module."""

_OUTPUT_TAIL_BYTES = 1 << 20  # keep at most the last 1 MiB of each rank's output
_REPORT_TAIL_LINES = 40


class RankFailedError(RuntimeError):
    """A rank exited non-zero (or, for :class:`RankTimeoutError`, the job ran past its timeout).

    Attributes:
        rank: the rank that failed first (for a timeout: the first rank still running).
        returncode: its exit status (negative: killed by that signal; None: still running).
        returncodes: every rank's exit status after the others were stopped.
        output: the tail of the failing rank's output (stdout and stderr together).
        outputs: the tail of every rank's output.
    """

    def __init__(
        self,
        message: str,
        rank: int,
        returncode: int | None,
        returncodes: list[int | None],
        outputs: list[str],
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.returncode = returncode
        self.returncodes = returncodes
        self.outputs = outputs
        self.output = outputs[rank] if 0 <= rank < len(outputs) else ""


class RankTimeoutError(RankFailedError):
    """The ranks did not all finish within the timeout; all were killed."""


class _Rank:
    def __init__(self, index: int, proc: subprocess.Popen, sink: IO[bytes] | None) -> None:
        self.index = index
        self.proc = proc
        self.sink = sink  # temp file holding the output (ranks > 0)
        self.buffer = bytearray()  # rank 0: tail of its streamed output
        self.reader: threading.Thread | None = None

    def output(self) -> str:
        if self.sink is not None:
            try:
                self.sink.flush()
                size = self.sink.seek(0, os.SEEK_END)
                self.sink.seek(max(0, size - _OUTPUT_TAIL_BYTES))
                data = self.sink.read()
            except (OSError, ValueError):
                data = b""
        else:
            data = bytes(self.buffer)
        return data.decode("utf-8", errors="replace")


def _tail(text: str, lines: int = _REPORT_TAIL_LINES) -> list[str]:
    return text.splitlines()[-lines:]


class RankJob:
    """One command started as every rank at once, watched until all end, one fails or the
    deadline passes; then every rank's process group is stopped.

    Args:
        argvs: the full command line of each rank (e.g. ``ShapedNetwork.rank_argv``).
        names: each rank's name in reports (e.g. its namespace).
        prefix: of the temporary files that hold ranks > 0's output.

    Example::

        job = RankJob([net.rank_argv(i, cmd) for i in range(2)], net.namespaces, "bgn")
        job.run(timeout=60)          # [0, 0]; job.outputs: the tail of each rank's output
    """

    def __init__(self, argvs: Sequence[Sequence[str]], names: Sequence[str], prefix: str) -> None:
        self.argvs = [list(a) for a in argvs]
        self.names = list(names)
        self.prefix = prefix
        self.returncodes: list[int | None] = []
        self.outputs: list[str] = []

    def run(
        self,
        timeout: float,
        check: bool = True,
        stream: IO[str] | None = None,
        echo: bool = True,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike | None = None,
        grace: float = 2.0,
    ) -> list[int | None]:
        """Start every rank (with ``env``, default this process's, in ``cwd``, default this
        process's) and wait: rank 0's output streams to ``stream`` (default ``sys.stdout``)
        unless ``echo`` is False, the others' is kept for the report. Returns the exit statuses;
        with ``check``, a failure raises ``RankFailedError`` and the deadline
        ``RankTimeoutError`` (without, their ranks read None). Stopping sends SIGTERM and, after
        ``grace`` seconds, SIGKILL."""
        base_env = dict(os.environ if env is None else env)
        out = stream if stream is not None else sys.stdout
        ranks: list[_Rank] = []
        deadline = time.monotonic() + timeout
        failed: _Rank | None = None
        timed_out = False
        try:
            for i in range(len(self.argvs)):
                if i == 0:
                    proc = subprocess.Popen(
                        self.argvs[i], env=base_env, cwd=cwd, stdin=subprocess.DEVNULL,
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                    r = _Rank(i, proc, None)
                    r.reader = threading.Thread(
                        target=self._pump, args=(r, out if echo else None), daemon=True
                    )
                    r.reader.start()
                else:
                    sink = tempfile.TemporaryFile(prefix=f"{self.prefix}r{i}-")
                    proc = subprocess.Popen(
                        self.argvs[i], env=base_env, cwd=cwd, stdin=subprocess.DEVNULL,
                        stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
                    )
                    r = _Rank(i, proc, sink)
                ranks.append(r)

            while True:
                running = 0
                for r in ranks:
                    rc = r.proc.poll()
                    if rc is None:
                        running += 1
                    elif rc != 0 and failed is None:
                        failed = r
                if failed is not None or running == 0:
                    break
                if time.monotonic() >= deadline:
                    timed_out = True
                    break
                time.sleep(0.02)
        finally:
            # On success this only reaps stray children that a rank left behind.
            survivors = self._stop(ranks, grace)
            self.returncodes = [r.proc.returncode for r in ranks]
            self.outputs = [r.output() for r in ranks]
            for r in ranks:
                if r.sink is not None:
                    r.sink.close()

        if timed_out:
            hung = survivors or [r.index for r in ranks if r.proc.returncode != 0]
            first = hung[0] if hung else 0
            msg = self._report(
                f"timeout after {timeout:g} s: rank(s) {hung} still running; all ranks killed",
                hung,
            )
            if check:
                raise RankTimeoutError(msg, first, None, self.returncodes, self.outputs)
            logger.error(msg)
            for i in hung:
                self.returncodes[i] = None
        elif failed is not None:
            msg = self._report(
                f"rank {failed.index} failed with exit code {failed.proc.returncode}; "
                f"the other ranks were stopped",
                [failed.index],
            )
            if check:
                raise RankFailedError(
                    msg, failed.index, failed.proc.returncode, self.returncodes, self.outputs
                )
            logger.error(msg)
        return list(self.returncodes)

    @staticmethod
    def _pump(r: _Rank, out: IO[str] | None) -> None:
        assert r.proc.stdout is not None
        for line in iter(r.proc.stdout.readline, b""):
            r.buffer += line
            if len(r.buffer) > _OUTPUT_TAIL_BYTES:
                del r.buffer[: len(r.buffer) - _OUTPUT_TAIL_BYTES]
            if out is not None:
                try:
                    out.write(line.decode("utf-8", errors="replace"))
                    out.flush()
                except (OSError, ValueError):
                    out = None
        r.proc.stdout.close()

    @staticmethod
    def _stop(ranks: list[_Rank], grace: float = 2.0) -> list[int]:
        """Kill every rank's process group; return the ranks that were still running."""
        survivors = [r.index for r in ranks if r.proc.poll() is None]

        def killpg(r: _Rank, sig: int) -> None:
            try:
                os.killpg(r.proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

        for r in ranks:
            if r.proc.poll() is None:
                killpg(r, signal.SIGTERM)
        end = time.monotonic() + grace
        while time.monotonic() < end and any(r.proc.poll() is None for r in ranks):
            time.sleep(0.02)
        for r in ranks:
            killpg(r, signal.SIGKILL)  # also takes down children left in the group
        for r in ranks:
            try:
                r.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                logger.warning("rank %d (pid %d) did not die after SIGKILL", r.index, r.proc.pid)
            if r.reader is not None:
                r.reader.join(timeout=5)
        return survivors

    def _report(self, headline: str, ranks: Sequence[int]) -> str:
        """``headline`` plus the output tail of each of ``ranks``, lines prefixed [rank i]."""
        lines = [headline]
        for i in ranks:
            if i >= len(self.outputs):
                continue
            lines.append(f"--- rank {i} ({self.names[i]}), exit {self.returncodes[i]}, "
                         f"last {_REPORT_TAIL_LINES} lines of output ---")
            tail = _tail(self.outputs[i])
            lines.extend(f"[rank {i}] {line}" for line in tail)
            if not tail:
                lines.append(f"[rank {i}] (no output)")
        return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# a driver's jobs: commands, one run, rank 0's JSON
# --------------------------------------------------------------------------------------------


def worker(module: str, *args: Any) -> list[str]:
    """``python -m module args``: a benchmark's worker, run from the repository root."""
    return [sys.executable, "-m", module, *map(str, args)]


def loopback(ranks: int, command: Sequence[str], *launcher_args: str) -> list[str]:
    """``command`` (``worker(...)``, or ``[sys.executable, script, ...]``) as ``ranks`` ranks on this
    machine's loopback: torchrun ``--standalone`` with ``launcher_args`` (e.g. ``--max-restarts 2``)."""
    if not command or command[0] != sys.executable:
        raise ValueError(f"loopback() runs this interpreter's worker(...) or script, got {list(command)}")
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
            *launcher_args, *command[1:]]


def emulated(command: Sequence[str], *netns_args: str) -> list[str]:
    """``command`` as the ranks of emulated machines: the emulated network's command line with
    ``netns_args`` (``--ranks 2 --rate 100mbit``, ``--machines 4 --ranks-per-machine 2``,
    ``--delay 5``, ``--timeout 900``...; needs root and iproute2)."""
    return [sys.executable, "-m", "benchmarks.network.netns", *netns_args, "--", *command]


def run(cmd: Sequence[str], timeout: float, stream: IO[str] | None = None, echo: bool = True,
        env: Mapping[str, str] | None = None) -> RankJob:
    """Run one job's command (a launcher: torchrun, the emulated network) from the repository
    root and wait. Raises ``RankFailedError`` (``RankTimeoutError`` past ``timeout``) with the
    tail of its output; the job's ``outputs[0]`` holds that tail either way.

    ``OMP_NUM_THREADS`` defaults to 1 (torchrun would set it anyway, with a warning) and output
    is unbuffered; on a timeout the job gets 15 s to clean up (the emulated network removes its
    namespaces) before it is killed.
    """
    env = dict(os.environ if env is None else env)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    print("$ " + " ".join(cmd), flush=True)
    job = RankJob([cmd], ["job"], "bgjob")
    job.run(timeout, stream=stream, echo=echo, env=env, cwd=ROOT, grace=15.0)
    return job


class _TaggedEcho:
    """A job's output, echoed line by line as ``  | line``, but for the line that carries rank
    0's JSON after ``tag``, which is kept (``job``; ``error`` when it does not parse)."""

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.job: Optional[dict[str, Any]] = None
        self.error: Optional[str] = None

    def write(self, line: str) -> None:
        if self.tag in line:
            try:
                self.job = json.loads(line.split(self.tag, 1)[1])
            except ValueError as e:
                self.error = f"its {self.tag.strip()} line is not JSON ({e})"
        else:
            sys.stdout.write("  | " + line)

    def flush(self) -> None:
        sys.stdout.flush()


def run_job(cmd: Sequence[str], timeout: float, json_tag: str, log: logging.Logger) -> Optional[dict[str, Any]]:
    """Run one job (``run``), echo its output, return the JSON rank 0 printed after ``json_tag``
    (None on failure or timeout, with a warning on ``log``)."""
    echo = _TaggedEcho(json_tag)
    try:
        run(cmd, timeout, stream=echo)
    except RankTimeoutError:
        log.warning("job timed out after %.0f s: %s", timeout, " ".join(cmd))
        return None
    except RankFailedError as e:
        log.warning("job failed (exit %s%s): %s", e.returncode, ", no results" if echo.job is None else "",
                    " ".join(cmd))
        return None
    if echo.job is None:
        log.warning("job failed (exit 0, %s): %s", echo.error or "no results", " ".join(cmd))
        return None
    return echo.job


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (a job's rendezvous, a server's)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
