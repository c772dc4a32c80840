"""Bad input gets a clear error, never a hang or a wrong answer."""

import pytest
import torch

import bagua
from tests.harness import RankFailure, run_ranks, run_ranks_expect_errors


def test_collectives_before_init_raise_a_clear_error():
    assert not bagua.is_initialized()
    for call in (
        lambda: bagua.comm.allreduce(torch.ones(2)),
        lambda: bagua.comm.broadcast(torch.ones(2)),
        lambda: bagua.comm.barrier(),
        lambda: bagua.get_rank(),
        lambda: bagua.get_local_size(),
    ):
        with pytest.raises(bagua.comm.NotInitializedError, match="init_process_group"):
            call()


def test_unknown_op_and_codec_names_list_the_known_ones():
    with pytest.raises(ValueError, match="SUM.*AVG"):
        bagua.comm.collectives.as_reduce_op("mean")
    with pytest.raises(ValueError, match="minmax_uint8"):
        bagua.comm.get_codec("zstd")


@pytest.mark.parametrize(
    "env,match",
    [
        ({"WORLD_SIZE": "4", "RANK": "0", "LOCAL_WORLD_SIZE": "3", "LOCAL_RANK": "0"}, "multiple of LOCAL_WORLD_SIZE"),
        ({"WORLD_SIZE": "2", "RANK": "2", "LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "0"}, "RANK must be in"),
        ({"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}, "RANK is not set"),
        ({"WORLD_SIZE": "x"}, "WORLD_SIZE must be an integer"),
        ({"WORLD_SIZE": "4", "RANK": "1", "LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "0"}, "LOCAL_RANK=0 does not match"),
    ],
)
def test_bad_launch_environment(monkeypatch, env, match):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=match):
        bagua.init_process_group()
    assert not bagua.is_initialized()


def _local_errors(rank: int) -> dict:
    comm = bagua.comm
    cases = {
        "noncontiguous": lambda: comm.allreduce(torch.ones(4, 4).t()),
        "device": lambda: comm.allreduce(torch.ones(4, device="meta")),
        "sparse": lambda: comm.allreduce(torch.ones(4).to_sparse()),
        "type": lambda: comm.allreduce([1.0, 2.0]),
        "avg_int": lambda: comm.allreduce(torch.ones(4, dtype=torch.int64), op="avg"),
        "root": lambda: comm.broadcast(torch.ones(4), src=5),
        "alltoall": lambda: comm.alltoall(torch.ones(5)),
        "splits_len": lambda: comm.alltoall_v(torch.ones(3), [1, 2, 0], [1, 2]),
        "splits_sum": lambda: comm.alltoall_v(torch.ones(3), [1, 1], [1, 1]),
        "send_self": lambda: comm.send(torch.ones(2), dst=rank),
        "scatter": lambda: comm.scatter(torch.ones(3), src=0),
    }
    out = {}
    for name, call in cases.items():
        try:
            call()
            out[name] = "no error"
        except (TypeError, ValueError) as e:
            out[name] = f"{type(e).__name__}: {e}"
    return out


def test_local_bad_input_is_refused_on_every_rank_before_any_traffic():
    for errors in run_ranks(_local_errors, 2):
        assert "contiguous" in errors["noncontiguous"]
        assert "meta" in errors["device"] and "move it" in errors["device"]
        assert "sparse" in errors["sparse"]
        assert "torch.Tensor" in errors["type"]
        assert "AVG needs a floating-point" in errors["avg_int"]
        assert "src must be a global rank" in errors["root"]
        assert "divisible" in errors["alltoall"] and "alltoall_v" in errors["alltoall"]
        assert "2 non-negative ints" in errors["splits_len"]
        assert "sum to 2" in errors["splits_sum"]
        assert "cannot send to itself" in errors["send_self"]
        assert "divisible" in errors["scatter"]


MISMATCHES = {
    "shape": lambda r: bagua.comm.allreduce(torch.ones(10 + 5 * r)),
    "same_numel_other_shape": lambda r: bagua.comm.allreduce(torch.ones((2, 3) if r == 0 else (3, 2))),
    "dtype": lambda r: bagua.comm.allreduce(torch.ones(8, dtype=torch.float32 if r == 0 else torch.float16)),
    "op": lambda r: bagua.comm.allreduce(torch.ones(8), op="sum" if r == 0 else "max"),
    "root": lambda r: bagua.comm.broadcast(torch.ones(8), src=r),
    "kind": lambda r: bagua.comm.allreduce(torch.ones(8)) if r == 0 else bagua.comm.broadcast(torch.ones(8), src=0),
    "splits": lambda r: bagua.comm.alltoall_v(torch.ones(3), [1, 2], [1, 2]),
}


def _mismatch(rank: int, case: str):
    MISMATCHES[case](rank)


@pytest.mark.parametrize("case,match", [
    ("shape", "different shapes.*rank 0: float32\\[10\\].*rank 1: float32\\[15\\]"),
    ("same_numel_other_shape", "different shapes"),
    ("dtype", "different dtypes"),
    ("op", "different ops"),
    ("root", "different src/dst"),
    ("kind", "different collectives.*allreduce.*broadcast"),
    ("splits", "splits disagree"),
])
def test_ranks_that_disagree_get_the_same_clear_error(case, match):
    import re

    errors = run_ranks_expect_errors(_mismatch, 2, case, timeout=60)
    for tb in errors.values():
        assert "ValueError" in tb and re.search(match, tb), tb[-600:]


def _missing_peer(rank: int):
    import time

    if rank == 1:
        time.sleep(8)  # never joins in time
        return
    bagua.comm.allreduce(torch.ones(16))


def test_a_peer_that_never_joins_ends_in_a_timeout_error_naming_the_operation():
    try:
        run_ranks(_missing_peer, 2, comm_timeout_s=2, timeout=60)
    except RankFailure as failure:
        text = str(failure)
    else:
        raise AssertionError("rank 0 should have timed out")
    assert "rank 0 raised" in text and "CollectiveError" in text
    assert "bagua.comm.allreduce(float32[16]) failed on rank 0" in text


def _unchecked_is_fast_path(rank: int) -> int:
    before = bagua.comm.bytes_sent()
    t = torch.full((4,), float(rank))
    bagua.comm.allreduce(t)
    return int(t[0].item()), bagua.comm.bytes_sent() - before


def test_checks_can_be_turned_off():
    results = run_ranks(_unchecked_is_fast_path, 2, init_kwargs={"check_collectives": False})
    assert results == [(1, 16), (1, 16)]
