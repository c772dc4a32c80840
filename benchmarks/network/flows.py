"""Per-connection caps of an emulated network: htb trees with one leaf per TCP connection.

Clouds cap a single TCP flow far below the NIC's rate; this emulates that. Each link (the veth
egress inside a namespace, and the host-side leg's egress towards it) gets::

    1:      htb root; traffic no filter matches goes to 1:2
    1:1     the aggregate            rate = ceil = rate
    1:2     default leaf             rate = rate/64, ceil = per_flow_rate
    1:101.. one leaf per TCP connection (u32 filter on its addresses and ports), rates as 1:2

An htb leaf sends its guaranteed ``rate`` without asking its parent, so the leaves' rates must sum
to at most the aggregate or the aggregate leaks (leaves at rate = cap pushed 2.9 Gbit/s through a
"1 Gbit/s" parent). Hence rate/64 per leaf, and at most 63 connection leaves per link beside the
default one; a 64th concurrent connection shares the default leaf (with a warning).

:class:`FlowWatcher` is a thread that polls each namespace's TCP tables and adds a leaf for every
connection made after start (by any job), and removes it when the connection closes. A poll reads
the namespace's TCP counters (/proc/net/snmp, microseconds); only when they change, and once a
second, does it read the socket tables (/proc/net/tcp and tcp6, ~1 ms each) and run ``tc``.

Needs root and iproute2. Standard library only.

Example::

    shaping = FlowShaping(rate_bit=10**9, per_flow_bit=250 * 10**6)
    watcher = FlowWatcher(shaping, [Link("bgn42ar0", "veth0", "bgn42ah0")])
    watcher.install()      # the trees; raises FlowShapingError if tc refuses
    watcher.start()        # leaves follow the connections from now on
    ...
    watcher.stop()         # raises FlowShapingError if the thread failed
"""

from __future__ import annotations

import logging
import math
import socket
import struct
import subprocess
import threading
import time
from typing import IO, NamedTuple, Sequence

from .namespaces import in_namespace

__all__ = [
    "MAX_LEAVES",
    "Connection",
    "FlowShaping",
    "FlowShapingError",
    "FlowWatcher",
    "Link",
    "read_connections",
]

logger = logging.getLogger(__name__)

MAX_LEAVES = 64
"""Leaves per link, the default one included; each is guaranteed rate/MAX_LEAVES."""

_DEFAULT_MINOR = 2
_FIRST_FLOW_MINOR = 0x100  # class 1:101 is slot 1; slot s is also the u32 filter's node 800::s
_MIN_BURST_BYTES = 64 * 1024  # >= one GSO packet from a veth (up to 64 KiB)
_QUANTUM_BYTES = 64 * 1024  # equal quanta: connections borrowing from 1:1 share it equally
# /proc/net/tcp states during which data may still flow (ESTABLISHED, FIN_WAIT1, FIN_WAIT2,
# CLOSE_WAIT, LAST_ACK, CLOSING); SYN_*, TIME_WAIT, CLOSE and LISTEN have no leaf.
_LIVE_STATES = frozenset({0x01, 0x04, 0x05, 0x08, 0x09, 0x0B})
_TCP_COUNTERS = ("ActiveOpens", "PassiveOpens", "AttemptFails", "EstabResets", "CurrEstab")


class FlowShapingError(RuntimeError):
    """``tc`` refused a command, or the watcher thread failed."""


class Link(NamedTuple):
    """A namespace's leg: ``device`` inside ``namespace``, its peer ``host_leg`` on the host side
    (on the bridge in the root namespace, or in the router's namespace ``host_namespace``)."""

    namespace: str
    device: str
    host_leg: str
    host_namespace: str | None = None


class Connection(NamedTuple):
    """A TCP connection as one namespace sees it (IPv4 on the wire).

    Example: ``Connection("10.213.7.2", 40112, "10.213.7.1", 29500).match(outgoing=True)``
    """

    local: str
    local_port: int
    remote: str
    remote_port: int

    def match(self, outgoing: bool) -> str:
        """u32 match of its packets leaving the namespace (outgoing) or entering it."""
        src, sport, dst, dport = (
            (self.local, self.local_port, self.remote, self.remote_port)
            if outgoing
            else (self.remote, self.remote_port, self.local, self.local_port)
        )
        return (
            f"match ip protocol 6 0xff match ip src {src}/32 match ip dst {dst}/32 "
            f"match ip sport {sport} 0xffff match ip dport {dport} 0xffff"
        )


def _burst_bytes(rate_bit: int) -> int:
    """10 ms at ``rate_bit``, at least one GSO packet."""
    return max(int(math.ceil(rate_bit / 8 / 100)), _MIN_BURST_BYTES)


class FlowShaping:
    """The htb tree of a link: aggregate ``rate_bit``, each TCP connection at ``per_flow_bit``.

    Attributes:
        rate_bit, per_flow_bit: the caps, bits/s.
        leaf_rate_bit: every leaf's guaranteed rate, rate_bit // MAX_LEAVES.
        leaf_limit_bytes: a leaf's queue: 100 ms at the per-flow cap, at least 256 KiB.

    Example: ``FlowShaping(10**9, 250 * 10**6).tree("veth0")`` lists the tc batch lines.
    """

    def __init__(self, rate_bit: int, per_flow_bit: int) -> None:
        if per_flow_bit > rate_bit:
            raise ValueError(
                f"per_flow_rate ({per_flow_bit} bit/s) must not exceed the aggregate rate "
                f"({rate_bit} bit/s); raise rate= or lower per_flow_rate="
            )
        self.rate_bit = int(rate_bit)
        self.per_flow_bit = int(per_flow_bit)
        self.leaf_rate_bit = max(self.rate_bit // MAX_LEAVES, 1)
        self.leaf_limit_bytes = max(self.per_flow_bit // 80, 256 * 1024)

    def tree(self, dev: str) -> list[str]:
        """tc batch lines building the root, the aggregate class and the default leaf on ``dev``."""
        burst = _burst_bytes(self.rate_bit)
        return [
            f"qdisc add dev {dev} root handle 1: htb default {_DEFAULT_MINOR:x}",
            f"class add dev {dev} parent 1: classid 1:1 htb rate {self.rate_bit}bit "
            f"ceil {self.rate_bit}bit burst {burst} cburst {burst} quantum {_QUANTUM_BYTES}",
            *self._leaf(dev, _DEFAULT_MINOR),
        ]

    def add_leaf(self, dev: str, slot: int, match: str) -> list[str]:
        """tc batch lines adding connection leaf ``slot`` (1..MAX_LEAVES-1) with its filter."""
        minor = _FIRST_FLOW_MINOR + slot
        return [
            *self._leaf(dev, minor),
            f"filter add dev {dev} parent 1: protocol ip prio 1 handle 800::{slot:x} u32 "
            f"{match} flowid 1:{minor:x}",
        ]

    @staticmethod
    def remove_leaf(dev: str, slot: int) -> list[str]:
        """tc batch lines removing leaf ``slot``: its filter first (htb keeps a filtered class)."""
        return [
            f"filter del dev {dev} parent 1: protocol ip prio 1 handle 800::{slot:x} u32",
            f"class del dev {dev} classid 1:{_FIRST_FLOW_MINOR + slot:x}",
        ]

    def _leaf(self, dev: str, minor: int) -> list[str]:
        burst = _burst_bytes(self.per_flow_bit)
        return [
            f"class add dev {dev} parent 1:1 classid 1:{minor:x} htb rate {self.leaf_rate_bit}bit "
            f"ceil {self.per_flow_bit}bit burst {burst} cburst {burst} quantum {_QUANTUM_BYTES}",
            f"qdisc add dev {dev} parent 1:{minor:x} handle {minor:x}: bfifo "
            f"limit {self.leaf_limit_bytes}",
        ]

    def __repr__(self) -> str:
        return (
            f"FlowShaping(rate={self.rate_bit / 1e6:g}mbit, "
            f"per_flow={self.per_flow_bit / 1e6:g}mbit, leaf rate={self.leaf_rate_bit / 1e6:g}mbit)"
        )


# --------------------------------------------------------------------------------------------
# reading a namespace's TCP tables
# --------------------------------------------------------------------------------------------


def _ipv4(hex_address: str) -> str | None:
    """The IPv4 address of a /proc/net/tcp{,6} address (None for a real IPv6 one)."""
    raw = bytes.fromhex(hex_address)
    # the kernel prints each 32-bit word of the address in host byte order
    words = b"".join(
        struct.pack("=I", struct.unpack(">I", raw[i:i + 4])[0]) for i in range(0, len(raw), 4)
    )
    if len(words) == 16:
        if words[:12] != b"\0" * 10 + b"\xff\xff":
            return None
        words = words[12:]
    return socket.inet_ntoa(words)


def read_connections(table: bytes) -> set[Connection]:
    """Connections of a /proc/net/tcp or tcp6 table that may carry data across the link.

    Listening sockets, half-open and closed ones, connections within the namespace (loopback or
    to its own address) and real IPv6 ones (none cross these links) are left out.

    Example: ``read_connections(open("/proc/net/tcp", "rb").read())``
    """
    found = set()
    for line in table.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 4 or int(fields[3], 16) not in _LIVE_STATES:
            continue
        (local_hex, local_port), (remote_hex, remote_port) = (
            f.decode().split(":") for f in fields[1:3]
        )
        local, remote = _ipv4(local_hex), _ipv4(remote_hex)
        if local is None or remote is None or remote == local or remote.startswith("127."):
            continue
        found.add(Connection(local, int(local_port, 16), remote, int(remote_port, 16)))
    return found


def _tcp_counters(snmp: bytes) -> tuple[int, ...]:
    """The TCP counters of /proc/net/snmp that change when a connection opens or closes."""
    header, values = [line.split()[1:] for line in snmp.splitlines() if line.startswith(b"Tcp:")]
    by_name = dict(zip(header, values))
    return tuple(int(by_name[name.encode()]) for name in _TCP_COUNTERS)


def _open_in_namespace(namespace: str, paths: Sequence[str]) -> list[IO[bytes]]:
    """Open /proc/thread-self/net/<path> of ``namespace``: the files keep reading that namespace."""

    def opener() -> list[IO[bytes]]:
        files: list[IO[bytes]] = []
        try:
            files.extend(open(f"/proc/thread-self/net/{p}", "rb", buffering=0) for p in paths)
        except BaseException:
            for opened in files:
                opened.close()
            raise
        return files

    try:
        return in_namespace(namespace, opener)
    except OSError as e:
        raise FlowShapingError(f"cannot read the TCP tables of namespace {namespace}: {e}") from e


def _read(f: IO[bytes]) -> bytes:
    f.seek(0)
    return f.read()


def _tc_batch(lines: Sequence[str], namespace: str | None = None) -> None:
    """Run ``lines`` through one ``tc -batch`` (in ``namespace``, or the root namespace)."""
    if not lines:
        return
    argv = ["tc", *(["-n", namespace] if namespace else []), "-batch", "-"]
    proc = subprocess.run(argv, input="\n".join(lines) + "\n", capture_output=True, text=True)
    if proc.returncode != 0:
        where = f"namespace {namespace}" if namespace else "the root namespace"
        raise FlowShapingError(
            f"tc failed in {where} (exit {proc.returncode}): "
            f"{(proc.stderr or proc.stdout).strip()}; commands were: {'; '.join(lines)}"
        )


# --------------------------------------------------------------------------------------------
# the watcher
# --------------------------------------------------------------------------------------------


class _LinkState:
    def __init__(self, link: Link) -> None:
        self.link = link
        self.tcp, self.tcp6, self.snmp = _open_in_namespace(link.namespace, ("tcp", "tcp6", "snmp"))
        self.counters: tuple[int, ...] | None = None
        self.scanned_at = -math.inf
        self.slots: dict[Connection, int] = {}
        self.warned_full = False

    def close(self) -> None:
        for f in (self.tcp, self.tcp6, self.snmp):
            f.close()


class FlowWatcher(threading.Thread):
    """Keeps one htb leaf per live TCP connection on every link, for connections made at any time.

    Args:
        shaping: the tree's rates.
        links: the namespaces' legs to shape (both directions of each).
        interval: seconds between polls (a new connection is capped by the default leaf until
            the next one).
        rescan: seconds after which the tables are read even if no counter changed (catches a
            connection that finished closing).

    Example: see the module docstring.
    """

    def __init__(
        self,
        shaping: FlowShaping,
        links: Sequence[Link],
        interval: float = 0.05,
        rescan: float = 1.0,
    ) -> None:
        super().__init__(name="netns-flow-watcher", daemon=True)
        self.shaping = shaping
        self.links = list(links)
        self.interval = interval
        self.rescan = rescan
        self.error: BaseException | None = None
        self._states: list[_LinkState] = []
        self._lock = threading.Lock()
        self._stopping = threading.Event()

    def install(self) -> None:
        """Build the tree on both ends of every link and open the namespaces' TCP tables."""
        for link in self.links:
            _tc_batch(self.shaping.tree(link.device), link.namespace)
            _tc_batch(self.shaping.tree(link.host_leg), link.host_namespace)
            self._states.append(_LinkState(link))

    def leaves(self, link_index: int) -> dict[Connection, str]:
        """The connections of ``links[link_index]`` that have a leaf, with its class id.

        Example: ``watcher.leaves(0)`` -> ``{Connection("10.213.7.1", 29500, ...): "1:101"}``
        """
        with self._lock:
            slots = dict(self._states[link_index].slots)
        return {conn: f"1:{_FIRST_FLOW_MINOR + slot:x}" for conn, slot in slots.items()}

    def run(self) -> None:
        try:
            while not self._stopping.is_set():
                for state in self._states:
                    self._poll(state)
                self._stopping.wait(self.interval)
        except BaseException as e:  # reported by stop()
            logger.error("per-flow watcher stopped: %s", e)
            self.error = e

    def stop(self) -> None:
        """Stop the thread, close the tables; raise :class:`FlowShapingError` if it had failed."""
        self._stopping.set()
        if self.is_alive():
            self.join()
        for state in self._states:
            state.close()
        self._states.clear()
        if self.error is not None:
            raise FlowShapingError(
                f"the per-flow watcher failed, so connections made after it may have shared the "
                f"default leaf: {self.error}"
            ) from self.error

    def _poll(self, state: _LinkState) -> None:
        counters = _tcp_counters(_read(state.snmp))
        now = time.monotonic()
        if counters == state.counters and now - state.scanned_at < self.rescan:
            return
        state.counters, state.scanned_at = counters, now
        live = read_connections(_read(state.tcp)) | read_connections(_read(state.tcp6))
        gone = [conn for conn in state.slots if conn not in live]
        new = sorted(live.difference(state.slots))
        if not gone and not new:
            return
        link, inside, outside = state.link, [], []
        slots = dict(state.slots)
        for conn in gone:
            slot = slots.pop(conn)
            inside += self.shaping.remove_leaf(link.device, slot)
            outside += self.shaping.remove_leaf(link.host_leg, slot)
        free = sorted(set(range(1, MAX_LEAVES)) - set(slots.values()), reverse=True)
        for conn in new:
            if not free:
                if not state.warned_full:
                    logger.warning(
                        "%s has more than %d connections; the others share the default leaf",
                        link.namespace, MAX_LEAVES - 1,
                    )
                    state.warned_full = True
                break
            slot = slots[conn] = free.pop()
            inside += self.shaping.add_leaf(link.device, slot, conn.match(outgoing=True))
            outside += self.shaping.add_leaf(link.host_leg, slot, conn.match(outgoing=False))
        _tc_batch(inside, link.namespace)
        _tc_batch(outside, link.host_namespace)
        with self._lock:
            state.slots = slots
