"""Host staging (``bagua/comm/host_staging.py``) without a GPU: ``through_host`` runs a collective
on a host copy of a CUDA tensor when the group moves CUDA tensors with Gloo. A CPU tensor that says
it is on CUDA takes that path on CPU; each collective's result, written back in place or returned,
sync and async, must equal the same collective's on a plain CPU tensor (2 real ranks, Gloo)."""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_ranks


class _SaysCuda(torch.Tensor):
    """A CPU tensor whose ``is_cuda`` is True, so ``through_host`` stages it; the torch functions
    applied to it go to ``calls`` (and return plain tensors). Its ``detach()`` is new memory, as a
    CUDA tensor's ``detach().to("cpu")`` is (on CPU ``to("cpu")`` would alias it)."""

    is_cuda = True
    calls: list[str] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.calls.append(func.__name__)
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*args, **(kwargs or {}))
        return result.clone() if func.__name__ == "detach" else result


def _collectives():
    """(name, whether it writes its tensor back, the call) for each kind of staged collective."""
    import bagua

    comm = bagua.comm
    return [
        ("allreduce", True, lambda t, a: comm.allreduce(t, op="avg", async_op=a)),
        ("compressed_allreduce", True, lambda t, a: comm.compressed_allreduce(t, codec="minmax_uint8", async_op=a)),
        ("broadcast", True, lambda t, a: comm.broadcast(t, src=1, async_op=a)),
        ("allgather", False, lambda t, a: comm.allgather(t, async_op=a)),
        ("reduce_scatter", False, lambda t, a: comm.reduce_scatter(t, op="sum", async_op=a)),
    ]


def _staged_and_unstaged(rank: int, async_op: bool) -> dict:
    import bagua

    assert bagua.comm.host_staging.moves_cuda_with_gloo(bagua.comm.get_default_group())
    x = torch.linspace(-1, 1, 1030) * (rank + 1) + rank  # 1030: not a whole number of codec chunks
    out = {}
    for name, write_back, call in _collectives():
        results = {}
        for staged in (True, False):
            tensor = x.clone().as_subclass(_SaysCuda) if staged else x.clone()
            _SaysCuda.calls = []
            returned = call(tensor, async_op)
            returned = returned.wait() if async_op else returned
            calls = list(_SaysCuda.calls)
            results[staged] = (tensor.as_subclass(torch.Tensor).clone(), returned, calls)
        out[name] = (write_back, results)
    return out


@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
def test_a_collective_through_host_memory_equals_it_unstaged(async_op):
    for rank, got in enumerate(run_ranks(_staged_and_unstaged, 2, async_op, timeout=90)):
        for name, (write_back, results) in got.items():
            (staged, staged_returned, calls), (plain, plain_returned, _) = results[True], results[False]
            assert torch.equal(staged, plain), (rank, name)  # written back in place, or left as it was
            assert (staged_returned is None) == (plain_returned is None), (rank, name)
            if plain_returned is not None:
                assert torch.equal(staged_returned, plain_returned), (rank, name)
            # the collective ran on a host copy (detach, then to("cpu")), never on the tensor itself,
            # which only the write-back touched again
            assert calls[0] == "detach" and ("copy_" in calls) == write_back, (rank, name, calls)
            assert set(calls) <= {"detach", "copy_", "__get__"}, (rank, name, calls)
