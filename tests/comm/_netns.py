"""Helpers for the network-namespace tests: skip without root, list leftovers, measure TCP."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.network import ShapedNetwork
from benchmarks.network.probes import parse_result

REPO = Path(__file__).resolve().parents[2]
PROBES = REPO / "benchmarks" / "network" / "probes.py"


def _netns_unavailable() -> str:
    """Why namespaces can't be made here ("" when they can)."""
    if sys.platform != "linux":
        return f"network namespaces need Linux, this is {sys.platform}"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not found; install iproute2"
    if os.geteuid() != 0:
        return f"creating network namespaces needs root (euid {os.geteuid()})"
    return ""


needs_netns = pytest.mark.skipif(bool(_netns_unavailable()), reason=_netns_unavailable())


def ours(net: ShapedNetwork) -> tuple[list[str], list[str]]:
    """Namespaces and links of ``net`` that still exist."""
    ns_out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    link_out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    ns = [line.split()[0] for line in ns_out.splitlines() if line.startswith(net.prefix)]
    links = [
        line.split(":")[1].strip().split("@")[0]
        for line in link_out.splitlines()
        if line.split(":")[1].strip().startswith(net.prefix)
    ]
    return ns, links


def probe(
    net: ShapedNetwork, connections: int, megabytes: float, warmup_megabytes: float = 0.0
) -> dict[str, str]:
    """Run the TCP probe on ``net`` (ranks > 0 send to rank 0); its result fields.

    Example: ``float(probe(net, 8, 2.0)["mbit_s"])``
    """
    net.run(
        [sys.executable, str(PROBES), "tcp", "--connections", str(connections),
         "--megabytes", str(megabytes), "--warmup-megabytes", str(warmup_megabytes)],
        timeout=30, echo=False,
    )
    return parse_result(net.outputs[0])
