#!/usr/bin/env python3
"""Probes of an emulated network, run as its ranks: TCP throughput and UDP one-way delay.

Run them as the ranks of ``python -m benchmarks.network.netns`` (they read RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT); every rank > 0 probes rank 0. Standard library only, so they run as
scripts.

``tcp``: the senders connect ``--connections`` each, wait ``--settle`` seconds (so that a
per-flow-capped link's watcher has given every connection its leaf), then send ``--megabytes``
of a seeded random pattern on each connection at once. Rank 0 checks every byte (SHA-256 of each
connection against the pattern) and prints throughput in Mbit/s (10^6 bit/s) from its first byte
to its last, and ``steady_mbit_s`` counted only after the first ``--warmup-megabytes`` of each
connection (what a long transfer gets once TCP's slow start is over)::

    TCP_PROBE connections=8 total_megabytes=128.0 seconds=1.07 mbit_s=955.1 steady_mbit_s=960.2 \
        per_connection_mbit_s=119.2,...,120.1 intact=yes from=10.213.7.2

``udp``: each sender sends ``--count`` timestamped datagrams, one at a time, to rank 0, which
stamps its receive time and echoes them; the sender prints the one-way delays, there and back
(every namespace reads the same CLOCK_MONOTONIC, so the two clocks are one)::

    UDP_PROBE count=100 lost=0 forward_ms=20.08/20.11/20.35 back_ms=20.07/20.10/20.31 \
        to=10.213.7.1 from=10.213.7.2             (min/median/p95)

CLI::

    python -m benchmarks.network.netns --ranks 2 --rate 1gbit --per-flow-rate 250mbit -- \\
        python benchmarks/network/probes.py tcp --connections 8 --megabytes 16
    python -m benchmarks.network.netns --ranks 2 --delay 20 -- python benchmarks/network/probes.py udp
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import socket
import statistics
import struct
import sys
import threading
import time

_CHUNK = 1 << 20
_PATTERN_SEED = 20260101
_START_TIMEOUT = 20.0  # s for rank 0 to come up


def pattern(nbytes: int) -> bytes:
    """The bytes every TCP probe connection carries."""
    return random.Random(_PATTERN_SEED).randbytes(nbytes)


# --------------------------------------------------------------------------------------------
# TCP throughput
# --------------------------------------------------------------------------------------------


class _Received:
    def __init__(self) -> None:
        self.bytes = 0
        self.first = self.last = self.warm_at = 0.0
        self.bytes_at_warm = 0
        self.digest = ""


def _receive(conn: socket.socket, warmup: int, record: list) -> None:
    """Read ``conn`` to its end, hashing; record a :class:`_Received`; answer "ok"."""
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    got = _Received()
    sha = hashlib.sha256()
    while True:
        k = conn.recv_into(buf)
        if not k:
            break
        got.last = time.perf_counter()
        got.first = got.first or got.last
        sha.update(view[:k])
        got.bytes += k
        if not got.warm_at and got.bytes >= warmup:
            got.warm_at, got.bytes_at_warm = got.last, got.bytes
    got.digest = sha.hexdigest()
    conn.sendall(b"ok")
    conn.close()
    record.append(got)


def receive(address: str, port: int, connections: int, megabytes: float,
            warmup_megabytes: float = 0.0) -> str:
    """Accept ``connections`` and read them in parallel; the TCP_PROBE line.

    Raises:
        RuntimeError: a connection carried other bytes than the pattern (or fewer).
    """
    expected = int(megabytes * 1e6)
    warmup = min(int(warmup_megabytes * 1e6), expected - 1)
    with socket.create_server((address, port), backlog=connections) as server:
        accepted = [server.accept() for _ in range(connections)]
    peers = sorted({peer[0] for _, peer in accepted})
    records: list[_Received] = []
    threads = [threading.Thread(target=_receive, args=(c, warmup, records)) for c, _ in accepted]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    digest = hashlib.sha256(pattern(expected)).hexdigest()
    wrong = [r.bytes for r in records if r.bytes != expected or r.digest != digest]
    if wrong:
        raise RuntimeError(
            f"expected the same {expected} bytes on each connection; {len(wrong)} of "
            f"{connections} carried other bytes (sizes {wrong})"
        )
    seconds = max(r.last for r in records) - min(r.first for r in records)
    steady_seconds = max(r.last for r in records) - min(r.warm_at for r in records)
    steady_bits = sum(r.bytes - r.bytes_at_warm for r in records) * 8
    per_connection = sorted(r.bytes * 8 / (r.last - r.first) / 1e6 for r in records)
    return (
        f"TCP_PROBE connections={connections} total_megabytes={megabytes * connections:.1f} "
        f"seconds={seconds:.3f} mbit_s={expected * connections * 8 / seconds / 1e6:.1f} "
        f"steady_mbit_s={steady_bits / steady_seconds / 1e6:.1f} "
        f"per_connection_mbit_s={','.join(f'{r:.1f}' for r in per_connection)} "
        f"intact=yes from={','.join(peers)}"
    )


def send(address: str, port: int, connections: int, megabytes: float, settle: float) -> None:
    """Open ``connections`` to rank 0, wait ``settle`` s, send ``megabytes`` on each at once."""
    deadline = time.monotonic() + _START_TIMEOUT
    socks = []
    while len(socks) < connections:
        try:
            socks.append(socket.create_connection((address, port), timeout=60))
        except OSError:  # rank 0 not listening yet
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    time.sleep(settle)
    payload = pattern(int(megabytes * 1e6))

    def push(s: socket.socket) -> None:
        s.sendall(payload)
        s.shutdown(socket.SHUT_WR)
        if s.recv(2) != b"ok":
            raise RuntimeError("rank 0 did not confirm the bytes")
        s.close()

    threads = [threading.Thread(target=push, args=(s,)) for s in socks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


# --------------------------------------------------------------------------------------------
# UDP one-way delay
# --------------------------------------------------------------------------------------------

_PROBE = struct.Struct("!4sIq")  # tag, sequence number, sender's clock (ns)
_ECHO = struct.Struct("!4sIqqq")  # ... and rank 0's clock at receipt and at reply (ns)
_HELLO, _DATA, _BYE = b"HELO", b"DATA", b"BYE!"


def reflect(address: str, port: int, senders: int, timeout: float) -> str:
    """Echo every probe with rank 0's receive and reply times until each sender said bye."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind((address, port))
        sock.settimeout(timeout)
        done: set = set()
        served = 0
        while len(done) < senders:
            data, peer = sock.recvfrom(64)
            received = time.monotonic_ns()
            tag, seq, sent = _PROBE.unpack(data)
            sock.sendto(_ECHO.pack(tag, seq, sent, received, time.monotonic_ns()), peer)
            served += tag == _DATA
            if tag == _BYE:
                done.add(peer)
    return f"UDP_REFLECTOR served={served} senders={senders}"


def _ask(sock: socket.socket, tag: bytes, seq: int, wait: float) -> tuple | None:
    """Send one probe; its echo's fields (None if none came within ``wait`` s)."""
    sock.send(_PROBE.pack(tag, seq, time.monotonic_ns()))
    end = time.monotonic() + wait
    while (left := end - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            data = sock.recv(64)
        except (socket.timeout, ConnectionRefusedError):  # refused: rank 0 not bound yet
            return None
        echo = _ECHO.unpack(data) + (time.monotonic_ns(),)
        if echo[0] == tag and echo[1] == seq:
            return echo
    return None


def probe_delay(address: str, port: int, count: int, interval: float, wait: float) -> str:
    """Send ``count`` probes to rank 0 one at a time; the UDP_PROBE line (ms: min/median/p95)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect((address, port))
        deadline = time.monotonic() + _START_TIMEOUT
        while _ask(sock, _HELLO, 0, 0.2) is None:
            if time.monotonic() > deadline:
                raise RuntimeError(f"rank 0 ({address}:{port}) did not answer for {_START_TIMEOUT} s")
        forward, back, lost = [], [], 0
        for seq in range(count):
            time.sleep(interval)
            echo = _ask(sock, _DATA, seq, wait)
            if echo is None:
                lost += 1
                continue
            _, _, sent, received, replied, returned = echo
            forward.append((received - sent) / 1e6)
            back.append((returned - replied) / 1e6)
        for _ in range(10):  # rank 0 waits for every sender's bye
            if _ask(sock, _BYE, count, 1.0) is not None:
                break
        me = sock.getsockname()[0]
    if not forward:
        raise RuntimeError(f"all {count} probes to {address} were lost")

    def summary(ms: list) -> str:
        ms = sorted(ms)
        return f"{ms[0]:.3f}/{statistics.median(ms):.3f}/{ms[int(0.95 * (len(ms) - 1))]:.3f}"

    return (f"UDP_PROBE count={count} lost={lost} forward_ms={summary(forward)} "
            f"back_ms={summary(back)} to={address} from={me}")


def parse_result(output: str, tag: str = "TCP_PROBE") -> dict[str, str]:
    """The fields of the last ``tag`` line (TCP_PROBE, UDP_PROBE) in a rank's ``output``.

    Example: ``float(parse_result(net.outputs[0])["mbit_s"])``
    """
    lines = [line for line in output.splitlines() if line.startswith(f"{tag} ")]
    if not lines:
        raise ValueError(f"no {tag} line in the rank's output: {output[-2000:]!r}")
    return dict(field.split("=", 1) for field in lines[-1].split()[1:])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="probes.py", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="probe", required=True)
    tcp = sub.add_parser("tcp", help="throughput of every rank > 0 sending to rank 0")
    tcp.add_argument("--connections", type=int, default=1, help="per sending rank (default 1)")
    tcp.add_argument("--megabytes", type=float, default=4.0, help="per connection (default 4)")
    tcp.add_argument("--warmup-megabytes", type=float, default=0.0,
                     help="per connection, left out of steady_mbit_s (default 0)")
    tcp.add_argument("--settle", type=float, default=0.3,
                     help="seconds between connecting and sending (default 0.3)")
    udp = sub.add_parser("udp", help="one-way delay between every rank > 0 and rank 0")
    udp.add_argument("--count", type=int, default=100, help="probes per sender (default 100)")
    udp.add_argument("--interval-ms", type=float, default=2.0,
                     help="pause between a probe's echo and the next probe (default 2)")
    udp.add_argument("--wait-s", type=float, default=2.0,
                     help="a probe whose echo takes longer is lost (default 2)")
    args = p.parse_args(argv)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if world < 2:
        p.error("needs at least 2 ranks (rank 0 answers, the others probe it)")
    if args.probe == "tcp":
        if args.connections < 1 or args.megabytes <= 0 or args.warmup_megabytes < 0:
            p.error(f"--connections must be >= 1, --megabytes > 0 and --warmup-megabytes >= 0, "
                    f"got {args.connections}, {args.megabytes} and {args.warmup_megabytes}")
        if rank == 0:
            print(receive(address, port, args.connections * (world - 1), args.megabytes,
                          args.warmup_megabytes), flush=True)
        else:
            send(address, port, args.connections, args.megabytes, args.settle)
    else:
        if args.count < 1:
            p.error(f"--count must be >= 1, got {args.count}")
        if rank == 0:
            print(reflect(address, port, world - 1, _START_TIMEOUT + args.count * args.wait_s),
                  flush=True)
        else:
            print(probe_delay(address, port, args.count, args.interval_ms / 1e3, args.wait_s),
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
