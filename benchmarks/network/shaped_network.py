"""N ranks of a torchrun-style job on emulated machines, each a network namespace, over shaped links.

Every machine is a private network namespace with one veth leg; by default each rank is a machine
of its own (``LOCAL_WORLD_SIZE=1``). With ``ranks_per_machine=R`` the R ranks of a machine share
its namespace, as a machine's GPUs share NVLink: they reach each other over its loopback,
uncapped and undelayed (the kernel routes traffic to the namespace's own address through ``lo``),
and other machines only through the leg, and each rank gets the variables torchrun gives it on
such a cluster (``LOCAL_RANK``, ``LOCAL_WORLD_SIZE=R``, ``GROUP_RANK`` = its machine, ...). Without a delay the other legs hang off a Linux bridge in the root namespace; with
one (``delay=``) they end in a router namespace that passes every packet through the delay line
(``router.py``). With a rate given, a ``tbf`` qdisc caps both directions of every leg (egress
inside the namespace, and egress of the host-side leg towards it), so all rank-to-rank traffic
crosses a link of that bandwidth; with ``per_flow_rate`` as well, each TCP connection is capped
at that rate under the aggregate (``flows.py``). Each rank's namespace pins its TCP congestion
control (cubic unless told otherwise; new namespaces would inherit the host's) and allows socket
buffers of twice the bandwidth-delay product. Nothing is routed anywhere else: no address, NAT
or default route leads out, and the addresses (a /24 inside 10.213.0.0/16) exist only inside
the namespaces.

Needs root and iproute2 (``ip``, ``tc``). Standard library only.

Example::

    from benchmarks.network import ShapedNetwork
    with ShapedNetwork(ranks=2, rate="100mbit", delay="20/1") as net:
        print(net.rank_env(1))
        rcs = net.run([sys.executable, "train.py"], timeout=300)   # [0, 0]
    net.delay_stats["dropped"]                                     # 0
"""

from __future__ import annotations

import logging
import os
import random
import signal
import threading
from pathlib import Path
from typing import IO, Callable, Mapping, Sequence

from ..jobs import RankJob
from .delay_line import Delay
from .flows import FlowShaping, FlowShapingError, FlowWatcher, Link
from .namespaces import (IFNAME_IN_NS, MAX_RANKS, PREFIX, SUBNET_BASE, NetnsError, _IFNAMSIZ, _cmd,
                         _counter, _counter_lock, _kill_netns_pids, allow_congestion_control, _link_exists, _list_netns,
                         check_requirements, write_sysctls)
from .router import GATEWAY, Router
from .shaping import Shaping, parse_rate, tcp_buffer_bytes

logger = logging.getLogger(__name__)

DEFAULT_MASTER_PORT = 29500
DEFAULT_TIMEOUT = 600.0
DEFAULT_TCP_CC = "cubic"

# --------------------------------------------------------------------------------------------
# the network
# --------------------------------------------------------------------------------------------


class ShapedNetwork:
    """N network namespaces, each leg capped at ``rate`` in both directions, ``delay`` apart.

    Use it as a context manager: entering builds the namespaces, leaving (also on an exception,
    Ctrl-C or SIGTERM) tears them down.

    Args:
        ranks: number of ranks, a multiple of ``ranks_per_machine``; the machines (namespaces)
            are ``ranks // ranks_per_machine``, 1..254.
        rate: per-link cap, tc syntax ("100mbit", "1gbit", "50mbps"); None or "none": no cap.
        per_flow_rate: also cap each TCP connection at this rate (at most ``rate``), in both
            directions, for connections made at any time (``self.flow_watcher`` keeps one
            htb leaf per connection); None: one tbf cap per leg.
        delay: one-way latency between any two ranks, in both directions: "MS" or
            "MS/JITTER_MS" (uniform jitter, order kept per pair), a number of ms, or a
            :class:`Delay`; None: no delay line, the legs are bridged.
        tcp_cc: TCP congestion control pinned in every rank's namespace (one of
            /proc/sys/net/ipv4/tcp_available_congestion_control).
        master_port: MASTER_PORT given to the ranks (each namespace is private, so it is free).
        subnet: third octet of the 10.213.<subnet>.0/24 used; default: random per invocation.
        ranks_per_machine: ranks sharing each machine's namespace (default 1), laid out machine
            by machine as torchrun lays them out: rank ``r`` on machine ``r // ranks_per_machine``.

    Attributes:
        router: the router namespace with the delay line (None without a delay).
        delay_stats: the delay line's counters after teardown (packets, dropped, tun_dropped,
            release lateness); None without a delay.

    Example::

        with ShapedNetwork(ranks=2, rate="100mbit") as net:
            rcs = net.run([sys.executable, "-c", "import os; print(os.environ['RANK'])"])
        with ShapedNetwork(ranks=2, rate="1gbit", per_flow_rate="250mbit") as net:
            ...  # one connection gets 250 Mbit/s, four or more share 1 Gbit/s
        with ShapedNetwork(ranks=4, rate="1gbit", delay="5") as net:
            ...  # a ping between two ranks takes 10 ms more
        with ShapedNetwork(ranks=8, ranks_per_machine=2, rate="100mbit") as net:
            ...  # 4 machines of 2 ranks: ranks 0 and 1 share machine 0's namespace
    """

    def __init__(
        self,
        ranks: int,
        rate: str | int | float | None = "100mbit",
        per_flow_rate: str | int | float | None = None,
        delay: str | float | Delay | None = None,
        tcp_cc: str = DEFAULT_TCP_CC,
        master_port: int = DEFAULT_MASTER_PORT,
        subnet: int | None = None,
        ranks_per_machine: int = 1,
    ) -> None:
        per = ranks_per_machine
        if not isinstance(per, int) or isinstance(per, bool) or per < 1:
            raise ValueError(f"ranks_per_machine must be a positive int, got {per!r}")
        if not isinstance(ranks, int) or isinstance(ranks, bool) or ranks < 1 or ranks % per \
                or not ranks // per <= MAX_RANKS:
            raise ValueError(f"ranks must be a multiple of ranks_per_machine={per} with at most {MAX_RANKS} "
                             f"machines, got {ranks!r}")
        if not isinstance(master_port, int) or not 1 <= master_port <= 65535:
            raise ValueError(f"master_port must be in [1, 65535], got {master_port!r}")
        if subnet is not None and not (isinstance(subnet, int) and 0 <= subnet <= 255):
            raise ValueError(f"subnet must be an int in [0, 255] or None, got {subnet!r}")
        self.ranks = ranks
        self.ranks_per_machine = per
        self.machines = ranks // per
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
        self.delay = delay if isinstance(delay, Delay) or delay is None else Delay.parse(delay)
        if not isinstance(tcp_cc, str) or not tcp_cc.isidentifier():
            raise ValueError(f"tcp_cc must name a congestion control such as 'cubic', got {tcp_cc!r}")
        self.tcp_cc = tcp_cc
        self.tcp_buffer_bytes = tcp_buffer_bytes(
            self.rate_bit, self.delay.ms + self.delay.jitter_ms if self.delay else 0.0
        )
        self.master_port = master_port
        self.subnet = random.SystemRandom().randrange(256) if subnet is None else subnet

        # bgn<pid><letter>: the letter tells apart networks made by one process; skip one
        # whose bridge or first namespace still exists (a network of ours that is alive or was
        # not torn down).
        with _counter_lock:
            for _ in range(26):
                letter = chr(ord("a") + next(_counter) % 26)
                self.prefix = f"{PREFIX}{os.getpid()}{letter}"
                if not (_link_exists(f"{self.prefix}br")
                        or os.path.exists(f"/run/netns/{self.prefix}r0")):
                    break
        # one namespace, leg and address per machine
        self.namespaces = [f"{self.prefix}r{i}" for i in range(self.machines)]
        self.host_legs = [f"{self.prefix}h{i}" for i in range(self.machines)]
        self.bridge = f"{self.prefix}br"
        self.router = None if self.delay is None else Router(f"{self.prefix}rt", self.delay)
        self.delay_stats: dict | None = None
        for name in self.host_legs + [self.bridge]:
            if len(name) > _IFNAMSIZ:  # cannot happen for pid <= 2**22 and ranks <= 254
                raise NetnsError(f"interface name {name!r} is longer than {_IFNAMSIZ} characters")
        self.addresses = [f"{SUBNET_BASE}.{self.subnet}.{i + 1}" for i in range(self.machines)]
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
        """Create the namespaces and their legs (bridged, or routed through the delay line)."""
        check_requirements()
        self._up = True  # from here on, teardown() has something to do
        logger.info(
            "creating %d namespaces %s..%s, 10.213.%d.0/24, rate %s, delay %s, TCP %s",
            self.machines, self.namespaces[0], self.namespaces[-1], self.subnet,
            self.shaping or "unlimited", self.delay or "none", self.tcp_cc,
        )
        if self.router is None:
            self._add_bridge()
        else:
            self.router.setup()
        tcp = {
            "net/ipv4/tcp_congestion_control": self.tcp_cc,
            "net/ipv4/tcp_rmem": f"4096 131072 {self.tcp_buffer_bytes}",
            "net/ipv4/tcp_wmem": f"4096 16384 {self.tcp_buffer_bytes}",
        }
        allow_congestion_control(self.tcp_cc)
        for ns, leg, address in zip(self.namespaces, self.host_legs, self.addresses):
            _cmd("ip", "netns", "add", ns)
            _cmd("ip", "-n", ns, "link", "set", "dev", "lo", "up")
            write_sysctls(ns, tcp)
            self._add_leg(ns, leg, address)
        if isinstance(self.shaping, FlowShaping):
            host_ns = None if self.router is None else self.router.namespace
            self.flow_watcher = FlowWatcher(
                self.shaping,
                [Link(ns, IFNAME_IN_NS, leg, host_ns)
                 for ns, leg in zip(self.namespaces, self.host_legs)],
            )
            try:
                self.flow_watcher.install()
            except FlowShapingError as e:
                raise NetnsError(str(e)) from e
            self.flow_watcher.start()

    def _add_bridge(self) -> None:
        _cmd("ip", "link", "add", "name", self.bridge, "type", "bridge", "stp_state", "0")
        # No IPv6 link-local (nor any other) address on root-namespace devices.
        _cmd("ip", "link", "set", "dev", self.bridge, "addrgenmode", "none")
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
        _cmd("ip", "link", "set", "dev", self.bridge, "up")

    def _add_leg(self, ns: str, leg: str, address: str) -> None:
        """The veth pair of namespace ``ns``: ``leg`` on the bridge or in the router, shaped."""
        # ip / tc on the host side of the leg: the root namespace, or the router's
        host = [] if self.router is None else ["-n", self.router.namespace]
        _cmd("ip", *host, "link", "add", "name", leg, "type", "veth",
             "peer", "name", IFNAME_IN_NS, "netns", ns)
        _cmd("ip", *host, "link", "set", "dev", leg, "addrgenmode", "none")
        _cmd("ip", "-n", ns, "link", "set", "dev", IFNAME_IN_NS, "addrgenmode", "none")
        if self.router is None:
            _cmd("ip", "link", "set", "dev", leg, "master", self.bridge)
            _cmd("ip", "-n", ns, "addr", "add", f"{address}/24", "dev", IFNAME_IN_NS)
        else:
            _cmd("ip", "-n", ns, "addr", "add", f"{address}/32", "dev", IFNAME_IN_NS)
        if isinstance(self.shaping, Shaping):
            args = self.shaping.tc_args()
            _cmd("tc", "-n", ns, "qdisc", "add", "dev", IFNAME_IN_NS, "root", *args)  # outbound
            _cmd("tc", *host, "qdisc", "add", "dev", leg, "root", *args)  # inbound
        _cmd("ip", *host, "link", "set", "dev", leg, "up")
        _cmd("ip", "-n", ns, "link", "set", "dev", IFNAME_IN_NS, "up")
        if self.router is not None:
            self.router.attach(leg, address)
            _cmd("ip", "-n", ns, "route", "add", GATEWAY, "dev", IFNAME_IN_NS, "scope", "link")
            _cmd("ip", "-n", ns, "route", "add", f"{SUBNET_BASE}.{self.subnet}.0/24",
                 "via", GATEWAY, "dev", IFNAME_IN_NS, "src", address)

    def teardown(self, raise_on_leftovers: bool = False) -> None:
        """Delete everything :meth:`setup` created; safe to call twice or after a failed setup.

        Ctrl-C and SIGTERM are held back until it is done. With ``raise_on_leftovers``, raise
        :class:`NetnsError` if something is left, or the per-flow watcher or the delay line had
        failed (otherwise log it).
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
            failures: list[str] = []  # of the per-flow watcher, the delay line
            if self.flow_watcher is not None:  # first: it holds the namespaces open
                try:
                    self.flow_watcher.stop()
                except FlowShapingError as e:
                    failures.append(str(e))
                self.flow_watcher = None
            if self.router is not None:
                try:
                    self.delay_stats = self.router.stop()
                except NetnsError as e:
                    failures.append(str(e))
                    self.delay_stats = self.router.stats
                if self.delay_stats and (self.delay_stats.get("dropped")
                                         or self.delay_stats.get("tun_dropped")):
                    logger.warning("the delay line dropped packets: %s", self.delay_stats)
            existing_ns = set(_list_netns())
            for ns in self._all_namespaces():
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
            # namespace open; delete the bridge-side end explicitly in that case (a router's
            # legs go with the router's namespace).
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
            leftovers = [ns for ns in self._all_namespaces() if ns in set(_list_netns())]
            leftovers += [n for n in self.host_legs + [self.bridge] if _link_exists(n)]
            if problems or leftovers:
                msg = (
                    f"teardown of {self.prefix}* incomplete: {'; '.join(problems)} "
                    f"leftovers: {leftovers}; remove them with "
                    f"`python -m benchmarks.network.netns --cleanup --all`"
                )
                if raise_on_leftovers:
                    raise NetnsError(msg)
                logger.warning(msg)
            if failures:
                if raise_on_leftovers:
                    raise NetnsError("; ".join(failures))
                for failure in failures:
                    logger.error(failure)
        finally:
            if old_mask is not None:
                signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)

    def _all_namespaces(self) -> list[str]:
        return self.namespaces + ([] if self.router is None else [self.router.namespace])

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
        machine, local = divmod(rank, self.ranks_per_machine)
        return {
            "RANK": str(rank),
            "WORLD_SIZE": str(self.ranks),
            "LOCAL_RANK": str(local),
            "LOCAL_WORLD_SIZE": str(self.ranks_per_machine),
            "GROUP_RANK": str(machine),
            "GROUP_WORLD_SIZE": str(self.machines),
            "ROLE_RANK": str(rank),
            "ROLE_WORLD_SIZE": str(self.ranks),
            "MASTER_ADDR": self.addresses[0],
            "MASTER_PORT": str(self.master_port),
            "GLOO_SOCKET_IFNAME": IFNAME_IN_NS,
            "TP_SOCKET_IFNAME": IFNAME_IN_NS,
            "NCCL_SOCKET_IFNAME": IFNAME_IN_NS,
        }

    def rank_argv(self, rank: int, cmd: Sequence[str]) -> list[str]:
        """The full command line that starts ``cmd`` as ``rank`` inside its machine's namespace."""
        env = [f"{k}={v}" for k, v in self.rank_env(rank).items()]
        return ["ip", "netns", "exec", self.machine_namespace(rank), "env", *env, *cmd]

    def machine_namespace(self, rank: int) -> str:
        """The namespace of ``rank``'s machine."""
        return self.namespaces[rank // self.ranks_per_machine]

    def run(
        self,
        cmd: Sequence[str],
        timeout: float = DEFAULT_TIMEOUT,
        check: bool = True,
        stream: IO[str] | None = None,
        echo: bool = True,
        env: Mapping[str, str] | None = None,
    ) -> list[int | None]:
        """Start ``cmd`` once per namespace and wait for all ranks (``benchmarks.jobs.RankJob``).

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
            RankFailedError: a rank exited non-zero; RankTimeoutError: the timeout passed
            (both from ``benchmarks.jobs``).
        """
        if not self._up:
            raise NetnsError("the network is not set up; use `with ShapedNetwork(...) as net:`")
        if not cmd:
            raise ValueError("cmd must name a program, got an empty command")
        cmd = [str(c) for c in cmd]
        job = RankJob([self.rank_argv(i, cmd) for i in range(self.ranks)],
                      [self.machine_namespace(i) for i in range(self.ranks)], self.prefix)
        try:
            return job.run(timeout, check=check, stream=stream, echo=echo, env=env)
        finally:
            self.returncodes, self.outputs = job.returncodes, job.outputs

    def __repr__(self) -> str:
        return (
            f"ShapedNetwork(ranks={self.ranks}, ranks_per_machine={self.ranks_per_machine}, "
            f"rate={self.shaping or 'none'}, "
            f"delay={self.delay or 'none'}, tcp_cc={self.tcp_cc!r}, "
            f"prefix={self.prefix!r}, subnet=10.213.{self.subnet}.0/24)"
        )


def tx_bytes_reader() -> Callable[[], int] | None:
    """In a rank: a function returning its interface's tx byte count, or None where not its own.

    Only on an emulated machine of one rank (``GLOO_SOCKET_IFNAME`` set by ``rank_env``,
    ``LOCAL_WORLD_SIZE=1``) is the interface this rank's alone; on loopback every rank (and
    everything else on the machine) shares ``lo``.
    """
    ifname = os.environ.get("GLOO_SOCKET_IFNAME")
    if not ifname or os.environ.get("LOCAL_WORLD_SIZE") != "1":
        return None
    path = Path("/sys/class/net") / ifname / "statistics" / "tx_bytes"
    if not path.exists():
        return None
    return lambda: int(path.read_text())


def rank_tcp_cc(requested: str | None, emulated: bool) -> str:
    """In a rank: set its network namespace's TCP congestion control to ``requested`` (before Gloo
    connects; only on an emulated machine, ``emulated``, where the namespace is the rank's own) and
    return the one in use ("?" where it cannot be read).

    Example::

        tcp_cc = rank_tcp_cc(args.tcp_cc, args.link == "netns")   # "bbr"
    """
    path = Path("/proc/sys/net/ipv4/tcp_congestion_control")
    if requested:
        if not emulated:  # on loopback this would change the host's setting
            raise SystemExit("--tcp-cc is only for the emulated network's settings (one namespace per rank)")
        path.write_text(requested)
    in_use = path.read_text().strip() if path.exists() else "?"
    if requested and in_use != requested:
        raise SystemExit(f"--tcp-cc {requested}: the namespace still uses {in_use} (not allowed there?)")
    return in_use
