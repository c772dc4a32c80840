"""gradient_allreduce and bytegrad against torch DistributedDataParallel, on real ranks."""

from __future__ import annotations

import pytest
import torch

import bagua
from tests.harness import run_ranks
from tests.parallel.models import flat_params, make_model, make_optimizer, rank_batches, train

STEPS = 10


def _against_torch_ddp(rank: int, optimizer_kind: str, hierarchical: bool, zero_grad_to_none: bool):
    batches = rank_batches(rank, STEPS)
    reference = make_model(seed=rank)  # torch DDP broadcasts rank 0's weights at wrap time
    ddp_ref = torch.nn.parallel.DistributedDataParallel(reference)
    train(ddp_ref, make_optimizer(optimizer_kind, ddp_ref.parameters()), batches)

    model = make_model(seed=rank)
    opt = make_optimizer(optimizer_kind, model.parameters())
    algo = bagua.algorithms.GradientAllReduceAlgorithm(hierarchical=hierarchical)
    ddp = bagua.DistributedDataParallel(model, optimizers=[opt], algorithm=algo)
    train(ddp, opt, batches, zero_grad_to_none)
    assert ddp.module is model
    return flat_params(reference), flat_params(model)


@pytest.mark.parametrize(
    "world, local, optimizer_kind, hierarchical, zero_grad_to_none",
    [
        (2, None, "sgd", False, True),
        (2, None, "adam", False, False),
        (3, None, "adam", False, True),
        (3, None, "sgd", False, False),
        (4, 2, "sgd", True, True),    # two simulated nodes of two ranks
        (4, 2, "adam", True, False),
    ],
)
def test_matches_torch_ddp(world, local, optimizer_kind, hierarchical, zero_grad_to_none):
    results = run_ranks(_against_torch_ddp, world, optimizer_kind, hierarchical, zero_grad_to_none,
                        local_world_size=local, timeout=120)
    for reference, ours in results:
        torch.testing.assert_close(ours, reference, rtol=0, atol=1e-6)
    assert all(torch.equal(results[0][1], ours) for _, ours in results)


def _bytegrad_step(rank: int, hierarchical: bool):
    """One backward: bytegrad's gradients vs the exact average, and identity across ranks."""
    x, y = rank_batches(rank, 1, batch=32)[0]
    exact_model = make_model()
    torch.nn.functional.cross_entropy(exact_model(x), y).backward()
    exact = torch.cat([p.grad.reshape(-1) for p in exact_model.parameters()])
    bagua.comm.allreduce(exact, op="avg")

    model = make_model()
    ddp = bagua.DistributedDataParallel(model, algorithm=bagua.algorithms.ByteGradAlgorithm(hierarchical=hierarchical),
                                        bucket_size_bytes=1024)
    before = bagua.comm.bytes_sent()
    torch.nn.functional.cross_entropy(ddp(x), y).backward()
    sent = bagua.comm.bytes_sent() - before
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    return exact, grads, sent, len(ddp.buckets)


@pytest.mark.parametrize("world, local, hierarchical", [(2, None, False), (3, None, False), (4, 2, True)])
def test_bytegrad_within_codec_error_and_identical(world, local, hierarchical):
    results = run_ranks(_bytegrad_step, world, hierarchical, local_world_size=local)
    exact, grads0, _, n_buckets = results[0]
    assert n_buckets > 1
    # two quantizations (scatter-reduce, then gather) of chunks no wider than the global range
    step = (exact.max() - exact.min()) / 255
    assert (grads0 - exact).abs().max() <= 2 * step + 1e-6
    assert not torch.equal(grads0, exact)  # it really was compressed
    for _, grads, _, _ in results[1:]:
        assert torch.equal(grads, grads0)


def _bytes_per_step(rank: int, algorithm: str) -> int:
    model = make_model()
    opt = make_optimizer("sgd", model.parameters())
    ddp = bagua.DistributedDataParallel(model, [opt], algorithm=algorithm)
    train(ddp, opt, rank_batches(rank, 2))
    ddp(torch.zeros(1, 12))  # the next forward closes the step's byte count
    return ddp.bytes_sent_last_step


def test_bytegrad_sends_about_four_times_less():
    exact = run_ranks(_bytes_per_step, 2, "gradient_allreduce")
    compressed = run_ranks(_bytes_per_step, 2, "bytegrad")
    numel = sum(p.numel() for p in make_model().parameters())
    assert exact == [4 * numel] * 2  # 2 (w-1)/w * 4 bytes * numel
    assert 3.5 <= exact[0] / compressed[0] <= 4.0, (exact, compressed)
