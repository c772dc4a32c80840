"""Tests for one-way latency in the emulated network (benchmarks/network/delay_line.py, router.py).

The delay line's logic is tested on a socket pair (no root); the measured tests build real
namespaces routed through the tun of a router namespace (root and iproute2 needed, skipped
otherwise): UDP probes see the set delay each way, TCP fills a 100 Mbit/s link 20 ms away with
every byte intact, nothing is dropped, and teardown leaves nothing behind, also after an error.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from benchmarks.network import netns
from benchmarks.network import Delay, NetnsError, ShapedNetwork, cleanup_stale, tcp_buffer_bytes
from benchmarks.network.delay_line import DelayLine
from benchmarks.network.probes import parse_result
from tests.comm._netns import PROBES, REPO, needs_netns, ours, probe

HEADER = bytes(10)  # a virtio-net header of a frame that needs nothing done


def _frame(src: int, dst: int, seq: int) -> bytes:
    """A fake IPv4 frame from 10.0.0.<src> to 10.0.0.<dst>, its sequence number as payload."""
    ip = bytes([0x45]) + bytes(11) + bytes([10, 0, 0, src, 10, 0, 0, dst])
    return HEADER + ip + seq.to_bytes(4, "big")


def test_delay_and_buffers_are_checked():
    assert Delay.parse("20") == Delay(20.0, 0.0) and Delay.parse("20/2") == Delay(20.0, 2.0)
    assert str(Delay.parse("5/0.5")) == "5ms/0.5ms"
    for bad in ("fast", "1/2/3", "nan", ""):
        with pytest.raises(ValueError, match="MS or MS/JITTER_MS"):
            Delay.parse(bad)
    for bad in ("-1", "2/3"):
        with pytest.raises(ValueError, match="jitter"):
            Delay.parse(bad)
    with pytest.raises(ValueError, match="tcp_cc must name"):
        ShapedNetwork(2, tcp_cc="cubic; reboot")
    with pytest.raises(SystemExit) as exit_info:  # the CLI says so before touching the machine
        netns.main(["--delay", "20/30", "--", "true"])
    assert exit_info.value.code == 2
    # 1 Gbit/s, 40 ms round trip: 5 MB in flight, buffers twice that; never below the default
    assert ShapedNetwork(2, rate="1gbit", delay="20").tcp_buffer_bytes == 10_000_000
    assert tcp_buffer_bytes(10**8, 1.0) == 6 << 20


def test_delay_line_holds_each_frame_and_keeps_each_pair_in_order():
    ours_end, line_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    line_end.setblocking(False)
    line = DelayLine(line_end.fileno(), delay_s=0.030, jitter_s=0.020, seed=0)
    stop_r, stop_w = os.pipe()
    mover = threading.Thread(target=line.run, args=(stop_r,))
    mover.start()
    try:
        sent = {}
        for seq in range(60):
            frame = _frame(1 + seq % 2, 9, seq)  # two pairs, interleaved
            sent[seq] = time.monotonic()
            ours_end.send(frame)
            time.sleep(0.001)
        ours_end.settimeout(5)
        back = []
        for _ in range(60):
            frame = ours_end.recv(100)
            back.append((int.from_bytes(frame[-4:], "big"), frame[10 + 15], time.monotonic()))
    finally:
        os.write(stop_w, b"x")
        mover.join()
    held = [at - sent[seq] for seq, _, at in back]
    assert min(held) >= 0.010 - 0.001, min(held)  # delay - jitter, less timer granularity
    for src in (1, 2):  # jitter moved frames, but never one past another of its pair
        seqs = [seq for seq, s, _ in back if s == src]
        assert seqs == sorted(seqs) and len(seqs) == 30
    assert [seq for seq, _, _ in back] != sorted(sent), "no jitter at all"
    stats = line.stats()
    assert stats["packets"] == 60 and stats["dropped"] == 0 and stats["held"] == 0


def test_delay_line_drops_and_counts_what_exceeds_its_limit():
    ours_end, line_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    frame = _frame(1, 2, 0)
    line = DelayLine(line_end.fileno(), delay_s=1.0, limit_bytes=3 * len(frame))
    for _ in range(10):
        line.take(frame, now=0.0)
    assert line.release(now=0.5) == pytest.approx(0.5)  # nothing due yet
    assert line.release(now=1.0) is None
    assert line.stats()["packets"] == 3 and line.stats()["dropped"] == 7
    assert [ours_end.recv(100) for _ in range(3)] == [frame] * 3


def _wait_for_exit(pid: int, seconds: float = 5.0) -> None:
    """Wait until ``pid`` is gone or a zombie (dead, waiting for its parent to reap it)."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return
        except FileNotFoundError:
            return
        assert time.monotonic() < deadline, f"process {pid} still running"
        time.sleep(0.02)


def _ranks_sysctls(net: ShapedNetwork) -> list[str]:
    net.run(["cat", "/proc/sys/net/ipv4/tcp_congestion_control", "/proc/sys/net/ipv4/tcp_rmem"],
            timeout=10, echo=False)
    return net.outputs[0].split()


def _udp_probe(net: ShapedNetwork, count: int) -> dict[str, list[float]]:
    """min/median/p95 of the one-way delays, ms, rank 1 -> 0 ("forward") and back."""
    net.run([sys.executable, str(PROBES), "udp", "--count", str(count)], timeout=30, echo=False)
    result = parse_result(net.outputs[1], "UDP_PROBE")
    assert result["lost"] == "0" and result["from"] == net.addresses[1], result
    return {way: [float(v) for v in result[f"{way}_ms"].split("/")] for way in ("forward", "back")}


@needs_netns
@pytest.mark.timeout(60)
def test_delay_each_way_tcp_fills_the_link_and_nothing_is_dropped():
    delay_ms, rate_mbit = 20.0, 100
    with ShapedNetwork(2, rate=f"{rate_mbit}mbit", delay=delay_ms) as net:
        assert _ranks_sysctls(net) == ["cubic", "4096", "131072", str(6 << 20)]
        delays = _udp_probe(net, count=40)
        tcp = probe(net, connections=1, megabytes=12, warmup_megabytes=3)
    for way, (low, median, p95) in delays.items():
        print(f"{way}: one-way delay min {low:.3f} median {median:.3f} p95 {p95:.3f} ms "
              f"(set {delay_ms:g})")
        assert abs(median - delay_ms) <= 0.05 * delay_ms + 0.2, (way, delays)
        assert low >= delay_ms - 0.05, (way, delays)  # never early
    steady = float(tcp["steady_mbit_s"])
    print(f"TCP at {rate_mbit} Mbit/s, {delay_ms:g} ms each way: {steady:.1f} Mbit/s steady, "
          f"{tcp['mbit_s']} from the first byte; delay line {net.delay_stats}")
    assert steady >= 0.9 * rate_mbit, tcp
    assert tcp["intact"] == "yes"
    stats = net.delay_stats
    assert stats["dropped"] == 0 and stats["tun_dropped"] == 0, stats
    # 12 MB crossed in GSO packets of up to 64 KB, not ~8300 frames of 1448 bytes
    assert 12e6 <= stats["bytes"] and stats["packets"] < 4000, stats
    assert ours(net) == ([], [])


@needs_netns
@pytest.mark.timeout(30)
def test_per_flow_caps_hold_on_the_router_legs():
    with ShapedNetwork(2, rate="100mbit", per_flow_rate="25mbit", delay="2") as net:
        assert net.flow_watcher.links[0].host_namespace == net.router.namespace
        tcp = probe(net, connections=2, megabytes=2, warmup_megabytes=0.5)
    per_connection = [float(m) for m in tcp["per_connection_mbit_s"].split(",")]
    assert all(0.7 * 25 <= m <= 1.1 * 25 for m in per_connection), tcp


@needs_netns
@pytest.mark.timeout(30)
def test_jitter_spreads_the_delay():
    with ShapedNetwork(2, rate=None, delay="5/2") as net:
        forward, back = _udp_probe(net, count=40).values()
    for low, median, p95 in (forward, back):
        assert low >= 3.0 - 0.05 and abs(median - 5.0) <= 1.0, (forward, back)
        assert p95 - low >= 2.0, (forward, back)  # spread over [3, 7] ms, not a constant 5


@needs_netns
@pytest.mark.timeout(30)
def test_teardown_leaves_nothing_after_an_error_or_a_dead_delay_line():
    net = ShapedNetwork(2, rate="100mbit", delay="1")
    with pytest.raises(RuntimeError, match="boom"):
        with net:
            pid = net.router.pid
            os.kill(pid, 0)  # running
            raise RuntimeError("boom")
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert ours(net) == ([], [])

    net = ShapedNetwork(2, rate=None, delay="1")
    with pytest.raises(NetnsError, match="the delay line in .* had exited"):
        with net:
            os.kill(net.router.pid, signal.SIGKILL)
            net.router.process.wait(timeout=5)
    assert ours(net) == ([], [])

    net = ShapedNetwork(2, rate=None, delay="1", tcp_cc="nosuchcc")  # fails after the router
    with pytest.raises(NetnsError, match="'nosuchcc' is not available"):
        with net:
            pass
    assert net.router.pid is not None
    with pytest.raises(ProcessLookupError):
        os.kill(net.router.pid, 0)
    assert ours(net) == ([], [])


@needs_netns
@pytest.mark.timeout(40)
def test_cleanup_removes_what_a_killed_launcher_left_with_its_delay_line():
    launcher = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.network.netns", "--ranks", "2", "--delay", "1",
         "--", "sleep", "60"],
        stderr=subprocess.PIPE, text=True, cwd=REPO,
    )
    try:
        banner = launcher.stderr.readline()  # printed once the network is up
        prefix = banner.split("prefix ")[1].split()[0]
        pids = subprocess.run(["ip", "netns", "pids", f"{prefix}rt"], capture_output=True,
                              text=True, check=True).stdout.split()
        assert len(pids) == 1  # the delay line
    finally:
        launcher.kill()
        launcher.wait()
    removed = cleanup_stale()
    assert {f"{prefix}rt", f"{prefix}r0", f"{prefix}r1"} <= set(removed)
    _wait_for_exit(int(pids[0]))  # killed; reaped by init, as the launcher is gone
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert prefix not in listed


@needs_netns
@pytest.mark.timeout(30)
def test_cli_delay_and_tcp_cc():
    script = "print(open('/proc/sys/net/ipv4/tcp_congestion_control').read().strip())"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.network.netns", "--ranks", "2", "--rate", "none",
         "--delay", "2", "--tcp-cc", "reno", "--timeout", "20", "--", sys.executable, "-c", script],
        capture_output=True, text=True, cwd=REPO, timeout=25,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "reno"
    assert "delay 2ms, TCP reno" in proc.stderr
    prefix = proc.stderr.split("prefix ")[1].split()[0]  # bgn<pid><letter>
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    assert prefix.startswith("bgn") and prefix not in namespaces and prefix not in links

