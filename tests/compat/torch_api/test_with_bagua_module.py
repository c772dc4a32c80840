"""``model.with_bagua(...)`` keeps the module the user's code knows: it returns the module itself
(``state_dict()`` keys unchanged, so checkpoint code keeps working), gradients are averaged
when the module itself is called, a copy of the module is a plain module, and calling
``with_bagua`` again switches algorithm with the old wrapper's hooks gone."""

from __future__ import annotations

import copy

import torch

from tests.harness import run_ranks
from tests.parallel.models import flat_params, make_model, rank_batches, train


def _with_bagua(rank: int) -> dict:
    import bagua.torch_api as bagua
    from bagua.torch_api.algorithms import bytegrad, gradient_allreduce

    model = make_model(seed=rank)
    keys = list(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    wrapped = model.with_bagua([opt], gradient_allreduce.GradientAllReduceAlgorithm())
    out = {"same_module": wrapped is model, "same_keys": list(model.state_dict()) == keys}
    x, y = rank_batches(rank, 1)[0]
    torch.nn.functional.cross_entropy(model(x), y).backward()
    out["grads"] = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    steps, clone = model.bagua_ddp.step, copy.deepcopy(model)
    clone(x).sum().backward()  # a training forward of the copy: none of the wrapper's business
    try:
        clone.bagua_ddp
        out["copy_is_plain"] = False
    except AttributeError:
        out["copy_is_plain"] = model.bagua_ddp.step == steps
    first = model.bagua_ddp
    model.with_bagua([opt], bytegrad.ByteGradAlgorithm(hierarchical=False))  # switch
    out["switched"] = (first._closed, type(model.bagua_algorithm).__name__, len(first._hooks))
    train(model, opt, rank_batches(rank, 3))
    out["weights"] = flat_params(model)
    out["rank"] = bagua.get_rank()
    return out


def test_with_bagua_returns_the_module_averages_through_it_and_switches_algorithm():
    a, b = run_ranks(_with_bagua, 2)
    for r in (a, b):
        assert r["same_module"] and r["same_keys"] and r["copy_is_plain"]
        assert r["switched"] == (True, "ByteGradAlgorithm", 0)
    assert torch.equal(a["grads"], b["grads"])  # averaged, though each rank had its own batch
    assert torch.equal(a["weights"], b["weights"])
