"""fuse_optimizer(single_pass=False) is bit-equal to step(); one-element parameters join runs;
fused_update_count counts the (step, param group) pairs that fused several parameters."""

from __future__ import annotations

import pytest
import torch

from bagua.optim import fuse_optimizer, fused_update_count

O = torch.optim
# the optimizers that fuse_step otherwise runs through torch's single-pass CPU kernel
SINGLE_PASS_ON_CPU = [
    lambda ps: O.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.1),
    lambda ps: O.Adam(ps, lr=1e-2, weight_decay=0.1, amsgrad=True),
    lambda ps: O.AdamW(ps, lr=1e-2, weight_decay=0.1),
    lambda ps: O.Adagrad(ps, lr=1e-2),
]


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    # the last layer's bias has one element
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1))


def _groups(model):
    return [{"params": [p for n, p in model.named_parameters() if "weight" in n]},
            {"params": [p for n, p in model.named_parameters() if "bias" in n], "lr": 0.05}]


def _train(model, opt, steps: int, fused_every: int):
    x = torch.linspace(-1, 1, 24).reshape(6, 4)
    for step in range(steps):
        opt.zero_grad(set_to_none=False)
        model(x).square().sum().backward()
        opt.fuse_step() if fused_every and step % fused_every == 0 else opt.step()


@pytest.mark.parametrize("make", SINGLE_PASS_ON_CPU, ids=["sgd", "adam", "adamw", "adagrad"])
def test_without_single_pass_fuse_step_is_bit_equal_to_step(make):
    plain, fused = _model(), _model()
    opt_plain = make(_groups(plain))
    opt_fused = fuse_optimizer(make(_groups(fused)), single_pass=False)
    _train(plain, opt_plain, steps=12, fused_every=0)
    _train(fused, opt_fused, steps=12, fused_every=2)  # fuse_step and step in turn
    for a, b in zip(plain.parameters(), fused.parameters()):
        assert torch.equal(a, b), (a - b).abs().max()


def test_a_one_element_parameter_joins_the_run_of_its_group():
    model = _model()
    opt = fuse_optimizer(O.SGD(_groups(model), lr=0.1, momentum=0.9))
    _train(model, opt, steps=3, fused_every=1)
    for _, _, buckets in opt._bagua_fuse.groups:
        (bucket,) = buckets
        assert [(r.i0, r.i1) for r in bucket.runs] == [(0, 2)] and not bucket.singles
    one = model[2].bias
    assert one.shape == (1,)
    # its momentum is a view of the flat state buffer, right after the other bias's
    other = model[0].bias
    m_one, m_other = opt.state[one]["momentum_buffer"], opt.state[other]["momentum_buffer"]
    assert m_one.untyped_storage().data_ptr() == m_other.untyped_storage().data_ptr()
    assert m_one.storage_offset() == m_other.storage_offset() + other.numel()


def test_a_zero_dim_parameter_is_updated_on_its_own_and_right():
    def make():
        torch.manual_seed(0)
        return [torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.tensor(0.5))]

    plain, fused = make(), make()
    opt_plain = O.Adam(plain, lr=0.1)
    opt_fused = fuse_optimizer(O.Adam(fused, lr=0.1), single_pass=False)
    for params, opt, fuse in ((plain, opt_plain, False), (fused, opt_fused, True)):
        for _ in range(4):
            opt.zero_grad(set_to_none=False)
            (params[0].square().sum() * params[1]).backward()
            opt.fuse_step() if fuse else opt.step()
    (bucket,) = opt_fused._bagua_fuse.groups[0][2]
    assert bucket.singles == [fused[1]]  # its state (0-dim, like "step") could be a scalar
    assert all(torch.equal(a, b) for a, b in zip(plain, fused))
    assert fused_update_count(opt_fused) == 1  # only the first fuse_step, before there was state


def test_fused_update_count_counts_param_groups_per_fuse_step():
    model = _model()
    opt = fuse_optimizer(O.SGD(_groups(model), lr=0.1))
    assert fused_update_count(opt) == 0
    _train(model, opt, steps=6, fused_every=2)  # 3 fuse_steps, 3 plain steps
    assert fused_update_count(opt) == 3 * 2

    separate = [torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(3))]
    unflat = fuse_optimizer(O.SGD(separate, lr=0.1), do_flatten=False)
    sum(p.sum() for p in separate).backward()
    unflat.fuse_step()
    assert fused_update_count(unflat) == 0  # not adjacent in memory: updated one by one


def test_fused_update_count_of_an_unfused_optimizer_is_an_error():
    with pytest.raises(ValueError, match="not fused; call fuse_optimizer"):
        fused_update_count(O.SGD(_model().parameters(), lr=0.1))
