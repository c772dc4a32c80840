"""Checking and averaging the model replicas of all ranks, for the examples' evaluations.

Example::

    from replicas import parameters_identical_on_all_ranks, average_parameters
    if not parameters_identical_on_all_ranks(list(model.parameters())):
        average_parameters(list(model.parameters()))
    evaluate(averaged_copy(model, shadow))     # mid-training: the replicas' average, the replicas kept
"""

from __future__ import annotations

import torch

import bagua


def parameters_identical_on_all_ranks(params: list[torch.Tensor]) -> bool:
    """Exact check: the elementwise MAX and MIN over ranks agree only if every rank holds
    the very same values."""
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    hi, lo = flat.clone(), flat.clone()
    bagua.comm.allreduce(hi, op=bagua.comm.ReduceOp.MAX)
    bagua.comm.allreduce(lo, op=bagua.comm.ReduceOp.MIN)
    return torch.equal(hi, lo)


@torch.no_grad()
def average_parameters(params: list[torch.Tensor]) -> None:
    """One exact average of the weights over all ranks (for algorithms that leave them apart)."""
    for p in params:
        bagua.comm.allreduce(p, op=bagua.comm.ReduceOp.AVG)


@torch.no_grad()
def averaged_copy(model: torch.nn.Module, shadow: torch.nn.Module) -> torch.nn.Module:
    """``shadow`` (a copy of ``model``'s architecture, e.g. ``copy.deepcopy(model)``) holding the
    average over all ranks of ``model``'s weights, ``model`` untouched: what stopping the run
    here and averaging the replicas would give."""
    for mine, theirs in zip(model.parameters(), shadow.parameters()):
        theirs.copy_(mine)
    average_parameters(list(shadow.parameters()))
    return shadow
