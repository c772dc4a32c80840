"""The ``"bagua"`` torch backend: torch's own calls, striped, give Gloo's results.

Each job runs plain ``torch.distributed`` (no bagua wrapper, no ``bagua.init_process_group``):
the default group is Gloo, a second group over the same ranks is ``new_group(backend="bagua")``
with 4 connection sets and a tiny piece size, so small tensors are cut into up to 4 pieces. Every
call runs on both groups with the same inputs; the results must agree (bit for bit on 2 ranks,
where Gloo's sums have one order; to float rounding on 3, where cutting moves Gloo's ring).
"""

from __future__ import annotations

import datetime
import os

import pytest
import torch

from tests.harness import run_ranks

MIN_CHUNK = 256  # bytes: a 1001-element fp32 tensor goes in 4 pieces
STREAMS = 4


def _init_torch(rank: int, world: int) -> None:
    import torch.distributed as dist

    import bagua  # noqa: F401  (registers the backend)

    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))


def _bagua_group(**options):
    import torch.distributed as dist

    import bagua

    settings = {"streams": STREAMS, "min_chunk_bytes": MIN_CHUNK, **options}
    return dist.new_group(backend="bagua", pg_options=bagua.comm.StripeOptions(**settings))


def _random(rank: int, shape, dtype=torch.float32, salt: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * rank + salt)
    return torch.randn(*shape, generator=g).to(dtype)


def _every_torch_call(group, rank: int, w: int, async_op: bool) -> dict:
    """Every torch.distributed call a training job makes, on ``group``; the results by name."""
    import torch.distributed as dist

    def done(work):
        if async_op:
            work.wait()

    out = {}
    for name, op in (("sum", dist.ReduceOp.SUM), ("max", dist.ReduceOp.MAX), ("product", dist.ReduceOp.PRODUCT)):
        t = _random(rank, (7, 143))  # 1001 elements: pieces of unequal size
        done(dist.all_reduce(t, op=op, group=group, async_op=async_op))
        out[f"all_reduce_{name}"] = t
    t = _random(rank, (1001,)).to(torch.bfloat16)
    done(dist.all_reduce(t, group=group, async_op=async_op))
    out["all_reduce_bf16"] = t
    t = torch.arange(1001, dtype=torch.int64) * (rank + 1)
    done(dist.all_reduce(t, group=group, async_op=async_op))
    out["all_reduce_int64"] = t
    t = _random(rank, (3,))  # one piece: below the chunk size
    done(dist.all_reduce(t, group=group, async_op=async_op))
    out["all_reduce_small"] = t
    t = _random(rank, (13, 77)).t()  # not contiguous: one operation
    done(dist.all_reduce(t, group=group, async_op=async_op))
    out["all_reduce_strided"] = t

    t = _random(rank, (1001,))
    done(dist.broadcast(t, src=w - 1, group=group, async_op=async_op))
    out["broadcast"] = t
    t = _random(rank, (1001,))
    done(dist.reduce(t, dst=w - 1, group=group, async_op=async_op))
    out["reduce"] = t if rank == w - 1 else None

    outs = [torch.empty(5, 201) for _ in range(w)]
    done(dist.all_gather(outs, _random(rank, (5, 201)), group=group, async_op=async_op))
    out["all_gather"] = outs
    into = torch.empty(w * 5, 201)
    done(dist.all_gather_into_tensor(into, _random(rank, (5, 201)), group=group, async_op=async_op))
    out["all_gather_into_tensor"] = into
    gathered = [torch.empty(3, 301) for _ in range(w)] if rank == 0 else None
    done(dist.gather(_random(rank, (3, 301)), gathered, dst=0, group=group, async_op=async_op))
    out["gather"] = gathered
    got = torch.empty(2, 301)
    parts = [_random(rank, (2, 301), salt=j) for j in range(w)] if rank == 0 else None
    done(dist.scatter(got, parts, src=0, group=group, async_op=async_op))
    out["scatter"] = got

    got = torch.empty(301)
    done(dist.reduce_scatter(got, [_random(rank, (301,), salt=j) for j in range(w)], group=group, async_op=async_op))
    out["reduce_scatter"] = got
    got = torch.empty(2, 301)
    done(dist.reduce_scatter_tensor(got, _random(rank, (2 * w, 301)), group=group, async_op=async_op))
    out["reduce_scatter_tensor"] = got

    got = torch.empty(w * 3, 101)
    done(dist.all_to_all_single(got, _random(rank, (w * 3, 101)), group=group, async_op=async_op))
    out["all_to_all_single"] = got
    ins = [(rank + 2 * j) % 3 * 40 for j in range(w)]  # rows for rank j; some parts empty
    outs_rows = [(r + 2 * rank) % 3 * 40 for r in range(w)]
    got = torch.empty(sum(outs_rows), 7)
    done(dist.all_to_all_single(got, _random(rank, (sum(ins), 7)), outs_rows, ins, group=group, async_op=async_op))
    out["all_to_all_single_splits"] = got
    landing = [torch.empty(3, 101) for _ in range(w)]
    done(dist.all_to_all(landing, [_random(rank, (3, 101), salt=j) for j in range(w)], group=group, async_op=async_op))
    out["all_to_all"] = landing

    got = torch.empty(1001)
    sending = dist.isend(_random(rank, (1001,)), (rank + 1) % w, group=group)
    dist.recv(got, (rank - 1) % w, group=group)
    sending.wait()
    out["send_recv"] = got
    got = torch.empty(1001)
    if rank == 0:  # a tag of its own: the batch below also sends to rank 0
        sources = sorted(dist.recv(got, group=group, tag=7) for _ in range(w - 1))
        out["recv_any_source"] = sources
    else:
        dist.send(_random(rank, (1001,)), 0, group=group, tag=7)
    batch = [dist.P2POp(dist.isend, _random(rank, (1001,), salt=5), (rank + 1) % w, group),
             dist.P2POp(dist.irecv, got, (rank - 1) % w, group)]
    for work in dist.batch_isend_irecv(batch):
        work.wait()
    out["batch_isend_irecv"] = got

    objects = [None] * w
    dist.all_gather_object(objects, {"rank": rank, "payload": list(range(rank * 300))}, group=group)
    out["all_gather_object"] = objects
    box = [{"from": rank, "big": "x" * 5000}]
    dist.broadcast_object_list(box, src=w - 1, group=group)
    out["broadcast_object_list"] = box
    gathered_objects = [None] * w if rank == 0 else None
    dist.gather_object(("r", rank), gathered_objects, dst=0, group=group)
    out["gather_object"] = gathered_objects
    dist.barrier(group=group)
    return out


def _compare(rank: int, world: int) -> dict:
    import torch.distributed as dist

    _init_torch(rank, world)
    bagua_group = _bagua_group()
    assert dist.get_backend(bagua_group) == "bagua"
    assert bagua_group.connections == STREAMS
    results = {}
    for async_op in (False, True):
        theirs = _every_torch_call(None, rank, world, async_op)
        ours = _every_torch_call(bagua_group, rank, world, async_op)
        results[async_op] = (theirs, ours)
    dist.destroy_process_group()
    return results


def _assert_same(theirs, ours, exact: bool, where: str) -> None:
    if isinstance(theirs, torch.Tensor):
        if exact:
            assert torch.equal(theirs, ours), where
        else:
            # Inputs are below 5 in magnitude: a sum of three is off by at most a few of its ulps.
            tolerance = 16 * torch.finfo(theirs.dtype).eps if theirs.is_floating_point() else 0
            torch.testing.assert_close(ours, theirs, rtol=0, atol=tolerance, msg=where)
    elif isinstance(theirs, (list, tuple)):
        assert len(theirs) == len(ours), where
        for i, (a, b) in enumerate(zip(theirs, ours)):
            _assert_same(a, b, exact, f"{where}[{i}]")
    else:
        assert theirs == ours, where


@pytest.mark.parametrize("world", [2, 3])
def test_every_torch_call_matches_gloo(world):
    results = run_ranks(_compare, world, world, init=False, local_world_size=1, timeout=150)
    for rank, by_mode in enumerate(results):
        for async_op, (theirs, ours) in by_mode.items():
            assert set(theirs) == set(ours)
            for name in theirs:
                _assert_same(theirs[name], ours[name], exact=world == 2 or "reduce" not in name,
                             where=f"rank {rank} {name} async_op={async_op}")


def _striped_ddp(rank: int, backend: str) -> list:
    """Plain torch DDP (bucket_cap_mb small, so several buckets) trained a few steps, ``backend`` the
    default group's."""
    import torch.distributed as dist

    import bagua

    options = bagua.comm.StripeOptions(streams=STREAMS, min_chunk_bytes=MIN_CHUNK) if backend == "bagua" else None
    dist.init_process_group(backend, rank=rank, world_size=2, pg_options=options)  # the default group
    group = dist.distributed_c10d._get_default_group()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.01)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(rank)
    for _ in range(4):
        x, y = torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    weights = [p.detach().clone() for p in model.parameters()]
    if backend == "bagua":  # every bucket's allreduce went in pieces
        assert group.striped_calls >= 4 * 2, group.striped_calls
    del ddp
    dist.destroy_process_group()
    return weights


def _trained_alike(train) -> list:
    """``train(rank, backend)`` on 2 ranks with Gloo and with the striped backend: each rank's tensors
    bit-equal between the two; returns the striped run's."""
    gloo = run_ranks(train, 2, "gloo", init=False, local_world_size=1)
    striped = run_ranks(train, 2, "bagua", init=False, local_world_size=1)
    for ours, theirs in zip(striped, gloo):
        for a, b in zip(ours, theirs):
            assert torch.equal(a, b)
    return striped


def test_torch_ddp_on_the_striped_backend_trains_as_on_gloo():
    striped = _trained_alike(_striped_ddp)
    assert all(torch.equal(a, b) for a, b in zip(striped[0], striped[1]))  # the replicas agree


def _fsdp_shards(rank: int, backend: str) -> list:
    """FSDP2 (``fully_shard``) on the CPU: its all-gathers and reduce-scatters on ``backend``."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    _init_torch(rank, 2)
    group = _bagua_group() if backend == "bagua" else dist.new_group(backend="gloo")
    mesh = torch.distributed.device_mesh.DeviceMesh.from_group(group, "cpu")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        x, y = torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    shards = [p.to_local().detach().clone() for p in model.parameters()]
    if backend == "bagua":  # its all-gathers and reduce-scatters went in pieces
        assert group.striped_calls >= 3 * 2, group.striped_calls
    dist.destroy_process_group()
    return shards


def test_fsdp_on_the_striped_backend_trains_as_on_gloo():
    _trained_alike(_fsdp_shards)


def _connections(rank: int, options: dict, local_env: str) -> tuple[int, list[str]]:
    import logging

    import torch.distributed as dist

    warnings = []

    class Collect(logging.Handler):
        def emit(self, record):
            warnings.append(record.getMessage())

    logging.getLogger("bagua.comm.striped_backend").addHandler(Collect(logging.WARNING))

    if local_env:
        os.environ["LOCAL_WORLD_SIZE"] = local_env
    else:
        os.environ.pop("LOCAL_WORLD_SIZE", None)
    _init_torch(rank, 2)
    group = dist.new_group(backend="bagua", pg_options=__import__("bagua").comm.StripeOptions(**options))
    dist.new_group(backend="bagua", pg_options=__import__("bagua").comm.StripeOptions(**options))  # no second warning
    count = group.connections
    dist.destroy_process_group()
    return count, warnings


@pytest.mark.parametrize("options, local_env, expected", [
    ({"streams": 3}, "1", 3),        # two machines: 3 sets of connections
    ({"streams": 3}, "2", 1),        # one machine: nothing leaves the host, one set
    ({"streams": 3}, "", 1),         # no LOCAL_WORLD_SIZE: taken as one machine
    ({"streams": 3, "local_world_size": 1}, "", 3),
    ({}, "1", 4),                    # the default
])
def test_connection_sets_follow_the_machines(options, local_env, expected):
    results = run_ranks(_connections, 2, options, local_env, init=False, local_world_size=1)
    assert [count for count, _ in results] == [expected, expected]
    for _, warnings in results:  # without LOCAL_WORLD_SIZE: one warning saying what to set
        unknown = not local_env and "local_world_size" not in options
        assert len(warnings) == (1 if unknown else 0), warnings
        assert not unknown or "LOCAL_WORLD_SIZE" in warnings[0]


def _bad_options(rank: int) -> str:
    import torch.distributed as dist

    _init_torch(rank, 1)
    try:
        dist.new_group(backend="bagua", pg_options={"streams": 4})
    except TypeError as error:
        return str(error)
    finally:
        dist.destroy_process_group()
    return "no error"


def test_bad_pg_options_name_what_the_backend_takes():
    [message] = run_ranks(_bad_options, 1, init=False)
    assert "StripeOptions" in message and "dict" in message


def _guide_snippet(rank: int, index: int) -> dict:
    """The ``index``-th python block of docs/striped_connections.md, run as written (``model`` and
    ``ranks`` given), then a step of whatever it built."""
    from pathlib import Path

    import torch.distributed as dist

    guide = (Path(__file__).resolve().parents[2] / "docs" / "striped_connections.md").read_text()
    code = guide.split("```python\n")[index + 1].split("```", 1)[0]
    os.environ["LOCAL_WORLD_SIZE"] = "1"  # two machines of one rank each
    os.environ["BAGUA_NET_MIN_CHUNKSIZE"] = str(MIN_CHUNK)
    torch.manual_seed(0)
    ns = {"torch": torch, "model": torch.nn.Linear(64, 64), "ranks": [0, 1]}
    exec(compile(code, "docs/striped_connections.md", "exec"), ns)
    default = dist.distributed_c10d._get_default_group()
    out = {"backend": dist.get_backend(), "connections": default.connections}
    if "group" in ns:
        t = torch.full((4096,), float(rank))
        dist.all_reduce(t, group=ns["group"])
        out["group_sum"] = t[0].item()
    if isinstance(ns["model"], torch.nn.parallel.DistributedDataParallel):
        ns["model"](torch.randn(8, 64)).sum().backward()
        out["weight"] = ns["model"].module.weight.grad.clone()
        del ns
    import bagua

    out["striped_calls"] = bagua.comm.striped_calls()
    dist.destroy_process_group()
    return out


def test_the_guide_snippets_run_as_written():
    first = run_ranks(_guide_snippet, 2, 0, init=False, local_world_size=1)
    assert [r["backend"] for r in first] == ["bagua", "bagua"] and first[0]["connections"] == 4  # the default K
    assert torch.equal(first[0]["weight"], first[1]["weight"]) and first[0]["striped_calls"] > 0
    second = run_ranks(_guide_snippet, 2, 1, init=False, local_world_size=1)
    assert second[0]["connections"] == 8 and [r["group_sum"] for r in second] == [1.0, 1.0]


def _cuda_on_the_backend(rank: int) -> dict:
    """One rank, one GPU: CUDA tensors on a "bagua" group go to its NCCL communicator."""
    import torch.distributed as dist

    import bagua

    torch.cuda.set_device(0)
    dist.init_process_group("bagua", rank=0, world_size=1, pg_options=bagua.comm.StripeOptions(streams=8))
    t = torch.arange(4096, dtype=torch.float32, device="cuda")
    dist.all_reduce(t)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 64).cuda(), device_ids=[0])
    model(torch.randn(8, 64, device="cuda")).sum().backward()
    torch.cuda.synchronize()
    out = {"sum_ok": bool(torch.equal(t.cpu(), torch.arange(4096, dtype=torch.float32))),
           "grad_finite": bool(model.module.weight.grad.isfinite().all()),
           "nccl_env": (os.environ.get("NCCL_SOCKET_NTHREADS"), os.environ.get("NCCL_NSOCKS_PERTHREAD"))}
    del model
    dist.destroy_process_group()
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_go_to_nccl_with_k_sockets():
    [out] = run_ranks(_cuda_on_the_backend, 1, init=False, timeout=120)
    assert out["sum_ok"] and out["grad_finite"]
    assert out["nccl_env"] == ("4", "2")  # 8 sockets per NCCL connection, unless the user set either
