"""Every collective on 1-4 real ranks (Gloo on CPU), each dtype, sync and async.

Inputs are small integers, exact in fp16 and bf16, so every expected value is exact.
"""

import pytest
import torch

from tests.harness import run_ranks

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _x(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank ``rank``'s input: small integers, different on each rank."""
    return ((torch.arange(numel) % 5) + rank + 1).to(dtype)


def _done(result, async_op):
    return result.wait() if async_op else result


def _all_collectives(rank: int, async_op: bool) -> int:
    import bagua
    from bagua.comm import ReduceOp

    comm = bagua.comm
    w = bagua.get_world_size()
    assert bagua.get_rank() == rank
    checked = 0
    for dtype in DTYPES:
        for numel in (1, 7, 10):  # 7: not divisible by 2, 3 or 4
            inputs = [_x(r, numel, dtype) for r in range(w)]
            stack = torch.stack([t.float() for t in inputs])
            # PRODUCT over small integers overflows fp16/bf16 exactness: rank 0 gives 2, others 1.
            factors = torch.stack([torch.full((numel,), 2.0 if r == 0 else 1.0) for r in range(w)])
            expected = {
                ReduceOp.SUM: stack.sum(0), ReduceOp.AVG: stack.mean(0), ReduceOp.MIN: stack.amin(0),
                ReduceOp.MAX: stack.amax(0), ReduceOp.PRODUCT: factors.prod(0),
            }
            for op, want in expected.items():
                t = (factors[rank] if op is ReduceOp.PRODUCT else inputs[rank]).to(dtype).clone()
                handle = comm.allreduce(t, op=op, async_op=async_op)
                if async_op:
                    handle.wait()
                torch.testing.assert_close(t.float(), want.to(dtype).float(), msg=f"allreduce {op} {dtype} {numel}")
                assert t.dtype == dtype
                checked += 1

            # allgather: inputs concatenated in rank order along dim 0
            out = _done(comm.allgather(inputs[rank].view(-1, 1), async_op=async_op), async_op)
            assert torch.equal(out, torch.cat(inputs).view(-1, 1))

            # alltoall: part j of rank r's input goes to rank j
            send = torch.stack([inputs[rank] + 10 * j for j in range(w)])  # [w, numel]
            out = _done(comm.alltoall(send, async_op=async_op), async_op)
            assert torch.equal(out, torch.stack([inputs[r] + 10 * rank for r in range(w)]))

            # alltoall_v: rank r sends split(r, j) rows to rank j
            def split(r, j):
                return (r + 2 * j) % 3

            ins = [split(rank, j) for j in range(w)]
            outs = [split(r, rank) for r in range(w)]
            send = torch.cat([torch.full((split(rank, j), 2), float(100 * rank + j)) for j in range(w)]).to(dtype)
            out = _done(comm.alltoall_v(send, ins, outs, async_op=async_op), async_op)
            want = torch.cat([torch.full((split(r, rank), 2), float(100 * r + rank)) for r in range(w)]).to(dtype)
            assert torch.equal(out, want)

            # reduce_scatter over rows that need not divide evenly
            rows = torch.stack([_x(rank, numel, dtype)] * 1).repeat(2 * w + 1, 1)  # [2w+1, numel]
            total = sum(torch.stack([_x(r, numel, torch.float32)]).repeat(2 * w + 1, 1) for r in range(w))
            for op, want in ((ReduceOp.SUM, total), (ReduceOp.AVG, total / w)):
                out = _done(comm.reduce_scatter(rows, op=op, async_op=async_op), async_op)
                torch.testing.assert_close(out.float(), want.tensor_split(w)[rank].to(dtype).float())

            # broadcast from the last rank
            t = inputs[rank].clone()
            _done(comm.broadcast(t, src=w - 1, async_op=async_op), async_op)
            assert torch.equal(t, inputs[w - 1])

            # reduce into the last rank; others keep their input
            t = inputs[rank].clone()
            _done(comm.reduce(t, dst=w - 1, op=ReduceOp.SUM, async_op=async_op), async_op)
            assert torch.equal(t, stack.sum(0).to(dtype) if rank == w - 1 else inputs[rank])

            # gather to rank 0
            out = _done(comm.gather(inputs[rank], dst=0, async_op=async_op), async_op)
            assert torch.equal(out, torch.cat(inputs)) if rank == 0 else out is None

            # scatter from rank 0
            full = torch.cat([inputs[0] * (j + 1) for j in range(w)])
            mine = _done(comm.scatter(full if rank == 0 else torch.zeros_like(full), src=0, async_op=async_op), async_op)
            assert torch.equal(mine, inputs[0] * (rank + 1))

            # send / recv around a ring (async: post the send first; sync: even ranks send first)
            if w > 1:
                dst, src = (rank + 1) % w, (rank - 1) % w
                got = torch.empty(numel, dtype=dtype)
                if async_op:
                    h = comm.send(inputs[rank], dst, async_op=True)
                    comm.recv(got, src, async_op=True).wait()
                    h.wait()
                elif rank % 2 == 0:
                    comm.send(inputs[rank], dst)
                    comm.recv(got, src)
                else:
                    comm.recv(got, src)
                    comm.send(inputs[rank], dst)
                if not (w % 2 == 1 and not async_op):  # odd ring + sync: covered by the async run
                    assert torch.equal(got, inputs[src])
            checked += 1
    _done(comm.barrier(async_op=async_op), async_op)
    return checked


@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_every_collective(world_size, async_op):
    counts = run_ranks(_all_collectives, world_size, async_op, timeout=240)
    assert counts == [counts[0]] * world_size and counts[0] == len(DTYPES) * 3 * 6


def _handles(rank: int) -> list:
    import bagua

    t = torch.full((1000,), float(rank))
    h = bagua.comm.allreduce(t, op="avg", async_op=True)
    result = h.wait()
    again = h.wait()  # waiting twice is harmless
    out = bagua.comm.allgather(torch.tensor([rank]), async_op=True).wait()
    return [result, again, bool(h.is_completed()), t[0].item(), out.tolist()]


def test_handle_wait_returns_result_and_is_idempotent():
    results = run_ranks(_handles, 2)
    for rank, (result, again, done, value, gathered) in enumerate(results):
        assert result is None and again is None and done
        assert value == 0.5
        assert gathered == [0, 1]


def _large_uneven(rank: int) -> float:
    import bagua

    n = 1_000_003  # prime: splits unevenly across any world size
    t = torch.arange(n, dtype=torch.float32) * (rank + 1)
    bagua.comm.allreduce(t, op="sum")
    expected = torch.arange(n, dtype=torch.float32) * sum(r + 1 for r in range(bagua.get_world_size()))
    return (t - expected).abs().max().item()


def test_large_tensor_with_numel_not_divisible_by_world_size():
    assert run_ranks(_large_uneven, 3) == [0.0, 0.0, 0.0]
