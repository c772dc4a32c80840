"""Striped collectives (``streams=K``): the same results as one stream, the pieces really spread.

Each job compares, on the same ranks, a striped group with the same group stripped of its
stripes (exactly the streams=1 code path). A tiny ``BAGUA_NET_MIN_CHUNKSIZE`` makes small
tensors use every stripe.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os

import pytest
import torch

import bagua
from tests.comm.test_compressed_allreduce import _step_bound
from tests.harness import RankFailure, run_ranks
from tests.parallel.models import rank_batches

MIN_CHUNK = 256  # bytes: a 1001-element fp32 tensor goes in 4 pieces


def _init(streams: int, min_chunk: int = MIN_CHUNK, **kwargs) -> None:
    # The forkserver's children do not see the test's environment: set it here, before init.
    os.environ["BAGUA_NET_MIN_CHUNKSIZE"] = str(min_chunk)
    bagua.init_process_group(streams=streams, timeout=datetime.timedelta(seconds=kwargs.pop("timeout_s", 60)), **kwargs)


def _random(rank: int, shape, dtype=torch.float32, salt: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * rank + salt)
    return torch.randn(*shape, generator=g).to(dtype)


def _every_collective(group, rank: int, w: int, async_op: bool) -> dict:
    """Every collective on ``group``; their results by name."""
    comm = bagua.comm

    def done(result):
        return result.wait() if async_op else result

    out = {}
    for op in ("sum", "avg", "max"):
        t = _random(rank, (7, 143))  # 1001 elements: pieces of unequal size
        done(comm.allreduce(t, op=op, group=group, async_op=async_op))
        out[f"allreduce_{op}"] = t
    t = _random(rank, (1001,), torch.bfloat16)
    done(comm.allreduce(t, group=group, async_op=async_op))
    out["allreduce_bf16"] = t
    out["allgather"] = done(comm.allgather(_random(rank, (5, 201)), group=group, async_op=async_op))
    out["alltoall"] = done(comm.alltoall(_random(rank, (w * 3, 101)), group=group, async_op=async_op))
    ins = [(rank + 2 * j) % 3 * 40 for j in range(w)]  # rows for rank j; some parts empty
    outs = [(r + 2 * rank) % 3 * 40 for r in range(w)]
    out["alltoall_v"] = done(comm.alltoall_v(_random(rank, (sum(ins), 7)), ins, outs, group=group, async_op=async_op))
    out["reduce_scatter"] = done(comm.reduce_scatter(_random(rank, (2 * w + 1, 301)), op="avg", group=group, async_op=async_op))
    t = _random(rank, (1001,))
    done(comm.broadcast(t, src=w - 1, group=group, async_op=async_op))
    out["broadcast"] = t
    t = _random(rank, (1001,))
    done(comm.reduce(t, dst=w - 1, group=group, async_op=async_op))
    out["reduce"] = t
    out["gather"] = done(comm.gather(_random(rank, (3, 301)), dst=0, group=group, async_op=async_op))
    out["scatter"] = done(comm.scatter(_random(rank, (w * 2, 301)), src=0, group=group, async_op=async_op))
    got = torch.empty(1001)
    sending = comm.send(_random(rank, (1001,)), (rank + 1) % w, async_op=True, group=group)
    comm.recv(got, (rank - 1) % w, group=group)
    sending.wait()
    out["send_recv"] = got
    t = _random(rank, (3 << 20,), salt=1)  # three compressed segments
    done(comm.allreduce(t, op="avg", compression="minmax_uint8", group=group, async_op=async_op))
    out["compressed"] = t
    return out


def _striped_and_plain(rank: int, async_op: bool) -> tuple[dict, dict]:
    _init(streams=4)
    w = bagua.get_world_size()
    striped = bagua.comm.get_default_group()
    assert len(striped.stripes) == 3
    plain = dataclasses.replace(striped, stripes=())  # the same torch group, the streams=1 path
    return _every_collective(striped, rank, w, async_op), _every_collective(plain, rank, w, async_op)


def _exact(name: str, rank: int, w: int) -> torch.Tensor:
    """The exact (float64) result of the reducing collective ``name`` on ``rank``."""
    def total(shape, dtype=torch.float32):
        return sum(_random(r, shape, dtype).double() for r in range(w))

    if name == "allreduce_sum":
        return total((7, 143))
    if name == "allreduce_avg":
        return total((7, 143)) / w
    if name == "allreduce_bf16":
        return total((1001,), torch.bfloat16)
    if name == "reduce":
        return total((1001,)) if rank == w - 1 else _random(rank, (1001,)).double()
    assert name == "reduce_scatter"
    return (total((2 * w + 1, 301)) / w).tensor_split(w)[rank]


REDUCING = ("allreduce_sum", "allreduce_avg", "allreduce_bf16", "reduce", "reduce_scatter")


@pytest.mark.parametrize("world_size,async_op", [(2, False), (2, True), (3, True), (4, False)])
def test_every_collective_striped_equals_one_stream(world_size, async_op):
    results = run_ranks(_striped_and_plain, world_size, async_op, init=False, timeout=120, local_world_size=1)
    for name in results[0][0]:
        for rank, (striped, plain) in enumerate(results):
            got, want = striped[name], plain[name]
            if got is None or want is None:  # gather off the destination
                assert got is None and want is None, name
                continue
            assert got.shape == want.shape and got.dtype == want.dtype, name
            if world_size == 2 or name not in REDUCING:
                assert torch.equal(got, want), f"{name} on rank {rank} differs from one stream"
            else:  # other pieces, so other summation orders inside Gloo
                tolerance = 5e-2 if got.dtype == torch.bfloat16 else 1e-5
                torch.testing.assert_close(got.double(), _exact(name, rank, world_size), rtol=tolerance, atol=tolerance, msg=name)
    for name in ("allreduce_sum", "allreduce_avg", "allreduce_max", "allreduce_bf16", "compressed"):
        for striped, _ in results[1:]:
            assert torch.equal(striped[name], results[0][0][name]), f"{name}: ranks differ"
    inputs = torch.stack([_random(r, (3 << 20,), salt=1) for r in range(world_size)])
    error = (results[0][0]["compressed"] - inputs.mean(0)).abs()
    assert (error <= _step_bound(inputs, "avg")).all(), "compressed allreduce beyond the codec's bound"


def _counted_ops(rank: int) -> list:
    import torch.distributed as dist

    _init(streams=4, min_chunk=1024)
    calls = []
    real = dist.all_reduce
    dist.all_reduce = lambda tensor, *a, **kw: calls.append(tensor.nbytes) or real(tensor, *a, **kw)
    counts = []
    for numel in (4, 511, 512, 767, 768, 5000):  # bytes // 1024: 0, 1, 2, 2, 3, 19
        del calls[:]
        bagua.comm.allreduce(torch.ones(numel))
        counts.append(len(calls))
    return counts


def test_a_collective_uses_min_of_streams_and_size_over_min_chunk_pieces():
    for counts in run_ranks(_counted_ops, 2, init=False, local_world_size=1):
        assert counts == [1, 1, 2, 2, 3, 4]


def _torch_groups(rank: int, streams: int) -> tuple:
    import torch.distributed as dist

    _init(streams=streams)
    after_init = len(dist.distributed_c10d._world.pg_map)
    pair = bagua.comm.new_group([0, 1]) if rank < 2 else None
    after_new_group = len(dist.distributed_c10d._world.pg_map)
    t = torch.full((1000,), float(rank))
    if pair is not None:
        bagua.comm.allreduce(t, group=pair)
    bagua.comm.allreduce(t, group=bagua.comm.get_intra_node_group())
    bagua.comm.barrier()
    stripes = [len(g.stripes) for g in (bagua.comm.get_default_group(), bagua.comm.get_intra_node_group(),
                                        bagua.comm.get_inter_node_group())]
    return after_init, after_new_group, stripes, t[0].item()


def test_streams_add_k_minus_1_torch_groups_per_bagua_group_across_machines_and_none_within_one():
    # two simulated nodes of two: each rank is in the global, its intra-node and its inter-node group
    one = run_ranks(_torch_groups, 4, 1, init=False, local_world_size=2)
    four = run_ranks(_torch_groups, 4, 4, init=False, local_world_size=2)
    for rank in range(4):
        (init1, new1, stripes1, value1), (init4, new4, stripes4, value4) = one[rank], four[rank]
        assert init1 == 3 and stripes1 == [0, 0, 0]  # streams=1: no extra group at all
        # the global and the inter-node group span both machines; the intra-node group does not
        assert init4 == init1 + 2 * 3 and stripes4 == [3, 0, 3]
        # new_group([0, 1]): both ranks on machine 0, so no stripes
        assert new1 - init1 == (1 if rank < 2 else 0) and new4 - init4 == (1 if rank < 2 else 0)
        assert value4 == value1


def _within_one_machine(rank: int) -> tuple[int, int]:
    _init(streams=4)
    t = torch.ones(1 << 20)
    calls = []
    real = torch.distributed.all_reduce
    torch.distributed.all_reduce = lambda *a, **kw: calls.append(kw.get("group")) or real(*a, **kw)
    bagua.comm.allreduce(t)
    return len(bagua.comm.get_default_group().stripes), len(calls)


def test_a_job_on_one_machine_does_not_stripe():
    """Loopback has no per-flow cap; four concurrent pieces only contend for the cores."""
    for stripes, calls in run_ranks(_within_one_machine, 2, init=False):
        assert stripes == 0 and calls == 1


def _ddp_weights(rank: int, streams: int) -> dict:
    import torch.distributed as dist

    _init(streams=streams, min_chunk=64 << 10)
    groups_used = set()
    for name in ("all_reduce", "isend"):  # the wrapper's allreduce, bytegrad's messages
        real = getattr(dist, name)
        setattr(dist, name, lambda *a, _real=real, **kw: groups_used.add(id(kw.get("group"))) or _real(*a, **kw))
    weights = {}
    for algorithm in ("gradient_allreduce", "bytegrad"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(12, 1024), torch.nn.Tanh(), torch.nn.Linear(1024, 1100),
                                    torch.nn.Tanh(), torch.nn.Linear(1100, 3))  # 1.1M parameters: 2 compressed segments
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        ddp = bagua.DistributedDataParallel(model, optimizers=[opt], algorithm=algorithm)
        for x, y in rank_batches(rank, 3):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
        weights[algorithm] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return weights, len(groups_used)


def test_ddp_trains_to_the_same_weights_with_four_streams():
    one = run_ranks(_ddp_weights, 2, 1, init=False, timeout=120, local_world_size=1)
    four = run_ranks(_ddp_weights, 2, 4, init=False, timeout=120, local_world_size=1)
    for (w1, groups1), (w4, groups4) in zip(one, four):
        # one stream: each wrapper's own group; four: gradient_allreduce's 4 stripes, bytegrad's 2 segments on 2
        assert (groups1, groups4) == (2, 6)
        for algorithm in w1:
            assert torch.equal(w4[algorithm], w1[algorithm]), algorithm


def _missing_peer(rank: int) -> None:
    import time

    _init(streams=4, check_collectives=False, timeout_s=2)
    if rank == 1:
        time.sleep(4.5)  # never joins in time
        return
    bagua.comm.allreduce(torch.ones(4096))


def test_a_timeout_names_the_operation_and_the_stripe():
    with pytest.raises(RankFailure) as failure:
        run_ranks(_missing_peer, 2, init=False, timeout=60, local_world_size=1)
    text = str(failure.value)
    assert "CollectiveError" in text and "bagua.comm.allreduce(float32[4096]) failed on rank 0: stripe 0 of 4" in text


@pytest.mark.parametrize("streams,env,match", [
    (0, {}, "streams must be in \\[1, 64\\], got 0"),
    (-2, {}, "streams must be in \\[1, 64\\], got -2"),
    (65, {}, "streams must be in \\[1, 64\\], got 65"),
    (2.0, {}, "streams must be a positive integer, got 2.0"),
    (True, {}, "streams must be a positive integer, got True"),
    (None, {"BAGUA_NET_NSTREAMS": "0"}, "BAGUA_NET_NSTREAMS must be in \\[1, 64\\], got 0"),
    (None, {"BAGUA_NET_NSTREAMS": "1.5"}, "BAGUA_NET_NSTREAMS must be a positive integer, got '1.5'"),
    (None, {"BAGUA_NET_MIN_CHUNKSIZE": "-1"}, "BAGUA_NET_MIN_CHUNKSIZE must be at least 1, got -1"),
    (None, {"BAGUA_NET_MIN_CHUNKSIZE": "1M"}, "BAGUA_NET_MIN_CHUNKSIZE must be a positive integer, got '1M'"),
])
def test_bad_stream_settings_are_clear_errors_naming_the_variable(monkeypatch, streams, env, match):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises((ValueError, TypeError), match=match):
        bagua.init_process_group(streams=streams)
    assert not bagua.is_initialized()


def test_nccl_gets_k_sockets_per_connection_unless_the_user_chose(monkeypatch, caplog):
    from bagua.comm import process_group, stripes

    assert stripes.nccl_socket_env(1, {}) == {}
    for k, threads, sockets in ((2, 2, 1), (4, 4, 1), (8, 4, 2), (64, 4, 16)):
        env = {}
        assert stripes.nccl_socket_env(k, env) == env == {"NCCL_SOCKET_NTHREADS": str(threads), "NCCL_NSOCKS_PERTHREAD": str(sockets)}
    mine = {"NCCL_NSOCKS_PERTHREAD": "3"}
    assert stripes.nccl_socket_env(8, mine) == {} and mine == {"NCCL_NSOCKS_PERTHREAD": "3"}

    monkeypatch.delenv("NCCL_SOCKET_NTHREADS", raising=False)
    monkeypatch.delenv("NCCL_NSOCKS_PERTHREAD", raising=False)
    with caplog.at_level(logging.INFO, logger=process_group.__name__):
        process_group._give_nccl_sockets(8)  # what init_process_group runs for an NCCL backend
    assert os.environ["NCCL_SOCKET_NTHREADS"] == "4" and os.environ["NCCL_NSOCKS_PERTHREAD"] == "2"
    assert "NCCL_SOCKET_NTHREADS=4 NCCL_NSOCKS_PERTHREAD=2" in caplog.text and "sockets" in caplog.text
