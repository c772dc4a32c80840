"""Small models and per-rank data shared by the data-parallel tests."""

from __future__ import annotations

import torch


def make_model(seed: int = 0, width: int = 16) -> torch.nn.Module:
    """An MLP 12 -> ``width`` -> 16 -> 3 (``width=256``: 4.6k parameters, several sign1 blocks per tensor)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(12, width), torch.nn.Tanh(), torch.nn.Linear(width, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)
    )


def rank_batches(rank: int, steps: int, batch: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Different data on every rank, the same on every run; learnable (the label is the
    largest of the first three features)."""
    g = torch.Generator().manual_seed(1000 + rank)
    xs = [torch.randn(batch, 12, generator=g) for _ in range(steps)]
    return [(x, x[:, :3].argmax(dim=1)) for x in xs]


def make_optimizer(kind: str, params) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    if kind == "plain_sgd":
        return torch.optim.SGD(params, lr=0.1)
    if kind == "adam":
        return torch.optim.Adam(params, lr=0.01)
    raise ValueError(kind)


def train(model, optimizer, batches, zero_grad_to_none: bool = True) -> list[float]:
    losses = []
    for x, y in batches:
        optimizer.zero_grad(set_to_none=zero_grad_to_none)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def flat_params(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()]).clone()


def set_flat_params(module: torch.nn.Module, flat: torch.Tensor) -> None:
    """Copy ``flat`` (as ``flat_params`` lays it out) into ``module``'s parameters."""
    offset = 0
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()


def gradients_at(weights: list[torch.Tensor], step: int) -> list[torch.Tensor]:
    """For simulations: each rank's flat cross-entropy gradient of ``make_model`` at its own
    weights ``weights[rank]``, on its own batch number ``step`` of ``rank_batches``."""
    out = []
    for rank, w in enumerate(weights):
        model = make_model()
        set_flat_params(model, w)
        x, y = rank_batches(rank, step + 1)[step]
        torch.nn.functional.cross_entropy(model(x), y).backward()
        out.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    return out
