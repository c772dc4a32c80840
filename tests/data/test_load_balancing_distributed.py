"""The samplers on real ranks (Gloo on CPU): defaults from the process group, identical plans,
disjoint coverage, and a training-style loop with one allreduce per batch that must not hang."""

import pytest
import torch

from tests.harness import run_ranks

N = 1003  # not divisible by 2 or 3: padding is exercised


def _lengths():
    return (torch.distributions.LogNormal(3.0, 1.0).sample((N,)) + 1).round().tolist()


def _on_rank(rank: int, budget: float) -> dict:
    import hashlib

    import bagua
    from bagua.data import LoadBalancingDistributedBatchSampler, LoadBalancingDistributedSampler

    torch.manual_seed(0)
    lengths = _lengths()
    sampler = LoadBalancingDistributedSampler(range(N), complexities=lengths, seed=3)
    assert sampler.rank == bagua.get_rank() == rank
    assert sampler.num_replicas == bagua.get_world_size()
    batches = LoadBalancingDistributedBatchSampler(sampler, max_complexity=budget)
    out = {"samples": [], "batches": [], "plan_digest": []}
    for epoch in range(2):
        batches.set_epoch(epoch)
        mine = list(sampler)
        out["samples"].append(mine)
        out["plan_digest"].append(hashlib.sha256(sampler._plan().tobytes()).hexdigest())
        steps = 0
        for batch in batches:
            # A gradient-averaging step: every rank must reach it the same number of times.
            t = torch.tensor([float(sum(lengths[i] for i in batch))])
            bagua.comm.allreduce(t)
            steps += 1
        out["batches"].append(steps)
        # Cross-check through the group: every rank reports its counts.
        counts = bagua.comm.allgather(torch.tensor([len(mine), steps]))
        assert counts.view(-1, 2).unique(dim=0).shape[0] == 1, counts.tolist()
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_real_ranks_agree(world_size):
    results = run_ranks(_on_rank, world_size, 200.0, timeout=120)
    for epoch in range(2):
        digests = {r["plan_digest"][epoch] for r in results}
        assert len(digests) == 1, "ranks computed different plans"
        samples = [r["samples"][epoch] for r in results]
        assert len({len(s) for s in samples}) == 1
        covered = set().union(*map(set, samples))
        assert covered == set(range(N))
        assert sum(map(len, samples)) - N == (-N) % world_size  # only the padding repeats
        assert len({r["batches"][epoch] for r in results}) == 1
    assert results[0]["samples"][0] != results[0]["samples"][1]
