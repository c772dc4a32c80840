"""The emulated network of the benchmarks: every rank its own machine, over shaped, delayed links.

- ``namespaces``: names, requirements, ``ip``/``tc``, things done inside a namespace, cleanup
- ``shaping``: rates and the tbf cap of a leg (aggregate bandwidth), TCP buffer sizes
- ``flows``: per-connection caps (htb + u32, a leaf per TCP connection)
- ``delay_line`` and ``router``: one-way latency, a userspace delay line on a TUN device in a
  router namespace (this kernel has no netem)
- ``probes``: programs run as the ranks to measure the links (TCP throughput, UDP one-way delay)
- ``shaped_network``: :class:`ShapedNetwork`, which builds it all and runs the ranks (with
  ``benchmarks.jobs.RankJob``: started together, watched, stopped, reported), and what a rank
  reads of its own link (``tx_bytes_reader``) and sets on it (``rank_tcp_cc``)
- ``netns``: the command line (``python -m benchmarks.network.netns --ranks 2 -- python x.py``)

Needs root and iproute2; standard library only.

Example::

    from benchmarks.network import ShapedNetwork
    with ShapedNetwork(ranks=2, rate="1gbit", delay="5/0.5") as net:
        net.run([sys.executable, "train.py"], timeout=300)
"""

from .delay_line import Delay
from .namespaces import (IFNAME_IN_NS, MAX_RANKS, PREFIX, NetnsError, check_requirements, cleanup_stale,
                         requirements_problem)
from .shaped_network import (DEFAULT_MASTER_PORT, DEFAULT_TCP_CC, DEFAULT_TIMEOUT, ShapedNetwork, rank_tcp_cc,
                             tx_bytes_reader)
from .shaping import Shaping, format_rate, parse_rate, shaping_for, tcp_buffer_bytes

__all__ = [
    "DEFAULT_MASTER_PORT",
    "DEFAULT_TCP_CC",
    "DEFAULT_TIMEOUT",
    "Delay",
    "IFNAME_IN_NS",
    "MAX_RANKS",
    "NetnsError",
    "PREFIX",
    "ShapedNetwork",
    "Shaping",
    "check_requirements",
    "rank_tcp_cc",
    "cleanup_stale",
    "format_rate",
    "parse_rate",
    "requirements_problem",
    "shaping_for",
    "tcp_buffer_bytes",
    "tx_bytes_reader",
]
