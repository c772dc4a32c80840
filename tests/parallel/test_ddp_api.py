"""The wrapper's contract: names, registry, wrap-time checks, unused parameters, dead peers."""

from __future__ import annotations

import pytest
import torch

import bagua
from bagua.algorithms import Algorithm
from tests.harness import run_ranks, run_ranks_expect_errors
from tests.parallel.models import flat_params, make_model, rank_batches

ALL_NAMES = ["async", "bytegrad", "decentralized", "gradient_allreduce", "low_precision_decentralized", "qadam"]


def test_registry_lists_the_six_algorithms_and_builds_by_name():
    assert set(ALL_NAMES) <= set(bagua.algorithms.registered_names())
    algo = Algorithm.init("decentralized", peer_selection_mode="shift_one", communication_interval=3)
    assert isinstance(algo, bagua.algorithms.DecentralizedAlgorithm)
    assert (algo.peer_selection_mode, algo.communication_interval) == ("shift_one", 3)


def test_unknown_name_lists_the_registered_ones():
    with pytest.raises(ValueError, match="unknown algorithm 'bytegrd'; registered: .*bytegrad.*gradient_allreduce"):
        Algorithm.init("bytegrd")


@pytest.mark.parametrize("make, message", [
    (lambda: bagua.algorithms.DecentralizedAlgorithm(peer_selection_mode="ring"), "peer_selection_mode must be one of"),
    (lambda: bagua.algorithms.DecentralizedAlgorithm(communication_interval=0), "communication_interval must be an integer >= 1, got 0"),
    (lambda: bagua.algorithms.AsyncModelAverageAlgorithm(sync_interval_ms=-1), "sync_interval_ms must be an integer >= 0"),
    (lambda: bagua.algorithms.QAdamAlgorithm(torch.optim.Adam(make_model().parameters())), "needs a bagua.optim.QAdamOptimizer"),
    (lambda: Algorithm.init("qadam"), "missing 1 required positional argument: 'q_adam_optimizer'"),
    (lambda: bagua.optim.QAdamOptimizer(make_model().parameters(), warmup_steps=0), "warmup_steps must be an integer >= 1"),
])
def test_bad_arguments_are_clear_errors(make, message):
    with pytest.raises((ValueError, TypeError), match=message):
        make()


def _by_name_with_options(rank: int):
    """Each case wraps, takes a step and closes; a mistake's message is returned instead."""
    def attempt(make_optimizer, algorithm, **options):
        model = make_model()
        opt = make_optimizer(model)
        try:
            ddp = bagua.DistributedDataParallel(model, [opt], algorithm, **options)
        except (TypeError, ValueError) as error:
            return str(error)
        x, y = rank_batches(rank, 1)[0]
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        built = ddp.algorithm
        ddp.close()
        return built

    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.1)  # noqa: E731
    qadam = lambda m: bagua.optim.QAdamOptimizer(m.parameters(), lr=1e-3, warmup_steps=2)  # noqa: E731
    return {
        "qadam": attempt(qadam, "qadam", hierarchical=True),
        "qadam_without_its_optimizer": attempt(sgd, "qadam"),
        "shift_one": attempt(sgd, "decentralized", peer_selection_mode="shift_one", communication_interval=2),
        "typo": attempt(sgd, "decentralized", peer_selection_mod="shift_one"),
        "instance_and_options": attempt(sgd, bagua.algorithms.ByteGradAlgorithm(), hierarchical=True),
    }


def test_algorithm_by_name_takes_its_options_and_qadam_its_optimizer():
    """``algorithm=name`` with the algorithm's options next to it, as ``BaguaStrategy`` takes them;
    qadam by name is built around the one QAdamOptimizer of ``optimizers``."""
    for result in run_ranks(_by_name_with_options, 2):
        assert isinstance(result["qadam"], bagua.algorithms.QAdamAlgorithm) and result["qadam"].hierarchical
        assert result["qadam_without_its_optimizer"] == (
            "bagua.DistributedDataParallel: algorithm 'qadam' by name is built around its optimizer and needs "
            "exactly one bagua.optim.qadam.QAdamOptimizer (optimizers=[opt]), got [SGD]")
        shift_one = result["shift_one"]
        assert (shift_one.peer_selection_mode, shift_one.communication_interval) == ("shift_one", 2)
        assert result["typo"] == (
            "bagua.DistributedDataParallel got an unexpected keyword argument 'peer_selection_mod': it is no option "
            "of algorithm 'decentralized' (bagua.algorithms.decentralized.DecentralizedAlgorithm accepts "
            "hierarchical, peer_selection_mode, communication_interval)")
        assert result["instance_and_options"] == (
            "bagua.DistributedDataParallel got an unexpected keyword argument 'hierarchical': algorithm is already "
            "an instance (ByteGradAlgorithm); an algorithm's options go to its constructor")


def test_a_new_algorithm_registers_and_rejects_a_taken_name():
    @Algorithm.register("test_only_noop")
    class Noop(Algorithm):
        def reify(self, process_group):
            return bagua.algorithms.AlgorithmImpl(process_group)

    assert isinstance(Algorithm.init("test_only_noop"), Noop)
    with pytest.raises(ValueError, match="already registered"):
        Algorithm.register("test_only_noop")(type("Other", (Algorithm,), {}))


def test_wrapping_before_init_is_a_clear_error():
    with pytest.raises(bagua.comm.NotInitializedError, match="call bagua.init_process_group"):
        bagua.DistributedDataParallel(make_model())


def _with_bagua(rank: int):
    model = make_model(seed=rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    wrapped = bagua.with_bagua(model, [opt], "bytegrad")
    assert isinstance(wrapped, bagua.DistributedDataParallel) and wrapped.module is model
    return flat_params(model)  # broadcast from rank 0 at wrap time


def test_with_bagua_wraps_and_broadcasts_rank0_weights():
    a, b = run_ranks(_with_bagua, 2)
    assert torch.equal(a, b) and torch.equal(a, flat_params(make_model(seed=0)))


def _different_models(rank: int):
    model = make_model() if rank == 0 else torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Linear(16, 3))
    bagua.DistributedDataParallel(model)


def test_models_that_differ_across_ranks_are_a_clear_error_on_every_rank():
    errors = run_ranks_expect_errors(_different_models, 2)
    for tb in errors.values():
        assert "the model differs across ranks" in tb and "rank 1: has" in tb and "1.weight" in tb


class _TwoHeads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body, self.head, self.unused_head = torch.nn.Linear(12, 8), torch.nn.Linear(8, 3), torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.head(torch.relu(self.body(x)))


def _unused(rank: int, find_unused: bool):
    model = _TwoHeads()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ddp = bagua.DistributedDataParallel(model, [opt], find_unused_parameters=find_unused, bucket_size_bytes=64)
    for x, y in rank_batches(rank, 3):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    return flat_params(model), model.unused_head.weight.detach().clone(), ddp.parameters_used_last_step


def test_unused_parameters_are_a_clear_error_without_find_unused_parameters():
    errors = run_ranks_expect_errors(_unused, 2, False)
    for tb in errors.values():
        assert "got no gradient in this step (unused_head.bias, unused_head.weight)" in tb
        assert "find_unused_parameters=True" in tb


def test_find_unused_parameters_trains_and_leaves_unused_ones_alone():
    (a, unused_a, used_a), (b, unused_b, used_b) = run_ranks(_unused, 2, True)
    assert torch.equal(a, b)
    assert torch.equal(unused_a, _TwoHeads().unused_head.weight.detach())
    assert used_a == used_b == {"body.weight", "body.bias", "head.weight", "head.bias"}


class _SkippableBranch(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body, self.branch = torch.nn.Linear(12, 3), torch.nn.Linear(12, 3)

    def forward(self, x, use_branch: bool):
        return self.body(x) + (self.branch(x) if use_branch else 0)


def _gradients_after_set_to_none(rank: int):
    model = _SkippableBranch()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ddp = bagua.DistributedDataParallel(model, [opt], find_unused_parameters=True)
    (x, y), = rank_batches(rank, 1)
    grads = []
    for use_branch, backward_passes in ((True, 1), (False, 1), (True, 2)):
        opt.zero_grad(set_to_none=True)
        for _ in range(backward_passes):  # two passes: gradients accumulate
            torch.nn.functional.cross_entropy(ddp(x, use_branch), y).backward()
        flat = ddp.buckets[0].flat
        in_bucket = all(
            flat.data_ptr() <= p.grad.data_ptr() < flat.data_ptr() + flat.nbytes for p in model.parameters()
            if p.grad is not None
        )
        grads.append((in_bucket, [None if p.grad is None else p.grad.clone() for p in model.parameters()]))
    return grads


def test_gradients_after_zero_grad_set_to_none_land_in_the_buckets_and_skipped_ones_stay_none():
    rank0, rank1 = run_ranks(_gradients_after_set_to_none, 2)
    for (_, a), (_, b) in zip(rank0, rank1):
        assert all((ga is None and gb is None) or torch.equal(ga, gb) for ga, gb in zip(a, b))
    (used_ok, used), (skipped_ok, skipped), (twice_ok, twice) = rank0
    assert used_ok and skipped_ok and twice_ok
    body_w, _, branch_w, branch_b = skipped
    assert branch_w is None and branch_b is None  # no rank used the branch: None, as torch DDP
    assert torch.count_nonzero(body_w) > 0
    for once, accumulated in zip(used, twice):  # no optimizer step: same weights, same batch
        torch.testing.assert_close(accumulated, 2 * once)


def _peer_dies(rank: int, algorithm: str):
    import time

    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ddp = bagua.DistributedDataParallel(model, [opt], algorithm=algorithm)
    if rank == 1:
        raise RuntimeError("rank 1 stops here on purpose")
    time.sleep(2.0)  # rank 1 has left: even posting the first message fails
    x, y = rank_batches(rank, 1)[0]
    torch.nn.functional.cross_entropy(ddp(x), y).backward()


@pytest.mark.parametrize("algorithm", ["gradient_allreduce", "bytegrad"])
def test_a_dead_peer_ends_in_an_error_naming_the_operation(algorithm):
    errors = run_ranks_expect_errors(_peer_dies, 2, algorithm, comm_timeout_s=5.0, timeout=60)
    assert "on purpose" in errors[1]
    assert "CollectiveError: bagua.comm.allreduce" in errors[0] and "bucket" in errors[0], errors[0]


def _for_launchers(rank: int, port: int):
    """What the Lightning strategy uses: explicit ranks and address, torch's ReduceOp, rank 0's
    weights on demand, backwards declared by the loop (several per training forward), and a
    close that does not wait for the peers."""
    import time

    # the launcher's numbers, not the environment's (the harness's MASTER_PORT is another port)
    bagua.init_process_group(rank=rank, world_size=2, local_rank=rank, local_world_size=2,
                             master_addr="127.0.0.1", master_port=port)
    t = torch.tensor([rank + 1.0])
    bagua.comm.allreduce(t, op=torch.distributed.ReduceOp.SUM)
    assert t.item() == 3.0

    model = make_model(seed=rank)
    bagua.parallel.broadcast_module(model)
    same_after_broadcast = flat_params(model)

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ddp = bagua.DistributedDataParallel(model, [opt])
    (x, y), = rank_batches(rank, 1)
    grads = []
    for half, forward in ((slice(0, 4), ddp), (slice(4, 8), model)):  # the second: no training forward of ddp's
        loss = torch.nn.functional.cross_entropy(forward(x[half]), y[half])
        opt.zero_grad()
        ddp.prepare_for_backward(loss)  # as Lightning's manual_backward does
        loss.backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]).clone())
        opt.step()

    async_model = make_model(seed=0)
    async_ddp = bagua.DistributedDataParallel(async_model, [torch.optim.SGD(async_model.parameters(), lr=0.1)],
                                              algorithm=bagua.algorithms.AsyncModelAverageAlgorithm(sync_interval_ms=1))
    async_ddp(x).sum().backward()
    started = time.monotonic()
    if rank == 1:  # rank 0 never closes: synchronize=False must not wait for it
        async_ddp.close(synchronize=False)
    closed_in = time.monotonic() - started
    bagua.comm.barrier()
    return same_after_broadcast, grads, closed_in, hasattr(async_model, "_bagua_wrapper")


def test_launcher_facing_api_explicit_init_broadcast_module_prepare_for_backward_close_without_peers():
    from bagua.comm.process_group import _free_port

    a, b = run_ranks(_for_launchers, 2, _free_port(), init=False)
    assert torch.equal(a[0], b[0]) and torch.equal(a[0], flat_params(make_model(seed=0)))
    for ga, gb in zip(a[1], b[1]):  # each backward averaged: the same gradient on both ranks
        assert torch.equal(ga, gb)
    assert not torch.equal(a[1][0], a[1][1])
    assert b[2] < 12.0 and not b[3]  # rank 1 closed alone, within the exit join's bound


def test_help_shows_our_init_and_a_torch_ddp_like_surface():
    """``help(bagua.DistributedDataParallel)``: the class's own section lists the user's API (torch
    DDP's methods, checkpoints, autotuning, traffic counters) with our docstrings; the services
    for algorithm writers live under ``ddp.for_algorithms`` (docs/writing_an_algorithm.md)."""
    import pydoc
    import re

    own = pydoc.render_doc(bagua.DistributedDataParallel, renderer=pydoc.plaintext).split("Methods inherited from")[0]
    listed = set(re.findall(r"^ \|  (\w+)(?:\(| =|$)", own, re.M))
    assert {"__init__", "forward", "no_sync", "join", "register_comm_hook", "algorithm_state_dict", "close",
            "bytes_sent_last_step", "bytes_sent_this_step", "autotune_result"} <= listed
    moved = {"mark_ready", "mark_all_ready", "communicate_all", "names_in", "gradient_slot", "parameter"}
    assert moved <= set(dir(bagua.parallel.for_algorithms.ForAlgorithms))
    assert not (moved | {"named_parameter", "synced_buffers"}) & listed
    assert "Initialize internal Module state" not in own and "Define the computation" not in own
    assert "Wrap ``module`` for data-parallel training" in own


class _RaisesInBackward(torch.autograd.Function):
    """Identity forward; its backward raises (as an out-of-memory error in backward would)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("backward failed on purpose")


class _FailsInBackward(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first, self.last = torch.nn.Linear(12, 12), torch.nn.Linear(12, 3)

    def forward(self, x):
        return self.last(_RaisesInBackward.apply(self.first(x)))


def _none_stays_none_when_backward_begins_in_the_buckets(rank: int):
    """Backward begins by making None gradients their bucket views (zeroed): whatever backward then
    does not reach must come out None again, on one rank and after errors."""
    model = _SkippableBranch()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ddp = bagua.DistributedDataParallel(model, [opt], find_unused_parameters=True, bucket_size_bytes=64)
    (x, y), = rank_batches(rank, 1)
    out = {}
    opt.zero_grad()
    torch.nn.functional.cross_entropy(ddp(x, False), y).backward()  # one rank: no allreduce of use
    out["skipped"] = [p.grad is None for p in model.parameters()]
    loss = torch.nn.functional.cross_entropy(ddp(x, True), y)
    opt.zero_grad()  # between forward and backward: the gradients still land in the buckets
    loss.backward()
    flats = [(b.flat.data_ptr(), b.flat.data_ptr() + b.flat.nbytes) for b in ddp.buckets]
    out["in_buckets"] = all(any(lo <= p.grad.data_ptr() < hi for lo, hi in flats) for p in model.parameters())
    failing = _FailsInBackward()
    ddp_failing = bagua.DistributedDataParallel(failing, find_unused_parameters=True)
    try:  # backward reaches the last layer, then raises before the first
        torch.nn.functional.cross_entropy(ddp_failing(x), y).backward()
    except RuntimeError as error:
        out["error"] = str(error)
    ddp_failing.reset()
    out["after_error"] = [p.grad is None for p in failing.parameters()]
    strict = bagua.DistributedDataParallel(_SkippableBranch(), find_unused_parameters=False)
    try:
        torch.nn.functional.cross_entropy(strict(x, False), y).backward()
    except RuntimeError as error:
        out["strict_error"] = str(error)
    out["strict"] = [p.grad is None for p in strict.module.parameters()]
    return out


def test_gradients_backward_does_not_reach_stay_none_on_one_rank_and_after_errors():
    out, = run_ranks(_none_stays_none_when_backward_begins_in_the_buckets, 1)
    assert out["skipped"] == [False, False, True, True]  # body used, branch not: None as before
    assert out["in_buckets"]
    assert "backward failed on purpose" in out["error"]
    assert out["after_error"][:2] == [True, True]  # first layer never reached: None, not zeros
    assert "got no gradient in this step" in out["strict_error"]
    assert out["strict"] == [False, False, True, True]
