"""fuse_step's dispatch to the single-pass Triton kernels (Adam/AdamW, SGD, Lion). On CUDA that is
the production path; without CUDA the same dispatch runs on CPU tensors through Triton's
interpreter (TRITON_INTERPRET=1, tests/conftest.py) with small models, against the unfused
optimizers."""

from __future__ import annotations

import copy

import pytest
import torch

from bagua.kernels import _optim_common
from bagua.kernels import adam as adam_kernels
from bagua.kernels import lion as lion_kernels
from bagua.kernels import sgd as sgd_kernels
from bagua.optim import Lion, fuse_optimizer
from bagua.optim import fused as fused_mod

from ._models import Net, assert_same_params, assert_same_state, backward, groups, twins

HAS_CUDA = torch.cuda.is_available()
needs_kernels = pytest.mark.skipif(
    not _optim_common.HAS_TRITON or (not HAS_CUDA and not _optim_common.triton_interpreting()),
    reason="needs triton, with CUDA or TRITON_INTERPRET=1",
)
O = torch.optim
CASES = [
    ("adam", lambda g: O.Adam(g, lr=1e-2, weight_decay=1e-2), "adam"),
    ("adam_amsgrad_maximize", lambda g: O.Adam(g, lr=1e-2, amsgrad=True, maximize=True), "adam"),
    ("adamw", lambda g: O.AdamW(g, lr=1e-2, weight_decay=0.1), "adam"),
    ("sgd", lambda g: O.SGD(g, lr=0.05, weight_decay=1e-2), "sgd"),
    ("sgd_nesterov", lambda g: O.SGD(g, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-2), "sgd"),
    ("sgd_dampening", lambda g: O.SGD(g, lr=0.05, momentum=0.9, dampening=0.2), "sgd"),
    ("lion", lambda g: Lion(g, lr=1e-3, weight_decay=0.1), "lion"),
]


@pytest.fixture
def kernel_calls(monkeypatch):
    """Routes CPU flat buffers to the Triton kernels (interpreter) and counts the launches."""
    calls = {"adam": 0, "sgd": 0, "lion": 0}
    if not HAS_CUDA:
        monkeypatch.setattr(fused_mod, "_KERNELS_ON_CPU", True)
    for name, mod in (("adam", adam_kernels), ("sgd", sgd_kernels), ("lion", lion_kernels)):
        real = getattr(mod, f"{name}_step_triton")

        def counted(*a, _real=real, _name=name, **k):
            calls[_name] += 1
            return _real(*a, **k)

        monkeypatch.setattr(mod, f"{name}_step_triton", counted)
    return calls


@needs_kernels
@pytest.mark.parametrize("ctor, kernel", [(c, k) for _, c, k in CASES], ids=[n for n, _, _ in CASES])
def test_kernel_dispatch_matches_unfused(ctor, kernel, kernel_calls):
    device = "cuda" if HAS_CUDA else "cpu"
    torch.manual_seed(0)
    model = Net(branch=True).to(device)
    m1, o1, m2, o2 = twins(lambda m: ctor(groups(m)), model=model)
    fuse_optimizer(o2)
    for step in range(8):
        for m, o in ((m1, o1), (m2, o2)):
            o.zero_grad(set_to_none=False)
            backward(m, step)  # odd steps: the branch has zero grads
        o1.step()
        (o2.step if step == 4 else o2.fuse_step)()  # an unfused step in the middle
    assert_same_params(m1, m2, rtol=1e-5, atol=1e-6)
    assert_same_state(o1, o2, rtol=1e-5, atol=1e-6)
    # 2 groups x 6 fuse_steps, less the first step of stateful optimizers (state is created by the
    # optimizer's own step), one kernel call per run
    stateful = kernel != "sgd" or o1.param_groups[0]["momentum"] != 0
    assert kernel_calls[kernel] == 2 * (6 if stateful else 7)
    assert sum(kernel_calls.values()) == kernel_calls[kernel]


@needs_kernels
@pytest.mark.filterwarnings("ignore::bagua.optim.FlattenWarning")  # set_to_none=True on purpose
def test_adam_kernel_after_load_state_dict_and_skipped_params(kernel_calls):
    device = "cuda" if HAS_CUDA else "cpu"
    torch.manual_seed(1)
    model = Net(branch=True).to(device)
    m1, o1, m2, o2 = twins(lambda m: O.Adam(groups(m), lr=1e-2), model=model)
    fuse_optimizer(o2)
    for step in range(6):
        for m, o in ((m1, o1), (m2, o2)):
            o.zero_grad(set_to_none=True)  # the branch has no grad on odd steps: its step lags
            backward(m, step)
        o1.step()
        o2.fuse_step()
        if step == 3:  # a copy: torch's load_state_dict keeps (aliases) the given step tensors
            o2.load_state_dict(copy.deepcopy(o1.state_dict()))
    assert_same_params(m1, m2, rtol=1e-5, atol=1e-6)
    assert_same_state(o1, o2, rtol=1e-5, atol=1e-6)
    assert kernel_calls["adam"] > 0
    # the branch's step counts differ from the rest: separate runs, each with its own step
    steps = {int(o2.state[p]["step"]) for p in m2.parameters()}
    assert steps == {6, 3}


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("fused_flag", [False, True])
def test_cuda_fuse_step_uses_one_kernel_per_run(fused_flag, kernel_calls):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)]).cuda()
    m1, o1, m2, o2 = twins(lambda m: O.AdamW(m.parameters(), lr=1e-3, fused=fused_flag), model=model)
    fuse_optimizer(o2)
    x = torch.randn(32, 256, device="cuda")
    for _ in range(10):
        for m, o in ((m1, o1), (m2, o2)):
            o.zero_grad(set_to_none=False)
            m(x).pow(2).mean().backward()
        o1.step()
        o2.fuse_step()
    assert kernel_calls["adam"] == 9
    assert_same_params(m1, m2, rtol=1e-5, atol=1e-6)
