"""The ranks' processes of one job: started together, watched, stopped, reported.

Rank 0's output streams as it comes; the others' goes to temporary files and is shown only when
a rank fails. As soon as one fails, or the deadline passes, every rank's process group is killed
(so a hung collective cannot outlive its job), and the error carries each rank's exit status and
the tail of its output. ``ShapedNetwork.run`` starts its ranks this way. Standard library only.

Example::

    job = RankJob([["python", "-c", "print(1)"]] * 2, ["r0", "r1"], "demo")
    job.run(timeout=30)          # [0, 0]
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import IO, Mapping, Sequence

logger = logging.getLogger(__name__)

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
    ) -> list[int | None]:
        """Start every rank (with ``env``, default this process's) and wait: rank 0's output
        streams to ``stream`` (default ``sys.stdout``) unless ``echo`` is False, the others' is
        kept for the report. Returns the exit statuses; with ``check``, a failure raises
        ``RankFailedError`` and the deadline ``RankTimeoutError`` (without, their ranks read
        None)."""
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
                        self.argvs[i], env=base_env, stdin=subprocess.DEVNULL,
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
                        self.argvs[i], env=base_env, stdin=subprocess.DEVNULL,
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
            survivors = self._stop(ranks)
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
