"""The host side of ``netns.py``: names, rates and tbf shaping, requirements, running ``ip`` /
``tc``, and removing what killed runs left behind. Standard library only.

Example::

    check_requirements()              # NetnsError unless root with iproute2
    parse_rate("100mbit")             # 100000000
    cleanup_stale()                   # remove leftovers of killed runs
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading

logger = logging.getLogger(__name__)

PREFIX = "bgn"
"""Every namespace, bridge and veth this tool creates starts with this."""

IFNAME_IN_NS = "veth0"
"""Name of the veth leg inside each namespace (unique per namespace, so a fixed name)."""

SUBNET_BASE = "10.213"
MAX_RANKS = 254  # .1 ... .254 in one /24

_IFNAMSIZ = 15

_counter = itertools.count()
_counter_lock = threading.Lock()

# name = bgn<pid><letter><kind><index>; kind: r = namespace, h = bridge-side veth, br = bridge
_NAME_RE = re.compile(r"^bgn(?P<pid>\d+)(?P<seq>[a-z])(?P<kind>r|h|br)(?P<idx>\d*)$")


class NetnsError(RuntimeError):
    """Setting up or tearing down the namespaces failed, or the machine can't do it."""


# --------------------------------------------------------------------------------------------
# rates and shaping parameters
# --------------------------------------------------------------------------------------------

_RATE_UNITS = {
    # bits per second (tc's names; SI units are powers of 1000, IEC ones of 1024)
    "bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
    "kibit": 1024, "mibit": 1024**2, "gibit": 1024**3, "tibit": 1024**4,
    # bytes per second
    "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12,
    "kibps": 8 * 1024, "mibps": 8 * 1024**2, "gibps": 8 * 1024**3, "tibps": 8 * 1024**4,
}
_RATE_RE = re.compile(r"^\s*(?P<num>\d+(?:\.\d*)?|\.\d+)\s*(?P<unit>[a-z]*)\s*$", re.IGNORECASE)


def parse_rate(rate: str | int | float | None) -> int | None:
    """Parse a tc-style rate into bits per second; ``None``/"none"/"off" mean unshaped.

    Args:
        rate: e.g. "100mbit", "1gbit", "12.5mbps" (bytes/s), "500kbit"; a bare number or an
            int/float is bits per second, as in tc.
    Returns:
        bits per second (int > 0), or None for no shaping.
    Raises:
        ValueError: the string is not a rate.

    Example: ``parse_rate("100mbit") == 100_000_000``
    """
    if rate is None:
        return None
    if isinstance(rate, (int, float)) and not isinstance(rate, bool):
        value = float(rate)
        text = repr(rate)
    elif isinstance(rate, str):
        text = rate
        if rate.strip().lower() in ("none", "off", "unlimited", "no"):
            return None
        m = _RATE_RE.match(rate)
        unit = m.group("unit").lower() if m else ""
        if not m or (unit and unit not in _RATE_UNITS):
            raise ValueError(
                f"rate must be a number with a tc unit ({', '.join(sorted(_RATE_UNITS))}) "
                f"or 'none', e.g. '100mbit'; got {rate!r}"
            )
        value = float(m.group("num")) * _RATE_UNITS[unit or "bit"]
    else:
        raise ValueError(f"rate must be a string like '100mbit', a number or None; got {rate!r}")
    bits = int(round(value))
    if not math.isfinite(value) or bits < 8000:
        raise ValueError(f"rate must be at least 8kbit (1000 bytes/s); got {text}")
    return bits


class Shaping:
    """The tbf parameters applied to each veth leg (both directions) for one rate.

    Attributes:
        rate_bit: the cap in bits/s.
        burst_bytes: token bucket size. Must be >= rate/HZ or the cap is not reached on kernels
            that refill per tick; we take 10 ms worth (rate/100, right even at HZ=100), but at
            least 16 KiB (>= 10 full-size frames) so small rates still pass whole frames.
        limit_bytes: queue length in bytes: burst + 100 ms at the rate (at least 64 KiB), so
            TCP can keep the link busy without building a huge queue.
    """

    def __init__(self, rate_bit: int) -> None:
        self.rate_bit = int(rate_bit)
        rate_bytes = self.rate_bit / 8.0
        self.burst_bytes = max(int(math.ceil(rate_bytes / 100.0)), 16 * 1024)
        self.limit_bytes = self.burst_bytes + max(int(rate_bytes * 0.1), 64 * 1024)

    def tc_args(self) -> list[str]:
        """Arguments after ``tc qdisc add dev X root``."""
        return [
            "tbf",
            "rate", f"{self.rate_bit}bit",
            "burst", str(self.burst_bytes),
            "limit", str(self.limit_bytes),
        ]

    def __repr__(self) -> str:
        return (
            f"Shaping(rate={format_rate(self.rate_bit)}, burst={self.burst_bytes}B, "
            f"limit={self.limit_bytes}B)"
        )


def format_rate(bits: int | None) -> str:
    """``100000000 -> "100mbit"``; None -> "unlimited"."""
    if bits is None:
        return "unlimited"
    for unit, scale in (("tbit", 10**12), ("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3)):
        if bits >= scale and (bits * 1000) % scale == 0:
            return f"{bits // scale if bits % scale == 0 else bits / scale}{unit}"
    return f"{bits}bit"


def shaping_for(rate: str | int | float | None) -> Shaping | None:
    """The :class:`Shaping` used for ``rate`` (None when unshaped)."""
    bits = parse_rate(rate)
    return None if bits is None else Shaping(bits)


# --------------------------------------------------------------------------------------------
# running ip / tc
# --------------------------------------------------------------------------------------------


def check_requirements() -> None:
    """Raise :class:`NetnsError` unless we are root and ``ip`` and ``tc`` are installed."""
    if sys.platform != "linux":
        raise NetnsError(f"network namespaces need Linux; this is {sys.platform}")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise NetnsError(
            f"{' and '.join(missing)} not found on PATH; install iproute2 "
            "(e.g. `apt-get install iproute2`)"
        )
    if os.geteuid() != 0:
        raise NetnsError(
            f"creating network namespaces needs root (euid is {os.geteuid()}); "
            "run as root, e.g. with sudo"
        )


def _cmd(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if check and proc.returncode != 0:
        raise NetnsError(
            f"`{' '.join(args)}` failed (exit {proc.returncode}): "
            f"{(proc.stderr or proc.stdout).strip()}"
        )
    return proc


def _link_exists(name: str) -> bool:
    return os.path.exists(f"/sys/class/net/{name}")


def _list_netns() -> list[str]:
    out = _cmd("ip", "netns", "list").stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _list_links() -> list[str]:
    try:
        return sorted(os.listdir("/sys/class/net"))
    except OSError:
        out = _cmd("ip", "-o", "link", "show").stdout
        return [line.split(":")[1].strip().split("@")[0] for line in out.splitlines()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_netns_pids(ns: str) -> list[int]:
    """SIGKILL every process still inside namespace ``ns``; return their pids."""
    proc = _cmd("ip", "netns", "pids", ns, check=False)
    pids = [int(tok) for tok in proc.stdout.split() if tok.isdigit()]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return pids


def cleanup_stale(include_live: bool = False) -> list[str]:
    """Remove namespaces, veths and bridges with our prefix left behind by killed runs.

    Processes still running inside such a namespace (ranks orphaned when the launcher was
    killed) are killed first.

    Args:
        include_live: also remove those whose creating process is still alive (by default they
            are left alone, since they belong to a run in progress).
    Returns:
        the names removed.
    """
    check_requirements()
    removed: list[str] = []
    skipped: list[str] = []

    def stale(name: str) -> bool:
        m = _NAME_RE.match(name)
        if not m:
            return False
        if _pid_alive(int(m.group("pid"))) and not include_live:
            skipped.append(name)
            return False
        return True

    for ns in _list_netns():
        if stale(ns):
            pids = _kill_netns_pids(ns)
            if pids:
                logger.info("killed %d leftover process(es) in %s: %s", len(pids), ns, pids)
            _cmd("ip", "netns", "del", ns, check=False)
            removed.append(ns)
    # bridge-side veths first (deleting one end removes the pair), then bridges
    links = _list_links()
    for kind in ("h", "br"):
        for link in links:
            m = _NAME_RE.match(link)
            if m and m.group("kind") == kind and _link_exists(link) and stale(link):
                _cmd("ip", "link", "del", link, check=False)
                removed.append(link)
    if skipped:
        logger.warning(
            "left %d item(s) of runs whose process is still alive (%s); include_live=True "
            "(CLI: --cleanup --all) removes them too", len(skipped), " ".join(skipped),
        )
    return removed
