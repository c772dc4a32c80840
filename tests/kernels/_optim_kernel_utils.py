"""Helpers shared by the optimizer-kernel tests (adam, sgd, lion)."""

import torch

from ._device import HAS_CUDA, KERNEL_DEVICE, needs_triton  # noqa: F401
# sizes: below one block, one block plus a tail, several blocks (full-block and tail launches)
NUMELS = [5, 2049, 3 * 2048 + 17]


def rand(numel, dtype=torch.float32, seed=0, positive=False, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=g) * scale
    return (x.abs() if positive else x).to(dtype)


def assert_close(got, want, dtype, what):
    got, want = got.cpu().float(), want.cpu().float()
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-7, msg=lambda m: f"{what}: {m}")
    else:
        # one unit in the last place of the stored dtype (the fp32 results may round differently,
        # e.g. FMA in torch's CPU kernels), plus fp32 rounding of operands of magnitude ~1 where a
        # result is small from cancellation
        ulp = torch.finfo(dtype).eps * want.abs()
        bad = (got - want).abs() > ulp + 1e-6
        assert not bool(bad.any()), f"{what}: {int(bad.sum())} differ, max diff {(got - want).abs().max()}"
