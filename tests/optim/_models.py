"""Small models, twin optimizers (unfused vs fused) and comparison helpers for tests/optim."""

from __future__ import annotations

import copy

import torch


class Net(torch.nn.Module):
    """Two linear layers with biases, a LayerNorm and an optional branch used on even steps only
    (its params have no gradient on odd steps)."""

    def __init__(self, width: int = 24, branch: bool = False):
        super().__init__()
        self.fc1 = torch.nn.Linear(10, width)
        self.norm = torch.nn.LayerNorm(width)
        self.fc2 = torch.nn.Linear(width, 3)
        self.branch = torch.nn.Linear(10, 3) if branch else None

    def forward(self, x: torch.Tensor, step: int = 0) -> torch.Tensor:
        y = self.fc2(torch.tanh(self.norm(self.fc1(x))))
        if self.branch is not None and step % 2 == 0:
            y = y + self.branch(x)
        return y


class MixedNet(torch.nn.Module):
    """fp32 and bf16 layers in turn (fc1 + norm fp32, fc2 bf16, fc3 fp32) and a bf16 branch used on
    even steps only: every param group holds params of both dtypes, so two flat buckets each.

    Every bf16 param has a multiple of 64 elements: torch's bf16 CPU kernels round an element
    differently in a full SIMD vector and in a tensor's tail, so only then does a flat buffer of
    them go through the same arithmetic as each param alone (fp32 rounds the same either way).
    """

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(10, 32)
        self.norm = torch.nn.LayerNorm(32)
        self.fc2 = torch.nn.Linear(32, 64).to(torch.bfloat16)
        self.fc3 = torch.nn.Linear(64, 3)
        self.branch = torch.nn.Linear(10, 64).to(torch.bfloat16)

    def forward(self, x: torch.Tensor, step: int = 0) -> torch.Tensor:
        z = self.fc2(torch.tanh(self.norm(self.fc1(x))).bfloat16())
        if step % 2 == 0:
            z = z + self.branch(x.bfloat16())
        return self.fc3(torch.tanh(z).float())


def groups(model: torch.nn.Module, **second_group_overrides) -> list[dict]:
    """Weights in one group, biases/norm params in another with no weight decay (the usual split)."""
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and p.dim() > 1]
    no_decay = [p for n, p in model.named_parameters() if not (n.endswith("weight") and p.dim() > 1)]
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0, **second_group_overrides}]


def twins(make_opt, seed: int = 0, branch: bool = False, model=None):
    torch.manual_seed(seed)
    m1 = model if model is not None else Net(branch=branch)
    m2 = copy.deepcopy(m1)
    return m1, make_opt(m1), m2, make_opt(m2)


def backward(model: torch.nn.Module, step: int, seed: int = 1000) -> None:
    g = torch.Generator().manual_seed(seed + step)
    x = torch.randn(16, 10, generator=g)
    model(x, step).pow(2).mean().backward()


def assert_same_params(m1, m2, rtol=1e-5, atol=1e-6):
    for (n, a), b in zip(m1.named_parameters(), m2.parameters()):
        torch.testing.assert_close(b.detach().float(), a.detach().float(), rtol=rtol, atol=atol, msg=lambda m: f"{n}: {m}")


def assert_same_state(o1, o2, rtol=1e-5, atol=1e-6):
    s1, s2 = o1.state_dict()["state"], o2.state_dict()["state"]
    assert s1.keys() == s2.keys()
    for idx in s1:
        assert s1[idx].keys() == s2[idx].keys(), (idx, s1[idx].keys(), s2[idx].keys())
        for k in s1[idx]:
            a, b = s1[idx][k], s2[idx][k]
            if isinstance(a, torch.Tensor):
                torch.testing.assert_close(b.float(), a.float(), rtol=rtol, atol=atol, msg=lambda m: f"{idx}/{k}: {m}")
            else:
                assert a == b, (idx, k, a, b)
