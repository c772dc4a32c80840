"""``ddp.rebucket`` between steps: training goes on exactly as if the buckets had never changed."""

from __future__ import annotations

import pytest
import torch

import bagua
from tests.harness import run_ranks
from tests.parallel.models import flat_params, make_model, rank_batches

STEPS = 9
SMALL = 200  # bytes: the test model's tensors in several buckets
SCHEDULE = {3: 1 << 20, 6: 64}  # before step 3: one bucket; before step 6: a bucket per tensor
QADAM_WARMUP = 4  # the rebucket before step 3 is in QAdam's (onebit_grad's) warm-up, the one before step 6 after it


def _optimizer(model, algorithm: str, fused: bool):
    if algorithm.startswith("qadam"):
        opt = bagua.optim.QAdamOptimizer(model.parameters(), lr=0.01, warmup_steps=QADAM_WARMUP)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
    return bagua.optim.fuse_optimizer(opt) if fused else opt


def _train(rank: int, algorithm: str, fused: bool, schedule: dict, accumulate: bool) -> dict:
    model = make_model(seed=rank)
    opt = _optimizer(model, algorithm, fused)
    algo = {"qadam": lambda: bagua.algorithms.QAdamAlgorithm(opt),  # warm-ups end between the two rebuckets
            "qadam_1bit": lambda: bagua.algorithms.QAdamAlgorithm(opt, bits=1),  # its residuals carried at step 6
            "onebit_grad": lambda: bagua.algorithms.OneBitGradAlgorithm(warmup_steps=QADAM_WARMUP)}.get(algorithm, lambda: algorithm)()
    ddp = bagua.DistributedDataParallel(model, [opt], algo, bucket_size_bytes=SMALL)
    buckets = []
    batches = rank_batches(rank, 2 * STEPS)
    for step in range(STEPS):
        (x0, y0), (x1, y1) = batches[2 * step], batches[2 * step + 1]
        opt.zero_grad()
        if accumulate:  # a micro-batch accumulated locally, then the buckets change under it
            with ddp.no_sync():
                torch.nn.functional.cross_entropy(ddp(x0), y0).backward()
        if step in schedule:
            ddp.rebucket(schedule[step])
        torch.nn.functional.cross_entropy(ddp(x1), y1).backward()
        opt.fuse_step() if fused else opt.step()
        buckets.append(len(ddp.buckets))
    state = [t.reshape(-1) for s in opt.state_dict()["state"].values() for t in s.values() if torch.is_tensor(t)]
    residuals = ddp.impl.state_dict().get("worker", {})  # error feedback (onebit_grad, qadam_1bit), by name
    return {"weights": flat_params(model), "state": torch.cat(state), "buckets": buckets, "residuals": residuals,
            "fused_grads_shared": fused and all(b.adopted for b in ddp.buckets if algorithm != "decentralized")}


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
@pytest.mark.parametrize("algorithm", ["gradient_allreduce", "bytegrad", "decentralized", "qadam", "qadam_1bit",
                                       "onebit_grad"])
def test_rebucketing_mid_training_changes_no_weight_and_no_optimizer_state(algorithm, fused):
    accumulate = algorithm == "gradient_allreduce"
    changed = run_ranks(_train, 2, algorithm, fused, SCHEDULE, accumulate)
    never = run_ranks(_train, 2, algorithm, fused, {}, accumulate)
    assert changed[0]["buckets"][2] > 1 and changed[0]["buckets"][3] == 1 and changed[0]["buckets"][6] > changed[0]["buckets"][2]
    for rank in range(2):
        assert torch.equal(changed[rank]["weights"], never[rank]["weights"]), f"rank {rank}: weights differ"
        assert torch.equal(changed[rank]["state"], never[rank]["state"]), f"rank {rank}: optimizer state differs"
        ours, theirs = changed[rank]["residuals"], never[rank]["residuals"]
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
        assert bool(ours) == (algorithm in ("onebit_grad", "qadam_1bit"))
    if algorithm != "decentralized":  # replicas of the decentralized ones legitimately differ
        assert torch.equal(changed[0]["weights"], changed[1]["weights"])
    if fused:
        assert changed[0]["fused_grads_shared"]  # the buckets still adopt the fused optimizer's buffer


def _lpd_replicas(rank: int) -> dict:
    model = make_model(seed=rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ddp = bagua.DistributedDataParallel(model, [opt], "low_precision_decentralized", bucket_size_bytes=SMALL)
    for x, y in rank_batches(rank, 3):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()

    def replicas() -> list[torch.Tensor]:
        per_bucket = [ddp.impl.replicas(b) for b in ddp.buckets]
        return [torch.cat([r[k] for r in per_bucket]) for k in range(3)]

    before, weights = replicas(), flat_params(model)
    ddp.rebucket(1 << 20)
    after = replicas()
    for x, y in rank_batches(rank, 2):  # and it trains on
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    return {"before": before, "after": after, "buckets": len(ddp.buckets), "weights": (weights, flat_params(model))}


def test_low_precision_decentralized_replicas_move_to_the_new_buckets_value_for_value():
    for out in run_ranks(_lpd_replicas, 2):
        assert out["buckets"] == 1
        for b, a in zip(out["before"], out["after"]):
            assert torch.equal(b, a)
        assert not torch.equal(*out["weights"])


def _misuse(rank: int, case: str):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ddp = bagua.DistributedDataParallel(model, [opt], "bytegrad" if case == "choice" else "gradient_allreduce")
    if case == "size":
        ddp.rebucket(0)
    elif case == "during_backward":
        x, y = rank_batches(rank, 1)[0]
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        model[0].weight.register_hook(lambda g: ddp.rebucket(1024))
        loss.backward()
    elif case == "unknown":
        ddp.configure(bucket_size_bytes=1 << 20, learning_rate=0.1)
    elif case == "choice":
        ddp.configure(segment_elems=12345)


@pytest.mark.parametrize("case,message", [
    ("size", "bucket_size_bytes must be a positive integer, got 0"),
    ("during_backward", "rebucket runs between steps"),
    ("unknown", "'learning_rate' is not tunable for GradientAllReduceAlgorithm"),
    ("choice", "segment_elems must be one of [65536,"),
])
def test_misuse_is_a_clear_error(case, message):
    from tests.harness import run_ranks_expect_errors

    errors = run_ranks_expect_errors(_misuse, 2, case, timeout=60)
    assert all(message in tb for tb in errors.values()), errors[0]


def test_the_first_bucket_closes_at_one_mib_so_the_link_starts_early_in_backward():
    """The tensors come in the order backward produces their gradients: the first bucket holds
    the last layers only (about 1 MiB, as torch DDP's first bucket), the others the size asked."""
    from bagua.algorithms.base import FIRST_BUCKET_BYTES, AlgorithmImpl

    def named(**numels):
        return [(name, torch.empty(n)) for name, n in numels.items()]

    impl = AlgorithmImpl(process_group=None)
    grads = named(head_bias=10, head=1000, top=300_000, mid=2_000_000, low=2_000_000, embed=5_000_000)
    groups = [[name for name, _ in g] for g in impl.bucket_tensors(grads, 25 << 20)]
    assert FIRST_BUCKET_BYTES == 1 << 20
    assert groups == [["head_bias", "head", "top"], ["mid", "low", "embed"]]
    # a bucket size below 1 MiB applies to the first bucket too
    groups = [[name for name, _ in g] for g in impl.bucket_tensors(grads, 4000)]
    assert groups == [["head_bias", "head"], ["top"], ["mid"], ["low"], ["embed"]]
