"""The worked example of docs/writing_an_algorithm.md, run as written on two ranks."""

from __future__ import annotations

import re
from pathlib import Path

import torch

import bagua
from tests.harness import run_ranks
from tests.parallel.models import flat_params, make_model, rank_batches

DOC = Path(__file__).resolve().parents[2] / "docs" / "writing_an_algorithm.md"


def _algorithm_from_the_doc():
    code = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)[0]
    namespace: dict = {}
    exec(compile(code, str(DOC), "exec"), namespace)  # the first code block defines the algorithm
    return namespace["PeriodicAverageAlgorithm"]


def _periodic(rank: int):
    algorithm_cls = _algorithm_from_the_doc()
    model = make_model(seed=rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ddp = bagua.DistributedDataParallel(model, [opt], algorithm=algorithm_cls(every=3))
    assert isinstance(bagua.algorithms.Algorithm.init("periodic_average", every=2), algorithm_cls)
    after = []
    for x, y in rank_batches(rank, 6):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        after.append(flat_params(model))
    return after


def test_the_documented_algorithm_averages_every_k_steps():
    a, b = run_ranks(_periodic, 2)
    for step, (x, y) in enumerate(zip(a, b), start=1):
        if step % 3 == 0:
            assert torch.equal(x, y), step
        else:
            assert not torch.equal(x, y), step
