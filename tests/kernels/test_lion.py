"""Lion kernel: Triton (interpreter on CPU) against the torch reference; the reference against a
direct transcription of the paper's update."""

import pytest
import torch

from bagua.kernels import lion

from ._optim_kernel_utils import KERNEL_DEVICE, NUMELS, assert_close, needs_triton, rand

CASES = [dict(), dict(weight_decay=0.1), dict(maximize=True, beta1=0.95, beta2=0.98)]


@needs_triton
@pytest.mark.parametrize("kw", CASES, ids=lambda k: ",".join(k) or "plain")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("numel", NUMELS)
def test_triton_matches_reference(numel, dtype, kw):
    ref = [rand(numel, dtype, numel), rand(numel, dtype, numel + 1), rand(numel, dtype, numel + 2, scale=0.1)]
    ref[1][:3] = 0.0  # sign(0) = 0 where the interpolation is exactly zero
    ref[2][:3] = 0.0
    got = [t.clone().to(KERNEL_DEVICE) for t in ref]
    b1 = kw.get("beta1", 0.9)
    c = b1 * ref[2].double() + (1 - b1) * ref[1].double() * (-1 if kw.get("maximize") else 1)
    # sign() of an interpolation within fp32 rounding of 0 may go either way (FMA or not): skip those
    keep = (c == 0) | (c.abs() > 1e-5)
    lion.lion_step_reference(*ref, lr=1e-2, **kw)
    lion.lion_step_triton(*got, lr=1e-2, **kw)
    assert int(keep.sum()) > 0.99 * numel
    for name, r, t in zip(["param", "grad", "exp_avg"], ref, got):
        assert_close(t.cpu()[keep], r[keep], dtype, name)


def test_reference_follows_the_paper():
    p, g, m = rand(1000, seed=1), rand(1000, seed=2), rand(1000, seed=3, scale=0.1)
    lr, b1, b2, wd = 3e-3, 0.9, 0.99, 0.5
    c = b1 * m + (1 - b1) * g
    want_p = p * (1 - lr * wd) - lr * torch.sign(c)
    want_m = b2 * m + (1 - b2) * g
    lion.lion_step(p, g, m, lr=lr, beta1=b1, beta2=b2, weight_decay=wd)
    torch.testing.assert_close(p, want_p, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(m, want_m, rtol=1e-6, atol=1e-7)
