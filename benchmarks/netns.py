#!/usr/bin/env python3
"""Run N ranks of a torchrun-style job, each in its own network namespace, over capped links.

Every rank becomes its own "node" (``LOCAL_WORLD_SIZE=1``) in a private network namespace
with one veth leg; the other legs hang off a Linux bridge in the root namespace. With a rate
given, a ``tbf`` qdisc caps both directions of every leg (egress inside the namespace, and
egress of the bridge-side leg towards the namespace), so all rank-to-rank traffic crosses a
link of that bandwidth. With ``per_flow_rate`` as well, each TCP connection is capped at that
rate under the aggregate ``rate`` instead, as clouds cap a single flow (an htb tree with one
leaf per connection, kept up to date by a watcher thread: ``benchmarks/netns_flows.py``).
Nothing is routed anywhere else: the bridge has no address, no route, NAT or default route is
added, and the addresses (a /24 inside 10.213.0.0/16) exist only inside the namespaces.

Needs root and iproute2 (``ip``, ``tc``). Standard library only. The host side (names, rates,
``ip``/``tc``, cleanup) is ``netns_host.py``.

CLI::

    python benchmarks/netns.py --ranks 2 --rate 100mbit -- python train.py --epochs 1
    python benchmarks/netns.py --ranks 2 --rate 1gbit --per-flow-rate 250mbit -- python train.py
    python benchmarks/netns.py --cleanup          # remove leftovers of killed runs

Python::

    from benchmarks.netns import ShapedNetwork
    with ShapedNetwork(ranks=2, rate="100mbit") as net:
        print(net.rank_env(1))
        rcs = net.run([sys.executable, "train.py"], timeout=300)   # [0, 0]
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import IO, Mapping, Sequence

if __package__:
    from .netns_flows import FlowShaping, FlowShapingError, FlowWatcher, Link
    from .netns_host import (IFNAME_IN_NS, MAX_RANKS, NetnsError, PREFIX, SUBNET_BASE, Shaping, _IFNAMSIZ, _cmd, _counter, _counter_lock, _kill_netns_pids, _link_exists, _list_netns, check_requirements, cleanup_stale, format_rate, parse_rate, shaping_for)
else:  # run as a script, or imported with benchmarks/ on the path
    from netns_flows import FlowShaping, FlowShapingError, FlowWatcher, Link
    from netns_host import (IFNAME_IN_NS, MAX_RANKS, NetnsError, PREFIX, SUBNET_BASE, Shaping, _IFNAMSIZ, _cmd, _counter, _counter_lock, _kill_netns_pids, _link_exists, _list_netns, check_requirements, cleanup_stale, format_rate, parse_rate, shaping_for)

__all__ = [
    "NetnsError",
    "RankFailedError",
    "RankTimeoutError",
    "ShapedNetwork",
    "Shaping",
    "cleanup_stale",
    "format_rate",
    "parse_rate",
    "shaping_for",
    "main",
]

logger = logging.getLogger(__name__)

DEFAULT_MASTER_PORT = 29500
DEFAULT_TIMEOUT = 600.0
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


# --------------------------------------------------------------------------------------------
# the network
# --------------------------------------------------------------------------------------------


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


class ShapedNetwork:
    """N network namespaces on one bridge, each leg capped at ``rate`` in both directions.

    Use it as a context manager: entering builds the namespaces, leaving (also on an exception,
    Ctrl-C or SIGTERM) tears them down.

    Args:
        ranks: number of namespaces (= ranks = "nodes"), 1..254.
        rate: per-link cap, tc syntax ("100mbit", "1gbit", "50mbps"); None or "none": no cap.
        per_flow_rate: also cap each TCP connection at this rate (at most ``rate``), in both
            directions, for connections made at any time (``self.flow_watcher`` keeps one
            htb leaf per connection); None: one tbf cap per leg.
        master_port: MASTER_PORT given to the ranks (each namespace is private, so it is free).
        subnet: third octet of the 10.213.<subnet>.0/24 used; default: random per invocation.

    Example::

        with ShapedNetwork(ranks=2, rate="100mbit") as net:
            rcs = net.run([sys.executable, "-c", "import os; print(os.environ['RANK'])"])
        with ShapedNetwork(ranks=2, rate="1gbit", per_flow_rate="250mbit") as net:
            ...  # one connection gets 250 Mbit/s, four or more share 1 Gbit/s
    """

    def __init__(
        self,
        ranks: int,
        rate: str | int | float | None = "100mbit",
        per_flow_rate: str | int | float | None = None,
        master_port: int = DEFAULT_MASTER_PORT,
        subnet: int | None = None,
    ) -> None:
        if not isinstance(ranks, int) or isinstance(ranks, bool) or not 1 <= ranks <= MAX_RANKS:
            raise ValueError(f"ranks must be an int in [1, {MAX_RANKS}], got {ranks!r}")
        if not isinstance(master_port, int) or not 1 <= master_port <= 65535:
            raise ValueError(f"master_port must be in [1, 65535], got {master_port!r}")
        if subnet is not None and not (isinstance(subnet, int) and 0 <= subnet <= 255):
            raise ValueError(f"subnet must be an int in [0, 255] or None, got {subnet!r}")
        self.ranks = ranks
        self.rate_bit = parse_rate(rate)
        self.per_flow_bit = parse_rate(per_flow_rate)
        if self.per_flow_bit is not None and self.rate_bit is None:
            raise ValueError(
                f"per_flow_rate={per_flow_rate!r} needs an aggregate rate= to sit under "
                f"(e.g. rate='1gbit'); got rate={rate!r}"
            )
        self.shaping: Shaping | FlowShaping | None = (
            None if self.rate_bit is None
            else Shaping(self.rate_bit) if self.per_flow_bit is None
            else FlowShaping(self.rate_bit, self.per_flow_bit)
        )
        self.flow_watcher: FlowWatcher | None = None
        self.master_port = master_port
        self.subnet = random.SystemRandom().randrange(256) if subnet is None else subnet

        # bgn<pid><letter>: the letter tells apart networks made by one process; skip one
        # whose bridge still exists (a network of ours that is alive or was not torn down).
        with _counter_lock:
            for _ in range(26):
                letter = chr(ord("a") + next(_counter) % 26)
                self.prefix = f"{PREFIX}{os.getpid()}{letter}"
                if not _link_exists(f"{self.prefix}br"):
                    break
        self.namespaces = [f"{self.prefix}r{i}" for i in range(ranks)]
        self.host_legs = [f"{self.prefix}h{i}" for i in range(ranks)]
        self.bridge = f"{self.prefix}br"
        for name in self.host_legs + [self.bridge]:
            if len(name) > _IFNAMSIZ:  # cannot happen for pid <= 2**22 and ranks <= 254
                raise NetnsError(f"interface name {name!r} is longer than {_IFNAMSIZ} characters")
        self.addresses = [f"{SUBNET_BASE}.{self.subnet}.{i + 1}" for i in range(ranks)]
        self.outputs: list[str] = []
        self.returncodes: list[int | None] = []
        self._up = False
        self._old_handlers: dict[int, object] = {}

    # ---- setup / teardown ------------------------------------------------------------------

    def __enter__(self) -> "ShapedNetwork":
        self._install_signal_handlers()
        try:
            self.setup()
        except BaseException:
            self.teardown()
            self._restore_signal_handlers()
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            self.teardown(raise_on_leftovers=exc_type is None)
        finally:
            self._restore_signal_handlers()

    def setup(self) -> None:
        """Create the bridge, namespaces, veth pairs, addresses and qdiscs."""
        check_requirements()
        self._up = True  # from here on, teardown() has something to do
        logger.info(
            "creating %d namespaces %s..%s on bridge %s, 10.213.%d.0/24, rate %s",
            self.ranks, self.namespaces[0], self.namespaces[-1], self.bridge, self.subnet,
            self.shaping or "unlimited",
        )
        ip = lambda *a: _cmd("ip", *a)  # noqa: E731

        ip("link", "add", "name", self.bridge, "type", "bridge", "stp_state", "0")
        # No IPv6 link-local (nor any other) address on root-namespace devices.
        ip("link", "set", "dev", self.bridge, "addrgenmode", "none")
        # Keep the host's iptables (e.g. a FORWARD DROP policy) out of our bridged traffic.
        proc = _cmd(
            "ip", "link", "set", "dev", self.bridge, "type", "bridge",
            "nf_call_iptables", "0", "nf_call_ip6tables", "0", "nf_call_arptables", "0",
            check=False,
        )
        if proc.returncode != 0:
            logger.warning(
                "could not turn off netfilter on bridge %s (%s); bridged traffic goes through "
                "the host's iptables FORWARD rules", self.bridge, proc.stderr.strip(),
            )
        ip("link", "set", "dev", self.bridge, "up")

        for i, (ns, leg) in enumerate(zip(self.namespaces, self.host_legs)):
            ip("netns", "add", ns)
            ip("-n", ns, "link", "set", "dev", "lo", "up")
            ip("link", "add", "name", leg, "type", "veth",
               "peer", "name", IFNAME_IN_NS, "netns", ns)
            ip("link", "set", "dev", leg, "addrgenmode", "none")
            ip("link", "set", "dev", leg, "master", self.bridge)
            ip("-n", ns, "link", "set", "dev", IFNAME_IN_NS, "addrgenmode", "none")
            ip("-n", ns, "addr", "add", f"{self.addresses[i]}/24", "dev", IFNAME_IN_NS)
            if isinstance(self.shaping, Shaping):
                args = self.shaping.tc_args()
                # namespace -> bridge
                _cmd("tc", "-n", ns, "qdisc", "add", "dev", IFNAME_IN_NS, "root", *args)
                # bridge -> namespace
                _cmd("tc", "qdisc", "add", "dev", leg, "root", *args)
            ip("link", "set", "dev", leg, "up")
            ip("-n", ns, "link", "set", "dev", IFNAME_IN_NS, "up")
        if isinstance(self.shaping, FlowShaping):
            self.flow_watcher = FlowWatcher(
                self.shaping,
                [Link(ns, IFNAME_IN_NS, leg) for ns, leg in zip(self.namespaces, self.host_legs)],
            )
            try:
                self.flow_watcher.install()
            except FlowShapingError as e:
                raise NetnsError(str(e)) from e
            self.flow_watcher.start()

    def teardown(self, raise_on_leftovers: bool = False) -> None:
        """Delete everything :meth:`setup` created; safe to call twice or after a failed setup.

        Ctrl-C and SIGTERM are held back until it is done. With ``raise_on_leftovers``, raise
        :class:`NetnsError` if something is left or the per-flow watcher had failed (otherwise
        log it).
        """
        if not self._up:
            return
        blocked = {signal.SIGINT, signal.SIGTERM}
        try:
            old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
        except (AttributeError, ValueError, OSError):
            old_mask = None
        try:
            problems: list[str] = []
            watcher_failure = ""
            if self.flow_watcher is not None:  # first: it holds the namespaces open
                try:
                    self.flow_watcher.stop()
                except FlowShapingError as e:
                    watcher_failure = str(e)
                self.flow_watcher = None
            existing_ns = set(_list_netns())
            for ns in self.namespaces:
                if ns in existing_ns:
                    # processes that escaped the ranks' process groups (e.g. via setsid)
                    stray = _kill_netns_pids(ns)
                    if stray:
                        logger.warning("killed %d stray process(es) left in %s: %s",
                                       len(stray), ns, stray)
                    proc = _cmd("ip", "netns", "del", ns, check=False)
                    if proc.returncode != 0:
                        problems.append(f"ip netns del {ns}: {proc.stderr.strip()}")
            # Deleting the namespace removes its veth pair unless a process still holds the
            # namespace open; delete the bridge-side end explicitly in that case.
            for leg in self.host_legs:
                if _link_exists(leg):
                    proc = _cmd("ip", "link", "del", leg, check=False)
                    if proc.returncode != 0 and _link_exists(leg):
                        problems.append(f"ip link del {leg}: {proc.stderr.strip()}")
            if _link_exists(self.bridge):
                proc = _cmd("ip", "link", "del", self.bridge, check=False)
                if proc.returncode != 0:
                    problems.append(f"ip link del {self.bridge}: {proc.stderr.strip()}")
            self._up = False
            leftovers = [ns for ns in self.namespaces if ns in set(_list_netns())]
            leftovers += [n for n in self.host_legs + [self.bridge] if _link_exists(n)]
            if problems or leftovers:
                msg = (
                    f"teardown of {self.prefix}* incomplete: {'; '.join(problems)} "
                    f"leftovers: {leftovers}; remove them with "
                    f"`python benchmarks/netns.py --cleanup --all`"
                )
                if raise_on_leftovers:
                    raise NetnsError(msg)
                logger.warning(msg)
            if watcher_failure:
                if raise_on_leftovers:
                    raise NetnsError(watcher_failure)
                logger.error(watcher_failure)
        finally:
            if old_mask is not None:
                signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return

        def on_signal(signum, frame):  # turn SIGTERM/SIGHUP into an exception -> finally runs
            raise SystemExit(128 + signum)

        for sig in (signal.SIGTERM, signal.SIGHUP):
            try:
                if signal.getsignal(sig) in (signal.SIG_DFL, None):
                    self._old_handlers[sig] = signal.signal(sig, on_signal)
            except (ValueError, OSError):
                pass

    def _restore_signal_handlers(self) -> None:
        for sig, handler in self._old_handlers.items():
            try:
                signal.signal(sig, handler)
            except (ValueError, OSError, TypeError):
                pass
        self._old_handlers.clear()

    # ---- ranks -----------------------------------------------------------------------------

    def rank_env(self, rank: int) -> dict[str, str]:
        """The variables set for ``rank`` on top of the inherited environment.

        Example: ``net.rank_env(1)["MASTER_ADDR"] == net.addresses[0]``
        """
        if not 0 <= rank < self.ranks:
            raise ValueError(f"rank must be in [0, {self.ranks}), got {rank}")
        return {
            "RANK": str(rank),
            "WORLD_SIZE": str(self.ranks),
            "LOCAL_RANK": "0",
            "LOCAL_WORLD_SIZE": "1",
            "GROUP_RANK": str(rank),
            "ROLE_RANK": str(rank),
            "ROLE_WORLD_SIZE": str(self.ranks),
            "MASTER_ADDR": self.addresses[0],
            "MASTER_PORT": str(self.master_port),
            "GLOO_SOCKET_IFNAME": IFNAME_IN_NS,
            "TP_SOCKET_IFNAME": IFNAME_IN_NS,
            "NCCL_SOCKET_IFNAME": IFNAME_IN_NS,
        }

    def rank_argv(self, rank: int, cmd: Sequence[str]) -> list[str]:
        """The full command line that starts ``cmd`` as ``rank`` inside its namespace."""
        env = [f"{k}={v}" for k, v in self.rank_env(rank).items()]
        return ["ip", "netns", "exec", self.namespaces[rank], "env", *env, *cmd]

    def run(
        self,
        cmd: Sequence[str],
        timeout: float = DEFAULT_TIMEOUT,
        check: bool = True,
        stream: IO[str] | None = None,
        echo: bool = True,
        env: Mapping[str, str] | None = None,
    ) -> list[int | None]:
        """Start ``cmd`` once per namespace and wait for all ranks.

        Rank 0's output (stdout and stderr) is streamed to ``stream`` (default ``sys.stdout``);
        the others' output is kept and shown only when one fails. As soon as a rank fails, or
        ``timeout`` passes, every rank's process group is killed. After the call,
        ``self.outputs`` holds the tail of each rank's output and ``self.returncodes`` their
        exit statuses.

        Args:
            cmd: the program and its arguments (no shell).
            timeout: seconds for the whole job.
            check: raise on failure (default); with False, return the exit statuses anyway
                (None for a rank that was still running at the timeout).
            stream: where rank 0's output goes.
            echo: False: don't stream rank 0's output anywhere (it is still kept).
            env: base environment (default: this process's, i.e. PATH, PYTHONPATH,
                VIRTUAL_ENV... pass through); the rank variables are added on top.
        Returns:
            the exit status of each rank (all 0 when check=True).
        Raises:
            RankFailedError: a rank exited non-zero; RankTimeoutError: the timeout passed.
        """
        if not self._up:
            raise NetnsError("the network is not set up; use `with ShapedNetwork(...) as net:`")
        if not cmd:
            raise ValueError("cmd must name a program, got an empty command")
        cmd = [str(c) for c in cmd]
        base_env = dict(os.environ if env is None else env)
        out = stream if stream is not None else sys.stdout
        ranks: list[_Rank] = []
        deadline = time.monotonic() + timeout
        failed: _Rank | None = None
        timed_out = False
        try:
            for i in range(self.ranks):
                if i == 0:
                    proc = subprocess.Popen(
                        self.rank_argv(i, cmd), env=base_env, stdin=subprocess.DEVNULL,
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
                        self.rank_argv(i, cmd), env=base_env, stdin=subprocess.DEVNULL,
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
            lines.append(f"--- rank {i} ({self.namespaces[i]}), exit {self.returncodes[i]}, "
                         f"last {_REPORT_TAIL_LINES} lines of output ---")
            tail = _tail(self.outputs[i])
            lines.extend(f"[rank {i}] {line}" for line in tail)
            if not tail:
                lines.append(f"[rank {i}] (no output)")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (
            f"ShapedNetwork(ranks={self.ranks}, rate={self.shaping or 'none'}, "
            f"prefix={self.prefix!r}, subnet=10.213.{self.subnet}.0/24)"
        )


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="netns.py",
        description=(
            "Run N ranks of a torchrun-style job, each in its own network namespace, joined by "
            "a bridge with every link capped at --rate in both directions (and each TCP "
            "connection at --per-flow-rate). Needs root and iproute2."
        ),
        epilog=(
            "example: python benchmarks/netns.py --ranks 2 --rate 100mbit -- "
            "python train.py --epochs 1; with --rate 1gbit --per-flow-rate 250mbit, one "
            "connection gets 250 Mbit/s and four share 1 Gbit/s"
        ),
    )
    p.add_argument("--ranks", type=int, default=2, help="number of ranks/namespaces (default 2)")
    p.add_argument(
        "--rate", default="100mbit",
        help="per-link cap in tc syntax (100mbit, 1gbit, 12.5mbps) or 'none' (default 100mbit)",
    )
    p.add_argument(
        "--per-flow-rate", default=None,
        help="also cap every TCP connection at this rate, under the aggregate --rate "
        "(e.g. 250mbit; default: no per-connection cap)",
    )
    p.add_argument(
        "--timeout", type=float, default=DEFAULT_TIMEOUT,
        help=f"seconds for the whole job (default {DEFAULT_TIMEOUT:g})",
    )
    p.add_argument(
        "--master-port", type=int, default=DEFAULT_MASTER_PORT,
        help=f"MASTER_PORT (default {DEFAULT_MASTER_PORT})",
    )
    p.add_argument(
        "--cleanup", action="store_true",
        help=f"remove leftovers named {PREFIX}* from killed runs (of dead processes) and exit",
    )
    p.add_argument(
        "--all", action="store_true",
        help="with --cleanup: also remove those of runs whose process is still alive",
    )
    p.add_argument("--print-env", action="store_true", help="print each rank's variables first")
    p.add_argument("-v", "--verbose", action="store_true", help="log what is set up")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the exit status (the failing rank's, 124 on timeout)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" in argv:
        split = argv.index("--")
        own, cmd = argv[:split], argv[split + 1:]
    else:
        own, cmd = argv, []
    parser = _parser()
    args = parser.parse_args(own)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="netns: %(levelname)s %(message)s",
    )
    try:
        if args.cleanup:
            removed = cleanup_stale(include_live=args.all)
            print(f"removed {len(removed)}: {' '.join(removed)}" if removed else "nothing to remove")
            return 0
        if not cmd:
            parser.error("give the command after --, e.g. -- python train.py")
        try:
            net = ShapedNetwork(
                args.ranks, args.rate, per_flow_rate=args.per_flow_rate,
                master_port=args.master_port,
            )
        except ValueError as e:
            parser.error(str(e))
        with net:
            print(
                f"netns: {net.ranks} ranks, rate {net.shaping or 'unlimited'}, "
                f"10.213.{net.subnet}.0/24, prefix {net.prefix}",
                file=sys.stderr, flush=True,
            )
            if args.print_env:
                for i in range(net.ranks):
                    env = " ".join(f"{k}={v}" for k, v in net.rank_env(i).items())
                    print(f"[rank {i}] {net.namespaces[i]}: {env}", file=sys.stderr)
            net.run(cmd, timeout=args.timeout)
        return 0
    except RankTimeoutError as e:
        print(f"netns: {e}", file=sys.stderr)
        return 124
    except RankFailedError as e:
        print(f"netns: {e}", file=sys.stderr)
        rc = e.returncode
        return rc if isinstance(rc, int) and 0 < rc < 256 else 1
    except (NetnsError, ValueError) as e:
        print(f"netns: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("netns: interrupted; ranks killed and namespaces removed", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
