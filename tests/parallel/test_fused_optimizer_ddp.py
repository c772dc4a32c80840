"""bagua.optim.fuse_optimizer under bagua.DistributedDataParallel: one flat gradient buffer, shared."""

from __future__ import annotations

import warnings

import pytest
import torch

import bagua
from tests.harness import run_ranks
from tests.parallel.models import flat_params, make_model, rank_batches

STEPS = 8


def _fused_vs_torch_ddp(rank: int, algorithm: str):
    warnings.simplefilter("error", bagua.optim.FlattenWarning)  # no layout repairs expected
    batches = rank_batches(rank, STEPS)
    reference = make_model(seed=rank)
    ddp_ref = torch.nn.parallel.DistributedDataParallel(reference)
    ref_opt = torch.optim.Adam(ddp_ref.parameters(), lr=0.01)

    model = make_model(seed=rank)
    opt = bagua.optim.fuse_optimizer(torch.optim.Adam(model.parameters(), lr=0.01))  # fuse first...
    ddp = bagua.DistributedDataParallel(model, [opt], algorithm=algorithm)           # ...then wrap
    assert all(p.grad is None for p in model.parameters())  # no gradient before the first backward
    grad_storage = set()
    for x, y in batches:
        for m, o, step in ((ddp_ref, ref_opt, ref_opt.step), (ddp, opt, opt.fuse_step)):
            o.zero_grad()
            torch.nn.functional.cross_entropy(m(x), y).backward()
            step()
        grad_storage |= {p.grad.untyped_storage().data_ptr() for p in model.parameters()}
    shared = all(b.flat.untyped_storage().data_ptr() in grad_storage for b in ddp.buckets)
    return flat_params(reference), flat_params(model), shared, len(grad_storage)


@pytest.mark.parametrize("algorithm", ["gradient_allreduce", "bytegrad"])
def test_fused_optimizer_shares_its_flat_gradients_with_the_buckets(algorithm):
    results = run_ranks(_fused_vs_torch_ddp, 2, algorithm)
    for reference, ours, shared, storages in results:
        assert shared and storages == 1  # one gradient buffer, communicated in place
        if algorithm == "gradient_allreduce":
            torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-6)
    assert torch.equal(results[0][1], results[1][1])
