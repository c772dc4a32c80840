#!/usr/bin/env python3
"""Measure TCP throughput between ranks: every rank > 0 sends to rank 0 over N parallel connections.

Run it as the ranks of ``benchmarks/netns.py`` (it reads RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT). The senders connect, wait ``--settle`` seconds (so that a per-flow-capped link's
watcher has given every connection its leaf), then send ``--megabytes`` on each connection at
once. Rank 0 prints one line, throughput in Mbit/s (10^6 bit/s) from its first byte to its last:

    TCP_PROBE connections=8 total_megabytes=128.0 seconds=1.07 mbit_s=955.1 \
        per_connection_mbit_s=119.2,...,120.1 from=10.213.7.2

CLI::

    python benchmarks/netns.py --ranks 2 --rate 1gbit --per-flow-rate 250mbit -- \\
        python benchmarks/tcp_probe.py --connections 8 --megabytes 16
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import threading
import time

_CHUNK = 1 << 20


def _receive(conn: socket.socket, record: list) -> None:
    """Read ``conn`` to its end; record (bytes, first byte time, last byte time); answer "ok"."""
    buf = bytearray(_CHUNK)
    got, first, last = 0, None, None
    while True:
        k = conn.recv_into(buf)
        if not k:
            break
        last = time.perf_counter()
        first = first or last
        got += k
    conn.sendall(b"ok")
    conn.close()
    record.append((got, first, last))


def receive(address: str, port: int, connections: int, megabytes: float) -> str:
    """Accept ``connections`` and read them in parallel; the TCP_PROBE line (raise if bytes miss)."""
    expected = int(megabytes * 1e6)
    with socket.create_server((address, port), backlog=connections) as server:
        accepted = [server.accept() for _ in range(connections)]
    peers = sorted({peer[0] for _, peer in accepted})
    records: list = []
    threads = [threading.Thread(target=_receive, args=(c, records)) for c, _ in accepted]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    short = [got for got, _, _ in records if got != expected]
    if short:
        raise RuntimeError(f"expected {expected} bytes on each connection, some got {short}")
    seconds = max(last for _, _, last in records) - min(first for _, first, _ in records)
    per_connection = sorted(got * 8 / (last - first) / 1e6 for got, first, last in records)
    return (
        f"TCP_PROBE connections={connections} total_megabytes={megabytes * connections:.1f} "
        f"seconds={seconds:.3f} mbit_s={expected * connections * 8 / seconds / 1e6:.1f} "
        f"per_connection_mbit_s={','.join(f'{r:.1f}' for r in per_connection)} "
        f"from={','.join(peers)}"
    )


def send(address: str, port: int, connections: int, megabytes: float, settle: float) -> None:
    """Open ``connections`` to rank 0, wait ``settle`` s, send ``megabytes`` on each at once."""
    deadline = time.monotonic() + 20
    socks = []
    while len(socks) < connections:
        try:
            socks.append(socket.create_connection((address, port), timeout=30))
        except OSError:  # rank 0 not listening yet
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    time.sleep(settle)
    payload = b"x" * int(megabytes * 1e6)

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


def parse_result(output: str) -> dict[str, str]:
    """The fields of the TCP_PROBE line in rank 0's ``output``.

    Example: ``float(parse_result(net.outputs[0])["mbit_s"])``
    """
    lines = [line for line in output.splitlines() if line.startswith("TCP_PROBE ")]
    if not lines:
        raise ValueError(f"no TCP_PROBE line in rank 0's output: {output[-2000:]!r}")
    return dict(field.split("=", 1) for field in lines[-1].split()[1:])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tcp_probe.py", description=__doc__.split("\n")[0])
    p.add_argument("--connections", type=int, default=1, help="per sending rank (default 1)")
    p.add_argument("--megabytes", type=float, default=4.0, help="per connection (default 4)")
    p.add_argument("--settle", type=float, default=0.3,
                   help="seconds between connecting and sending (default 0.3)")
    args = p.parse_args(argv)
    if args.connections < 1 or args.megabytes <= 0:
        p.error(f"--connections must be >= 1 and --megabytes > 0, got "
                f"{args.connections} and {args.megabytes}")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if world < 2:
        p.error("needs at least 2 ranks (rank 0 receives, the others send)")
    if rank == 0:
        print(receive(address, port, args.connections * (world - 1), args.megabytes), flush=True)
    else:
        send(address, port, args.connections, args.megabytes, args.settle)
    return 0


if __name__ == "__main__":
    sys.exit(main())
