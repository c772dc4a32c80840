#!/usr/bin/env python3
"""The delay line: hold every IP packet routed into a TUN device for a one-way delay, then send it on.

The kernel here has no netem, so latency is added in user space. The router namespace routes the
ranks' packets into a TUN device (see ``router.py``); this program reads each packet from it,
keeps it for the delay (``delay_ms`` plus a uniform jitter in ``[-jitter_ms, +jitter_ms]``) and
writes it back, and the router forwards it to its destination. What keeps it faithful:

- the tun is opened with ``IFF_VNET_HDR`` and offloads on (``TUNSETOFFLOAD``), so GSO packets of
  up to 64 KB cross whole (a 2 MB transfer is a few hundred packets, not 1400); every frame is
  written back exactly as read, its virtio-net header included;
- packets of one (source, destination) pair leave in the order they came, whatever the jitter
  (TCP takes reordering for loss), so a packet waits at least until the one before it left: a
  lone packet sees the uniform spread, a dense stream's packets drift towards delay + jitter;
- the process asks for ``SCHED_FIFO`` (as ``chrt -f`` would): at normal priority, release
  lateness on a loaded 2-core box reached 3.3 ms p99, under SCHED_FIFO 0.1 ms.

Nothing is dropped on purpose; a packet is dropped (and counted) only when ``limit_bytes`` are
already held, it is larger than the read buffer, or the kernel refuses the write. On SIGTERM or SIGINT it prints one line of
counters (``DELAY_LINE_STATS {json}``) and exits. Standard library only, so it runs as a script.

Example (root; the router namespace routes into ``tun0``)::

    ip netns exec bgn42art python benchmarks/network/delay_line.py --tun tun0 --delay-ms 20

    line = DelayLine(fd, delay_s=0.020)     # fd: any file descriptor of whole IP frames
    line.run(stop_fd)                       # until stop_fd is readable; then line.stats()
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import heapq
import json
import math
import os
import random
import select
import signal
import struct
import sys
import time
from typing import NamedTuple

TUNSETIFF = 0x400454CA
TUNSETOFFLOAD = 0x400454D0
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
IFF_VNET_HDR = 0x4000
TUN_F_CSUM, TUN_F_TSO4, TUN_F_TSO6, TUN_F_TSO_ECN = 0x01, 0x02, 0x04, 0x08
VNET_HDR_BYTES = 10
"""struct virtio_net_hdr, in front of every frame of a tun opened with IFF_VNET_HDR."""

STATS_TAG = "DELAY_LINE_STATS"
DEFAULT_LIMIT_BYTES = 256 << 20
_READ_BYTES = VNET_HDR_BYTES + (256 << 10)  # above any GSO packet (64 KB; BIG TCP is off)
_BATCH = 256  # frames read per wake-up at most, so releases are not held up by a flood


class Delay(NamedTuple):
    """A one-way delay and its jitter, in milliseconds.

    Example: ``Delay.parse("20/2") == Delay(20.0, 2.0)``
    """

    ms: float
    jitter_ms: float = 0.0

    @classmethod
    def parse(cls, text: str | float | int) -> "Delay":
        """``"MS"`` or ``"MS/JITTER_MS"`` (or a number of ms); jitter at most the delay."""
        if isinstance(text, (int, float)) and not isinstance(text, bool):
            parts = [float(text)]
        else:
            try:
                parts = [float(p) for p in str(text).split("/")]
            except ValueError:
                parts = []
        if not 1 <= len(parts) <= 2 or not all(math.isfinite(p) for p in parts):
            raise ValueError(
                f"delay must be MS or MS/JITTER_MS in milliseconds, e.g. '20' or '20/2'; "
                f"got {text!r}"
            )
        delay = cls(*parts)
        if not 0 <= delay.jitter_ms <= delay.ms:
            raise ValueError(
                f"delay needs 0 <= jitter <= delay (a packet cannot leave before it came); "
                f"got {delay.ms:g} ms with jitter {delay.jitter_ms:g} ms"
            )
        return delay

    def __str__(self) -> str:
        return f"{self.ms:g}ms" + (f"/{self.jitter_ms:g}ms" if self.jitter_ms else "")


def open_tun(name: str) -> int:
    """Create tun ``name`` in this thread's network namespace, with GSO offloads; its fd.

    The device exists as long as the fd is open (it is not persistent).
    """
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    try:
        ifreq = struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI | IFF_VNET_HDR)
        fcntl.ioctl(fd, TUNSETIFF, ifreq)
        fcntl.ioctl(fd, TUNSETOFFLOAD, TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6 | TUN_F_TSO_ECN)
    except BaseException:
        os.close(fd)
        raise
    return fd


class DelayLine:
    """Holds frames read from ``fd`` for the delay, then writes them back to ``fd``.

    Args:
        fd: a non-blocking file descriptor that reads and writes whole frames (a tun fd).
        delay_s, jitter_s: the one-way delay and its uniform jitter, seconds.
        header_bytes: bytes in front of the IP header of each frame (the virtio-net header).
        limit_bytes: most bytes held at once; beyond it frames are dropped (and counted).
        seed: of the jitter's random numbers.

    Example: see the module docstring.
    """

    def __init__(
        self,
        fd: int,
        delay_s: float,
        jitter_s: float = 0.0,
        header_bytes: int = VNET_HDR_BYTES,
        limit_bytes: int = DEFAULT_LIMIT_BYTES,
        seed: int | None = None,
    ) -> None:
        self.fd = fd
        self.delay_s = delay_s
        self.jitter_s = jitter_s
        self.header_bytes = header_bytes
        self.limit_bytes = limit_bytes
        self._random = random.Random(seed)
        self._held: list[tuple[float, int, bytes]] = []  # (due, arrival number, frame)
        self._held_bytes = 0
        self._last_due: dict[bytes, float] = {}  # per (source, destination): order kept
        self._arrivals = 0
        self.packets = self.bytes = self.dropped = self.write_errors = self.max_held_bytes = 0
        self._lateness_us: list[float] = []
        self.first_error = ""

    def _pair(self, frame: bytes) -> bytes:
        """Source and destination addresses of an IPv4 or IPv6 frame (b"" if neither)."""
        at = self.header_bytes
        version = frame[at] >> 4 if len(frame) > at else 0
        if version == 4:
            return frame[at + 12:at + 20]
        if version == 6:
            return frame[at + 8:at + 40]
        return b""

    def take(self, frame: bytes, now: float) -> None:
        """Hold ``frame`` (arrived at ``now``) until its release time."""
        if len(frame) >= _READ_BYTES:  # cut off by the read: the kernel would drop it anyway
            self.dropped += 1
            self.first_error = self.first_error or f"a frame of {_READ_BYTES}+ bytes was cut"
            return
        if self._held_bytes + len(frame) > self.limit_bytes:
            self.dropped += 1
            return
        due = now + self.delay_s
        if self.jitter_s:
            due += self._random.uniform(-self.jitter_s, self.jitter_s)
            pair = self._pair(frame)
            due = max(due, self._last_due.get(pair, due))
            self._last_due[pair] = due
        self._arrivals += 1
        heapq.heappush(self._held, (due, self._arrivals, frame))
        self._held_bytes += len(frame)
        self.max_held_bytes = max(self.max_held_bytes, self._held_bytes)

    def release(self, now: float) -> float | None:
        """Write every frame due by ``now``; seconds until the next one is due (None: none held)."""
        while self._held and self._held[0][0] <= now:
            due, _, frame = heapq.heappop(self._held)
            self._held_bytes -= len(frame)
            try:
                os.write(self.fd, frame)
            except OSError as e:
                self.dropped += 1
                self.write_errors += 1
                self.first_error = self.first_error or f"write: {e}"
                continue
            self.packets += 1
            self.bytes += len(frame) - self.header_bytes
            if len(self._lateness_us) < 1_000_000:
                self._lateness_us.append((time.monotonic() - due) * 1e6)
        if not self._held and self.jitter_s:
            self._last_due.clear()  # every pair's order is kept by the clock alone now
        return self._held[0][0] - now if self._held else None

    def _read_batch(self) -> None:
        for _ in range(_BATCH):
            try:
                frame = os.read(self.fd, _READ_BYTES)
            except BlockingIOError:
                return
            except OSError as e:
                if e.errno == errno.EINTR:
                    continue
                raise
            self.take(frame, time.monotonic())

    def run(self, stop_fd: int) -> None:
        """Move frames until ``stop_fd`` becomes readable."""
        wait: float | None = None
        while True:
            readable, _, _ = select.select([self.fd, stop_fd], [], [], wait)
            if stop_fd in readable:
                return
            if self.fd in readable:
                self._read_batch()
            wait = self.release(time.monotonic())

    def stats(self) -> dict[str, float | int | str]:
        """Counters: packets and bytes (IP) sent on, dropped, most bytes held, release lateness.

        Example: ``line.stats()["dropped"] == 0``
        """
        late = sorted(self._lateness_us)
        pick = lambda q: round(late[min(len(late) - 1, int(q * len(late)))], 1) if late else 0.0  # noqa: E731
        return {
            "packets": self.packets, "bytes": self.bytes, "dropped": self.dropped,
            "write_errors": self.write_errors, "held": len(self._held),
            "max_held_bytes": self.max_held_bytes, "late_us_p50": pick(0.5),
            "late_us_p99": pick(0.99), "late_us_max": round(late[-1], 1) if late else 0.0,
            "first_error": self.first_error,
        }


def _realtime() -> str:
    """Ask for SCHED_FIFO; "" on success, else why not (it then runs at normal priority)."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(50))
    except (OSError, AttributeError) as e:
        return f"SCHED_FIFO refused ({e}); release times will be late more often"
    return ""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="delay_line.py", description=__doc__.split("\n")[0])
    p.add_argument("--tun", required=True, help="name of the tun device to create")
    p.add_argument("--delay-ms", type=float, required=True, help="one-way delay")
    p.add_argument("--jitter-ms", type=float, default=0.0, help="uniform jitter (default 0)")
    p.add_argument("--limit-bytes", type=int, default=DEFAULT_LIMIT_BYTES,
                   help=f"most bytes held at once (default {DEFAULT_LIMIT_BYTES})")
    args = p.parse_args(argv)
    try:
        delay = Delay.parse(f"{args.delay_ms}/{args.jitter_ms}")
    except ValueError as e:
        p.error(str(e))
    stop_r, stop_w = os.pipe()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: os.write(stop_w, b"x"))
    warning = _realtime()
    if warning:
        print(f"delay_line: {warning}", file=sys.stderr, flush=True)
    fd = open_tun(args.tun)
    line = DelayLine(fd, delay.ms / 1e3, delay.jitter_ms / 1e3, limit_bytes=args.limit_bytes)
    print("DELAY_LINE_READY", flush=True)
    try:
        line.run(stop_r)
    finally:
        print(f"{STATS_TAG} {json.dumps(line.stats())}", flush=True)
        os.close(fd)
    return 0


if __name__ == "__main__":
    sys.exit(main())
