"""decentralized matches a single-process simulation of its update rule (low_precision_decentralized:
test_low_precision_decentralized.py)."""

from __future__ import annotations

import pytest
import torch

import bagua
from bagua.algorithms.decentralized import shift_one_peer
from tests.harness import run_ranks, run_ranks_expect_errors
from tests.parallel.models import flat_params, gradients_at, make_model, rank_batches

STEPS = 6
LR = 0.1


def _trajectory(rank: int, algorithm) -> dict:
    """The weights after each step, and the last peer average (``peer_weight``), in model order."""
    model = make_model(seed=rank)  # wrapping broadcasts rank 0's weights
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    ddp = bagua.DistributedDataParallel(model, [opt], algorithm=algorithm)
    out = [flat_params(model)]
    for x, y in rank_batches(rank, STEPS):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        out.append(flat_params(model))
    (bucket,) = ddp.buckets  # the last parameter first
    averaged = torch.split(ddp.impl.peer_weight(bucket), [p.numel() for p in reversed(list(model.parameters()))])
    return {"weights": out, "peer_weight": torch.cat(list(reversed(averaged))).clone()}


def _simulate_decentralized(world: int, mode: str, interval: int) -> tuple[list[list[torch.Tensor]], list[torch.Tensor]]:
    """Every rank's weights after each step, and the weights of the last peer average."""
    x = [flat_params(make_model(seed=0)) for _ in range(world)]
    history, comm_step = [[w.clone() for w in x]], 0
    for t in range(STEPS):
        g = gradients_at(x, t)
        if t % interval == 0:
            if mode == "all":
                mean = torch.stack(x).sum(0) / world
                x = [mean.clone() for _ in range(world)]
            else:
                x = [(x[r] + x[shift_one_peer(r, world, comm_step)]) * 0.5 for r in range(world)]
            averaged = [w.clone() for w in x]
            comm_step += 1
        x = [w.add(gr, alpha=-LR) for w, gr in zip(x, g)]
        history.append([w.clone() for w in x])
    return history, averaged


@pytest.mark.parametrize("world, mode, interval", [(2, "all", 1), (3, "all", 2), (2, "shift_one", 1), (4, "shift_one", 1)])
def test_decentralized_matches_simulation(world, mode, interval):
    algo = bagua.algorithms.DecentralizedAlgorithm(peer_selection_mode=mode, communication_interval=interval)
    runs = run_ranks(_trajectory, world, algo, timeout=120)
    expected, averaged = _simulate_decentralized(world, mode, interval)
    for step in range(STEPS + 1):
        for rank in range(world):
            torch.testing.assert_close(runs[rank]["weights"][step], expected[step][rank], rtol=0, atol=1e-6)
    for rank in range(world):
        torch.testing.assert_close(runs[rank]["peer_weight"], averaged[rank], rtol=0, atol=1e-6)
    # it is decentralized: the ranks do not hold identical weights
    assert not torch.equal(runs[0]["weights"][-1], runs[1]["weights"][-1])


def test_shift_one_pairs_every_rank_with_a_new_peer_each_step():
    for n in (2, 4, 6, 8):
        for t in range(n):
            peers = [shift_one_peer(r, n, t) for r in range(n)]
            assert all(peers[peers[r]] == r and peers[r] != r for r in range(n))
        met = {(r, shift_one_peer(r, n, t)) for r in range(n // 2) for t in range(n // 2)}
        assert met == {(r, s) for r in range(n // 2) for s in range(n // 2, n)}


def _hierarchical_trajectory(rank: int):
    return _trajectory(rank, bagua.algorithms.DecentralizedAlgorithm(hierarchical=True))


def test_hierarchical_decentralized_matches_simulation():
    # two simulated nodes of two ranks: exact within a node, then the two leaders average
    # ("all"), which is the global average: x_{t+1} = mean(x_t) - lr * g_i(x_t)
    runs = run_ranks(_hierarchical_trajectory, 4, local_world_size=2, timeout=120)
    expected, _ = _simulate_decentralized(4, "all", 1)
    for step in range(STEPS + 1):
        for rank in range(4):
            torch.testing.assert_close(runs[rank]["weights"][step], expected[step][rank], rtol=0, atol=1e-6)


def _shift_one_odd(rank: int):
    bagua.DistributedDataParallel(make_model(), algorithm=bagua.algorithms.DecentralizedAlgorithm(peer_selection_mode="shift_one"))


def test_shift_one_with_an_odd_world_size_is_a_clear_error():
    errors = run_ranks_expect_errors(_shift_one_odd, 3)
    assert all("needs an even number" in tb and "got 3" in tb for tb in errors.values())
