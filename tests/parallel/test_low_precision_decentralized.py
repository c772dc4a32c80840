"""low_precision_decentralized: the original Bagua's DCD-PSGD update on real ranks, replicas that
follow loaded weights, and resuming from a checkpoint.

The simulation replays the reference of the original Bagua's test
(tests/torch_api/test_low_precision_decentralized.py, ``LowPrecDecentralizedAlgor``): after the
optimizer step, z = x + ⅓·x̂_left + ⅓·x̂_right − ⁵⁄₃·x̂_self is 8-bit encoded and every replica
adds its sender's decoded z. MinMaxUInt8 is deterministic and the simulation does the same
float operations in the same order, so it matches the ranks far inside the reference's 1e-5.
"""

from __future__ import annotations

import pytest
import torch

import bagua
from bagua.comm.compression import MinMaxUInt8
from tests.harness import run_ranks
from tests.parallel.models import flat_params, gradients_at, make_model, rank_batches

STEPS = 6
LR = 0.1
_SHAPES = [p.numel() for p in make_model().parameters()]


def _to_bucket(flat: torch.Tensor) -> torch.Tensor:
    """Model order -> the bucket's order (the algorithm buckets the last parameter first)."""
    return torch.cat(list(reversed(torch.split(flat, _SHAPES))))


def _from_bucket(flat: torch.Tensor) -> torch.Tensor:
    return torch.cat(list(reversed(torch.split(flat, list(reversed(_SHAPES))))))


def _replicas(ddp) -> dict:
    """This rank's replicas of its one bucket, in model order: its own, and its neighbours' by ring rank."""
    (bucket,) = ddp.buckets
    own, left, right = ddp.impl.replicas(bucket)
    rank, size = ddp.impl.ring.rank, ddp.impl.ring.size
    peers = {(rank - 1) % size: _from_bucket(left), (rank + 1) % size: _from_bucket(right)}
    return {"own": _from_bucket(own), "peers": peers}


def _train(ddp, opt, batches, out: list) -> None:
    for x, y in batches:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        out.append(flat_params(ddp.module))


def _trajectory(rank: int, interval: int, hierarchical: bool = False) -> dict:
    model = make_model(seed=rank)  # wrapping broadcasts rank 0's weights
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    algo = bagua.algorithms.LowPrecisionDecentralizedAlgorithm(hierarchical=hierarchical, communication_interval=interval)
    ddp = bagua.DistributedDataParallel(model, [opt], algorithm=algo)
    weights = [flat_params(model)]
    _train(ddp, opt, rank_batches(rank, STEPS), weights)
    return {"weights": weights, "replicas": _replicas(ddp) if ddp.impl.neighbours else None}


def _simulate(world: int, interval: int, local: int = 1) -> list[list[torch.Tensor]]:
    """The reference update on ``world`` simulated ranks, ``local`` per node (``local > 1``: the
    hierarchical mode; the node average runs first and the node leaders form the ring)."""
    codec = MinMaxUInt8()
    nodes = world // local
    x0 = _to_bucket(flat_params(make_model(seed=0)))
    x = [x0.clone() for _ in range(world)]
    sides = [[(n - 1) % nodes, (n + 1) % nodes] for n in range(nodes)]  # left, right
    own = [x0.clone() for _ in range(nodes)]
    peers = [{j: x0.clone() for j in set(sides[n])} for n in range(nodes)]
    history = [[_from_bucket(w) for w in x]]
    for t in range(STEPS):
        g = [_to_bucket(gr) for gr in gradients_at([_from_bucket(w) for w in x], t)]
        x = [w.add(gr, alpha=-LR) for w, gr in zip(x, g)]  # the optimizer step
        if t % interval == 0:
            node_x = x if local == 1 else [sum(x[n * local:(n + 1) * local]) / local for n in range(nodes)]
            diffs = []
            for n in range(nodes):
                z = node_x[n] + 1 / 3 * peers[n][sides[n][0]]  # the reference's roundings
                z += 1 / 3 * peers[n][sides[n][1]]
                z -= 5 / 3 * own[n]
                diffs.append(codec.decode(codec.encode(z)))
            for n in range(nodes):
                own[n] += diffs[n]
                for j in peers[n]:
                    peers[n][j] += diffs[j]
            x = [own[r // local].clone() for r in range(world)]
        history.append([_from_bucket(w) for w in x])
    return history


def _check_replicas_exact(runs: list[dict], ring: list[int], interval: int = 1) -> None:
    """Every ring member's replica of a neighbour is that neighbour's own, bit for bit; its own
    replica is its weights after the last communication step."""
    last = max(t for t in range(len(runs[0]["weights"]) - 1) if t % interval == 0) + 1
    for rank in ring:
        mine = runs[rank]["replicas"]
        torch.testing.assert_close(mine["own"], runs[rank]["weights"][last], rtol=0, atol=0)
        for j, replica in mine["peers"].items():
            torch.testing.assert_close(replica, runs[ring[j]]["replicas"]["own"], rtol=0, atol=0)


@pytest.mark.parametrize("world, interval", [(2, 1), (4, 1), (4, 2)])
def test_matches_the_original_reference_simulation(world, interval):
    runs = run_ranks(_trajectory, world, interval, timeout=120)
    expected = _simulate(world, interval)
    for step in range(STEPS + 1):
        for rank in range(world):
            torch.testing.assert_close(runs[rank]["weights"][step], expected[step][rank], rtol=0, atol=1e-5)
    assert not torch.equal(runs[0]["weights"][-1], runs[1]["weights"][-1])  # decentralized
    _check_replicas_exact(runs, list(range(world)), interval)


def test_hierarchical_matches_the_simulation_and_keeps_each_node_identical():
    # two simulated nodes of two ranks: exact average within a node, the two leaders form the ring
    runs = run_ranks(_trajectory, 4, 1, True, local_world_size=2, timeout=120)
    expected = _simulate(4, 1, local=2)
    for step in range(STEPS + 1):
        for rank in range(4):
            torch.testing.assert_close(runs[rank]["weights"][step], expected[step][rank], rtol=0, atol=1e-5)
        torch.testing.assert_close(runs[0]["weights"][step], runs[1]["weights"][step], rtol=0, atol=0)
    assert not torch.equal(runs[0]["weights"][-1], runs[2]["weights"][-1])
    _check_replicas_exact(runs, [0, 2])


def _checkpoint_state() -> dict:
    return make_model(seed=42).state_dict()


def _load_before_or_after_wrapping(rank: int, when: str) -> dict:
    """Train STEPS steps from the checkpoint's weights, loaded before wrapping or (after two
    steps of training from other weights) after it."""
    batches = rank_batches(rank, 2 + STEPS)
    model = make_model(seed=rank)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    if when == "before":
        model.load_state_dict(_checkpoint_state())
    ddp = bagua.DistributedDataParallel(model, [opt], algorithm="low_precision_decentralized")
    if when == "after":
        _train(ddp, opt, batches[:2], [])  # replicas now hold these weights
        fresh = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9).state_dict()
        model.load_state_dict(_checkpoint_state())
        opt.load_state_dict(fresh)
        ddp.impl.on_weights_loaded(ddp)  # until the wrapper calls it after load_state_dict
    weights = [flat_params(model)]
    _train(ddp, opt, batches[2:], weights)
    return {"weights": weights, "replicas": _replicas(ddp)}


def test_loading_after_wrapping_equals_loading_before():
    before = run_ranks(_load_before_or_after_wrapping, 3, "before", timeout=120)
    after = run_ranks(_load_before_or_after_wrapping, 3, "after", timeout=120)
    for rank in range(3):
        for step in range(STEPS + 1):
            torch.testing.assert_close(after[rank]["weights"][step], before[rank]["weights"][step], rtol=0, atol=0)
    _check_replicas_exact(after, [0, 1, 2])


def _resumable_run(rank: int, directory: str, phase: str, save_at: int) -> list[torch.Tensor]:
    """``whole``: STEPS steps, saving after ``save_at`` of them; ``resume``: a fresh job that
    loads that checkpoint and runs the remaining steps. Returns the weights after each step."""
    batches = rank_batches(rank, STEPS)
    model = make_model(seed=rank)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    ddp = bagua.DistributedDataParallel(model, [opt], algorithm="low_precision_decentralized")
    path = f"{directory}/rank{rank}.pt"
    weights: list[torch.Tensor] = []
    if phase == "whole":
        _train(ddp, opt, batches[:save_at], weights)
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    else:
        checkpoint = torch.load(path)
        model.load_state_dict(checkpoint["model"])
        opt.load_state_dict(checkpoint["optimizer"])
        ddp.impl.on_weights_loaded(ddp)  # until the wrapper calls it after load_state_dict
    _train(ddp, opt, batches[save_at:], weights)
    return weights


def test_resuming_from_a_checkpoint_equals_an_uninterrupted_run(tmp_path):
    save_at = 3
    whole = run_ranks(_resumable_run, 3, str(tmp_path), "whole", save_at, timeout=120)
    resumed = run_ranks(_resumable_run, 3, str(tmp_path), "resume", save_at, timeout=120)
    for rank in range(3):
        assert len(resumed[rank]) == STEPS - save_at
        for got, want in zip(resumed[rank], whole[rank][save_at:]):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert not torch.equal(whole[0][-1], whole[1][-1])
