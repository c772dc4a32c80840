"""Two ways the wrapper meets code written for torch DDP or the original Bagua: calls of the
wrapped module itself (``attach_to_module``), and parameters/buffers left out of communication
(``_ddp_params_and_buffers_to_ignore``, ``_bagua_params_and_buffers_to_ignore``)."""

from __future__ import annotations

import pytest
import torch

import bagua
from tests.harness import run_ranks
from tests.parallel.models import flat_params, make_model, rank_batches, train


def _train(rank: int, attach: bool, algorithm: str):
    model = make_model(seed=rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ddp = bagua.DistributedDataParallel(model, [opt], algorithm=algorithm)
    if attach:
        ddp.attach_to_module()
    net = model if attach else ddp
    batches = rank_batches(rank, 6)
    train(net, opt, batches[:4])
    with ddp.no_sync():  # accumulate locally, then one synced step
        torch.nn.functional.cross_entropy(net(batches[4][0]), batches[4][1]).backward()
    torch.nn.functional.cross_entropy(net(batches[5][0]), batches[5][1]).backward()
    opt.step()
    sent = bagua.comm.bytes_sent()
    with torch.no_grad():
        net(batches[0][0])  # an evaluation forward: no step, no traffic
    assert bagua.comm.bytes_sent() == sent and ddp.step == 5
    ddp.close()
    model(batches[0][0]).sum().backward()  # detached: a plain module again
    return flat_params(model)


@pytest.mark.parametrize("algorithm", ["gradient_allreduce", "decentralized"])
def test_calling_the_attached_module_trains_as_calling_the_wrapper(algorithm):
    through_wrapper = run_ranks(_train, 2, False, algorithm)
    through_module = run_ranks(_train, 2, True, algorithm)
    for a, b in zip(through_wrapper, through_module):
        assert torch.equal(a, b)


class _WithLocalParts(torch.nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.shared = torch.nn.Linear(4, 4)
        self.local = torch.nn.Linear(4, 4)
        self.scale = torch.nn.Parameter(torch.ones(4) * (seed + 1))
        self.register_buffer("steps_here", torch.full((1,), float(seed)))

    def forward(self, x):
        return self.local(self.shared(x)) * self.scale


def _ignored(rank: int, attribute: str, names: list):
    model = _WithLocalParts(seed=rank)
    setattr(model, attribute, names)
    local_before = model.local.weight.detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ddp = bagua.DistributedDataParallel(model, [opt])
    assert torch.equal(model.local.weight, local_before)  # not broadcast at wrap time
    x = torch.full((2, 4), float(rank + 1))
    ddp(x).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    ddp.close()
    return grads, model.steps_here.item(), model.shared.weight.detach().clone()


@pytest.mark.parametrize("attribute, names", [
    ("_ddp_params_and_buffers_to_ignore", ["local.weight", "local.bias", "scale", "steps_here"]),
    ("_bagua_params_and_buffers_to_ignore", ["local.weight", "local.bias", ".scale", ".steps_here"]),  # original's form
])
def test_ignored_parameters_and_buffers_stay_local(attribute, names):
    (g0, buffer0, shared0), (g1, buffer1, shared1) = run_ranks(_ignored, 2, attribute, names)
    assert torch.equal(shared0, shared1)  # the rest is broadcast
    assert torch.equal(g0["shared.weight"], g1["shared.weight"])  # and averaged
    for name in ("local.weight", "local.bias", "scale"):
        assert not torch.equal(g0[name], g1[name]), name  # each rank's own gradient
    assert (buffer0, buffer1) == (0.0, 1.0)


def test_an_ignore_list_that_is_not_a_list_of_names_is_a_clear_error():
    model = make_model()
    model._ddp_params_and_buffers_to_ignore = "0.weight"
    with pytest.raises(TypeError, match="_ddp_params_and_buffers_to_ignore must be a list of parameter/buffer names"):
        bagua.parallel.wrapping.ignored_names(model)


def _async_abort_through_the_module(rank: int):
    model = make_model(seed=rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    algorithm = bagua.algorithms.AsyncModelAverageAlgorithm(sync_interval_ms=5)
    ddp = bagua.DistributedDataParallel(model, [opt], algorithm=algorithm)
    train(ddp, opt, rank_batches(rank, 5))
    algorithm.abort(model)  # the module, as the original Bagua's code passes it
    weights = flat_params(model)
    algorithm.resume(model)
    ddp.close()
    return weights


def test_async_abort_and_resume_accept_the_wrapped_module():
    a, b = run_ranks(_async_abort_through_the_module, 2)
    assert torch.equal(a, b)
