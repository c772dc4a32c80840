"""The cost model of bagua.advise: message counts from the code, the overlap arithmetic, the link
from two allreduces' timings, and the pattern's bytes against what the algorithms really send
(bagua's traffic counters, 3 real ranks; the network's own: ``test_pattern_on_the_wire.py``)."""

from __future__ import annotations

import math

import pytest
import torch

import bagua
from bagua.advise import (
    ALGORITHMS, SIGN1_BYTES_PER_ELEMENT, UINT8_BYTES_PER_ELEMENT, Collective, Constants, Link, allreduce_hops,
    collective_time, communication_pace, cpu_slowdown, default_buckets, exposed_time, link_from_timings, message_pattern, predict,
    predict_all,
)
from bagua.comm.compression import MinMaxUInt8, Sign1
from tests.harness import run_ranks

MB13 = 12_966_912  # the tradeoff study's LM: one bucket of 3.24M fp32 gradients


def test_gloo_ring_keeps_two_segments_in_flight():
    # small: 2m segments -> 2(m-1) messages in sequence, as the textbook ring
    assert [allreduce_hops(4096, m) for m in (2, 4, 8)] == [2, 6, 14]
    # 13 MB on 4 machines: 16 segments of 0.8 MB, 12 sent per phase two at a time -> 2 x 6
    assert allreduce_hops(MB13, 4) == 12
    assert allreduce_hops(MB13 / 2, 4) == 6  # fp16: 8 segments
    assert allreduce_hops(MB13, 8) == 14
    # NCCL: data crosses each machine boundary twice; nothing for one machine
    assert allreduce_hops(25 << 20, 16, "nccl") == 30 and allreduce_hops(1e9, 1) == 0


def test_each_algorithms_step_as_counted_from_the_code():
    wire = MB13 / 4 * UINT8_BYTES_PER_ELEMENT
    ddp = message_pattern("torch-ddp", [MB13], 4)
    assert ddp == [Collective("allreduce", 1.5 * MB13, 12, "backward", remote_messages=12 * 4)]  # a message a machine a hop
    assert message_pattern("torch-ddp-fp16", [MB13], 4)[0].nbytes == 0.75 * MB13
    assert message_pattern("gradient_allreduce", [MB13], 4) == ddp
    assert message_pattern("bytegrad", [MB13], 4) == [Collective("compressed allreduce", 1.5 * wire, 2, "backward", 24)]
    assert message_pattern("decentralized", [MB13], 4)[0].overlap == "forward"
    exchange, = message_pattern("low_precision_decentralized", [MB13], 4)  # no agreement check: trusted
    assert (exchange.hops, exchange.nbytes, exchange.overlap, exchange.remote_messages) == (1, 2 * wire, "none", 8)
    assert message_pattern("low_precision_decentralized", [MB13], 2)[0].nbytes == wire  # one neighbour
    assert [c.hops for c in message_pattern("low_precision_decentralized", [MB13] * 2, 4)] == [1, 1]
    qadam = message_pattern("qadam", [MB13, MB13], 4)  # the momentum by bucket during backward, then the verdict
    assert [(c.hops, c.overlap) for c in qadam] == [(2, "backward"), (2, "backward"), (6, "none")]
    assert qadam[0].nbytes == pytest.approx(1.5 * wire)
    in_step = message_pattern("qadam", [MB13, MB13], 4, speculating=False)  # overlap off: after backward, no verdict
    assert [(c.hops, c.overlap, c.nbytes) for c in in_step] == [(2, "none", qadam[0].nbytes)] * 2
    assert [c.overlap for c in message_pattern("async", [MB13], 4)] == ["background"]
    onebit, = message_pattern("onebit_grad", [MB13], 4)  # past its warm-up: bytegrad's pattern at 1.125 bits
    assert (onebit.hops, onebit.overlap) == (2, "backward")
    assert onebit.nbytes == pytest.approx(1.5 * MB13 / 4 * SIGN1_BYTES_PER_ELEMENT)
    assert all(message_pattern(a, [MB13], 1) == [] for a in ALGORITHMS)
    # 128 ranks, 8 per machine: bagua hierarchical among 16 machines, torch's ring crosses them
    assert message_pattern("bytegrad", [MB13], 128, 8)[0].nbytes == pytest.approx(2 * 15 / 16 * wire)
    # flat, every rank sends its chunk to each rank of the other machines, and gets its reduced chunk back
    assert message_pattern("bytegrad", [MB13], 128, 8)[0].remote_messages == 2 * 16 * 15
    assert message_pattern("bytegrad", [MB13], 128, 8, hierarchical=False)[0].remote_messages == 2 * 128 * 120
    assert message_pattern("torch-ddp", [MB13], 128, 8, "nccl")[0].nbytes == pytest.approx(2 * 127 / 128 * MB13)
    with pytest.raises(ValueError, match="unknown algorithm 'adam'; known: torch-ddp"):
        message_pattern("adam", [MB13], 4)


def test_the_codec_constants_are_the_real_codecs_wire_sizes():
    for n in (1024, 1 << 20):
        payload = MinMaxUInt8().encode(torch.randn(n))
        assert payload.data.numel() * payload.data.element_size() == n * UINT8_BYTES_PER_ELEMENT
        payload = Sign1().encode(torch.randn(n))
        assert payload.data.numel() * payload.data.element_size() == n * SIGN1_BYTES_PER_ELEMENT


def test_overlap_follows_the_engine():
    one = [Collective("a", 1.0, 1, "backward")]
    assert exposed_time(one, [0.3], compute_s=1.0, backward_share=0.6) == pytest.approx(0.3)  # ready at backward's end
    two = [Collective("a", 1.0, 1, "backward")] * 2
    # the first bucket leaves halfway through backward (0.3 s), is done by its end: only the last waits
    assert exposed_time(two, [0.2, 0.2], 1.0, 0.6) == pytest.approx(0.2)
    # a first bucket longer than what is left of backward pushes the second back
    assert exposed_time(two, [0.5, 0.2], 1.0, 0.6) == pytest.approx(0.5 + 0.2 - 0.3)
    ahead = [Collective("w", 1.0, 1, "forward")]  # hides behind forward (0.3) and backward (0.6)
    assert exposed_time(ahead, [0.5], 1.0, 0.6) == 0.0 and exposed_time(ahead, [1.2], 1.0, 0.6) == pytest.approx(0.3)
    after = [Collective("x", 1.0, 1, "none"), Collective("y", 1.0, 1, "background")]
    assert exposed_time(after, [0.25, 9.0], 1.0, 0.6) == 0.25


def test_communication_moves_at_its_pace_while_compute_runs():
    """On a box whose ranks leave no core free, communication runs at the ranks' share of a core
    until compute stops, then at its own speed."""
    assert communication_pace(16, 2, 1.0) == pytest.approx(2 / 17) and communication_pace(2, 8) == 1.0
    two = [Collective("a", 1.0, 1, "backward")] * 2
    # the first bucket leaves halfway through backward (0.3 s left): at half pace 0.15 of its 0.2 s is
    # done by backward's end, then 0.05 s and the second bucket's 0.2 s
    assert exposed_time(two, [0.2, 0.2], 1.0, 0.6, pace=0.5) == pytest.approx(0.05 + 0.2)
    assert exposed_time(two, [0.1, 0.2], 1.0, 0.6, pace=0.5) == pytest.approx(0.2)  # done within backward at 0.2 s
    ahead = [Collective("w", 1.0, 1, "forward")]  # behind forward and backward's 0.9 s, at half pace: 0.45 s of it
    assert exposed_time(ahead, [0.5], 1.0, 0.6, pace=0.5) == pytest.approx(0.05)
    for times in ([0.2, 0.2], [0.5, 0.2], [0.05, 0.9]):  # pace 1: each rank has a core or a device of its own
        assert exposed_time(two, times, 1.0, 0.6, pace=1.0) == exposed_time(two, times, 1.0, 0.6)
    slowed = predict("decentralized", [MB13], 16, Link(100e6), 1.0, ranks_per_machine=4, pace=communication_pace(16, 2))
    assert slowed.step_s > predict("decentralized", [MB13], 16, Link(100e6), 1.0, ranks_per_machine=4).step_s
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="0 < pace <= 1"):
            exposed_time(two, [0.1, 0.1], 1.0, 0.6, pace=bad)
    with pytest.raises(ValueError, match="processes >= 1"):
        communication_pace(0, 2)


def test_a_shared_router_costs_each_message_between_machines():
    """A link's ``message_s``: every message between machines, all ranks together, one after another."""
    link, routed = Link(1e9, 0.005), Link(1e9, 0.005, message_s=1e-4)
    for hierarchical in (True, False):
        c, = message_pattern("bytegrad", [MB13], 16, 2, hierarchical=hierarchical)
        added = collective_time(c, routed, Constants())[0] - collective_time(c, link, Constants())[0]
        assert added == pytest.approx(c.remote_messages * 1e-4)
    flat, = message_pattern("bytegrad", [MB13], 16, 2, hierarchical=False)
    assert flat.remote_messages == 2 * 16 * 14  # 16 ranks each to the 14 on other machines, and back


def test_a_prediction_adds_latencies_and_transfers():
    constants = Constants(message_s=1e-4, latency_factor=2.0, efficiency=0.5, backward_share=0.6)
    p = predict("low_precision_decentralized", [MB13], 4, Link(100e6, 0.005), compute_s=0.3, constants=constants)
    # one message in sequence: its fixed cost once, and a round trip of two one-way latencies on Gloo
    assert p.hops == 1 and p.latency_s == pytest.approx(1e-4 + 2 * 2 * 0.005)
    on_nccl = predict("low_precision_decentralized", [MB13], 4, Link(100e6, 0.005), 0.3, constants, backend="nccl")
    assert on_nccl.latency_s == pytest.approx(1e-4 + 2 * 0.005)  # NCCL's buffers wait ahead: one latency
    assert p.transfer_s == pytest.approx(8 * (2 * MB13 / 4 * UINT8_BYTES_PER_ELEMENT) / 50e6)
    assert p.step_s == pytest.approx(0.3 + p.latency_s + p.transfer_s) and p.exposed_s == pytest.approx(p.comm_s)
    slow = predict("async", [MB13], 4, Link(1e6), compute_s=0.3)
    assert slow.step_s == 0.3 and slow.comm_s > 100 and slow.nbytes == 0  # its averaging is off the step
    with pytest.raises(ValueError, match="positive bandwidth"):
        predict("bytegrad", [MB13], 4, Link(0.0), 0.1)


def test_each_transport_reaches_its_own_share_of_the_link():
    link = Link(100e6)
    split = Constants(efficiency=0.9, compressed_efficiency=0.8, exchange_efficiency=0.6)
    for algo, share in (("torch-ddp", 0.9), ("bytegrad", 0.8), ("onebit_grad", 0.8), ("low_precision_decentralized", 0.6)):
        p = predict(algo, [MB13], 4, link, 0.0, split)
        assert p.transfer_s == pytest.approx(8 * p.nbytes / (share * 100e6)), algo
    same = Constants(efficiency=0.9)  # unset: the ring's share for every transport
    assert predict("bytegrad", [MB13], 4, link, 0.0, same).transfer_s == pytest.approx(
        8 * message_pattern("bytegrad", [MB13], 4)[0].nbytes / 90e6)
    given = [Collective("ring exchange", 1e6, 3, "none")]  # a recorded pattern replaces today's
    assert predict("bytegrad", [MB13], 4, link, 0.0, same, pattern=given).hops == 3


def test_ranks_share_the_cores_with_what_runs_there():
    assert cpu_slowdown(4, 2) == 2.0 and cpu_slowdown(8, 2) / cpu_slowdown(4, 2) == 2.0
    assert cpu_slowdown(1, 8) == 1.0  # more cores than processes: as alone
    assert cpu_slowdown(8, 2, background=5.1) / cpu_slowdown(4, 2, background=5.1) == pytest.approx(13.1 / 9.1)
    with pytest.raises(ValueError):
        cpu_slowdown(0, 2)
    # contention: past one process a core, each one costs more than its share
    assert cpu_slowdown(8, 2, contention=1.5) / cpu_slowdown(4, 2, contention=1.5) == pytest.approx(2 ** 1.5)
    assert cpu_slowdown(2, 2, contention=1.5) == 1.0  # a core each: no contention to pay
    with pytest.raises(ValueError, match="contention"):
        cpu_slowdown(8, 2, contention=0.5)


def test_predict_all_ranks_fastest_first_and_buckets_at_25_mib():
    assert default_buckets(340e6) == [25 << 20] * 51 + [340e6 * 4 - 51 * (25 << 20)]
    assert default_buckets(1e6) == [4e6]
    found = predict_all(340e6, 16, Link(1e9, 0.002), compute_s=0.5)
    steps = [p.step_s for p in found]
    assert steps == sorted(steps) and {p.algorithm for p in found} == set(ALGORITHMS)
    assert found[0].algorithm == "async" and found[-1].algorithm in ("torch-ddp", "gradient_allreduce", "decentralized")
    with pytest.raises(ValueError, match="multiple of ranks_per_machine"):
        predict_all(340e6, 12, Link(1e9), ranks_per_machine=8)


@pytest.mark.parametrize("world, backend", [(2, "gloo"), (3, "gloo"), (8, "gloo"), (4, "nccl")])
@pytest.mark.parametrize("link", [Link(1e9, 0.002), Link(100e6, 20e-6), Link(10e9, 0.0)])
def test_the_link_is_recovered_from_timings_of_a_known_link(world, backend, link):
    """measure_link's two exact allreduces (4 KB and 16 MB) timed as the model has them on a known
    link: bandwidth and latency come back within 1%."""
    def took(nbytes: float) -> float:
        allreduce, = message_pattern("gradient_allreduce", [nbytes], world, backend=backend)
        return sum(collective_time(allreduce, link, Constants(), backend))

    found = link_from_timings(4096, took(4096), 16e6, took(16e6), world, backend)
    assert found.bandwidth_bit_s == pytest.approx(link.bandwidth_bit_s, rel=0.01)
    assert found.latency_s == pytest.approx(link.latency_s, rel=0.01, abs=1e-9)


def test_nonsense_timings_are_named():
    with pytest.raises(ValueError, match=r"the 1.6e\+07-byte allreduce took 1.000 ms, no longer than 4 x the "
                                         r"4096-byte one's 2.000 ms \(8 and 2 messages in sequence\)"):
        link_from_timings(4096, 0.002, 16e6, 0.001, 2)  # the large one faster than the small one
    with pytest.raises(ValueError, match="no longer than 3 x"):  # slower, but not by its 12 latencies to 4
        link_from_timings(4096, 0.010, 16e6, 0.029, 3)
    with pytest.raises(ValueError, match="must carry more bytes per message in sequence than the small one; got 1.6e"):
        link_from_timings(16e6, 0.1, 4096, 0.002, 2)
    with pytest.raises(ValueError, match="2 or more ranks, got world_size=1"):
        link_from_timings(4096, 0.002, 16e6, 0.1, 1)
    with pytest.raises(ValueError, match="times must be positive seconds, got 0.0"):
        link_from_timings(4096, 0.0, 16e6, 0.1, 2)


def _one_step_traffic(rank: int, name: str) -> dict:
    """Bytes by collective kind that one step of ``name`` sends, after a warm-up step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 40))
    if name.startswith("qadam"):
        opt = bagua.optim.QAdamOptimizer(model.parameters(), lr=1e-3, warmup_steps=1)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
    if name == "onebit_grad":
        algorithm = bagua.algorithms.OneBitGradAlgorithm(warmup_steps=1)
    else:
        algorithm = bagua.algorithms.QAdamAlgorithm(opt, bits=1) if name == "qadam-1bit" else name
    ddp = bagua.DistributedDataParallel(model, [opt], algorithm=algorithm)
    x = torch.randn(8, 256)
    for step in range(2):
        before = bagua.comm.traffic_by_kind()
        opt.zero_grad()
        ddp(x).square().mean().backward()
        opt.step()
    after = bagua.comm.traffic_by_kind()
    buckets = [b.flat.numel() * b.flat.element_size() for b in ddp.buckets]
    ddp.close()
    return {"sent": {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}, "buckets": buckets}


def _all_algorithms(rank: int) -> dict:
    return {name: _one_step_traffic(rank, name) for name in
            ("gradient_allreduce", "bytegrad", "decentralized", "low_precision_decentralized", "qadam",
             "qadam-1bit", "onebit_grad")}


def test_the_pattern_sends_what_the_algorithms_send():
    """3 ranks (a ring with two distinct neighbours): each algorithm's bytes by collective, as bagua
    counts them while it runs, against the pattern's (the agreement check is not counted there)."""
    kind = {"allreduce": "allreduce", "weights allreduce": "allreduce", "compressed allreduce": "compressed_allreduce",
            "compressed momentum allreduce": "compressed_allreduce", "verdict allreduce": "allreduce",
            "ring exchange": "alltoall_v", "1-bit allreduce": "compressed_allreduce"}
    measured = run_ranks(_all_algorithms, 3, timeout=120)[0]
    for name, got in measured.items():
        expected: dict = {}
        for c in message_pattern(name, got["buckets"], 3):
            if c.what != "agreement check":
                expected[kind[c.what]] = expected.get(kind[c.what], 0) + c.nbytes
        assert set(got["sent"]) == set(expected), name
        for k, nbytes in expected.items():
            # (the counters round each collective to whole bytes: qadam's verdict is 8 bytes)
            assert math.isclose(got["sent"][k], nbytes, rel_tol=0.01, abs_tol=1), (name, k, got["sent"][k], nbytes)


def test_flat_on_machines_of_several_ranks_sends_every_ranks_share():
    """4 machines x 2 ranks: hierarchical, the machines' leaders run the pattern among 4; flat, an exact
    ring over 8 ranks crosses each link with 2 (n-1)/n of the bytes (torch DDP's), and the compressed
    allreduce sends every rank's share: 2 R (n-R)/n = 3.0 of the encoded bytes, twice 2 (m-1)/m = 1.5."""
    wire = MB13 / 4 * UINT8_BYTES_PER_ELEMENT
    hier, = message_pattern("bytegrad", [MB13], 8, ranks_per_machine=2)
    flat, = message_pattern("bytegrad", [MB13], 8, ranks_per_machine=2, hierarchical=False)
    assert hier.nbytes == pytest.approx(1.5 * wire) and flat.nbytes == pytest.approx(3.0 * wire)
    assert hier.hops == flat.hops == 2
    exact_flat, = message_pattern("gradient_allreduce", [MB13], 8, ranks_per_machine=2, hierarchical=False)
    ddp, = message_pattern("torch-ddp", [MB13], 8, ranks_per_machine=2)
    assert exact_flat.nbytes == pytest.approx(ddp.nbytes) == pytest.approx(2 * 7 / 8 * MB13)
    assert exact_flat.hops == ddp.hops  # a message waits across each machine boundary, not each rank's
    # one rank a machine: flat and hierarchical are the same thing
    assert message_pattern("bytegrad", [MB13], 4, hierarchical=False) == message_pattern("bytegrad", [MB13], 4)
    link = Link(100e6)
    slow = predict("bytegrad", [MB13], 8, link, 0.2, ranks_per_machine=2, hierarchical=False)
    fast = predict("bytegrad", [MB13], 8, link, 0.2, ranks_per_machine=2)
    assert slow.transfer_s == pytest.approx(2 * fast.transfer_s)
