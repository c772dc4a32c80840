"""Namespaces and links: names, requirements, running ``ip`` / ``tc``, doing things inside a
namespace, and removing what killed runs left behind. Standard library only.

Example::

    check_requirements()                          # NetnsError unless root with iproute2
    write_sysctls("bgn42ar0", {"net/ipv4/tcp_congestion_control": "cubic"})
    cleanup_stale()                               # remove leftovers of killed runs
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from typing import Callable, Mapping, TypeVar

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

_CLONE_NEWNET = 0x40000000
_T = TypeVar("_T")

# name = bgn<pid><letter><kind><index>; kind: r = a rank's namespace, rt = the router's
# namespace, h = the host-side veth (on the bridge, or in the router), br = the bridge
_NAME_RE = re.compile(r"^bgn(?P<pid>\d+)(?P<seq>[a-z])(?P<kind>rt|r|h|br)(?P<idx>\d*)$")


class NetnsError(RuntimeError):
    """Setting up or tearing down the namespaces failed, or the machine can't do it."""


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


def requirements_problem() -> str | None:
    """Why the emulated network cannot run here (not root, no iproute2...), or None."""
    try:
        check_requirements()
    except NetnsError as e:
        return str(e)
    return None


def _cmd(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if check and proc.returncode != 0:
        raise NetnsError(
            f"`{' '.join(args)}` failed (exit {proc.returncode}): "
            f"{(proc.stderr or proc.stdout).strip()}"
        )
    return proc


def in_namespace(namespace: str, fn: Callable[[], _T]) -> _T:
    """``fn()`` called on a short-lived thread inside network namespace ``namespace``.

    setns changes only the calling thread's namespace, so no process is started; what ``fn``
    opens there (a /proc/thread-self/net file, a socket, /dev/net/tun) stays in that namespace
    after the thread is gone. Its exception is raised here.

    Example: ``in_namespace("bgn42ar0", lambda: open("/proc/thread-self/net/snmp", "rb"))``
    """
    result: list[_T] = []
    failure: list[BaseException] = []

    def target() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = os.open(f"/run/netns/{namespace}", os.O_RDONLY)
            try:
                if libc.setns(fd, _CLONE_NEWNET) != 0:
                    errno = ctypes.get_errno()
                    raise OSError(errno, f"setns into {namespace}: {os.strerror(errno)}")
            finally:
                os.close(fd)
            result.append(fn())
        except BaseException as e:  # handed to the caller below
            failure.append(e)

    thread = threading.Thread(target=target, name=f"in-{namespace}")
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return result[0]


def write_sysctls(namespace: str, values: Mapping[str, str | int]) -> None:
    """Set per-namespace sysctls (paths under /proc/sys) inside ``namespace``.

    Raises:
        NetnsError: one could not be written (naming it and the value).

    Example: ``write_sysctls("bgn42ar0", {"net/ipv4/tcp_rmem": "4096 131072 8388608"})``
    """

    def write() -> None:
        for path, value in values.items():
            try:
                with open(f"/proc/sys/{path}", "w") as f:
                    f.write(str(value))
            except OSError as e:
                raise NetnsError(
                    f"cannot set {path.replace('/', '.')} = {value} in namespace {namespace}: "
                    f"{e.strerror}; check the value (e.g. the congestion control is in "
                    f"/proc/sys/net/ipv4/tcp_available_congestion_control)"
                ) from e

    in_namespace(namespace, write)


def allow_congestion_control(name: str) -> None:
    """Let network namespaces other than the host's pick TCP congestion control ``name``.

    The kernel lets a namespace set only the algorithms in the host's
    ``net.ipv4.tcp_allowed_congestion_control`` (here "reno bbr": no cubic), so a missing one is
    appended to that list: a host-wide change, but one that only allows (no default changes).

    Raises:
        NetnsError: the algorithm is not loaded, naming the module to load.

    Example: ``allow_congestion_control("cubic")``
    """
    base = "/proc/sys/net/ipv4/tcp_"
    with open(f"{base}allowed_congestion_control") as f:
        allowed = f.read().split()
    if name in allowed:
        return
    with open(f"{base}available_congestion_control") as f:
        available = f.read().split()
    if name not in available:
        raise NetnsError(
            f"TCP congestion control {name!r} is not available (available: {' '.join(available)}); "
            f"choose one of those or load it with `modprobe tcp_{name}`"
        )
    try:
        with open(f"{base}allowed_congestion_control", "w") as f:
            f.write(" ".join(allowed + [name]))
    except OSError as e:
        raise NetnsError(
            f"cannot add {name!r} to net.ipv4.tcp_allowed_congestion_control "
            f"({' '.join(allowed)}): {e.strerror}; namespaces may only use those"
        ) from e
    logger.info("added %s to net.ipv4.tcp_allowed_congestion_control so namespaces may use it", name)


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
