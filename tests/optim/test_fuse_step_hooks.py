"""fuse_step runs the optimizer's step hooks exactly once, like step(), whichever path it takes."""

from __future__ import annotations

import pytest
import torch

from bagua.optim import fuse_optimizer


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.Adam(ps, lr=0.01),       # CPU: torch's fused kernel on the flat buffers
    lambda ps: torch.optim.Adadelta(ps, lr=0.1),    # the optimizer's own step on flat views
    lambda ps: torch.optim.RMSprop(ps, lr=0.01),
])
def test_step_hooks_run_once_per_fuse_step(make):
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 2))
    opt = fuse_optimizer(make(model.parameters()))
    calls = []
    opt.register_step_pre_hook(lambda o, args, kwargs: calls.append("pre"))
    opt.register_step_post_hook(lambda o, args, kwargs: calls.append("post"))
    for _ in range(3):
        model(torch.randn(4, 6)).sum().backward()
        opt.fuse_step()
    opt.step()
    assert calls == ["pre", "post"] * 4
