"""Helpers shared by the benchmark drivers: run a worker job, read a rank's interface counter.

Example::

    job = run_job([sys.executable, "benchmarks/comm.py", "--worker"], 600, "@@tag@@ ", logger)
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def run_job(cmd: list[str], timeout: float, json_tag: str, logger: logging.Logger) -> Optional[dict[str, Any]]:
    """Run one worker job, echo its output, return the JSON rank 0 printed after ``json_tag``
    (None on failure or timeout, with a warning)."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # torchrun would set it anyway, with a warning
    env["PYTHONUNBUFFERED"] = "1"
    print("$ " + " ".join(cmd), flush=True)
    job = None
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            if json_tag in line:
                job = json.loads(line.split(json_tag, 1)[1])
            else:
                sys.stdout.write("  | " + line)
                sys.stdout.flush()
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(cmd, timeout)
        rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
        logger.warning("job timed out after %.0f s: %s", timeout, " ".join(cmd))
        return None
    if rc != 0 or job is None:
        logger.warning("job failed (exit %s%s): %s", rc, ", no results" if job is None else "", " ".join(cmd))
        return None
    return job


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tx_bytes_reader() -> Optional[Callable[[], int]]:
    """A function returning this rank's interface tx byte count, or None where not per-rank.

    Only under netns.py (GLOO_SOCKET_IFNAME set, one rank per namespace) is the interface this
    rank's alone; on loopback every rank (and everything else on the machine) shares ``lo``.
    """
    ifname = os.environ.get("GLOO_SOCKET_IFNAME")
    if not ifname or os.environ.get("LOCAL_WORLD_SIZE") != "1":
        return None
    path = Path("/sys/class/net") / ifname / "statistics" / "tx_bytes"
    if not path.exists():
        return None
    return lambda: int(path.read_text())


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``values`` with linear interpolation."""
    s = sorted(values)
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def fmt_bytes(n: Optional[float]) -> str:
    """``1.05MB``, ``16.5KB``, ``512B``; ``-`` for None."""
    if n is None:
        return "-"
    for unit, mult in (("MB", 1e6), ("KB", 1e3)):
        if n >= mult:
            return f"{n / mult:.3g}{unit}"
    return f"{n:.0f}B"


def import_netns():
    """benchmarks/netns.py as a module, whether or not ``benchmarks`` is on the path."""
    sys.path.insert(0, str(HERE))
    try:
        import netns
    finally:
        sys.path.pop(0)
    return netns


def netns_problem() -> Optional[str]:
    """Why the network-namespace benchmarks cannot run here (not root, no iproute2...), or None."""
    netns = import_netns()
    try:
        netns.check_requirements()
    except netns.NetnsError as e:
        return str(e)
    return None


def save_run(path: str, elapsed: float, failed: Sequence[str], key: dict[str, Any], **results: Any) -> None:
    """Write one run's record (date, argv, time taken, failed jobs, key ratios, ``results``) as JSON.

    Example::

        save_run(".bench/comm.json", 240.0, [], {"uint8_speedup": 3.6}, jobs=jobs)
    """
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {"date": time.strftime("%Y-%m-%d"), "argv": sys.argv[1:], "elapsed_s": elapsed,
              "failed": list(failed), "key": key, **results}
    out.write_text(json.dumps(record, indent=1))
    print(f"\nwrote {out}")
