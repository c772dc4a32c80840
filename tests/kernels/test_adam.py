"""Adam/AdamW kernel: Triton (interpreter on CPU) against the torch reference, and the reference
against torch.optim.Adam / AdamW themselves over several steps."""

import pytest
import torch

from bagua.kernels import adam

from ._optim_kernel_utils import KERNEL_DEVICE, NUMELS, assert_close, needs_triton, rand

CASES = [
    dict(),
    dict(weight_decay=0.1),
    dict(weight_decay=0.1, decoupled_weight_decay=True),
    dict(amsgrad=True, maximize=True, weight_decay=0.01),
]


def _tensors(numel, dtype, seed, amsgrad):
    p = rand(numel, dtype, seed)
    g = rand(numel, dtype, seed + 1)
    m = rand(numel, dtype, seed + 2, scale=0.1)
    v = rand(numel, dtype, seed + 3, positive=True, scale=0.01)
    vm = (v.float() * 1.5).to(dtype) if amsgrad else None
    return [p, g, m, v, vm]


@needs_triton
@pytest.mark.parametrize("kw", CASES, ids=lambda k: ",".join(k) or "plain")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("numel", NUMELS)
def test_triton_matches_reference(numel, dtype, kw):
    amsgrad = kw.get("amsgrad", False)
    ref = _tensors(numel, dtype, numel, amsgrad)
    got = [t.clone().to(KERNEL_DEVICE) if t is not None else None for t in ref]
    hp = dict(step=3, lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, **kw)
    adam.adam_step_reference(*ref, **hp)
    adam.adam_step_triton(*got, **hp)
    for name, r, t in zip(["param", "grad", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"], ref, got):
        if r is not None:
            assert_close(t, r, dtype, name)
    assert not torch.equal(ref[0], _tensors(numel, dtype, numel, amsgrad)[0])  # it did update


@pytest.mark.parametrize("kw", CASES, ids=lambda k: ",".join(k) or "plain")
def test_reference_matches_torch_adam_over_steps(kw):
    kw = dict(kw)
    decoupled = kw.pop("decoupled_weight_decay", False)
    amsgrad = kw.get("amsgrad", False)
    p_t = torch.nn.Parameter(rand(3000, seed=1).view(30, 100))
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    opt = cls([p_t], lr=1e-2, betas=(0.8, 0.95), eps=1e-6, foreach=False, **kw)
    if not decoupled and "weight_decay" not in kw:
        kw["weight_decay"] = 0.0
    p = p_t.detach().clone().view(-1)
    m, v = torch.zeros(3000), torch.zeros(3000)
    vm = torch.zeros(3000) if amsgrad else None
    for step in range(1, 8):
        g = rand(3000, seed=100 + step)
        p_t.grad = g.view(30, 100).clone()
        opt.step()
        adam.adam_step(p, g, m, v, vm, step=step, lr=1e-2, beta1=0.8, beta2=0.95, eps=1e-6,
                       decoupled_weight_decay=decoupled, **kw)  # fmt: skip
    torch.testing.assert_close(p, p_t.detach().view(-1), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(m, opt.state[p_t]["exp_avg"].view(-1), rtol=1e-5, atol=1e-8)


def test_chunking_does_not_change_results(monkeypatch):
    a = _tensors(5000, torch.float32, 7, True)
    b = [t.clone() for t in a]
    hp = dict(step=2, lr=1e-3, amsgrad=True, weight_decay=0.1)
    adam.adam_step_reference(*a, **hp)
    monkeypatch.setattr(adam._c, "REF_CHUNK_ELEMS", 999)
    adam.adam_step_reference(*b, **hp)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: adam.adam_step(*_tensors(8, torch.float32, 0, False)[:4], step=0, lr=1.0), "step"),
        (lambda: adam.adam_step(*_tensors(8, torch.float32, 0, False)[:4], step=1, lr=1.0, amsgrad=True), "max_exp_avg_sq"),
        (lambda: adam.adam_step(torch.ones(8), torch.ones(7), torch.ones(8), torch.ones(8), step=1, lr=1.0), "7 elements"),
        (lambda: adam.adam_step(torch.ones(8, 2).t(), torch.ones(2, 8), torch.ones(2, 8), torch.ones(2, 8), step=1, lr=1.0), "contiguous"),
        (lambda: adam.adam_step(torch.ones(8, dtype=torch.int32), torch.ones(8), torch.ones(8), torch.ones(8), step=1, lr=1.0), "float32"),
    ],
)
def test_argument_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_dispatch_matches_reference():
    ref = _tensors((1 << 20) + 3, torch.float32, 5, True)
    got = [t.cuda() for t in ref]
    hp = dict(step=10, lr=1e-3, amsgrad=True, weight_decay=0.05, decoupled_weight_decay=True)
    adam.adam_step_reference(*ref, **hp)
    adam.adam_step(*got, **hp)
    for r, t in zip(ref, got):
        torch.testing.assert_close(t.cpu(), r, rtol=2e-6, atol=1e-7)
