"""Tests for the per-connection-capped link (benchmarks/network/flows.py through ShapedNetwork).

The measured ones build real namespaces with an htb tree per leg (root and iproute2 needed,
skipped otherwise): one connection gets the per-flow cap, eight share the aggregate and no more
(leaves at rate = cap would let them through at 2x), a connection made after start gets its leaf.
"""

from __future__ import annotations

import re
import socket
import struct
import subprocess
import sys
import textwrap
import time

import pytest

from benchmarks.network import IFNAME_IN_NS, ShapedNetwork, netns
from benchmarks.network.flows import (
    MAX_LEAVES,
    Connection,
    FlowShaping,
    FlowShapingError,
    FlowWatcher,
    Link,
    read_connections,
)
from tests.comm._netns import needs_netns, ours, probe

PER_FLOW_MBIT, AGGREGATE_MBIT = 25, 100
CAPS = dict(rate=f"{AGGREGATE_MBIT}mbit", per_flow_rate=f"{PER_FLOW_MBIT}mbit")


def _word(raw: bytes) -> str:
    """4 address bytes as /proc/net/tcp prints them (a 32-bit word in host byte order)."""
    return "%08X" % struct.unpack("=I", raw)[0]


def _hex4(address: str) -> str:
    return _word(socket.inet_aton(address))


def _mapped(address: str) -> str:
    """::ffff:``address``, as /proc/net/tcp6 prints it."""
    return "0" * 16 + _word(b"\0\0\xff\xff") + _hex4(address)


def _row(local: str, remote: str, state: int) -> str:
    return f"   0: {local} {remote} {state:02X} 00000000:00000000 00:00000000 00000000     0 0 1 1"


def test_read_connections_keeps_live_ipv4_connections_only():
    a, b = "10.213.7.2", "10.213.7.1"
    tcp = "\n".join([
        "  sl  local_address rem_address   st tx_queue ...",
        _row(f"{_hex4(a)}:9CB0", f"{_hex4(b)}:732C", 0x01),  # established: kept
        _row(f"{_hex4(a)}:9CB1", f"{_hex4(b)}:732C", 0x08),  # close-wait: may still send
        _row(f"{_hex4(a)}:7530", "00000000:0000", 0x0A),  # listening
        _row(f"{_hex4(a)}:9CB2", f"{_hex4(b)}:732C", 0x06),  # time-wait
        _row(f"{_hex4(a)}:9CB3", f"{_hex4(b)}:732C", 0x02),  # syn-sent
        _row(f"{_hex4('127.0.0.1')}:9CB4", f"{_hex4('127.0.0.1')}:7530", 0x01),  # loopback
        _row(f"{_hex4(a)}:9CB5", f"{_hex4(a)}:7530", 0x01),  # to itself
    ]).encode()
    assert read_connections(tcp) == {
        Connection(a, 0x9CB0, b, 0x732C),
        Connection(a, 0x9CB1, b, 0x732C),
    }
    tcp6 = "\n".join([
        "  sl  local_address                         remote_address ...",
        _row(f"{_mapped(b)}:7530", f"{_mapped(a)}:9CB6", 0x01),  # IPv4 on a dual-stack socket
        _row("00000000000000000000000001000000:1F90", "FE8000000000000000000000000000AA:1F91", 1),
    ]).encode()
    assert read_connections(tcp6) == {Connection(b, 0x7530, a, 0x9CB6)}


def test_per_flow_rate_is_checked_and_leaves_sum_to_the_aggregate():
    with pytest.raises(ValueError, match="per_flow_rate='10mbit' needs an aggregate rate="):
        ShapedNetwork(2, rate=None, per_flow_rate="10mbit")
    with pytest.raises(ValueError, match="must not exceed the aggregate"):
        ShapedNetwork(2, rate="10mbit", per_flow_rate="20mbit")
    with pytest.raises(SystemExit) as exit_info:  # the CLI says so before touching the machine
        netns.main(["--rate", "none", "--per-flow-rate", "1mbit", "--", "true"])
    assert exit_info.value.code == 2
    shaping = ShapedNetwork(2, rate="1gbit", per_flow_rate="250mbit").shaping
    assert isinstance(shaping, FlowShaping)
    assert shaping.leaf_rate_bit * MAX_LEAVES <= shaping.rate_bit
    tree = "\n".join(shaping.tree("veth0"))
    assert "classid 1:1 htb rate 1000000000bit ceil 1000000000bit" in tree
    assert "classid 1:2 htb rate 15625000bit ceil 250000000bit" in tree


@needs_netns
@pytest.mark.timeout(60)
def test_one_connection_gets_the_per_flow_cap():
    with ShapedNetwork(2, **CAPS) as net:
        result = probe(net, connections=1, megabytes=3)
    assert ours(net) == ([], [])
    mbit = float(result["mbit_s"])
    print(f"1 connection, {PER_FLOW_MBIT} Mbit/s per flow: {mbit:.1f} Mbit/s")
    assert 0.7 * PER_FLOW_MBIT <= mbit <= 1.1 * PER_FLOW_MBIT, result


@needs_netns
@pytest.mark.timeout(60)
def test_eight_connections_share_the_aggregate_and_no_more():
    with ShapedNetwork(2, **CAPS) as net:
        result = probe(net, connections=8, megabytes=2)
    mbit = float(result["mbit_s"])
    print(f"8 connections, {PER_FLOW_MBIT} Mbit/s per flow under {AGGREGATE_MBIT}: {mbit:.1f}")
    # 8 x 25 would be 200: the aggregate holds; and far above one flow's cap: each has its leaf
    assert 0.7 * AGGREGATE_MBIT <= mbit <= 1.1 * AGGREGATE_MBIT, result


# Rank 1 connects to rank 0, sends 1 MB when told on stdin, and closes when told again.
_LATE_CONNECTION = textwrap.dedent(
    """
    import os, socket, sys, time
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if os.environ["RANK"] == "0":
        with socket.create_server((addr, port)) as server:
            conn = server.accept()[0]
        while conn.recv(1 << 16):
            pass
    else:
        deadline = time.monotonic() + 20
        while True:
            try:
                s = socket.create_connection((addr, port))
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        print(s.getsockname()[1], flush=True)
        sys.stdin.readline()
        s.sendall(b"x" * 1_000_000)
        print("sent", flush=True)
        sys.stdin.readline()
        s.close()
    """
)


def _class_bytes(dev: str, classid: str, namespace: str | None = None) -> int:
    where = ["-n", namespace] if namespace else []
    out = subprocess.run(["tc", *where, "-s", "class", "show", "dev", dev],
                         capture_output=True, text=True, check=True).stdout
    # "class htb 1:101 parent 1:1 leaf 101: ...\n Sent 1034502 bytes 712 pkt ..."
    sent = dict(re.findall(r"^class htb (\S+) .*\n Sent (\d+) bytes", out, re.MULTILINE))
    return int(sent[classid])


def _wait_for(condition, what: str, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"no {what} after {seconds} s"
        time.sleep(0.02)


@needs_netns
@pytest.mark.timeout(60)
def test_watcher_gives_a_later_connection_its_leaf_and_removes_it_when_closed():
    with ShapedNetwork(2, rate="100mbit", per_flow_rate="50mbit") as net:
        watcher = net.flow_watcher
        time.sleep(0.2)  # the watcher is polling; nothing is connected yet
        assert watcher.leaves(0) == {} and watcher.leaves(1) == {}
        server = subprocess.Popen(net.rank_argv(0, [sys.executable, "-c", _LATE_CONNECTION]))
        client = subprocess.Popen(net.rank_argv(1, [sys.executable, "-c", _LATE_CONNECTION]),
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            client_port = int(client.stdout.readline())
            a0, a1, port = net.addresses[0], net.addresses[1], net.master_port
            _wait_for(lambda: watcher.leaves(0) and watcher.leaves(1), "leaf for the connection")
            assert list(watcher.leaves(1)) == [Connection(a1, client_port, a0, port)]
            assert list(watcher.leaves(0)) == [Connection(a0, port, a1, client_port)]
            leaf = watcher.leaves(1)[Connection(a1, client_port, a0, port)]
            client.stdin.write("send\n")
            client.stdin.flush()
            assert client.stdout.readline() == "sent\n"
            # the bytes went through the connection's leaf on both legs: out of rank 1's
            # namespace, and from the bridge towards rank 0's
            leaf_towards_0 = watcher.leaves(0)[Connection(a0, port, a1, client_port)]
            _wait_for(lambda: _class_bytes(IFNAME_IN_NS, leaf, net.namespaces[1]) > 1e6,
                      "1 MB through the leaf in rank 1's namespace")
            _wait_for(lambda: _class_bytes(net.host_legs[0], leaf_towards_0) > 1e6,
                      "1 MB through the leaf towards rank 0's namespace")
            client.stdin.write("close\n")
            client.stdin.flush()
            assert client.wait(timeout=10) == 0 and server.wait(timeout=10) == 0
            _wait_for(lambda: not watcher.leaves(0) and not watcher.leaves(1),
                      "removal of the closed connection's leaves")
            out = subprocess.run(["tc", "class", "show", "dev", net.host_legs[0]],
                                 capture_output=True, text=True, check=True).stdout
            assert sorted(line.split()[2] for line in out.splitlines()) == ["1:1", "1:2"]
        finally:
            for proc in (client, server):
                proc.kill()
                proc.wait()
    assert not watcher.is_alive()
    assert ours(net) == ([], [])


@needs_netns
@pytest.mark.timeout(30)
def test_teardown_on_error_stops_the_watcher_and_tc_failures_name_the_command():
    net = ShapedNetwork(2, rate="100mbit", per_flow_rate="10mbit")
    with pytest.raises(RuntimeError, match="boom"):
        with net:
            watcher = net.flow_watcher
            assert watcher.is_alive()
            raise RuntimeError("boom")
    assert not watcher.is_alive() and net.flow_watcher is None
    assert ours(net) == ([], [])

    broken = FlowWatcher(FlowShaping(10**8, 10**7), [Link("bgn-no-such-ns", "veth0", "nolink")])
    with pytest.raises(FlowShapingError, match="tc failed in namespace bgn-no-such-ns"):
        broken.install()
