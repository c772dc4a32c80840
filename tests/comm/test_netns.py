"""Tests for benchmarks/network/netns.py: ranks in network namespaces over bandwidth-capped links.

Real namespaces, veths, bridge and tbf qdiscs; needs root and iproute2, skipped otherwise.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from benchmarks.jobs import RankFailedError, RankTimeoutError
from benchmarks.network import PREFIX, ShapedNetwork, parse_rate
from tests.comm._netns import REPO, needs_netns, ours, probe

GLOO_SCRIPT = textwrap.dedent(
    """
    import os, torch, torch.distributed as dist
    dist.init_process_group("gloo")  # env:// from RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == int(os.environ["WORLD_SIZE"]) and rank == int(os.environ["RANK"])
    t = torch.full((1000,), float(rank + 1))
    dist.all_reduce(t)
    expected = world * (world + 1) / 2
    assert torch.all(t == expected), (t[:4], expected)
    print(f"ALLREDUCE_OK rank={rank} sum={t[0].item()}", flush=True)
    dist.destroy_process_group()
    """
)


def _measure(rate: str) -> float:
    """Bits/s of one TCP connection from rank 1 to rank 0 over a link capped at ``rate``."""
    with ShapedNetwork(ranks=2, rate=rate) as net:
        result = probe(net, connections=1, megabytes=2.5)
    assert ours(net) == ([], [])
    assert result["from"] == net.addresses[1]  # came over the veth from rank 1's namespace
    return float(result["mbit_s"]) * 1e6


def test_parse_rate_rejects_garbage():
    assert parse_rate("100mbit") == 100_000_000
    assert parse_rate("12.5mbps") == 100_000_000
    assert parse_rate("none") is None
    for bad in ("fast", "10 parsecs", "-1mbit", "0", ""):
        with pytest.raises(ValueError, match="rate"):
            parse_rate(bad)


@needs_netns
@pytest.mark.timeout(60)
def test_tcp_throughput_is_capped():
    cap = parse_rate("20mbit")
    capped = _measure("20mbit")
    print(f"20mbit cap: measured {capped / 1e6:.2f} Mbit/s ({capped / cap:.2f}x cap)")
    assert 0.5 * cap <= capped <= 1.15 * cap, f"{capped / 1e6:.2f} Mbit/s vs cap 20 Mbit/s"

    free = _measure("none")
    print(f"no cap: measured {free / 1e6:.1f} Mbit/s")
    assert free > 5 * cap, f"uncapped {free / 1e6:.1f} Mbit/s should be far above 20 Mbit/s"


@needs_netns
@pytest.mark.timeout(60)
def test_failing_rank_is_reported_and_namespaces_removed():
    script = (
        "import os, sys, time\n"
        "r = int(os.environ['RANK'])\n"
        "print('starting rank', r, flush=True)\n"
        "if r == 1:\n"
        "    print('rank one is about to fail', flush=True); sys.exit(3)\n"
        "time.sleep(30)\n"
    )
    net = ShapedNetwork(ranks=2, rate="100mbit")
    t0 = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        with net:
            assert sorted(ours(net)[0]) == sorted(net.namespaces)
            net.run([sys.executable, "-c", script], timeout=30, echo=False)
    assert time.monotonic() - t0 < 20  # rank 0 was killed, not waited for
    err = info.value
    assert not isinstance(err, RankTimeoutError)
    assert err.rank == 1 and err.returncode == 3
    assert "rank 1 failed with exit code 3" in str(err)
    assert "[rank 1] rank one is about to fail" in str(err)
    assert "rank one is about to fail" in err.output
    assert err.returncodes[0] != 0  # rank 0 was killed
    assert ours(net) == ([], [])


@needs_netns
@pytest.mark.timeout(60)
def test_hanging_rank_times_out_and_is_killed(tmp_path):
    pidfile = tmp_path / "pid"
    script = (
        "import os, sys, time\n"
        "if os.environ['RANK'] == '1':\n"
        f"    open({str(pidfile)!r}, 'w').write(str(os.getpid()))\n"
        "    print('rank 1 hangs', flush=True)\n"
        "    time.sleep(600)\n"
    )
    net = ShapedNetwork(ranks=2, rate="none")
    t0 = time.monotonic()
    with pytest.raises(RankTimeoutError) as info:
        with net:
            net.run([sys.executable, "-c", script], timeout=3, echo=False)
    assert time.monotonic() - t0 < 15
    err = info.value
    assert err.rank == 1 and "timeout after 3 s" in str(err) and "[rank 1] rank 1 hangs" in str(err)
    assert err.returncodes[0] == 0
    pid = int(pidfile.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert ours(net) == ([], [])


@needs_netns
@pytest.mark.timeout(90)
def test_gloo_allreduce_across_namespaces():
    with ShapedNetwork(ranks=2, rate="200mbit") as net:
        env = net.rank_env(1)
        assert env["MASTER_ADDR"] == net.addresses[0] and env["LOCAL_WORLD_SIZE"] == "1"
        assert env["GLOO_SOCKET_IFNAME"] == "veth0" and env["RANK"] == "1"
        rcs = net.run([sys.executable, "-c", GLOO_SCRIPT], timeout=60, echo=False)
        assert rcs == [0, 0]
        assert "ALLREDUCE_OK rank=0 sum=3.0" in net.outputs[0], net.outputs[0]
        assert "ALLREDUCE_OK rank=1 sum=3.0" in net.outputs[1], net.outputs[1]
    assert ours(net) == ([], [])


@needs_netns
@pytest.mark.timeout(60)
def test_cli_streams_rank0_and_propagates_exit_code(tmp_path):
    printed = tmp_path / "rank0-printed"  # rank 2 fails only after rank 0 printed (loaded CI)
    script = (
        "import os, sys, time\n"
        "r = os.environ['RANK']\n"
        "print('hello from rank', r, os.environ['MASTER_ADDR'], flush=True)\n"
        f"if r == '0': open({str(printed)!r}, 'w').close()\n"
        "deadline = time.monotonic() + 20\n"
        f"while r == '2' and not os.path.exists({str(printed)!r}) and time.monotonic() < deadline:\n"
        "    time.sleep(0.01)\n"
        "sys.exit(5 if r == '2' else 0)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.network.netns", "--ranks", "3", "--rate", "none",
         "--timeout", "30", "--", sys.executable, "-c", script],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
    )
    stdout, stderr = proc.communicate(timeout=50)
    assert proc.returncode == 5, (stdout, stderr)
    assert "hello from rank 0 10.213." in stdout
    assert "[rank 2] hello from rank 2" in stderr
    assert "rank 2 failed with exit code 5" in stderr
    assert "[rank 1]" not in stderr  # a successful rank's output stays quiet
    prefix = f"{PREFIX}{proc.pid}a"
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    assert prefix not in namespaces and prefix not in links


MACHINES_SCRIPT = textwrap.dedent(
    """
    import json, os, torch, bagua
    bagua.init_process_group()  # torchrun's variables, as the emulated network gives them
    tx = lambda: int(open("/sys/class/net/veth0/statistics/tx_bytes").read())
    values = 1 << 19  # 2 MB of fp32
    sent = {}
    for name, group in (("intra", bagua.comm.get_intra_node_group()), ("inter", bagua.comm.get_inter_node_group())):
        bagua.comm.barrier()
        before = tx()
        bagua.comm.barrier()
        t = torch.full((values,), float(bagua.get_rank()))
        bagua.comm.allreduce(t, group=group)
        bagua.comm.barrier()
        sent[name] = tx() - before  # both ranks of this machine, barriers included
    env = {k: os.environ[k] for k in ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE")}
    print("MACHINES " + json.dumps({"env": env, "sent": sent, "local_size": bagua.get_local_size(),
                                    "intra": list(bagua.comm.get_intra_node_group().ranks)}), flush=True)
    bagua.destroy_process_group()
    """
)


def _machine_reports(net) -> list[dict]:
    import json

    return [json.loads(next(line for line in out.splitlines() if line.startswith("MACHINES "))[len("MACHINES "):])
            for out in net.outputs]


@needs_netns
@pytest.mark.timeout(120)
def test_ranks_of_a_machine_share_its_namespace_and_only_machines_cross_the_link():
    with ShapedNetwork(ranks=4, ranks_per_machine=2, rate="1gbit") as net:
        assert net.machines == 2 and len(net.namespaces) == 2
        assert net.machine_namespace(1) == net.namespaces[0] and net.machine_namespace(2) == net.namespaces[1]
        env = net.rank_env(3)
        assert (env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"], env["GROUP_RANK"], env["GROUP_WORLD_SIZE"]) == ("1", "2", "1", "2")
        assert env["MASTER_ADDR"] == net.addresses[0]
        assert net.run([sys.executable, "-c", MACHINES_SCRIPT], timeout=90, echo=False) == [0] * 4
        reports = _machine_reports(net)
    assert ours(net) == ([], [])
    for rank, report in enumerate(reports):
        assert report["local_size"] == 2 and report["intra"] == [rank // 2 * 2, rank // 2 * 2 + 1]
        # the machine's two ranks allreduce over its loopback: nothing but the barriers' bytes leaves it
        assert report["sent"]["intra"] < 100_000, report
        # rank r and r+2 allreduce 2 MB over the link: each sends 2 MB, the machine's two ranks 4 MB
        assert 4_000_000 < report["sent"]["inter"] < 5_000_000, report


@needs_netns
@pytest.mark.timeout(60)
def test_one_rank_per_machine_is_the_default_layout():
    with ShapedNetwork(ranks=3, rate="none") as net:
        assert net.machines == 3 and [net.machine_namespace(r) for r in range(3)] == net.namespaces
        env = net.rank_env(2)
        assert (env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"], env["GROUP_RANK"], env["GROUP_WORLD_SIZE"]) == ("0", "1", "2", "3")
    with pytest.raises(ValueError, match="multiple of ranks_per_machine=2"):
        ShapedNetwork(ranks=3, ranks_per_machine=2)
