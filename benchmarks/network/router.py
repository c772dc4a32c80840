"""The router namespace of a delayed network: every rank's leg ends here, every packet between two
ranks goes through the delay line's tun.

Bridged traffic never reaches ``ip rule``, so with a delay the ranks are routed instead of bridged::

    rank i's namespace                     router namespace
    veth0 10.213.S.i/32  ---- veth ----   h<i> 169.254.0.1/32, route 10.213.S.i/32 dev h<i>
    route 10.213.S.0/24 via 169.254.0.1    ip rule iif h<i> lookup 100 -> default dev tun0
                                           tun0 <-> delay_line.py (reads, holds, writes back)

A packet from rank a to rank b leaves a's veth0 (its tbf), enters the router on h<a>, is routed
by table 100 into tun0, held by the delay line, written back into tun0, routed by the main table
to h<b> and leaves there (b's inbound tbf) into b's namespace. The delay sits between the
sender's and the receiver's shaping, in the router, not in the sender's namespace (where it
would hold back the sender's own TCP stack). Standard library only.

Example::

    router = Router("bgn42art", Delay(20.0))
    router.setup()                          # namespace, forwarding, delay line, tun0 routes
    router.attach("bgn42ah0", "10.213.7.1")   # after the veth leg was moved into the router
    ...
    stats = router.stop()                   # {"packets": ..., "dropped": 0, "tun_dropped": 0, ...}
"""

from __future__ import annotations

import json
import logging
import select
import subprocess
import sys
import time
from pathlib import Path

from .delay_line import STATS_TAG, Delay
from .namespaces import NetnsError, _cmd, write_sysctls

logger = logging.getLogger(__name__)

GATEWAY = "169.254.0.1"
"""The router's address on every leg (link-local, the same on each): the ranks' next hop."""

TUN = "tun0"
TUN_TXQUEUELEN = 10000  # a full tun queue drops silently; 1000 (the default) is not enough
_TABLE = 100
_RULE_PREF = 100
_DELAY_LINE = Path(__file__).with_name("delay_line.py")
_READY_TIMEOUT = 10.0
_SYSCTLS = {
    "net/ipv4/ip_forward": 1,
    # packets come back from tun0 with a source routed via another leg: no reverse-path check
    "net/ipv4/conf/all/rp_filter": 0,
    "net/ipv4/conf/default/rp_filter": 0,
    "net/ipv4/conf/all/send_redirects": 0,
    "net/ipv4/conf/default/send_redirects": 0,
}


class Router:
    """The router namespace ``namespace`` with its delay line.

    Args:
        namespace: name of the namespace to create.
        delay: the one-way delay between any two ranks.

    Attributes:
        process: the delay line's process (None until :meth:`setup`, and after :meth:`stop`).
        stats: the delay line's counters after :meth:`stop` (None before).

    Example: see the module docstring.
    """

    def __init__(self, namespace: str, delay: Delay) -> None:
        self.namespace = namespace
        self.delay = delay
        self.process: subprocess.Popen | None = None
        self.pid: int | None = None
        self.stats: dict | None = None

    def setup(self) -> None:
        """Create the namespace, turn on forwarding, start the delay line and route into its tun."""
        ns = self.namespace
        _cmd("ip", "netns", "add", ns)
        _cmd("ip", "-n", ns, "link", "set", "dev", "lo", "up")
        write_sysctls(ns, _SYSCTLS)
        self.process = subprocess.Popen(
            ["ip", "netns", "exec", ns, sys.executable, str(_DELAY_LINE), "--tun", TUN,
             "--delay-ms", repr(self.delay.ms), "--jitter-ms", repr(self.delay.jitter_ms)],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True,
        )
        self.pid = self.process.pid
        self._wait_ready()
        _cmd("ip", "-n", ns, "link", "set", "dev", TUN, "txqueuelen", str(TUN_TXQUEUELEN), "up")
        _cmd("ip", "-n", ns, "route", "add", "default", "dev", TUN, "table", str(_TABLE))

    def _wait_ready(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        deadline = time.monotonic() + _READY_TIMEOUT
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.process.stdout], [], [], 0.1)
            if ready:
                line = self.process.stdout.readline()
                if line.strip() == "DELAY_LINE_READY":
                    return
                if not line:  # it exited
                    break
        self.process.kill()
        _, err = self.process.communicate()
        self.process = None
        raise NetnsError(
            f"the delay line did not start in namespace {self.namespace} within "
            f"{_READY_TIMEOUT:g} s: {err.strip() or 'no output'}; it needs /dev/net/tun "
            f"(modprobe tun)"
        )

    def attach(self, leg: str, rank_address: str) -> None:
        """Route a rank's leg ``leg`` (already in the router's namespace) through the delay line."""
        ip = lambda *a: _cmd("ip", "-n", self.namespace, *a)  # noqa: E731
        ip("addr", "add", f"{GATEWAY}/32", "dev", leg)
        ip("route", "add", f"{rank_address}/32", "dev", leg, "scope", "link", "src", GATEWAY)
        ip("rule", "add", "iif", leg, "lookup", str(_TABLE), "pref", str(_RULE_PREF))

    def tun_dropped(self) -> int:
        """Packets the kernel dropped at the tun (its queue towards the delay line, or a write)."""
        out = _cmd("ip", "-n", self.namespace, "-s", "-j", "link", "show", "dev", TUN).stdout
        stats = json.loads(out)[0]["stats64"]
        return int(stats["rx"]["dropped"]) + int(stats["tx"]["dropped"])

    def stop(self) -> dict:
        """Stop the delay line; its counters plus ``tun_dropped``, also kept in :attr:`stats`.

        Raises:
            NetnsError: it had died before (so the ranks' packets went nowhere), naming its error.
        """
        if self.process is None:
            return self.stats or {}
        proc, self.process = self.process, None
        try:
            tun_dropped = self.tun_dropped() if proc.poll() is None else None
        except (NetnsError, ValueError, KeyError, IndexError) as e:
            logger.warning("could not read the counters of %s in %s: %s", TUN, self.namespace, e)
            tun_dropped = None
        died = proc.poll()
        if died is None:
            proc.terminate()
        try:
            out, err = proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        lines = [line for line in out.splitlines() if line.startswith(STATS_TAG)]
        self.stats = json.loads(lines[-1].split(" ", 1)[1]) if lines else {}
        self.stats["tun_dropped"] = tun_dropped
        if died is not None:
            raise NetnsError(
                f"the delay line in {self.namespace} had exited (status {died}) before the "
                f"network was taken down, so packets between ranks were lost: "
                f"{err.strip()[-2000:] or 'no output'}"
            )
        if err.strip():
            logger.warning("delay line: %s", err.strip())
        return self.stats
