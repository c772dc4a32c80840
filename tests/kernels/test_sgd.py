"""SGD kernel: Triton (interpreter on CPU) against the torch reference, and the reference against
torch.optim.SGD over several steps (momentum, dampening, nesterov, weight decay, maximize)."""

import pytest
import torch

from bagua.kernels import sgd

from ._optim_kernel_utils import KERNEL_DEVICE, NUMELS, assert_close, needs_triton, rand

CASES = [
    dict(),
    dict(momentum=0.9, weight_decay=0.1),
    dict(momentum=0.9, first=True),
    dict(momentum=0.8, dampening=0.3, nesterov=False, maximize=True),
    dict(momentum=0.9, nesterov=True, weight_decay=0.01),
]


@needs_triton
@pytest.mark.parametrize("kw", CASES, ids=lambda k: ",".join(k) or "plain")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("numel", NUMELS)
def test_triton_matches_reference(numel, dtype, kw):
    ref = [rand(numel, dtype, numel), rand(numel, dtype, numel + 1), rand(numel, dtype, numel + 2)]
    if not kw.get("momentum"):
        ref[2] = None
    got = [t.clone().to(KERNEL_DEVICE) if t is not None else None for t in ref]
    sgd.sgd_step_reference(*ref, lr=0.05, **kw)
    sgd.sgd_step_triton(*got, lr=0.05, **kw)
    for name, r, t in zip(["param", "grad", "momentum_buffer"], ref, got):
        if r is not None:
            assert_close(t, r, dtype, name)


@pytest.mark.parametrize("kw", [c for c in CASES if not c.get("first")], ids=lambda k: ",".join(k) or "plain")
def test_reference_matches_torch_sgd_over_steps(kw):
    p_t = torch.nn.Parameter(rand(2000, seed=3).view(20, 100))
    opt = torch.optim.SGD([p_t], lr=0.05, foreach=False, **kw)
    p = p_t.detach().clone().view(-1)
    momentum = kw.get("momentum", 0.0)
    b = torch.empty(2000) if momentum else None
    for step in range(6):
        g = rand(2000, seed=50 + step)
        p_t.grad = g.view(20, 100).clone()
        opt.step()
        sgd.sgd_step(p, g, b, lr=0.05, first=step == 0, **kw)
    torch.testing.assert_close(p, p_t.detach().view(-1), rtol=1e-6, atol=1e-7)
    if momentum:
        torch.testing.assert_close(b, opt.state[p_t]["momentum_buffer"].view(-1), rtol=1e-6, atol=1e-7)


def test_momentum_needs_buffer():
    with pytest.raises(ValueError, match="momentum_buffer"):
        sgd.sgd_step(torch.ones(4), torch.ones(4), lr=0.1, momentum=0.9)
