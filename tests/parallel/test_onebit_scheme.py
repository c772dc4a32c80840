"""onebit_grad's averaged gradients against an independent plain-torch computation of the scheme.

The other onebit_grad tests compare the algorithm with itself (fused, rebucketed, resumed); this
one checks what it computes. From the ranks' own gradients (every rank computes both on an
unwrapped copy of the model and gathers them), the reference below runs 1-bit Adam's two-stage
scheme with sign1's definition (one sign per value, one scale per block of 256 values anchored
at each tensor's start: the root mean square of the block's real values), written here from the
definition, not from the library:

- each rank r sends v_r = g_r + e_r (its worker residual) as sign(v_r) * rms(v_r), keeps
  e_r = v_r - that;
- the average of what the ranks sent, plus the server residual s, is sent back the same way,
  s keeping what that rounding left out; every rank ends with the result.

Step 1 is the exact warm-up; steps 2 to 4 are 1-bit, so the residuals of each step are checked by
the next ones.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F

import bagua
from tests.harness import run_ranks
from tests.parallel.models import make_model, rank_batches

BLOCK = 256
STEPS = 4


def _sign1(x: torch.Tensor) -> torch.Tensor:
    """x flattened, each block of BLOCK values (the last one shorter) as +-its root mean square."""
    flat = x.reshape(-1)
    out = torch.empty_like(flat)
    for start in range(0, flat.numel(), BLOCK):
        block = flat[start:start + BLOCK]
        rms = block.double().pow(2).mean().sqrt().float()
        out[start:start + BLOCK] = torch.where(block >= 0, rms, -rms)
    return out.view_as(x)


class _Reference:
    """The two-stage scheme on one tensor, for every rank at once."""

    def __init__(self, world: int):
        self.worker = [None] * world
        self.server = None

    def average(self, grads: list[torch.Tensor]) -> torch.Tensor:
        sent = []
        for r, g in enumerate(grads):
            v = g if self.worker[r] is None else g + self.worker[r]
            sent.append(_sign1(v))
            self.worker[r] = v - sent[-1]
        u = torch.stack(sent).mean(dim=0)
        if self.server is not None:
            u = u + self.server
        out = _sign1(u)
        self.server = u - out
        return out


def _job(rank: int) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
    world = bagua.get_world_size()
    model = make_model(seed=0, width=256)  # several sign1 blocks per tensor, short last blocks too
    twin = copy.deepcopy(model)  # the same weights, unwrapped: each rank's own gradient
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ddp = bagua.DistributedDataParallel(model, [opt], bagua.algorithms.OneBitGradAlgorithm(warmup_steps=1))
    steps = []
    for x, y in rank_batches(rank, STEPS):
        twin.load_state_dict(model.state_dict())
        own = torch.autograd.grad(F.cross_entropy(twin(x), y), list(twin.parameters()))
        everyone = []
        for g in own:
            gathered = [torch.empty_like(g) for _ in range(world)]
            dist.all_gather(gathered, g.contiguous())
            everyone.append(gathered)
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        steps.append((everyone, [p.grad.clone() for p in model.parameters()]))
        opt.step()
    ddp.close()
    return steps


def test_onebit_grad_averages_as_the_two_stage_scheme_with_worker_and_server_residuals():
    results = run_ranks(_job, 2, timeout=120)
    steps = results[0]
    references = [_Reference(world=2) for _ in steps[0][1]]
    for step, (everyone, averaged) in enumerate(steps):
        for i, (grads, ours) in enumerate(zip(everyone, averaged)):
            if step == 0:  # the exact warm-up
                expected = torch.stack(grads).mean(dim=0)
            else:
                expected = references[i].average(grads)
            torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-7,
                                       msg=lambda m: f"step {step + 1}, tensor {i}: {m}")
            assert torch.equal(ours, results[1][step][1][i])  # identical on both ranks
        if step > 0:  # the residuals are doing something: the 1-bit result is not the plain average
            plain = torch.stack(everyone[0]).mean(dim=0)
            assert not torch.allclose(averaged[0], plain, rtol=1e-2)
