"""Readiness per bucket (``bagua.parallel.backward``): a synced backward counts each bucket's
gradients down and runs no per-parameter Python, and every loop the per-parameter path served
still equals torch DDP (2 ranks: a sum of two values is exact in either order, so bit-equal)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import bagua
from bagua.parallel import backward
from tests.harness import run_ranks
from tests.parallel.models import flat_params, make_model, rank_batches

pytestmark = pytest.mark.xdist_group("backward_readiness")
KINDS = ("plain", "zero_grad_keeps", "assigned", "input_penalty", "opaque_output", "create_graph")


class _Holder:
    """An output torch's pytree does not know: the wrapper finds no tensor in it to hook."""

    def __init__(self, logits):
        self.logits = logits


class _Opaque(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = make_model()

    def forward(self, x):
        return _Holder(self.net(x))


class _SharedAcrossCheckpoint(torch.nn.Module):
    """``shared`` runs inside a reentrant checkpoint and outside it: autograd accumulates its
    gradient twice in one backward (in the checkpoint's inner backward, then in the outer one)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first, self.shared, self.head = torch.nn.Linear(12, 12), torch.nn.Linear(12, 12), torch.nn.Linear(12, 3)

    def forward(self, x):
        h = checkpoint(lambda t: torch.tanh(self.shared(t)), self.first(x), use_reentrant=True)
        return self.head(self.shared(h))


def _loop(rank: int, wrap, kind: str, per_parameter_calls: list) -> torch.Tensor:
    """One training loop of ``kind`` through ``wrap(model, opt)``; the weights after it."""
    model = _Opaque() if kind == "opaque_output" else make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ddp = wrap(model, opt)
    for step, (x, y) in enumerate(rank_batches(rank, 4, batch=8)):
        # every other step keeps the gradients (zeroed in place); create_graph=True wants them None
        opt.zero_grad(set_to_none=kind == "create_graph" or (kind != "zero_grad_keeps" and step % 2 == 0))
        if kind == "assigned":  # some gradients assigned before backward, others None: a mixed bucket
            first = next(model.parameters())
            first.grad = torch.full_like(first, 0.01 * (rank + 1))
        if kind == "opaque_output":
            loss = F.cross_entropy(ddp(x).logits, y)
        elif kind == "input_penalty":  # an R1-style penalty: autograd.grad through the outputs first
            x.requires_grad_(True)
            out = ddp(x)
            (gx,) = torch.autograd.grad(out.sum(), [x], create_graph=True)
            loss = F.cross_entropy(out, y) + 0.1 * gx.pow(2).sum()
        else:
            loss = F.cross_entropy(ddp(x), y)
        if kind == "create_graph":  # a gradient penalty: backward with create_graph=True
            (g,) = torch.autograd.grad(loss, [next(model.parameters())], create_graph=True)
            loss = loss + 0.1 * g.pow(2).sum()
            loss.backward(create_graph=True)
        else:
            loss.backward()
        if ddp is model:  # by hand (torch DDP refuses create_graph=True): the average of the ranks' gradients
            for q in model.parameters():
                q.grad = q.grad.detach()
                torch.distributed.all_reduce(q.grad)
                q.grad /= torch.distributed.get_world_size()
        opt.step()
    if isinstance(ddp, bagua.DistributedDataParallel):
        ddp.close()
    return flat_params(model)


def _job(rank: int) -> dict:
    calls: list = []
    real = backward.BackwardTracker._per_parameter

    def counted(self, name, param):
        calls.append(name)
        return real(self, name, param)

    backward.BackwardTracker._per_parameter = counted
    out = {}
    torch_wrap = lambda m, o: torch.nn.parallel.DistributedDataParallel(m)  # noqa: E731
    for kind in KINDS:
        for algorithm in ("gradient_allreduce", "bytegrad"):
            calls.clear()
            out[f"{kind}_{algorithm}"] = _loop(
                rank, lambda m, o: bagua.DistributedDataParallel(m, [o], algorithm, bucket_size_bytes=600), kind, calls)
            out[f"{kind}_{algorithm}_calls"] = len(calls)
        out[f"{kind}_torch"] = _loop(rank, (lambda m, o: m) if kind == "create_graph" else torch_wrap, kind, calls)

    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out["reasons"] = {}
    for name, kwargs, optimizer in (
        ("gradient_allreduce", {}, opt),
        ("find_unused", {"find_unused_parameters": True}, opt),
        ("qadam", {}, bagua.optim.QAdamOptimizer(model.parameters(), lr=1e-3, warmup_steps=2)),
        ("decentralized", {}, opt),
    ):
        ddp = bagua.DistributedDataParallel(model, [optimizer], name if name in ("qadam", "decentralized")
                                            else "gradient_allreduce", **kwargs)
        out["reasons"][name] = ddp.for_algorithms.per_parameter_reason
        ddp.close()

    model = _SharedAcrossCheckpoint()
    ddp = bagua.DistributedDataParallel(model, [torch.optim.SGD(model.parameters(), lr=0.1)])
    x, y = rank_batches(rank, 1)[0]
    try:
        F.cross_entropy(ddp(x), y).backward()
        out["twice"] = "no error"
    except RuntimeError as error:
        out["twice"] = str(error)
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(_job, 2, timeout=180)


@pytest.mark.parametrize("kind", KINDS)
def test_every_loop_equals_torch_ddp(ranks, kind):
    for out in ranks:
        for algorithm in ("gradient_allreduce",):
            assert torch.equal(out[f"{kind}_{algorithm}"], out[f"{kind}_torch"]), (kind, algorithm)
        # bytegrad rounds to 8 bits: close to DDP, and identical across ranks
        assert torch.allclose(out[f"{kind}_bytegrad"], out[f"{kind}_torch"], atol=2e-2), kind
    assert torch.equal(ranks[0][f"{kind}_bytegrad"], ranks[1][f"{kind}_bytegrad"])


def test_a_synced_backward_runs_no_per_parameter_python_unless_a_feature_needs_it(ranks):
    for out in ranks:
        for algorithm in ("gradient_allreduce", "bytegrad"):
            # gradients None, kept (set_to_none=False) or assigned: one count per bucket
            for kind in ("plain", "zero_grad_keeps", "assigned", "input_penalty"):
                assert out[f"{kind}_{algorithm}_calls"] == 0, (kind, algorithm)
            # backward reached the parameters before the outputs (nothing to hook on them), and
            # create_graph=True (autograd replaces gradients instead of adding in place): per parameter
            assert out[f"opaque_output_{algorithm}_calls"] > 0
            assert out[f"create_graph_{algorithm}_calls"] > 0
        reasons = out["reasons"]
        assert reasons["gradient_allreduce"] is None and reasons["decentralized"] is None
        assert "find_unused_parameters" in reasons["find_unused"]
        assert "on_tensor_ready" in reasons["qadam"]


def test_a_gradient_accumulated_twice_in_one_backward_is_a_clear_error(ranks):
    for out in ranks:
        assert "accumulated its gradient twice in one backward" in out["twice"]
        assert "use_reentrant=False" in out["twice"]
