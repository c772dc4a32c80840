"""Bucket (flat buffer + views + op chain) and Engine (ordered launch, overlap, wait)."""

import threading

import pytest
import torch

import bagua
from bagua.comm import Bucket, Engine, EngineError
from tests.harness import run_ranks


def test_bucket_makes_tensors_views_of_one_flat_buffer():
    a, b = torch.randn(3, 4), torch.randn(5)
    values = [a.clone(), b.clone()]
    bucket = Bucket([a, b], name="b0")
    assert bucket.flat.numel() == 17 and bucket.nbytes == 68
    assert torch.equal(a, values[0]) and torch.equal(b, values[1])  # values kept
    bucket.flat.fill_(2.0)  # one write to the buffer is seen through every tensor
    assert (a == 2).all() and (b == 2).all()
    a.mul_(3)  # and writes through a tensor land in the buffer
    assert (bucket.flat[:12] == 6).all() and bucket.is_intact()
    a.data = torch.zeros(3, 4)  # somebody replaced the storage
    assert not bucket.is_intact()


def test_bucket_rejects_mixed_dtypes_devices_and_empty():
    with pytest.raises(ValueError, match="one dtype"):
        Bucket([torch.ones(2), torch.ones(2, dtype=torch.float16)])
    with pytest.raises(ValueError, match="at least one"):
        Bucket([])
    with pytest.raises(TypeError, match="callable"):
        Bucket([torch.ones(1)]).append_op("allreduce")


def test_bucket_runs_its_ops_in_order_and_names_a_failing_op():
    seen = []
    bucket = Bucket([torch.ones(2)], name="grads")
    bucket.append_op(lambda b: seen.append(("scale", b.name)), "scale")
    bucket.append_op(lambda b: b.flat.mul_(2), "double")
    bucket.append_op(lambda b: seen.append(("after", b.flat.tolist())), "after")
    assert bucket.ops == ["scale", "double", "after"]
    bucket.run_ops()
    assert seen == [("scale", "grads"), ("after", [2.0, 2.0])]

    def boom(b):
        raise ValueError("bad thing")

    bucket.clear_ops()
    bucket.append_op(boom, "boom")
    with pytest.raises(ValueError, match="bad thing") as info:
        bucket.run_ops()
    assert any("boom" in note and "grads" in note for note in getattr(info.value, "__notes__", ["boom grads"]))


def _recording_buckets(n: int, log: list, gate: threading.Event = None) -> list:
    buckets = []
    for i in range(n):
        bucket = Bucket([torch.ones(2), torch.ones(3)], name=f"b{i}")

        def op(b, i=i):
            if gate is not None:
                gate.wait(5)
            log.append(i)

        bucket.append_op(op, "record")
        buckets.append(bucket)
    return buckets


def test_engine_launches_in_bucket_order_whatever_the_readiness_order():
    log = []
    buckets = _recording_buckets(3, log)
    engine = Engine(buckets)
    engine.mark_ready(buckets[2].tensors[0])
    engine.mark_ready(buckets[2].tensors[1])  # bucket 2 complete, but bucket 0 is not
    assert engine.launched == 0
    engine.mark_ready(buckets[1].tensors[1])
    engine.mark_ready(buckets[1].tensors[0])
    assert engine.launched == 0
    engine.mark_ready(buckets[0].tensors[0])
    engine.mark_ready_at(0, 1)  # bucket 0 complete: 0, 1, 2 all go, in order
    assert engine.launched == 3
    engine.wait()
    assert log == [0, 1, 2]
    # the engine is ready for the next step
    for b in buckets:
        for t in b.tensors:
            engine.mark_ready(t)
    engine.wait()
    assert log == [0, 1, 2, 0, 1, 2]


def test_engine_overlaps_ops_with_the_rest_of_the_step():
    log, gate = [], threading.Event()
    buckets = _recording_buckets(2, log, gate)
    engine = Engine(buckets)
    for t in buckets[0].tensors:
        engine.mark_ready(t)
    assert engine.launched == 1  # launched as soon as complete, before wait()
    gate.set()  # the "rest of backward" runs while bucket 0's ops are in flight
    for t in buckets[1].tensors:
        engine.mark_ready(t)
    engine.wait()
    assert log == [0, 1]


def test_engine_errors_unready_twice_and_failing_ops():
    log = []
    buckets = _recording_buckets(2, log)
    engine = Engine(buckets)
    engine.mark_ready(buckets[0].tensors[0])
    with pytest.raises(EngineError, match="marked ready twice"):
        engine.mark_ready(buckets[0].tensors[0])
    with pytest.raises(EngineError, match=r"never became ready.*'b0' \(tensors \[1\]\).*'b1' \(tensors \[0, 1\]\)"):
        engine.wait()
    with pytest.raises(KeyError):
        engine.mark_ready(torch.ones(2))

    failing = Bucket([torch.ones(1)], name="bad")
    failing.append_op(lambda b: (_ for _ in ()).throw(RuntimeError("collective exploded")), "explode")
    engine = Engine([failing])
    engine.mark_ready(failing.tensors[0])
    with pytest.raises(RuntimeError, match="collective exploded"):
        engine.wait()
    with pytest.raises(ValueError, match="also in another bucket"):
        t = torch.ones(1)
        Engine([Bucket([t], rebind=False), Bucket([t], rebind=False)])


def _engine_allreduce(rank: int, compression):
    """Gradients of 3 buckets allreduced by the engine; ranks mark them ready in different orders."""
    torch.manual_seed(0)
    grads = [torch.full((n,), float(rank + 1) * (i + 1)) for i, n in enumerate([5, 7, 1000, 3, 11, 2])]
    buckets = [Bucket(grads[i:i + 2], name=f"g{i // 2}") for i in range(0, 6, 2)]
    for b in buckets:
        b.append_allreduce(op="avg", compression=compression)
    engine = Engine(buckets)
    order = list(range(6)) if rank == 0 else list(reversed(range(6)))
    for step in range(3):
        for i in order:
            engine.mark_ready(grads[i])
        engine.wait()
    return [g.clone() for g in grads]


@pytest.mark.parametrize("compression", [None, "minmax_uint8"])
def test_engine_allreduce_across_ranks(compression):
    w = 3
    results = run_ranks(_engine_allreduce, w, compression)
    for grads in results:
        for i, g in enumerate(grads):
            # three steps of averaging a value that is already the mean keep it at the mean
            torch.testing.assert_close(g, torch.full_like(g, 2.0 * (i + 1)), rtol=1e-5, atol=1e-2)
    for grads in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(grads, results[0]))


def _engine_layout_mismatch(rank: int):
    sizes = [4, 4] if rank == 0 else [4, 5]
    Engine([Bucket([torch.ones(n)], name=f"b{i}") for i, n in enumerate(sizes)])


def test_engine_refuses_bucket_layouts_that_differ_across_ranks():
    from tests.harness import run_ranks_expect_errors

    errors = run_ranks_expect_errors(_engine_layout_mismatch, 2)
    assert all("bucket layout differs" in tb and "rank 1: 2 buckets, 9 elements" in tb for tb in errors.values())


def _engine_ops_skip_agreement_check(rank: int) -> tuple[int, int]:
    from bagua.comm import checks

    calls = []
    original = checks.check_agreement
    checks.check_agreement = lambda *a, **k: (calls.append(a[0]), original(*a, **k))[1]
    grads = [torch.ones(10) * rank]
    engine = Engine([Bucket(grads).append_allreduce(op="sum")])
    engine.mark_ready(grads[0])
    engine.wait()
    assert torch.equal(grads[0], torch.ones(10))
    in_engine = len(calls)
    bagua.comm.allreduce(torch.ones(3))  # outside the engine the check still runs
    return in_engine, len(calls) - in_engine


def test_engine_ops_run_without_per_call_checks():
    assert run_ranks(_engine_ops_skip_agreement_check, 2) == [(0, 1), (0, 1)]


def test_bucket_adopts_tensors_that_already_tile_one_buffer():
    buffer = torch.arange(10.0)
    a, b = buffer[0:4].view(2, 2), buffer[4:10]
    bucket = Bucket([b, a])  # any order
    assert bucket.flat.data_ptr() == buffer.data_ptr() and bucket.flat.numel() == 10
    assert bucket.is_intact() and bucket.offsets == [4, 0]
    bucket.flat.mul_(2)
    assert torch.equal(a, torch.tensor([[0.0, 2.0], [4.0, 6.0]])) and torch.equal(buffer[4:], 2 * torch.arange(4.0, 10.0))


def test_bucket_copies_tensors_with_a_gap_between_them():
    buffer = torch.arange(10.0)
    a, b = buffer[0:4], buffer[5:10]
    bucket = Bucket([a, b])
    assert bucket.flat.numel() == 9 and bucket.flat.data_ptr() != buffer.data_ptr()
    assert torch.equal(bucket.flat, torch.cat([torch.arange(4.0), torch.arange(5.0, 10.0)]))
    assert a.data_ptr() == bucket.flat.data_ptr()  # rebound to its view


def test_engine_reads_at_each_step_whether_chains_only_enqueue():
    """A chain that only enqueues runs on the marking thread; ops appended anew between steps (a
    communication hook after wrapping, a rebucket) are honoured at the next step."""
    ran_on = []

    def enqueue_only(bucket):
        ran_on.append(threading.current_thread())

    def blocking(bucket):
        ran_on.append(threading.current_thread())

    bucket = Bucket([torch.zeros(3)], name="b")
    bucket.append_op(enqueue_only, launch_only=True)
    engine = Engine([bucket])
    engine.mark_ready_at(0, 0)
    engine.wait()
    assert engine.inline and ran_on[-1] is threading.current_thread()
    bucket.clear_ops()
    bucket.append_op(blocking)  # between steps, as register_comm_hook does
    engine.mark_ready_at(0, 0)
    engine.wait()
    assert not engine.inline and ran_on[-1] is not threading.current_thread()
