"""Compressed allreduce (scatter-reduce-gather over encoded chunks) on real ranks."""

import pytest
import torch

from bagua.comm.compressed import SEGMENT_ELEMS
from tests.harness import run_ranks, run_ranks_expect_errors

BLOCK = 1024
SEGMENT = SEGMENT_ELEMS


def _input(rank: int, numel: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(numel, generator=g) * (rank + 1) + rank


def _compressed(rank: int, codec: str, op: str, numel: int, async_op: bool):
    import bagua

    w = bagua.get_world_size()
    t = _input(rank, numel).view(-1, 1) if numel % 2 else _input(rank, numel).view(2, -1)
    shape = t.shape
    bagua.comm.reset_traffic()
    h = bagua.comm.allreduce(t, op=op, compression=codec, async_op=async_op)
    if async_op:
        h.wait()
    sent = bagua.comm.bytes_sent("compressed_allreduce")
    exact = torch.stack([_input(r, numel) for r in range(w)])
    return t.reshape(-1), shape, sent, exact


def _step_bound(exact: torch.Tensor, op: str) -> torch.Tensor:
    """Per element: the worst error two MinMaxUInt8 round trips can make (half a step each).

    Codec blocks run every 1024 elements from the tensor's start, whoever reduces them; the
    first encode works on each rank's block, the second on the reduced block, which spans at
    most the sum (SUM) or mean (AVG) of the ranks' ranges.
    """
    n = exact.shape[1]
    bound = torch.empty(n)
    for b in range(0, n, BLOCK):
        block = exact[:, b:b + BLOCK]
        ranges = block.amax(1) - block.amin(1)
        first = ranges.sum() / 510 if op == "sum" else ranges.mean() / 510
        reduced = block.sum(0) if op == "sum" else block.mean(0)
        second = (reduced.amax() - reduced.amin()) / 510
        bound[b:b + BLOCK] = first + second
    return bound * 1.001 + 1e-5


@pytest.mark.parametrize("world_size", [2, 3])
def test_minmax_uint8_is_identical_on_all_ranks_and_within_codec_bound(world_size):
    numel = 10_007  # not divisible by the world size, several codec blocks per rank chunk
    for op in ("avg", "sum"):
        results = run_ranks(_compressed, world_size, "minmax_uint8", op, numel, False)
        first, shape, sent, exact = results[0]
        for result, shape_r, _, _ in results[1:]:
            assert torch.equal(result, first), "ranks must end with bit-identical results"
            assert shape_r == shape
        want = exact.sum(0) if op == "sum" else exact.mean(0)
        err = (first - want).abs()
        assert (err <= _step_bound(exact, op)).all(), f"max error {err.max()} beyond two half-steps"
        assert err.max() > 0  # it really was quantized
        # every byte on the wire is compressed: ~4x fewer than an fp32 ring allreduce (all ranks
        # together: chunks end on codec blocks, so one rank may reduce a block more than another)
        fp32_ring = 2 * (world_size - 1) * numel * 4
        assert 3.9 < fp32_ring / sum(r[2] for r in results) < 4.1


@pytest.mark.parametrize("world_size", [2, 3])
def test_pipelined_segments_are_identical_and_within_codec_bound(world_size):
    numel = 2 * SEGMENT + 12_345  # three segments, the last one short
    results = run_ranks(_compressed, world_size, "minmax_uint8", "avg", numel, True)
    first, _, _, exact = results[0]
    assert all(torch.equal(r[0], first) for r in results[1:])
    error = (first - exact.mean(0)).abs()
    assert (error <= _step_bound(exact, "avg")).all()


@pytest.mark.parametrize("codec,tol", [("fp16", 2e-3), ("bf16", 2e-2)])
def test_half_precision_codecs(codec, tol):
    for async_op in (False, True):
        results = run_ranks(_compressed, 3, codec, "avg", 1001, async_op)
        first = results[0][0]
        assert all(torch.equal(r[0], first) for r in results)
        want = results[0][3].mean(0)
        torch.testing.assert_close(first, want, rtol=tol, atol=tol)
        fp32_ring = 2 * 2 * 1001 * 4
        assert 1.9 < fp32_ring / sum(r[2] for r in results) < 2.1


def _minmax_ops(rank: int):
    import bagua

    out = {}
    for op in ("min", "max"):
        t = torch.full((5000,), float(rank + 1))  # constant: exactly representable after coding
        bagua.comm.allreduce(t, op=op, compression="minmax_uint8")
        out[op] = t
    return out


def test_min_max_through_the_codec():
    for out in run_ranks(_minmax_ops, 2):
        assert torch.equal(out["min"], torch.full((5000,), 1.0))
        assert torch.equal(out["max"], torch.full((5000,), 2.0))


def _nan_on_one_rank(rank: int):
    import bagua

    t = torch.randn(4096)
    if rank == 1:
        t[123] = float("nan")
    bagua.comm.allreduce(t, op="avg", compression="minmax_uint8")


def test_nan_on_one_rank_raises_on_every_rank_without_hanging():
    errors = run_ranks_expect_errors(_nan_on_one_rank, 3, timeout=60)
    assert set(errors) == {0, 1, 2}
    for tb in errors.values():
        assert "ValueError" in tb and "NaN or Inf" in tb


def _inf_on_one_rank_propagated(rank: int) -> torch.Tensor:
    import bagua

    t = _input(rank, 4096)
    if rank == 1:
        t[123] = float("inf")  # in the tensor's first codec block
    bagua.comm.compressed_allreduce(t, op="avg", codec="minmax_uint8", nonfinite="propagate")
    return t


def test_propagate_leaves_the_bad_block_non_finite_on_every_rank():
    results = run_ranks(_inf_on_one_rank_propagated, 3, timeout=60)
    for r in results:
        torch.testing.assert_close(r, results[0], rtol=0, atol=0, equal_nan=True)
    bad = ~torch.isfinite(results[0])
    assert bad[:BLOCK].all() and not bad[BLOCK:].any()


def _nan_on_a_non_leader(rank: int, nonfinite: str):
    from bagua.comm.hierarchical import hierarchical_allreduce

    t = _input(rank, 4096)
    if rank == 1:  # local rank 1 of node 0: its NaN reaches the ring through its leader
        t[7] = float("nan")
    hierarchical_allreduce(t, op="avg", compression="minmax_uint8", nonfinite=nonfinite)
    return t


def test_hierarchical_nan_on_a_non_leader_raises_on_every_rank_or_propagates():
    errors = run_ranks_expect_errors(_nan_on_a_non_leader, 4, "raise", local_world_size=2, timeout=60)
    assert set(errors) == {0, 1, 2, 3}
    assert all("hierarchical_allreduce[minmax_uint8]" in tb and "NaN or Inf" in tb for tb in errors.values())
    results = run_ranks(_nan_on_a_non_leader, 4, "propagate", local_world_size=2, timeout=60)
    for r in results:
        torch.testing.assert_close(r, results[0], rtol=0, atol=0, equal_nan=True)
    bad = ~torch.isfinite(results[0])
    assert bad[:BLOCK].all() and not bad[BLOCK:].any()


def _bad_compressed_input(rank: int):
    import bagua

    problems = {}
    for name, call in {
        "int": lambda: bagua.comm.allreduce(torch.ones(4, dtype=torch.int32), compression="minmax_uint8"),
        "codec": lambda: bagua.comm.allreduce(torch.ones(4), compression="int4"),
        "op": lambda: bagua.comm.allreduce(torch.ones(4), op="mean", compression="fp16"),
        "nonfinite": lambda: bagua.comm.compressed_allreduce(torch.ones(4), nonfinite="ignore"),
    }.items():
        try:
            call()
        except (TypeError, ValueError) as e:
            problems[name] = str(e)
    return problems


def test_bad_compressed_input_is_refused_clearly():
    problems = run_ranks(_bad_compressed_input, 2)[0]
    assert "floating-point" in problems["int"]
    assert "int4" in problems["codec"] and "minmax_uint8" in problems["codec"]
    assert "mean" in problems["op"] and "AVG" in problems["op"]
    assert "nonfinite must be 'raise' or 'propagate', got 'ignore'" in problems["nonfinite"]


def _codec_mismatch(rank: int):
    import bagua

    bagua.comm.allreduce(torch.ones(100), compression="fp16" if rank == 0 else "minmax_uint8")


def test_ranks_using_different_codecs_get_a_clear_error():
    errors = run_ranks_expect_errors(_codec_mismatch, 2)
    assert all("different compression codecs" in tb for tb in errors.values())


def _cut_differently(rank: int, streams: int) -> dict:
    """One tensor of three members, allreduced whole with several segment sizes, and each
    member allreduced alone."""
    import datetime
    import os

    import bagua
    from bagua.comm.compressed import compressed_allreduce

    os.environ["BAGUA_NET_MIN_CHUNKSIZE"] = "4096"
    bagua.init_process_group(streams=streams, timeout=datetime.timedelta(seconds=60))

    sizes = [3000, 5, 70_000]
    starts = [0, 3000, 3005]
    whole = _input(rank, sum(sizes))
    out = {}
    for segment in (SEGMENT, 4096, 1000, 1):
        t = whole.clone()
        compressed_allreduce(t, op="avg", starts=starts, segment_elems=segment)
        out[segment] = t
    out["alone"] = torch.cat([
        _alone(part.clone()) for part in whole.split(sizes)
    ])
    return out


def _alone(t: torch.Tensor) -> torch.Tensor:
    from bagua.comm.compressed import compressed_allreduce

    compressed_allreduce(t, op="avg")
    return t


@pytest.mark.parametrize("world_size,streams", [(2, 1), (3, 4)])
def test_a_member_result_depends_on_neither_its_neighbours_nor_the_segment_size_nor_stripes(world_size, streams):
    """The codec blocks run from each member's start: cutting the work differently (segment size,
    stripes, what else shares the call) leaves every member's result bit for bit the same."""
    results = run_ranks(_cut_differently, world_size, streams, init=False, local_world_size=1)
    first = results[0][SEGMENT]
    for out in results:
        for value in out.values():
            assert torch.equal(value, first)


def _bad_layout(rank: int, starts, segment):
    from bagua.comm.compressed import compressed_allreduce

    compressed_allreduce(torch.ones(100), starts=starts, segment_elems=segment)


@pytest.mark.parametrize("starts,segment,message", [
    ([0, 100], SEGMENT, "starts must be element offsets in [0, 100)"),
    ([-1], SEGMENT, "starts must be element offsets"),
    ((), 0, "segment_elems must be a positive integer, got 0"),
])
def test_bad_layout_is_refused_clearly(starts, segment, message):
    errors = run_ranks_expect_errors(_bad_layout, 1, starts, segment, timeout=60)
    assert message in errors[0]
