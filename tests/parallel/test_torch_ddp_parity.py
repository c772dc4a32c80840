"""gradient_allreduce against torch DDP on the same everyday loops (2 ranks, same seeds): results
must be bit-equal (with two ranks a sum of two values is exact in either order).

Each job runs several loops on the same spawned ranks; the tests then check one item each.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import bagua
from tests.harness import run_ranks, run_ranks_expect_errors
from tests.parallel.models import flat_params, make_model, rank_batches

# Under xdist (`--dist loadgroup`) one worker runs the module: its module-scoped jobs run once, not once per worker.
pytestmark = pytest.mark.xdist_group("torch_ddp_parity")


def _wrap_torch(model, **kwargs):
    return torch.nn.parallel.DistributedDataParallel(model, **kwargs)


def _wrap_bagua(model, opt, **kwargs):
    return bagua.DistributedDataParallel(model, [opt], **kwargs)


def _train(ddp, opt, batches, sent=None):
    """The plain loop; with ``sent``, the bytes bagua sent in each step are appended to it."""
    for x, y in batches:
        before = bagua.comm.bytes_sent()
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
        if sent is not None:
            sent.append(bagua.comm.bytes_sent() - before)


def _grads(model):
    return [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


# --- accumulation, BatchNorm, unused parameters, reentrant checkpointing ---------------------------

class _BatchNormNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU())
        self.head = torch.nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.body(x))


class _Branches(torch.nn.Module):
    """``unused`` is never used; ``sometimes`` only when asked (on one rank only, in the tests)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body, self.head = torch.nn.Linear(12, 8), torch.nn.Linear(8, 3)
        self.sometimes, self.unused = torch.nn.Linear(8, 3), torch.nn.Linear(8, 3)

    def forward(self, x, use_sometimes=False):
        h = torch.relu(self.body(x))
        return self.head(h) + (self.sometimes(h) if use_sometimes else 0)


class _Checkpointed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first, self.middle, self.last = torch.nn.Linear(12, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 3)

    def forward(self, x):
        h = torch.tanh(self.first(x))
        h = checkpoint(lambda t: torch.tanh(self.middle(t)), h, use_reentrant=True)
        return self.last(h)


def _accumulate(rank, wrap, model, make_opt, batches, micro=2):
    opt = make_opt(model.parameters())
    ddp = wrap(model, opt)
    sent = []
    for x, y in batches:
        before = bagua.comm.bytes_sent()
        opt.zero_grad()
        chunks = list(zip(x.chunk(micro), y.chunk(micro)))
        with ddp.no_sync():
            for cx, cy in chunks[:-1]:
                F.cross_entropy(ddp(cx), cy).backward()
        F.cross_entropy(ddp(chunks[-1][0]), chunks[-1][1]).backward()
        opt.step()
        sent.append(bagua.comm.bytes_sent() - before)
    return flat_params(model), sent


def _loops_job(rank: int) -> dict:
    out = {}
    batches = rank_batches(rank, 3, batch=16)
    sgd = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)

    # accumulation: no_sync() on the first micro-batch, then a synced one
    out["acc_torch"], _ = _accumulate(rank, lambda m, o: _wrap_torch(m), make_model(), sgd, batches)
    out["acc_bagua"], out["acc_sent"] = _accumulate(rank, lambda m, o: _wrap_bagua(m, o), make_model(), sgd, batches)
    _, out["acc_sent_every_micro_batch"] = _accumulate(
        rank, lambda m, o: _wrap_bagua(m, o), make_model(), sgd, batches, micro=1)

    # BatchNorm: different data per rank; then evaluate on every rank
    (x_eval, _), = rank_batches(0, 1)
    for name, wrap in (("torch", lambda m, o: _wrap_torch(m)), ("bagua", lambda m, o: _wrap_bagua(m, o))):
        model = _BatchNormNet()
        opt = sgd(model.parameters())
        _train(wrap(model, opt), opt, batches)
        model.eval()
        with torch.no_grad():
            out[f"bn_{name}_eval"] = model(x_eval)
        out[f"bn_{name}_params"] = flat_params(model)
        out[f"bn_{name}_buffers"] = [b.clone() for b in model.buffers()]

    # unused parameters with AdamW (weight decay moves any parameter that has a gradient)
    for name, wrap in (("torch", lambda m, o: _wrap_torch(m, find_unused_parameters=True)),
                       ("bagua", lambda m, o: _wrap_bagua(m, o, find_unused_parameters=True))):
        model = _Branches()
        opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
        ddp = wrap(model, opt)
        grads = []
        for step, (x, y) in enumerate(batches):
            opt.zero_grad()
            F.cross_entropy(ddp(x, use_sometimes=(rank == 1 and step == 1)), y).backward()
            grads.append(_grads(model))
            opt.step()
        out[f"unused_{name}_params"], out[f"unused_{name}_grads"] = flat_params(model), grads

    # reentrant activation checkpointing, with and without find_unused_parameters (torch DDP needs
    # its static_graph=True there, or it fails with "marked as ready twice"; bagua needs nothing)
    for find_unused in (False, True):
        for name, wrap in (("torch", lambda m, o: _wrap_torch(m, find_unused_parameters=find_unused, static_graph=find_unused)),
                           ("bagua", lambda m, o: _wrap_bagua(m, o, find_unused_parameters=find_unused))):
            model = _Checkpointed()
            opt = sgd(model.parameters())
            sent = []
            _train(wrap(model, opt), opt, batches, sent)
            out[f"ckpt_{name}_{find_unused}"] = flat_params(model)
            out[f"ckpt_sent_{find_unused}"] = sent
    return out


@pytest.fixture(scope="module")
def loops():
    return run_ranks(_loops_job, 2, timeout=180)


def test_no_sync_accumulates_locally_halves_the_bytes_and_equals_torch_ddp(loops):
    for r in loops:
        assert torch.equal(r["acc_bagua"], r["acc_torch"])
        per_step_with_no_sync = r["acc_sent"]
        assert per_step_with_no_sync == [per_step_with_no_sync[0]] * 3 and per_step_with_no_sync[0] > 0
        # the same 3 steps without no_sync (micro=1 sends once a step too); with no_sync we send once
        # a step instead of once a micro-batch:
        assert per_step_with_no_sync == r["acc_sent_every_micro_batch"]
    assert torch.equal(loops[0]["acc_bagua"], loops[1]["acc_bagua"])


def test_batchnorm_buffers_are_rank0s_so_eval_outputs_are_equal_across_ranks(loops):
    a, b = loops
    assert torch.equal(a["bn_bagua_eval"], b["bn_bagua_eval"])
    assert all(torch.equal(x, y) for x, y in zip(a["bn_bagua_buffers"], b["bn_bagua_buffers"]))
    for r in loops:
        assert torch.equal(r["bn_bagua_params"], r["bn_torch_params"])  # same gradients as torch DDP
    # rank 0's buffers evolve as under torch DDP (torch broadcasts them at the next forward)
    assert all(torch.equal(x, y) for x, y in zip(a["bn_bagua_buffers"], a["bn_torch_buffers"]))


def test_parameters_no_rank_used_keep_grad_none_and_adamw_leaves_them_alone(loops):
    for r in loops:
        assert torch.equal(r["unused_bagua_params"], r["unused_torch_params"])
        for ours, theirs in zip(r["unused_bagua_grads"], r["unused_torch_grads"]):
            for g, h in zip(ours, theirs):
                assert (g is None) == (h is None)
                assert g is None or torch.equal(g, h)
    grads = loops[0]["unused_bagua_grads"]
    assert grads[0][-1] is None and grads[0][-3] is None   # `sometimes` unused by every rank at step 0
    assert grads[1][-3] is not None                        # used by rank 1 at step 1: averaged into rank 0 too


@pytest.mark.parametrize("find_unused", [False, True])
def test_reentrant_checkpointing_ends_the_step_once(loops, find_unused):
    for r in loops:
        assert torch.equal(r[f"ckpt_bagua_{find_unused}"], r[f"ckpt_torch_{find_unused}"])
        sent = r[f"ckpt_sent_{find_unused}"]
        assert len(set(sent)) == 1  # each bucket once per step (twice would double the bytes)


# --- torch DDP's arguments, a torch process group, join() and communication hooks -------------------

def _api_job(rank: int) -> dict:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    out = {}
    batches = rank_batches(rank, 3)
    torch_group = dist.new_group([0, 1])
    kwargs = dict(device_ids=None, output_device=None, dim=0, broadcast_buffers=False, bucket_cap_mb=0.001,
                  gradient_as_bucket_view=True, static_graph=False, find_unused_parameters=False,
                  process_group=torch_group, init_sync=True)
    for name, wrap in (("torch", lambda m, o: _wrap_torch(m, **kwargs)), ("bagua", lambda m, o: _wrap_bagua(m, o, **kwargs))):
        model = make_model(seed=rank)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ddp = wrap(model, opt)
        _train(ddp, opt, batches)
        out[f"kwargs_{name}"] = flat_params(model)
        if name == "bagua":
            out["buckets"] = len(ddp.buckets)

    # communication hook: torch's fp16 compression, on both
    for name in ("torch", "bagua"):
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ddp = _wrap_torch(model) if name == "torch" else _wrap_bagua(model, opt)
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        _train(ddp, opt, batches)
        out[f"hook_{name}"] = flat_params(model)

    # join(): rank 0 has 5 batches, rank 1 has 2
    uneven = rank_batches(rank, 5 if rank == 0 else 2)
    for name in ("torch", "bagua"):
        for divide in (True, False):
            model = make_model()
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            ddp = _wrap_torch(model) if name == "torch" else _wrap_bagua(model, opt)
            with ddp.join(divide_by_initial_world_size=divide):
                _train(ddp, opt, uneven)
            out[f"join_{name}_{divide}"] = flat_params(model)
            if name == "bagua":
                out[f"join_momentum_{divide}"] = torch.cat([opt.state[p]["momentum_buffer"].reshape(-1) for p in model.parameters()])
    return out


@pytest.fixture(scope="module")
def api():
    return run_ranks(_api_job, 2, timeout=180)


def test_torch_ddp_keyword_arguments_and_a_torch_group_mean_what_they_mean_in_torch(api):
    for r in api:
        assert torch.equal(r["kwargs_bagua"], r["kwargs_torch"])
        assert r["buckets"] == 2  # bucket_cap_mb=0.001 (1048 bytes): 1292 + 832 bytes of gradients


def test_register_comm_hook_runs_torchs_hooks_on_the_buckets(api):
    for r in api:
        assert torch.equal(r["hook_bagua"], r["hook_torch"])


@pytest.mark.parametrize("divide", [True, False])
def test_join_with_uneven_inputs_equals_torch_ddp_and_ends_identical(api, divide):
    a, b = api
    for r in api:
        assert torch.equal(r[f"join_bagua_{divide}"], r[f"join_torch_{divide}"])
    assert torch.equal(a[f"join_bagua_{divide}"], b[f"join_bagua_{divide}"])
    assert torch.equal(a[f"join_momentum_{divide}"], b[f"join_momentum_{divide}"])  # more than torch syncs


# --- wrap-time state: optimizer state broadcast, hyperparameters checked ----------------------------

def _optimizer_state_job(rank: int) -> dict:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if rank == 0:  # only rank 0 resumed a checkpoint that holds momentum
        (x, y), = rank_batches(5, 1)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    ddp = bagua.DistributedDataParallel(model, [opt])
    momentum = [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    _train(ddp, opt, rank_batches(rank, 2))
    return momentum, flat_params(model)


def test_optimizer_state_is_broadcast_at_wrap_time():
    (m0, w0), (m1, w1) = run_ranks(_optimizer_state_job, 2)
    assert all(torch.equal(a, b) for a, b in zip(m0, m1))
    assert torch.equal(w0, w1)


def _different_lr(rank: int):
    model = make_model()
    bagua.DistributedDataParallel(model, [torch.optim.SGD(model.parameters(), lr=0.1 * (rank + 1))])


def test_different_hyperparameters_across_ranks_are_a_clear_error():
    for tb in run_ranks_expect_errors(_different_lr, 2).values():
        assert "optimizers[0] (SGD) has different param groups across ranks" in tb and "'lr'" in tb


# --- small sharp edges ---------------------------------------------------------------------------

class _Transposed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.weight = torch.nn.Parameter(torch.randn(3, 12).t())  # non-contiguous, as torch allows
        self.bias = torch.nn.Parameter(torch.zeros(3))

    def forward(self, x):
        return x @ self.weight + self.bias


def _sharp_edges(rank: int) -> dict:
    out = {}
    for name in ("torch", "bagua"):
        model = _Transposed()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ddp = _wrap_torch(model) if name == "torch" else _wrap_bagua(model, opt)
        _train(ddp, opt, rank_batches(rank, 2))
        out[name] = flat_params(model)

    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    first = bagua.DistributedDataParallel(model, [opt])
    try:
        bagua.DistributedDataParallel(model, [opt], algorithm="bytegrad")
    except ValueError as error:
        out["rewrap"] = str(error)
    first.close()
    second = bagua.DistributedDataParallel(model, [opt], algorithm="bytegrad")  # an explicit switch
    (x, y), = rank_batches(rank, 1)
    before = bagua.comm.bytes_sent()
    F.cross_entropy(second(x), y).backward()
    out["switched_bytes"] = bagua.comm.bytes_sent() - before
    return out


def test_non_contiguous_parameters_and_switching_algorithms():
    for r in run_ranks(_sharp_edges, 2):
        assert torch.equal(r["bagua"], r["torch"])
        assert "already wrapped by a bagua.DistributedDataParallel" in r["rewrap"] and "close()" in r["rewrap"]
        n = sum(p.numel() for p in make_model().parameters())
        assert 0 < r["switched_bytes"] < 2 * n  # bytegrad alone: ~1 byte per value, not fp32 twice


def _bad_wrap(rank: int, case: str):
    model = make_model()
    if case == "frozen":
        for p in model.parameters():
            p.requires_grad_(False)
        bagua.DistributedDataParallel(model)
    elif case == "foreign_optimizer":
        bagua.DistributedDataParallel(model, [torch.optim.SGD(make_model().parameters(), lr=0.1)])
    elif case == "device_ids_on_cpu":
        bagua.DistributedDataParallel(model, device_ids=[0])
    elif case == "mixed_precision":
        bagua.DistributedDataParallel(model, mixed_precision=object())
    elif case == "unknown":
        bagua.DistributedDataParallel(model, bucket_cap=3)
    elif case == "wrapped_twice":
        bagua.DistributedDataParallel(bagua.DistributedDataParallel(model))
    elif case == "positional_device_ids":
        bagua.DistributedDataParallel(model, [rank])
    elif case == "needs_optimizers":
        bagua.DistributedDataParallel(model, algorithm="low_precision_decentralized")


@pytest.mark.parametrize("case, message", [
    ("frozen", "not needed when a module doesn't have any parameter that requires a gradient"),
    ("foreign_optimizer", "optimizers[0] (SGD) holds none of the module's trainable parameters"),
    ("device_ids_on_cpu", "device_ids must be None for CPU modules"),
    ("mixed_precision", "does not support mixed_precision"),
    ("unknown", "unexpected keyword argument 'bucket_cap'"),
    ("wrapped_twice", "already a bagua.parallel.ddp.DistributedDataParallel"),
    ("positional_device_ids", "device_ids? pass it by keyword"),
    ("needs_optimizers", "works through the optimizer's step(): pass it"),
])
def test_wrapping_mistakes_are_clear_errors(case, message):
    for tb in run_ranks_expect_errors(_bad_wrap, 2, case).values():
        assert message in tb, tb
