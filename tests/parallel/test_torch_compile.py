"""``torch.compile`` with the wrapper, both ways users write it: ``torch.compile(bagua_ddp)`` and
``bagua.DistributedDataParallel(torch.compile(model))`` (2 ranks, Gloo, same seeds).

The wrapper's hooks fire on the parameters' gradient accumulation, outside the compiled graph, so
compiling changes only what the compiler changes. Compiled either way, gradient_allreduce has the
bits of torch DDP wrapping the compiled model (inductor's fused kernels round differently from
eager ops, so those are not eager's bits), and the state-dict keys of torch DDP compiled the same
way; bytegrad and qadam (speculating during backward) compiled through AOTAutograd without
inductor (``backend="aot_eager"``: eager's arithmetic) keep their eager bits.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import bagua
from tests.harness import run_ranks
from tests.parallel.models import flat_params, make_model, make_optimizer, rank_batches

STEPS = 5
#: (how, algorithm, model) of every run of the module's one job (inductor starts once per rank)
RUNS = ([(how, algorithm, "net") for algorithm in (None, "gradient_allreduce")
         for how in ("eager", "compile-outside", "compile-inside")]
        + [(how, "gradient_allreduce", "sequential") for how in ("eager", "compile-outside", "compile-inside")]
        + [(how, algorithm, "net") for algorithm in ("bytegrad", "qadam") for how in ("eager", "aot_eager-outside")])

# Under xdist (`--dist loadgroup`) one worker runs the module: its module-scoped job runs once, not once per worker.
pytestmark = pytest.mark.xdist_group("torch_compile")


class _Net(torch.nn.Module):
    """``make_model``'s MLP (an ``nn.Sequential``) inside a module of user code: dynamo compiles
    frames of user code, and leaves torch's own (``nn.Sequential.forward``) alone where it meets
    them first, as under ``torch.compile(torch_ddp)``."""

    def __init__(self):
        super().__init__()
        self.layers = make_model()

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _wrap(model, opt, how: str, algorithm):
    """``how``: "eager", "compile-outside" (compile the wrapper), "compile-inside" (wrap the
    compiled model) or "aot_eager-outside" (compile the wrapper with that backend); ``algorithm``
    None: torch DDP."""
    inner = torch.compile(model) if how == "compile-inside" else model
    if algorithm is None:
        ddp = torch.nn.parallel.DistributedDataParallel(inner)
    else:
        ddp = bagua.DistributedDataParallel(inner, [opt], algorithm)
    if how == "compile-outside":
        return torch.compile(ddp)
    return torch.compile(ddp, backend="aot_eager") if how == "aot_eager-outside" else ddp


def _run(rank: int, how: str, algorithm, model_kind: str) -> dict:
    torch._dynamo.reset()  # compile anew: the same module class would reuse the last run's graphs
    model = _Net() if model_kind == "net" else make_model()
    if algorithm == "qadam":
        opt = bagua.optim.QAdamOptimizer(model.parameters(), lr=0.01, warmup_steps=2)
        algorithm = bagua.algorithms.QAdamAlgorithm(opt, overlap=True)
    else:
        opt = make_optimizer("sgd", model.parameters())
    ddp = _wrap(model, opt, how, algorithm)
    nodes = []
    for x, y in rank_batches(rank, STEPS):
        opt.zero_grad()
        loss = F.cross_entropy(ddp(x), y)
        nodes.append(_compiled_backward_nodes(loss))
        loss.backward()
        opt.step()
    wrapper = getattr(ddp, "_orig_mod", ddp)
    speculation = getattr(getattr(wrapper, "impl", None), "speculation", None)
    return {"params": flat_params(model), "keys": list(ddp.state_dict()), "nodes": nodes,
            "hits": speculation.stats.hits if speculation is not None else None}


def _job(rank: int) -> dict:
    runs = {(how, str(algorithm), kind): _run(rank, how, algorithm, kind) for how, algorithm, kind in RUNS}
    return {"runs": runs, "split": _split(rank)}


@pytest.fixture(scope="module")
def got() -> dict:
    results = run_ranks(_job, 2, timeout=280)
    for rank_result in results[1:]:  # every algorithm here keeps the ranks identical
        for run, result in rank_result["runs"].items():
            assert torch.equal(result["params"], results[0]["runs"][run]["params"]), f"{run}: the ranks differ"
    return results[0]


@pytest.mark.timeout(300)
def test_compiled_gradient_allreduce_has_torch_ddps_bits_and_keys(got):
    runs = got["runs"]
    for how in ("eager", "compile-outside", "compile-inside"):
        ours, theirs = runs[(how, "gradient_allreduce", "net")], runs[(how, "None", "net")]
        assert torch.equal(ours["params"], theirs["params"]), how
        assert ours["keys"] == theirs["keys"], (how, ours["keys"][:3], theirs["keys"][:3])
    compiled = runs[("compile-inside", "None", "net")]["params"]
    assert not torch.equal(compiled, runs[("eager", "None", "net")]["params"])  # inductor did compile the model
    # a bare nn.Sequential compiles under torch.compile(bagua_ddp) too (the wrapper calls it from a
    # frame of its own, which dynamo compiles), with the bits of the compiled model
    sequential = {how: runs[(how, "gradient_allreduce", "sequential")]["params"]
                  for how in ("eager", "compile-outside", "compile-inside")}
    assert torch.equal(sequential["compile-outside"], sequential["compile-inside"])
    assert not torch.equal(sequential["compile-outside"], sequential["eager"])


class _Wide(torch.nn.Module):
    """Four 384 x 384 layers (~590 KB each): two 1 MiB buckets."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first = torch.nn.Linear(12, 384)
        self.hidden = torch.nn.ModuleList(torch.nn.Linear(384, 384) for _ in range(4))
        self.last = torch.nn.Linear(384, 3)

    def forward(self, x):
        x = torch.tanh(self.first(x))
        for layer in self.hidden:
            x = torch.tanh(layer(x))
        return self.last(x)


def _compiled_backward_nodes(loss: torch.Tensor) -> int:
    """How many compiled graphs' backwards the loss's autograd graph holds."""
    seen, todo, count = set(), [loss.grad_fn], 0
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        count += type(node).__name__ == "CompiledFunctionBackward"
        todo += [next_node for next_node, _ in node.next_functions]
    return count


def _split(rank: int) -> dict:
    out = {}
    for wrapper in ("torch", "bagua"):
        torch._dynamo.reset()  # compile anew: the same module class would reuse the last one's graphs
        model = _Wide()
        opt = make_optimizer("sgd", model.parameters())
        if wrapper == "torch":
            ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1)
        else:
            ddp = bagua.DistributedDataParallel(model, [opt], "gradient_allreduce", bucket_size_bytes=1 << 20)
        compiled, nodes = torch.compile(ddp), []
        for x, y in rank_batches(rank, 3):
            opt.zero_grad()
            loss = F.cross_entropy(compiled(x), y)
            nodes.append(_compiled_backward_nodes(loss))
            loss.backward()
            opt.step()
        out[wrapper] = {"params": flat_params(model), "nodes": nodes}
    return out


@pytest.mark.timeout(300)
def test_compiled_backward_is_split_at_the_buckets_as_torch_ddps(got):
    """Gradients must arrive bucket by bucket, not all at the end of one compiled backward."""
    split = got["split"]
    assert split["bagua"]["nodes"] == split["torch"]["nodes"] and min(split["bagua"]["nodes"]) >= 2, split
    assert torch.equal(split["bagua"]["params"], split["torch"]["params"])


@pytest.mark.timeout(300)
def test_compiled_bytegrad_and_speculating_qadam_keep_their_eager_bits(got):
    runs = got["runs"]
    for algorithm in ("bytegrad", "qadam"):
        eager, compiled = runs[("eager", algorithm, "net")], runs[("aot_eager-outside", algorithm, "net")]
        assert torch.equal(compiled["params"], eager["params"]), algorithm
        # AOTAutograd compiled every step's backward (eager runs none): the bits are not a fallback's
        assert min(compiled["nodes"]) >= 1 and eager["nodes"] == [0] * STEPS, (algorithm, compiled["nodes"])
    assert runs[("aot_eager-outside", "qadam", "net")]["hits"] == runs[("eager", "qadam", "net")]["hits"] == STEPS - 2
