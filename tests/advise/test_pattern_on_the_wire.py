"""The cost model against the emulated network's own interface counters: 3 ranks, each its own
machine in a network namespace (root and iproute2; skipped otherwise).

Bytes: what each rank's ``veth0`` sends in one training step, against the bytes that
``message_pattern`` puts on the busiest link (in a ring every rank sends as much). Hops: collectives
of a few KB through a 20 ms one-way delay line, started by every rank at one instant of the shared
clock, against ``hops`` one-way latencies each: Gloo's rendezvous makes them cost more than the model
counts (the expected failures below, with what was measured).
"""

from __future__ import annotations

import json
import sys
import textwrap

import pytest

from bagua.advise import Constants, Link, collective_time, message_pattern, one_way_delays
from benchmarks.network import ShapedNetwork
from tests.comm._netns import needs_netns

pytestmark = pytest.mark.xdist_group("pattern_on_the_wire")  # its module-scoped jobs run once, on one worker

RANKS = 3  # a ring with two distinct neighbours
#: what each packet adds to its TCP payload on ``veth0``: Ethernet 14, IPv4 20, TCP 20 and its
#: timestamps option 12 (a GSO packet of up to 64 KB counts once, with one set of headers)
HEADER_BYTES = 66
#: a full TCP segment's payload on a 1500-byte MTU with timestamps: what a resent segment repeats, at most
SEGMENT_BYTES = 1448
DELAY_S = 0.020
JOB_TIMEOUT_S = 150  # each job: ~10-20 s on an idle 2-core machine, 70 s seen under a load of 29
WIRE_ALGORITHMS = ("gradient_allreduce", "bytegrad", "decentralized", "low_precision_decentralized")

STEP_SCRIPT = textwrap.dedent(
    """
    import json, sys, torch, bagua
    bagua.init_process_group()

    def counters():  # what this rank's machine sent: bytes and packets, and TCP segments sent again
        tcp = [line.split() for line in open("/proc/net/snmp") if line.startswith("Tcp:")]
        return [*(int(open(f"/sys/class/net/veth0/statistics/{name}").read()) for name in ("tx_bytes", "tx_packets")),
                int(tcp[1][tcp[0].index("RetransSegs")])]

    def sent_during(work):
        # a rank's step returns once it has received everything, not once its own last bytes have
        # left: the closing barrier waits for every rank's step, so every byte of it has crossed
        bagua.comm.barrier()
        before = counters()
        work()
        bagua.comm.barrier()
        return [a - b for a, b in zip(counters(), before)]

    report = {"barrier": sent_during(lambda: None), "steps": {}}  # the closing barrier's own, taken out
    for name in sys.argv[1:]:
        torch.manual_seed(0)
        model = torch.nn.Linear(1000, 1000)  # 1M parameters: 4 MB of fp32 gradients
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        ddp = bagua.DistributedDataParallel(model, [opt], algorithm=name)
        x = torch.randn(8, 1000)

        def step():
            opt.zero_grad()
            ddp(x).square().mean().backward()
            opt.step()

        step()  # warm-up: connections made, buckets built
        report["steps"][name] = {"sent": sent_during(step),
                                 "buckets": [b.flat.numel() * b.flat.element_size() for b in ddp.buckets]}
        ddp.close()
    print("WIRE " + json.dumps(report), flush=True)
    bagua.destroy_process_group()
    """
)

TIMING_SCRIPT = textwrap.dedent(
    """
    import json, statistics, time, torch, torch.distributed as dist, bagua
    bagua.init_process_group(check_collectives=False)  # the collectives' own messages alone
    rank, world = bagua.get_rank(), bagua.get_world_size()
    small = torch.ones(1024)  # 4 KB
    to_both = [0 if r == rank else 1024 for r in range(world)]  # 4 KB to each other rank: both ring neighbours

    def until(t):
        time.sleep(max(0.0, t - time.time()))

    def collective(call):
        def run(at):
            until(at)
            call()
        return run

    def message(ahead):  # rank 0 sends 4 KB to rank 1 at `at`; rank 1 posts its receive `ahead` seconds before
        def run(at):
            if rank == 0:
                until(at)
                dist.send(small, dst=1)
            elif rank == 1:
                until(at - ahead)
                dist.irecv(torch.empty(1024), src=0).wait()
        return run

    runs = {
        "allreduce": collective(lambda: bagua.comm.allreduce(small)),
        # a block of 1024 values reduced by each rank, as in a bucket
        "compressed allreduce": collective(lambda: bagua.comm.allreduce(torch.ones(3 * 1024), compression="minmax_uint8")),
        "ring exchange": collective(lambda: bagua.comm.alltoall_v(small.repeat(world - 1), to_both, to_both)),
        "message, receive posted with the send": message(0.0),
        "message, receive posted ahead": message(0.2),
    }
    period, calls = 0.4, 5  # every call starts on an idle link, at the same instant on every rank
    report = {}
    for what, run in runs.items():
        start = torch.tensor([time.time() + 0.5], dtype=torch.float64)
        bagua.comm.broadcast(start, 0)  # one clock: the ranks share one machine's
        took = []
        for k in range(-1, calls):  # the first call connects and warms up
            at = float(start) + (k + 1) * period
            run(at)
            took.append(time.time() - at)
        slowest = torch.tensor(took[1:], dtype=torch.float64)
        bagua.comm.allreduce(slowest, op=bagua.comm.ReduceOp.MAX)  # what a step waits for
        report[what] = statistics.median(slowest.tolist())
    print("TIMING " + json.dumps(report), flush=True)
    bagua.destroy_process_group()
    """
)


def _report(output: str, tag: str) -> dict:
    """The JSON a rank printed after ``tag``."""
    return json.loads(next(line for line in output.splitlines() if line.startswith(tag + " "))[len(tag) + 1:])


def _sent_once(counts: list[int]) -> tuple[int, int]:
    """(bytes on the wire, TCP payload) a window's counters say were sent once: less a full segment
    for each segment TCP sent again, and the payload less each packet's headers."""
    nbytes, packets, resent = counts
    wire = nbytes - SEGMENT_BYTES * resent
    return wire, wire - HEADER_BYTES * packets


@pytest.fixture(scope="module")
def one_step_sent() -> list[dict]:
    """Per rank and algorithm: bytes and packets its interface sent in one step, and the buckets."""
    with ShapedNetwork(ranks=RANKS, rate="1gbit") as net:
        net.run([sys.executable, "-c", STEP_SCRIPT, *WIRE_ALGORITHMS], timeout=JOB_TIMEOUT_S, echo=False)
        return [_report(out, "WIRE") for out in net.outputs]


@pytest.fixture(scope="module")
def delayed_seconds() -> dict[str, float]:
    """Median seconds of each timed call through the delay line (the slowest rank's, from a common start)."""
    with ShapedNetwork(ranks=RANKS, rate="1gbit", delay=f"{DELAY_S * 1e3:g}") as net:
        net.run([sys.executable, "-c", TIMING_SCRIPT], timeout=JOB_TIMEOUT_S, echo=False)
        return _report(net.outputs[0], "TIMING")


@needs_netns
@pytest.mark.timeout(2 * JOB_TIMEOUT_S)
@pytest.mark.parametrize("algorithm", WIRE_ALGORITHMS)
def test_one_step_sends_the_patterns_bytes(algorithm, one_step_sent):
    """Each rank's TCP payload sent once (its interface's bytes, less 66 per packet and a full
    segment per segment TCP sent again) is the pattern's bytes within 0.5%: gloo's framing adds
    less than 0.1%, while a codec's block headers (0.8% of uint8) or a wrong share of the ring would
    show. The bytes on the wire exceed the pattern's by TCP/IP alone (and what TCP resent): at most
    66 bytes per 1448-byte segment sent (4.6%) and an ACK per two received (2.3%)."""
    for rank, report in enumerate(one_step_sent):
        sent = report["steps"][algorithm]
        expected = sum(c.nbytes for c in message_pattern(algorithm, sent["buckets"], RANKS))
        wire, payload = (a - b for a, b in zip(_sent_once(sent["sent"]), _sent_once(report["barrier"])))
        assert payload == pytest.approx(expected, rel=0.005), (rank, report, expected)
        assert expected <= wire <= 1.07 * expected, (rank, report, expected)


@needs_netns
@pytest.mark.timeout(2 * JOB_TIMEOUT_S)
def test_a_message_crosses_in_one_delay_only_when_its_receive_was_posted_ahead(delayed_seconds):
    """The clock and the delay line: a message whose receive was posted 0.2 s ahead arrives one
    one-way delay after it is sent; posted with the send, two (Gloo sends only once the receiver's
    announcement has crossed, ``bagua.comm.p2p``). Up to 30% more: each end's software time on 2
    shared cores."""
    assert 1.0 <= delayed_seconds["message, receive posted ahead"] / DELAY_S <= 1.3, delayed_seconds
    assert 2.0 <= delayed_seconds["message, receive posted with the send"] / DELAY_S <= 2.6, delayed_seconds


@needs_netns
@pytest.mark.timeout(2 * JOB_TIMEOUT_S)
@pytest.mark.parametrize("what, algorithm, nbytes", [
    ("allreduce", "gradient_allreduce", 4096),  # 4 hops, each a round trip: 8 delays (8.2 measured)
    ("compressed allreduce", "bytegrad", 3 * 4096),  # a round trip, then one delay: 3 (3.2 measured)
    ("ring exchange", "low_precision_decentralized", 4096),  # one round trip: 2 (2.1 measured)
])
def test_each_collective_costs_the_one_way_latencies_the_model_counts(what, algorithm, nbytes, delayed_seconds):
    """A collective of a few KB, started on an idle link, takes the one-way latencies
    ``one_way_delays`` counts for its pattern (latency_factor 1: a few KB fit TCP's initial window,
    no slow start to pay) and its transfer: not less (nothing crosses faster than the delay line),
    up to 30% more (each message's software time at both ends, on 2 shared cores). Until the model
    counted Gloo's announcements (a round trip for a message whose receive was not posted ahead) it
    predicted half of the ring's time here. The timing itself is checked above."""
    collective, = message_pattern(algorithm, [nbytes], RANKS)
    predicted = sum(collective_time(collective, Link(1e9, DELAY_S), Constants()))
    measured = delayed_seconds[what]
    assert 1.0 <= measured / predicted <= 1.3, (
        f"{what}: {measured * 1e3:.0f} ms, {measured / DELAY_S:.2f} one-way delays; the pattern: {collective.hops} hops, "
        f"{one_way_delays(collective):g} delays, "
        f"{predicted * 1e3:.0f} ms")
