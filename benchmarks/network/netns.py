#!/usr/bin/env python3
"""Run N ranks of a torchrun-style job on emulated machines (network namespaces), over shaped links.

The command line of ``benchmarks.network`` (see :class:`benchmarks.network.ShapedNetwork`):
every rank its own machine (``--ranks N``), or ``--machines M --ranks-per-machine R`` (the R
ranks of a machine share its namespace and talk over its loopback, uncapped), links capped at
``--rate`` in both directions (each TCP connection at ``--per-flow-rate``), ``--delay`` ms apart
one way (a userspace delay line in a router namespace), TCP congestion control pinned
(``--tcp-cc``, cubic by default). The command after ``--`` runs in this directory.

CLI (from the repository root)::

    python -m benchmarks.network.netns --ranks 2 --rate 100mbit -- python train.py --epochs 1
    python -m benchmarks.network.netns --machines 4 --ranks-per-machine 2 --rate 100mbit -- python train.py
    python -m benchmarks.network.netns --ranks 2 --rate 1gbit --per-flow-rate 250mbit -- python train.py
    python -m benchmarks.network.netns --ranks 4 --rate 1gbit --delay 5/0.5 -- python train.py
    python -m benchmarks.network.netns --cleanup          # remove leftovers of killed runs
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Sequence

from benchmarks.jobs import RankFailedError, RankTimeoutError
from benchmarks.network import (DEFAULT_MASTER_PORT, DEFAULT_TCP_CC, DEFAULT_TIMEOUT, PREFIX, NetnsError,
                                ShapedNetwork, cleanup_stale)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.network.netns",
        description=(
            "Run N ranks of a torchrun-style job, each in its own network namespace, every link "
            "capped at --rate in both directions (and each TCP connection at --per-flow-rate), "
            "the ranks --delay ms apart one way. Needs root and iproute2."
        ),
        epilog=(
            "example: python -m benchmarks.network.netns --ranks 2 --rate 100mbit -- "
            "python train.py --epochs 1; with --rate 1gbit --per-flow-rate 250mbit, one "
            "connection gets 250 Mbit/s and four share 1 Gbit/s; with --delay 5, a ping between "
            "two ranks takes 10 ms more"
        ),
    )
    p.add_argument("--ranks", type=int, default=None,
                   help="number of ranks, each a machine of its own (default 2; or --machines)")
    p.add_argument("--machines", type=int, default=None,
                   help="number of machines (namespaces), each with --ranks-per-machine ranks")
    p.add_argument("--ranks-per-machine", type=int, default=1,
                   help="ranks sharing each machine's namespace and loopback, uncapped among themselves "
                        "(default 1)")
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
        "--delay", default=None, metavar="MS[/JITTER_MS]",
        help="one-way latency between any two ranks, both directions, e.g. 20 or 20/2 (uniform "
        "jitter, order kept); packets go through a userspace delay line (default: none)",
    )
    p.add_argument(
        "--tcp-cc", default=DEFAULT_TCP_CC, metavar="NAME",
        help=f"TCP congestion control in every rank's namespace (default {DEFAULT_TCP_CC}; "
        "see /proc/sys/net/ipv4/tcp_available_congestion_control)",
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
        if args.ranks is not None and args.machines is not None:
            parser.error("give --ranks (a machine each) or --machines with --ranks-per-machine, not both")
        if args.ranks is not None and args.ranks_per_machine != 1:
            parser.error("--ranks-per-machine goes with --machines (ranks = machines x ranks per machine)")
        if args.machines is not None and args.machines < 1:
            parser.error(f"--machines must be at least 1, got {args.machines}")
        ranks = args.ranks if args.ranks is not None else (args.machines or 2) * args.ranks_per_machine
        try:
            net = ShapedNetwork(
                ranks, args.rate, per_flow_rate=args.per_flow_rate, delay=args.delay,
                tcp_cc=args.tcp_cc, master_port=args.master_port, ranks_per_machine=args.ranks_per_machine,
            )
        except ValueError as e:
            parser.error(str(e))
        with net:
            print(
                f"netns: {net.ranks} ranks on {net.machines} machine(s), rate {net.shaping or 'unlimited'}, delay "
                f"{net.delay or 'none'}, TCP {net.tcp_cc}, 10.213.{net.subnet}.0/24, "
                f"prefix {net.prefix}",
                file=sys.stderr, flush=True,
            )
            if args.print_env:
                for i in range(net.ranks):
                    env = " ".join(f"{k}={v}" for k, v in net.rank_env(i).items())
                    print(f"[rank {i}] {net.machine_namespace(i)}: {env}", file=sys.stderr)
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
