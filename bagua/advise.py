"""Which algorithm for which network: an alpha-beta cost model per algorithm, and ``python -m bagua.advise``.

A training step costs its compute, plus whatever communication the step cannot hide. Each
algorithm's step is a list of collectives (:func:`message_pattern`), counted from the code: for
each, the bytes the busiest link carries and the messages that must follow each other (hops:
each waits for the one before it to arrive) and the one-way latencies they cost
(:func:`one_way_delays`: on Gloo a message whose receive was not posted ahead waits for the
receiver's announcement to cross first, a round trip). A collective takes
``hops * message_s + delays * latency_factor * latency + bytes / (efficiency * bandwidth)``, the
efficiency that of its transport (an exact ring, the compressed allreduce, the ring exchange).
What overlaps with compute follows the engine (``bagua.comm.engine``): gradient buckets leave
in order as backward fills them (torch DDP alike), and so does qadam's momentum (speculated;
after a miss it is averaged again after backward), the decentralized weights leave at forward,
the low-precision ring goes after backward with nothing to hide behind, and async's averaging
runs on its own thread, off the step. Where the ranks leave no core free (CPU ranks sharing a
machine's cores), communication moves at their share of a core while they compute
(:func:`communication_pace`); a link whose messages a shared software router forwards (an emulated
network) adds its ``Link.message_s`` per message between machines.

Messages in sequence, per collective (1 rank per machine; ``m`` machines):

=========================  ====================================================================
exact allreduce, Gloo      ring of at most two 1 MiB segments in flight: ``2 ceil(K/2)`` with
                           ``K = s (m-1)/m`` segments and ``s`` = max(bytes / 1 MiB, 2m) rounded
                           up to a multiple of m (``gloo/allreduce.cc``); 2(m-1) at least
exact allreduce, NCCL      a ring pipelined in slices: data crosses each machine boundary
                           twice, ``2(m-1)``
compressed allreduce       ``bagua.comm.compressed_allreduce``: every receive posted first,
                           chunks to all peers at once, then the reduced chunks: 2 (8-bit for
                           bytegrad and qadam, 1-bit ``sign1`` for onebit_grad and qadam-1bit;
                           qadam-1bit's tracked variance sends 8 bits on one step in 32 in the long
                           run, 8% of a 1000-step run's: +19% and +51% bytes, not in the pattern)
ring exchange              ``alltoall_v`` to both ring neighbours at once: 1
=========================  ====================================================================

With several ranks per machine, bagua's algorithms are taken as ``hierarchical=True`` (exact
within the machine, the pattern above among machines; within a machine counts as free) unless
``hierarchical=False`` is given, and torch DDP as one ring over all ranks (its bytes cross each
machine's link once per direction). Flat, an exact ring is torch DDP's; the compressed allreduce
has every rank send its own share to every rank of the other machines, so a machine's link
carries ``2 R (n-R)/n`` of the encoded bytes (R ranks a machine, n in all) against
``2 (m-1)/m`` hierarchically (m machines): at 4 x 2 ranks 3.0 against 1.5, twice the bytes.

Example::

    from bagua.advise import Link, predict_all
    for p in predict_all(params=340e6, world_size=128, link=Link(1e9, 0.002), ranks_per_machine=8,
                         compute_s=0.5):
        print(p.algorithm, round(p.step_s, 3))

    python -m bagua.advise --bandwidth 1gbit --latency-ms 2 --params 340M --world-size 128
    torchrun --nproc-per-node 2 -m bagua.advise --params 3.2M      # measures the link itself
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from typing import Optional, Sequence

from .measured_accuracy import LONGEST, MEASURED, RESULTS, WORKLOAD

__all__ = [
    "ALGORITHMS", "SIGN1_BYTES_PER_ELEMENT", "UINT8_BYTES_PER_ELEMENT", "Collective", "Constants", "Link", "Prediction",
    "allreduce_hops", "collective_time", "communication_pace", "cpu_slowdown", "default_buckets", "exposed_time",
    "link_from_timings", "main", "measure_link", "message_pattern", "one_way_delays", "parse_bandwidth", "parse_count",
    "predict", "predict_all", "rank_by_time_to_target", "steps_multipliers",
]

ALGORITHMS = ("torch-ddp", "torch-ddp-fp16", "gradient_allreduce", "bytegrad", "decentralized",
              "low_precision_decentralized", "async", "qadam", "qadam-1bit", "onebit_grad")
"""The names the model knows: torch DDP (fp32, and with its fp16 compression hook) and bagua's algorithms."""
UINT8_BYTES_PER_ELEMENT = 1 + 8 / 1024
"""MinMaxUInt8 on the wire: a byte per element and an fp32 (min, max) per 1024-element block."""
SIGN1_BYTES_PER_ELEMENT = 1 / 8 + 4 / 256
"""Sign1 on the wire (onebit_grad, qadam's ``bits=1``): a bit per element and an fp32 scale per 256-element block."""
#: gloo's ring allreduce keeps two segments of at most this many bytes in flight
GLOO_SEGMENT_BYTES = 1 << 20
BUCKET_BYTES = 25 << 20  # both wrappers' default bucket size
VERDICT_BYTES = 2 * 4  # qadam's step: whether any rank skips it, whether any rank's speculation missed
#: how a user selects each algorithm: what to write
SELECT = {
    "torch-ddp": "torch.nn.parallel.DistributedDataParallel(model)",
    "torch-ddp-fp16": "torch DDP + register_comm_hook(None, fp16_compress_hook)",
    "gradient_allreduce": 'algorithm="gradient_allreduce"',
    "bytegrad": 'algorithm="bytegrad"',
    "decentralized": 'algorithm="decentralized"',
    "low_precision_decentralized": 'algorithm="low_precision_decentralized"',
    "async": 'algorithm="async"',
    "qadam": 'algorithm="qadam"',
    "qadam-1bit": 'algorithm="qadam", bits=1',
    "onebit_grad": 'algorithm="onebit_grad"',
}
#: other names of an algorithm that ``--steps-multiplier`` takes (the benchmarks' and examples' own)
ALIASES = {"qadam1": "qadam-1bit", "qadam_1bit": "qadam-1bit", "ddp": "torch-ddp", "ddp-fp16": "torch-ddp-fp16"}


@dataclass(frozen=True)
class Link:
    """A link between machines: ``bandwidth_bit_s`` each way, ``latency_s`` one way, and
    ``message_s``, what each message between machines costs a router they all share, one after
    another (0 for hardware; the emulated network's delay line is a process on the box's cores)."""

    bandwidth_bit_s: float
    latency_s: float = 0.0
    message_s: float = 0.0


@dataclass(frozen=True)
class Collective:
    """One collective of a step: what it is, the bytes on the busiest link, the messages in
    sequence (hops), what it may hide behind: "backward", "forward" (forward and backward),
    "none", or "background" (off the step), and the messages between machines it sends, all
    ranks together (``remote_messages``: what a shared router forwards)."""

    what: str
    nbytes: float
    hops: int
    overlap: str
    remote_messages: float = 0.0


@dataclass(frozen=True)
class Constants:
    """What the machines and the software add to the counts.

    Args:
        message_s: fixed cost of each message in sequence (wake-ups, framing), seconds.
        latency_factor: what each one-way latency of :func:`one_way_delays` really costs, in
            one-way latencies (1: the delay alone; more where TCP's slow start after an idle link,
            or the software at both ends, adds to it).
        efficiency: share of the link's rate an exact (ring) allreduce reaches.
        backward_share: share of the step's compute that backward takes (forward: half of it;
            2/3: backward does twice forward's arithmetic).
        compressed_efficiency: the same for bagua's compressed allreduce (chunks to every peer at
            once, reduced, sent back; None: ``efficiency``).
        exchange_efficiency: the same for the ring exchange (``alltoall_v`` to both neighbours;
            None: ``efficiency``). Each transport keeps the link busy its own way (a pipelined
            ring, a scatter then a gather, a pairwise exchange), so each reaches its own share.
    """

    message_s: float = 0.0
    latency_factor: float = 1.0
    efficiency: float = 1.0
    backward_share: float = 2 / 3
    compressed_efficiency: Optional[float] = None
    exchange_efficiency: Optional[float] = None

    def efficiency_of(self, transport: str) -> float:
        """The share of the link's rate that ``transport`` ("ring", "compressed", "exchange") reaches."""
        own = {"compressed": self.compressed_efficiency, "exchange": self.exchange_efficiency}.get(transport)
        return self.efficiency if own is None else own

    @classmethod
    def load(cls, path: str) -> "Constants":
        """Constants from a JSON file (as ``benchmarks/tradeoff/fit.py`` writes: a "constants" key)."""
        with open(path) as f:
            data = json.load(f)
        return cls(**data.get("constants", data))


@dataclass(frozen=True)
class Prediction:
    """One algorithm's predicted step: compute, the communication the step waits for, the
    communication in all (latency and bandwidth parts), messages in sequence and bytes."""

    algorithm: str
    step_s: float
    compute_s: float
    exposed_s: float
    comm_s: float
    latency_s: float
    transfer_s: float
    hops: int
    nbytes: float


# ---- the message pattern of each algorithm ------------------------------------------------------

#: how each collective of a pattern moves its bytes (its link efficiency: ``Constants.efficiency_of``)
TRANSPORT = {"allreduce": "ring", "weights allreduce": "ring", "verdict allreduce": "ring", "agreement check": "ring",
             "compressed allreduce": "compressed", "compressed momentum allreduce": "compressed",
             "1-bit allreduce": "compressed", "ring exchange": "exchange"}

def default_buckets(params: float, bucket_bytes: int = BUCKET_BYTES, element_bytes: int = 4) -> list[float]:
    """Bucket sizes in bytes for ``params`` fp32 parameters cut at ``bucket_bytes``."""
    total = params * element_bytes
    full, rest = divmod(total, bucket_bytes)
    return [float(bucket_bytes)] * int(full) + ([float(rest)] if rest or not full else [])


def allreduce_hops(nbytes: float, machines: int, backend: str = "gloo") -> int:
    """Messages in sequence of an exact ring allreduce of ``nbytes`` over ``machines`` (see the table)."""
    if machines < 2:
        return 0
    if backend == "nccl":
        return 2 * (machines - 1)
    segments = max(math.ceil(nbytes / GLOO_SEGMENT_BYTES), 2 * machines)
    segments = math.ceil(segments / machines) * machines
    return 2 * math.ceil((segments - segments // machines) / 2)


def _ring(nbytes: float, m: int, backend: str, overlap: str, what: str, ranks: Optional[int] = None) -> Collective:
    """An exact ring over ``ranks`` (default ``m``) ranks laid out on ``m`` machines: a machine's
    link carries the ring's ``2 (n-1)/n`` of the bytes once each way, and a message waits for the
    one before it across each machine boundary (within a machine counts as free)."""
    n, hops = ranks or m, allreduce_hops(nbytes, m, backend)
    return Collective(what, 2 * (n - 1) / n * nbytes, hops, overlap, hops * m)


def _compressed(nbytes: float, m: int, overlap: str, what: str, per_element: float = UINT8_BYTES_PER_ELEMENT,
                per_machine: int = 1) -> Collective:
    """Bagua's compressed allreduce over ``m`` machines of ``per_machine`` ranks each (every rank its
    own share: flat): each rank sends its chunk for every rank of other machines, and their reduced
    chunks come back, so a machine's link carries ``2 R (n-R)/n`` of the encoded bytes, in
    ``2 n (n-R)`` messages between machines."""
    wire = nbytes / 4 * per_element
    n = m * per_machine
    return Collective(what, 2 * per_machine * (n - per_machine) / n * wire, 2 if m > 1 else 0, overlap,
                      2 * n * (n - per_machine))


def message_pattern(algorithm: str, buckets: Sequence[float], world_size: int, ranks_per_machine: int = 1,
                    backend: str = "gloo", speculating: bool = True, hierarchical: bool = True) -> list[Collective]:
    """The collectives of one step of ``algorithm`` (after any warm-up), with fp32 buckets of
    ``buckets`` bytes in launch order, on ``world_size`` ranks, ``ranks_per_machine`` per machine
    (no agreement check: the wrapper's per-step collectives skip it). ``speculating=False``: qadam
    averaging its momentum in ``step()`` (``overlap=False``, or where ``overlap="auto"`` found that
    faster), after backward and with no verdict. ``hierarchical=False`` with several ranks per
    machine: bagua's algorithm flat over every rank (its ``hierarchical=False``), not exact within
    the machine and among the machines' leaders.

    Example::

        message_pattern("bytegrad", [13e6], 4)   # [Collective('compressed allreduce', 4.9e6, 2, 'backward')]
    """
    check_algorithm(algorithm)
    m = world_size // ranks_per_machine  # machines: the ring of torch DDP or the hierarchical leaders
    if m < 2:
        return []
    flat = not hierarchical and ranks_per_machine > 1
    ring_ranks = world_size if flat else None
    sharing = ranks_per_machine if flat else 1  # ranks that each send their own share over the machine's link
    if algorithm in ("torch-ddp", "torch-ddp-fp16"):
        half = algorithm == "torch-ddp-fp16"
        return [_ring(b / 2 if half else b, m, backend, "backward", "allreduce", world_size) for b in buckets]
    if algorithm == "gradient_allreduce":
        return [_ring(b, m, backend, "backward", "allreduce", ring_ranks) for b in buckets]
    if algorithm == "bytegrad":
        return [_compressed(b, m, "backward", "compressed allreduce", per_machine=sharing) for b in buckets]
    if algorithm == "onebit_grad":  # after its exact warm-up (a gradient_allreduce step until then)
        return [_compressed(b, m, "backward", "1-bit allreduce", SIGN1_BYTES_PER_ELEMENT, sharing) for b in buckets]
    if algorithm == "decentralized":
        return [_ring(b, m, backend, "forward", "weights allreduce", ring_ranks) for b in buckets]
    if algorithm == "low_precision_decentralized":
        neighbours = min(2, m - 1)
        return [Collective("ring exchange", neighbours * b / 4 * UINT8_BYTES_PER_ELEMENT, 1, "none", neighbours * m)
                for b in buckets]
    if algorithm in ("qadam", "qadam-1bit"):  # each bucket's momentum during backward (a hit), then the verdict
        per_element = SIGN1_BYTES_PER_ELEMENT if algorithm == "qadam-1bit" else UINT8_BYTES_PER_ELEMENT
        if not speculating:
            return [_compressed(b, m, "none", "compressed momentum allreduce", per_element, sharing) for b in buckets]
        return [*(_compressed(b, m, "backward", "compressed momentum allreduce", per_element, sharing) for b in buckets),
                _ring(VERDICT_BYTES, m, backend, "none", "verdict allreduce", ring_ranks)]
    return [_ring(sum(buckets), m, backend, "background", "weights allreduce", world_size)]  # async: flat, always


def check_algorithm(algorithm: str) -> None:
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}; known: {', '.join(ALGORITHMS)}")


# ---- step time ------------------------------------------------------------------------------------

def cpu_slowdown(processes: float, cores: float, background: float = 0.0, contention: float = 1.0) -> float:
    """How many times longer CPU-bound work takes in each of ``processes`` processes (ranks) that
    share ``cores`` with ``background`` other runnable ones (the load that was there before them):
    each core's share, ``max(1, (processes + background) / cores)``, to the power ``contention``.

    ``contention`` 1 is a scheduler that shares the cores evenly at no cost. Past one process a
    core the switches and the caches they evict cost more than the share: on the 2-core box of
    benchmarks/RESULTS.md the no-communication step at 8 and 16 ranks fits 1.32
    (``benchmarks/tradeoff/machines_prediction.py`` fits it; the linear share had predicted 16
    ranks' compute at x3.4 of 4 ranks' where x4.8-5.3 was measured). Several ranks on one CPU
    machine stretch each step's compute by this; scale a compute time measured at one rank count
    to another by the ratio of the two. On a GPU each rank has its own device: leave compute as
    measured.

    Example::

        cpu_slowdown(8, 2) / cpu_slowdown(4, 2)                                   # 2.0
        cpu_slowdown(16, 2, 1.0, contention=1.32) / cpu_slowdown(4, 2, 1.0, 1.32)  # 5.0
    """
    if processes < 1 or cores <= 0 or background < 0 or contention < 1:
        raise ValueError(f"need processes >= 1, cores > 0, background >= 0 and contention >= 1, "
                         f"got {processes}, {cores}, {background}, {contention}")
    return max(1.0, (processes + background) / cores) ** contention


def one_way_delays(c: Collective, backend: str = "gloo") -> float:
    """The one-way latencies ``c``'s messages in sequence cost.

    Gloo sends a message only once the receiver's announcement that its buffer is ready has
    crossed (``bagua.comm.p2p``): a message whose receive was not posted ahead costs a round trip,
    two latencies. Every step of a ring does, and so does the ring exchange. Bagua's compressed
    allreduce posts every receive before it sends: its first hop pays the round trip (the peers
    post at the same moment), its second (the reduced chunks, long awaited) one latency. NCCL's
    connections hold their buffers ahead: one latency a message. Measured under a 20 ms delay line
    (tests/advise/test_pattern_on_the_wire.py, 3 ranks): 8.2, 3.2 and 2.1 one-way delays for a
    4-hop ring, the compressed allreduce and the ring exchange.

    Example::

        one_way_delays(Collective("allreduce", 4096, 4, "none"))   # 8.0
    """
    if backend == "nccl" or c.hops == 0:
        return float(c.hops)
    if TRANSPORT.get(c.what, "ring") == "compressed":
        return 2.0 * c.hops - 1
    return 2.0 * c.hops


def collective_time(c: Collective, link: Link, constants: Constants, backend: str = "gloo") -> tuple[float, float]:
    """(latency part, transfer part) of one collective's time on ``backend``, seconds."""
    latency = (c.hops * constants.message_s + one_way_delays(c, backend) * constants.latency_factor * link.latency_s
               + c.remote_messages * link.message_s)
    transfer = 8 * c.nbytes / (constants.efficiency_of(TRANSPORT.get(c.what, "ring")) * link.bandwidth_bit_s)
    return latency, transfer


def communication_pace(processes: float, cores: float, background: float = 0.0) -> float:
    """How fast communication progresses while the step computes, as a share of its pace alone:
    each rank's communication thread gets its share of a core, ``min(1, cores / (processes +
    background))`` (the inverse of :func:`cpu_slowdown` with cores shared at no cost). 1 where the ranks leave a core free (a GPU per rank, or cores to spare);
    less where CPU ranks oversubscribe the machine, and their communication waits for compute to
    stop (on the 2-core box of benchmarks/RESULTS.md, 16 ranks: about 0.12).

    Example::

        communication_pace(16, 2, 1.0)   # 0.1176...
        communication_pace(1, 8)         # 1.0
    """
    return 1.0 / cpu_slowdown(processes, cores, background)


def exposed_time(pattern: Sequence[Collective], times: Sequence[float], compute_s: float, backward_share: float,
                 pace: float = 1.0) -> float:
    """Seconds of communication the step waits for, as the engine overlaps it: "backward" buckets
    leave in order as backward produces them (evenly over backward, by bytes), "forward" ones at
    the start of forward and finish before the step ends backward, "none" after backward. While
    compute runs, communication moves at ``pace`` of its own speed (:func:`communication_pace`),
    at full speed once it stops."""
    if not 0 < pace <= 1:
        raise ValueError(f"need 0 < pace <= 1, got {pace}")
    backward = backward_share * compute_s
    forward = backward / 2
    clock = 0.0  # the end of the last bucket sent during backward (from backward's start)
    sized = [(c, t) for c, t in zip(pattern, times) if c.overlap == "backward"]
    total = sum(c.nbytes for c, _ in sized) or 1.0
    done = 0.0
    for c, t in sized:
        done += c.nbytes
        start = max(clock, backward * done / total)
        overlapped = pace * max(0.0, backward - start)  # its own seconds done before backward ends
        clock = start + t / pace if overlapped >= t else max(start, backward) + t - overlapped
    wait = max(0.0, clock - backward)
    ahead = sum(t for c, t in zip(pattern, times) if c.overlap == "forward")
    wait += max(0.0, ahead - pace * min(compute_s, forward + backward))
    return wait + sum(t for c, t in zip(pattern, times) if c.overlap == "none")


def predict(algorithm: str, buckets: Sequence[float], world_size: int, link: Link, compute_s: float,
            constants: Constants = Constants(), ranks_per_machine: int = 1, backend: str = "gloo",
            pattern: Optional[Sequence[Collective]] = None, hierarchical: bool = True,
            pace: float = 1.0) -> Prediction:
    """The predicted step of ``algorithm`` (see the module docstring); ``compute_s`` is the step's
    compute without communication. ``pattern``: the step's collectives if not today's
    ``message_pattern`` (a measurement of older code predicted with the pattern it recorded);
    ``hierarchical``: as ``message_pattern``'s; ``pace``: communication's pace while compute runs
    (:func:`communication_pace`; 1: each rank has a core or a device of its own)."""
    if link.bandwidth_bit_s <= 0 or link.latency_s < 0 or compute_s < 0:
        raise ValueError(f"need a positive bandwidth, latency >= 0 and compute >= 0, got {link} and {compute_s}")
    if pattern is None:
        pattern = message_pattern(algorithm, buckets, world_size, ranks_per_machine, backend, hierarchical=hierarchical)
    parts = [collective_time(c, link, constants, backend) for c in pattern]
    times = [a + b for a, b in parts]
    exposed = exposed_time(pattern, times, compute_s, constants.backward_share, pace)
    on_step = [(c, p) for c, p in zip(pattern, parts) if c.overlap != "background"]
    return Prediction(algorithm, compute_s + exposed, compute_s, exposed, sum(times),
                      sum(p[0] for _, p in on_step), sum(p[1] for _, p in on_step),
                      sum(c.hops for c, _ in on_step), sum(c.nbytes for c, _ in on_step))


def predict_all(params: float, world_size: int, link: Link, compute_s: float = 0.0,
                constants: Constants = Constants(), ranks_per_machine: int = 1, backend: str = "nccl",
                algorithms: Sequence[str] = ALGORITHMS) -> list[Prediction]:
    """Every algorithm's predicted step for ``params`` fp32 parameters in 25 MiB buckets, fastest first."""
    if world_size < 1 or ranks_per_machine < 1 or world_size % ranks_per_machine:
        raise ValueError(f"world_size ({world_size}) must be a positive multiple of ranks_per_machine ({ranks_per_machine})")
    buckets = default_buckets(params)
    found = [predict(a, buckets, world_size, link, compute_s, constants, ranks_per_machine, backend)
             for a in algorithms]
    return sorted(found, key=lambda p: p.step_s)


# ---- the command line ---------------------------------------------------------------------------

_NUMBER = r"([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)"
_RATE = re.compile(rf"^{_NUMBER}\s*([kmgt]?)(?:bit|bps)?(?:/s)?$", re.IGNORECASE)
_COUNT = re.compile(rf"^{_NUMBER}\s*([kmbgt]?)$", re.IGNORECASE)
_SCALE = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "b": 1e9, "t": 1e12}


def _scaled(pattern: re.Pattern, text: str) -> float:
    match = pattern.match(str(text).strip())
    value = float(match.group(1)) * _SCALE[match.group(2).lower()] if match else float("nan")
    return value if math.isfinite(value) else float("nan")


def parse_bandwidth(text: str) -> float:
    """``"1gbit"``, ``"300mbit"``, ``"10Gbit/s"``, ``"1e9"`` -> bits per second."""
    value = _scaled(_RATE, text)
    if not value > 0:
        raise ValueError(f"bandwidth must be a positive rate in bits such as 1gbit, 300mbit or 10Gbit/s, got {text!r}")
    return value


def parse_count(text: str) -> float:
    """``"340M"``, ``"3.2m"``, ``"1.5B"``, ``"125000"`` -> a number of parameters."""
    value = _scaled(_COUNT, text)
    if not value >= 1:
        raise ValueError(f"params must be a positive count such as 340M, 3.2M or 1.5B, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def _non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text!r}")
    return value


def _typed(parse):
    def convert(text: str):
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    convert.__name__ = parse.__name__
    return convert


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bagua.advise", description=(
        "Predicted step time of each algorithm on a link (alpha-beta model) and its time to torch DDP's final "
        "loss (step time x its measured steps multiplier), ranked by the latter. "
        "Under torchrun without --bandwidth and --latency-ms it measures the link first."),
        epilog="example: python -m bagua.advise --bandwidth 1gbit --latency-ms 2 --params 340M --world-size 128")
    p.add_argument("--params", required=True, type=_typed(parse_count), help="model parameters, e.g. 340M")
    p.add_argument("--bandwidth", type=_typed(parse_bandwidth), help="link bandwidth each way, e.g. 1gbit, 100mbit")
    p.add_argument("--latency-ms", type=_non_negative, help="one-way latency between machines, ms")
    p.add_argument("--world-size", type=_positive_int, help="ranks (default under torchrun: the job's)")
    p.add_argument("--ranks-per-machine", type=_positive_int, default=1,
                   help="ranks (GPUs) per machine, exact within one (default 1: every rank its own machine)")
    p.add_argument("--compute-ms", type=_non_negative, default=None,
                   help="one step's compute (forward, backward, optimizer) without communication; without it "
                        "the ranking is by the communication a step waits for, nothing hidden")
    p.add_argument("--backend", choices=("nccl", "gloo"), default=None,
                   help="how exact allreduces run (default nccl; measured: the job's)")
    p.add_argument("--constants", default=None, help="fitted constants (JSON from benchmarks/tradeoff/fit.py)")
    p.add_argument("--probe-mb", type=float, default=16.0, help="large allreduce of the link measurement, MB")
    p.add_argument("--steps-multiplier", action="append", default=[], type=_typed(parse_multiplier),
                   metavar="ALGORITHM=X",
                   help="your own steps to torch DDP's loss over DDP's for an algorithm (repeatable), e.g. qadam=1.05; "
                        "default: the measured ones (bagua.measured_accuracy)")
    p.add_argument("--json", action="store_true", help="print the predictions as JSON")
    args = p.parse_args(argv)
    if (args.bandwidth is None) != (args.latency_ms is None):
        p.error("give both --bandwidth and --latency-ms, or neither (then run under torchrun to measure the link)")
    if args.bandwidth is None and "WORLD_SIZE" not in os.environ:
        p.error("no link given: pass --bandwidth and --latency-ms (e.g. --bandwidth 1gbit --latency-ms 2), "
                "or run under torchrun (torchrun --nproc-per-node 2 -m bagua.advise --params ...) to measure it")
    if args.bandwidth is None and int(os.environ["WORLD_SIZE"]) < 2:
        p.error("measuring the link needs at least 2 ranks (torchrun --nproc-per-node 2 ...)")
    if args.bandwidth is not None and args.world_size is None:
        p.error("--world-size is needed with a stated link (e.g. --world-size 128)")
    if not args.probe_mb > 0:
        p.error(f"--probe-mb must be positive, got {args.probe_mb}")
    if args.world_size is not None and args.world_size % args.ranks_per_machine:
        p.error(f"--world-size ({args.world_size}) must be a multiple of --ranks-per-machine ({args.ranks_per_machine})")
    return args


def measure_link(probe_bytes: int, repeats: int = 5, attempts: int = 3) -> tuple[Link, dict]:
    """Measure this job's link with exact allreduces of two sizes (4 KB and ``probe_bytes``) on
    the default group: the slowest rank's median times, fitted by :func:`link_from_timings`. Call on
    every rank of a job initialized with ``check_collectives=False`` (an agreement check would
    add its own messages); returns the link and what was measured. Timings that cannot be a link
    (the large allreduce no slower than the small one: a busy machine) are measured again, up to
    ``attempts`` times in all, with one warning each; every rank sees the same medians, so all
    retry together."""
    import torch

    from . import comm

    world = comm.get_world_size()  # the ranks as machines: the link between any two of them
    backend = "nccl" if comm.get_default_group().backend == "nccl" else "gloo"
    device = "cuda" if backend == "nccl" else "cpu"
    sizes = (4096, probe_bytes)

    def measured(attempt: int) -> tuple[Link, dict]:
        medians = []
        for size in sizes:
            tensor = torch.zeros(size // 4, device=device)
            comm.allreduce(tensor)  # a first call connects and warms up
            times = []
            for _ in range(repeats):
                if device == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                comm.allreduce(tensor)
                if device == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
            verdict = torch.tensor([statistics.median(times)], dtype=torch.float64)
            comm.allreduce(verdict, op=comm.ReduceOp.MAX)  # the slowest rank's median: what a step waits for
            medians.append(float(verdict))
        details = {"sizes_bytes": sizes, "median_s": medians, "hops": [allreduce_hops(s, world, backend) for s in sizes],
                   "world_size": world, "backend": backend, "repeats": repeats, "attempts": attempt}
        return link_from_timings(sizes[0], medians[0], sizes[1], medians[1], world, backend), details

    for attempt in range(1, attempts):
        try:
            return measured(attempt)
        except ValueError as error:
            warnings.warn(f"bagua.advise: measuring the link again ({attempt} of {attempts}): {error}", stacklevel=2)
    return measured(attempts)


def link_from_timings(small_bytes: float, small_s: float, large_bytes: float, large_s: float, world_size: int,
                      backend: str = "gloo") -> Link:
    """The link under two exact allreduces on ``world_size`` ranks as machines: their times fitted
    to ``hops * per-message cost + bytes on the busiest link / bandwidth`` (the pattern of an
    allreduce, :func:`allreduce_hops`). The latency returned is one way: the per-message cost over
    the one-way latencies a ring's message costs on ``backend`` (:func:`one_way_delays`: 2 on Gloo,
    1 on NCCL); 0 where the small one took less than its bytes (noise). The bandwidth is the rate
    reached.

    Example::

        link_from_timings(4096, 0.0041, 16e6, 0.139, 2)   # Link(bandwidth_bit_s=9.8e8, latency_s=0.001)
    """
    if world_size < 2:
        raise ValueError(f"an allreduce crosses a link only on 2 or more ranks, got world_size={world_size}")
    if not (small_s > 0 and large_s > 0):
        raise ValueError(f"the allreduces' times must be positive seconds, got {small_s} and {large_s}")
    hops = [allreduce_hops(n, world_size, backend) for n in (small_bytes, large_bytes)]
    moved = [2 * (world_size - 1) / world_size * n for n in (small_bytes, large_bytes)]
    scale = hops[1] / hops[0]  # the large one's latencies, in units of the small one's
    if not (small_bytes > 0 and moved[1] > moved[0] * scale):
        raise ValueError(f"to tell latency from bandwidth the large allreduce must carry more bytes per message in "
                         f"sequence than the small one; got {small_bytes:g} and {large_bytes:g} bytes ({hops[0]} and "
                         f"{hops[1]} messages): pass a small size such as 4096 and a large one of several MB")
    per_byte = (large_s - small_s * scale) / (moved[1] - moved[0] * scale)
    if not per_byte > 0:
        raise ValueError(
            f"the {large_bytes:g}-byte allreduce took {large_s * 1e3:.3f} ms, no longer than {scale:g} x the "
            f"{small_bytes:g}-byte one's {small_s * 1e3:.3f} ms ({hops[1]} and {hops[0]} messages in sequence): "
            "no time left for its bytes. Measure again with a larger probe (--probe-mb) on a quieter machine")
    per_message = max(0.0, (small_s - moved[0] * per_byte) / hops[0])
    delays_per_message = one_way_delays(Collective("allreduce", small_bytes, hops[0], "none"), backend) / hops[0]
    return Link(8 / per_byte, per_message / delays_per_message)


def steps_multipliers(overrides: Optional[dict[str, float]] = None) -> dict[str, Optional[float]]:
    """Each algorithm's steps to torch DDP's final loss over DDP's steps: the measured ones
    (``bagua.measured_accuracy``; None where it did not get there within the measurement), with
    ``overrides`` (a user's own, measured on their job) on top."""
    found: dict[str, Optional[float]] = {name: MEASURED[name]["steps_multiplier"] if name in MEASURED else None
                                         for name in ALGORITHMS}
    found.update(overrides or {})
    return found


def rank_by_time_to_target(predictions: Sequence[Prediction], multipliers: dict[str, Optional[float]]) -> list[Prediction]:
    """``predictions`` by predicted time to torch DDP's final loss (step time x steps multiplier),
    those without a multiplier (not there within the measurement) last, by step time."""
    def key(p: Prediction) -> tuple:
        m = multipliers.get(p.algorithm)
        return (m is None, p.step_s * (m if m is not None else 1.0))
    return sorted(predictions, key=key)


def parse_multiplier(text: str) -> tuple[str, float]:
    """``"qadam=1.05"`` -> ``("qadam", 1.05)``; the name as ``ALGORITHMS`` or ``ALIASES`` spell it."""
    name, sep, value = text.partition("=")
    name = ALIASES.get(name.strip(), name.strip())
    try:
        number = float(value)
    except ValueError:
        number = float("nan")
    if not sep or name not in ALGORITHMS or not number > 0 or not math.isfinite(number):
        raise ValueError(f"--steps-multiplier takes ALGORITHM=X with X > 0 (its steps to torch DDP's loss over DDP's), "
                         f"ALGORITHM one of {', '.join(ALGORITHMS)}; got {text!r}")
    return name, number


def report(predictions: Sequence[Prediction], header: str, compute_given: bool,
           multipliers: Optional[dict[str, Optional[float]]] = None, overridden: Sequence[str] = ()) -> str:
    """The table the command line prints, ranked by predicted time to torch DDP's final loss."""
    multipliers = steps_multipliers() if multipliers is None else multipliers
    ranked = rank_by_time_to_target(predictions, multipliers)
    ddp = next((p for p in predictions if p.algorithm == "torch-ddp"), predictions[0])
    ddp_time = ddp.step_s * (multipliers.get("torch-ddp") or 1.0)
    lines = [header, "", f"{'rank':<5}{'select with':<58}{'step ms':>9}{'waits ms':>9}{'hops':>5}{'MB/step':>8}"
             f"{'steps x':>8}{'time x':>8}  loss at DDP's steps"]
    for i, p in enumerate(ranked, 1):
        m = multipliers.get(p.algorithm)
        steps = f"{m:>7.2f}{'*' if p.algorithm in overridden else ' '}" if m is not None else f"{'> ' + LONGEST:>7} "
        faster = f"{ddp_time / (p.step_s * m):>7.2f}x" if m is not None and p.step_s > 0 else f"{'-':>8}"
        gap = MEASURED.get(p.algorithm, {}).get("loss_vs_ddp")
        note = f"{gap:+.1%}" if gap is not None else "not measured"
        if p.algorithm == "async":
            note += f" (one averaging round: {p.comm_s * 1e3:.0f} ms in the background)"
        lines.append(f"{i:<5}{SELECT[p.algorithm]:<58}{p.step_s * 1e3:>9.1f}{p.exposed_s * 1e3:>9.1f}{p.hops:>5}"
                     f"{p.nbytes / 1e6:>8.1f}{steps}{faster}  {note}")
    lines += ["",
              "step ms: predicted step (compute and the communication it cannot hide); waits ms: that communication; "
              "hops: messages in sequence per step (each costs a one-way latency); MB/step: bytes on the busiest link.",
              f"steps x: steps to torch DDP's final validation loss over DDP's (* yours, --steps-multiplier; "
              f"'> {LONGEST}': not there within the measurement); time x: DDP's predicted time to its loss over this "
              f"one's (step x steps); loss at DDP's steps: relative to DDP's. Measured on {WORKLOAD} "
              f"({RESULTS}); pass your own with --steps-multiplier NAME=X."]
    if not compute_given:
        lines.append("no --compute-ms: step = the communication a step waits for (none hidden behind compute).")
    best = next((p for p in ranked if multipliers.get(p.algorithm) is not None), None)
    if best is not None:
        lines.append(f"Recommended: {SELECT[best.algorithm]} (predicted {ddp_time / (best.step_s * multipliers[best.algorithm]):.2f}x "
                     f"torch DDP's time to its loss); exact, as torch DDP: algorithm=\"gradient_allreduce\". "
                     "A prediction of the alpha-beta model and of one workload's steps, not a measurement of yours "
                     "(docs/choosing_an_algorithm.md).")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m bagua.advise``: every algorithm's predicted step time and time to torch DDP's final loss,
    ranked by the latter."""
    args = parse_args(argv)
    constants = Constants.load(args.constants) if args.constants else Constants()
    rank, measured = 0, None
    if args.bandwidth is None:
        from . import comm

        comm.init_process_group(check_collectives=False)  # the probes: allreduces alone
        rank = comm.get_rank()
        link, measured = measure_link(int(args.probe_mb * 1e6))
        world = args.world_size or comm.get_world_size()
        backend = args.backend or measured["backend"]
        comm.destroy_process_group()
        if world % args.ranks_per_machine:
            raise SystemExit(f"--world-size ({world}) must be a multiple of --ranks-per-machine ({args.ranks_per_machine})")
    else:
        link = Link(args.bandwidth, args.latency_ms / 1e3)
        world, backend = args.world_size, args.backend or "nccl"
    rpm = args.ranks_per_machine
    if rank:
        return 0
    compute = (args.compute_ms or 0.0) / 1e3
    found = predict_all(args.params, world, link, compute, constants, rpm, backend)
    multipliers = steps_multipliers(dict(args.steps_multiplier))
    if args.json:
        print(json.dumps({"link": asdict(link), "measured": measured, "predictions": [asdict(p) for p in found],
                          "steps_multipliers": multipliers}))
        return 0
    header = (f"{args.params / 1e6:g}M parameters (fp32), {world} ranks, {rpm} per machine, "
              f"{link.bandwidth_bit_s / 1e6:g} Mbit/s, {link.latency_s * 1e3:g} ms one way, {backend}")
    if measured:
        header = (f"measured: {link.bandwidth_bit_s / 1e6:.0f} Mbit/s and {link.latency_s * 1e3:.3f} ms one way "
                  f"(what each message in sequence costs, over its one-way latencies), from exact allreduces of {measured['sizes_bytes'][0] / 1e3:g} KB and "
                  f"{measured['sizes_bytes'][1] / 1e6:g} MB on {measured['world_size']} ranks ({backend}; "
                  f"medians {measured['median_s'][0] * 1e3:.2f} ms and {measured['median_s'][1] * 1e3:.1f} ms)\n" + header)
    print(report(found, header, args.compute_ms is not None, multipliers, [name for name, _ in args.steps_multiplier]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
