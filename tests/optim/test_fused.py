"""fuse_optimizer / fuse_step against the unfused torch optimizers: numerics over many steps for
every torch.optim optimizer, param groups, mixing step() and fuse_step(), state_dict both ways,
params without grads, frozen params, mixed dtypes, broken flat layout, schedulers, refusals."""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch

import bagua.optim
from bagua.optim import FlattenWarning, Lion, fuse_optimizer, is_fused_optimizer
from bagua.optim import fused as fused_mod
from bagua.optim.flat_buffers import FlatBucket

from ._models import MixedNet, Net, assert_same_params, assert_same_state, backward, groups, twins

O = torch.optim
# (name, constructor over param groups); second group: no weight decay (and lr x2 where given)
OPTIMIZERS = [
    ("sgd", lambda g: O.SGD(g, lr=0.05, weight_decay=1e-2)),
    ("sgd_momentum", lambda g: O.SGD(g, lr=0.05, momentum=0.9, dampening=0.1, weight_decay=1e-2)),
    ("sgd_nesterov", lambda g: O.SGD(g, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-2)),
    ("adam", lambda g: O.Adam(g, lr=1e-2, weight_decay=1e-2)),
    ("adam_amsgrad_maximize", lambda g: O.Adam(g, lr=1e-2, amsgrad=True, maximize=True)),
    ("adam_fused", lambda g: O.Adam(g, lr=1e-2, weight_decay=1e-2, fused=True)),
    ("adamw", lambda g: O.AdamW(g, lr=1e-2, weight_decay=0.1)),
    ("adamw_amsgrad", lambda g: O.AdamW(g, lr=1e-2, weight_decay=0.1, amsgrad=True)),
    ("adamax", lambda g: O.Adamax(g, lr=1e-2, weight_decay=1e-2)),
    ("adadelta", lambda g: O.Adadelta(g, lr=1.0, weight_decay=1e-2)),
    ("adagrad", lambda g: O.Adagrad(g, lr=1e-2, lr_decay=1e-3, weight_decay=1e-2)),
    ("rmsprop", lambda g: O.RMSprop(g, lr=1e-3, momentum=0.5, centered=True, weight_decay=1e-2)),
    ("rprop", lambda g: O.Rprop(g, lr=1e-3)),
    ("nadam", lambda g: O.NAdam(g, lr=1e-2, weight_decay=1e-2)),
    ("radam", lambda g: O.RAdam(g, lr=1e-2, weight_decay=1e-2, decoupled_weight_decay=True)),
    ("asgd", lambda g: O.ASGD(g, lr=1e-2, t0=5, weight_decay=1e-2)),
    ("lion", lambda g: Lion(g, lr=1e-3, weight_decay=0.1)),
]
IDS = [name for name, _ in OPTIMIZERS]


class PerParamSGDW(torch.optim.Optimizer):
    """A user-written optimizer: per-parameter tensor state and a python int step, element-wise."""

    def __init__(self, params, lr=0.01, beta=0.9, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, beta=beta, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["step"] = 0
                    st["avg"] = torch.zeros_like(p)
                st["step"] += 1
                st["avg"] = st["avg"] * group["beta"] + p.grad  # reallocates its state every step
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(st["avg"], alpha=-group["lr"] / st["step"] ** 0.5)
        return None


@pytest.mark.parametrize("ctor", [c for _, c in OPTIMIZERS], ids=IDS)
def test_matches_unfused_over_many_steps_mixing_step_and_fuse_step(ctor, monkeypatch):
    monkeypatch.setattr(fused_mod, "CPU_CHUNK_ELEMS", 100)  # several chunks per run, tails merged
    m1, o1, m2, o2 = twins(lambda m: ctor(groups(m)))
    fuse_optimizer(o2)
    for step in range(40):
        for m, o in ((m1, o1), (m2, o2)):
            o.zero_grad(set_to_none=False)
            backward(m, step)
        o1.step()
        if step % 7 == 3:
            o2.step()  # the original step on the flat views, mixed in
        else:
            o2.fuse_step()
    assert_same_params(m1, m2, rtol=1e-4, atol=1e-5)
    assert_same_state(o1, o2, rtol=1e-4, atol=1e-5)
    assert o2.param_groups[1]["weight_decay"] == 0.0 and not o2._bagua_fuse.warned


# fuse_step runs these through torch's single-pass CPU kernel, where step() runs the multi-pass one:
# the same math, rounded once per step instead of after each op. (SGD's single-pass CPU kernel is
# not used with bf16 params: it computes a wrong update there.)
SINGLE_PASS_ON_CPU = {"adam", "adam_amsgrad_maximize", "adamw", "adamw_amsgrad", "adagrad"}


def _grads_by_hand(model: torch.nn.Module, step: int) -> None:
    g = torch.Generator().manual_seed(2000 + step)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


def _state_outside_buffers(opt) -> list[tuple]:
    """(param shape, key) of each per-element state tensor that is not in its fused bucket's buffer."""
    outside = []
    for _, _, buckets in opt._bagua_fuse.groups:
        for b in buckets:
            for i, p in enumerate(b.params):
                for k, v in opt.state.get(p, {}).items():
                    if isinstance(v, torch.Tensor) and v.shape == p.shape and p.numel() > 1:
                        home = b.state_homes.get(k)
                        if home is None or v.data_ptr() != home[i].data_ptr():
                            outside.append((tuple(p.shape), k))
    return outside


def _assert_same_step(name: str, m1, o1, m2, o2) -> None:
    """Params and state of (m2, o2) equal those of the unfused (m1, o1): bit for bit, or within
    rounding for the optimizers that fuse_step runs through torch's single-pass kernel."""

    def check(what, a, b):
        if not isinstance(a, torch.Tensor):
            assert b == a, (what, a, b)
        elif name in SINGLE_PASS_ON_CPU:
            tol = dict(rtol=2**-6, atol=1e-3) if a.dtype == torch.bfloat16 else dict(rtol=1e-6, atol=1e-8)
            torch.testing.assert_close(b, a, **tol, msg=lambda m: f"{what}: {m}")
        else:
            assert torch.equal(b, a), f"{what}: max diff {(a.double() - b.double()).abs().max().item()}"

    for (n, a), b in zip(m1.named_parameters(), m2.parameters()):
        check(n, a.detach(), b.detach())
        assert o2.state.get(b, {}).keys() == o1.state.get(a, {}).keys(), n
        for k, v in o1.state.get(a, {}).items():
            check(f"{n} state {k!r}", v, o2.state[b][k])


@torch.no_grad()
def _copy_values(m1, o1, m2, o2) -> None:
    """Gives (m2, o2) the exact values of (m1, o1), in place (the flat layout stays): each step
    is compared from the same start, so rounding differences (single-pass kernels) do not compound."""
    for a, b in zip(m1.parameters(), m2.parameters()):
        b.copy_(a)
        for k, v in o1.state.get(a, {}).items():
            if isinstance(v, torch.Tensor):
                o2.state[b][k].copy_(v)


@pytest.mark.filterwarnings("ignore::bagua.optim.FlattenWarning")  # grads replaced on purpose
@pytest.mark.parametrize("name, ctor", OPTIMIZERS, ids=IDS)
def test_fuse_step_equals_step_through_a_mixed_precision_training_loop(name, ctor):
    """fp32 and bf16 params in two groups (weight decay, lr x2), an LR schedule, gradients from
    backward, assigned by hand, freed by zero_grad(set_to_none=True), missing for some params in
    some steps, and a checkpoint loaded back, and into a new fused optimizer, at step 5."""

    def make(model):
        opt = ctor(groups(model))
        opt.param_groups[1]["lr"] *= 2
        return opt

    def schedule(opt, last_epoch=-1):
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 0.8**e, last_epoch=last_epoch)

    def checkpoint(model, opt) -> dict:
        buf = io.BytesIO()
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
        buf.seek(0)
        return torch.load(buf, weights_only=True)

    m1, o1, m2, o2 = twins(make, model=MixedNet())
    fuse_optimizer(o2)
    loops = [(m1, o1, schedule(o1)), (m2, o2, schedule(o2))]
    for step in range(10):
        for m, o, _ in loops:
            if step in (2, 7):
                _grads_by_hand(m, step)
            else:
                o.zero_grad(set_to_none=step in (3, 4))  # step 3: the branch gets no gradient (None)
                backward(m, step)
            if step == 5:
                m.fc3.bias.grad = None  # no gradient for one param, whose neighbours have one
        for m, o, sched in loops:
            getattr(o, "fuse_step", o.step)()
            sched.step()
        for m, o, _ in loops[1:]:
            _assert_same_step(name, m1, o1, m, o)
            _copy_values(m1, o1, m, o)
        if step == 5:
            o1.load_state_dict(checkpoint(m1, o1)["opt"])  # torch casts some state on load: both do
            ckpt = checkpoint(m2, o2)
            o2.load_state_dict(ckpt["opt"])
            m3 = MixedNet()
            m3.load_state_dict(ckpt["model"])
            o3 = fuse_optimizer(make(m3))
            o3.load_state_dict(ckpt["opt"])
            for m, o in ((m2, o2), (m3, o3)):
                assert _state_outside_buffers(o) == []  # views of the flat buffers right after the load
                _assert_same_step(name, m1, o1, m, o)
            loops.append((m3, o3, schedule(o3, last_epoch=step)))
    assert [g["lr"] for g in o3.param_groups] == [g["lr"] for g in o1.param_groups]


@pytest.mark.filterwarnings("ignore::bagua.optim.FlattenWarning")  # grads assigned by hand on purpose
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_a_hand_assigned_gradient_moves_a_bf16_param_as_step_does(momentum):
    # fuse_step ran SGD's bf16 buckets through torch's single-pass CPU kernel (torch 2.13), which
    # moves only the elements past the last full SIMD vector: the bf16 layer barely moved.
    m1, o1, m2, o2 = twins(lambda m: O.SGD(m.parameters(), lr=0.1, momentum=momentum), model=MixedNet())
    fuse_optimizer(o2)
    for step in range(3):
        for m in (m1, m2):
            for p in m.parameters():
                p.grad = torch.full_like(p, 1.0 + step)  # every element moves by more than its ulp
        before = m2.fc2.weight.detach().clone()
        o1.step()
        o2.fuse_step()
        assert (m2.fc2.weight != before).all()
        _assert_same_step("sgd", m1, o1, m2, o2)


def test_user_written_optimizer_with_reallocated_state():
    m1, o1, m2, o2 = twins(lambda m: PerParamSGDW(groups(m), lr=0.05, weight_decay=0.1))
    fuse_optimizer(o2)
    for step in range(15):
        for m, o in ((m1, o1), (m2, o2)):
            o.zero_grad(set_to_none=False)
            backward(m, step)
        o1.step()
        o2.fuse_step()
    assert_same_params(m1, m2)
    assert_same_state(o1, o2)
    run_states = o2.state[next(iter(m2.parameters()))]
    assert run_states["step"] == 15 and run_states["avg"]._base is not None  # kept in the flat buffer


def test_api_contract():
    model = Net()
    opt = torch.optim.Adam(model.parameters())
    assert not is_fused_optimizer(opt) and not hasattr(opt, "fuse_step")
    assert fuse_optimizer(opt) is opt and is_fused_optimizer(opt)
    assert "fuse_step" in vars(opt) and not hasattr(torch.optim.Adam, "fuse_step")
    assert not hasattr(torch.optim.Adam(Net().parameters()), "fuse_step")  # class untouched
    with pytest.raises(ValueError, match="already fused"):
        fuse_optimizer(opt)
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        fuse_optimizer(model)
    assert bagua.optim.fuse_optimizer is fuse_optimizer


def test_params_grads_and_state_are_views_of_flat_buffers():
    model = Net()
    opt = fuse_optimizer(torch.optim.Adam(groups(model), lr=1e-3))
    backward(model, 0)
    opt.fuse_step()  # creates the state (per parameter), moved into buffers at the next step
    opt.fuse_step()
    decay = opt.param_groups[0]["params"]
    base = decay[0].untyped_storage().data_ptr()
    assert all(p.untyped_storage().data_ptr() == base for p in decay)
    assert all(p.grad.untyped_storage().data_ptr() == decay[0].grad.untyped_storage().data_ptr() for p in decay)
    for k in ("exp_avg", "exp_avg_sq", "step"):  # "step" too: 0-dim views of one buffer
        assert len({opt.state[p][k].untyped_storage().data_ptr() for p in decay}) == 1
    assert all(opt.state[p]["step"].dim() == 0 and float(opt.state[p]["step"]) == 2.0 for p in decay)
    sd = opt.state_dict()["state"]
    assert all(v["step"]._base is None and v["step"].untyped_storage().nbytes() == 4 for v in sd.values())
    b = opt._bagua_fuse.groups[0][2][0]
    assert len(b.runs) == 1 and b.runs[0].numel == sum(p.numel() for p in decay)
    # the two groups (different hyperparameters) never share a buffer
    assert opt.param_groups[1]["params"][0].untyped_storage().data_ptr() != base


def test_closure_and_return_value():
    m1, o1, m2, o2 = twins(lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9))
    fuse_optimizer(o2)
    x = torch.randn(4, 10)
    for _ in range(3):
        l1 = o1.step(lambda: (o1.zero_grad(), m1(x).pow(2).sum().backward(), m1(x).pow(2).sum())[-1])
        l2 = o2.fuse_step(lambda: (o2.zero_grad(set_to_none=False), m2(x).pow(2).sum().backward(), m2(x).pow(2).sum())[-1])
        torch.testing.assert_close(l2, l1)
    assert_same_params(m1, m2)


@pytest.mark.parametrize("direction", ["fused_to_unfused", "unfused_to_fused"])
def test_state_dict_round_trips(direction):
    make = lambda m: torch.optim.AdamW(groups(m), lr=1e-2, weight_decay=0.1, amsgrad=True)  # noqa: E731
    m_a, o_a, m_b, o_b = twins(make)
    if direction == "fused_to_unfused":
        fuse_optimizer(o_a)
    for step in range(5):
        o_a.zero_grad(set_to_none=False)
        backward(m_a, step)
        getattr(o_a, "fuse_step", o_a.step)()
    buf = io.BytesIO()
    torch.save({"model": m_a.state_dict(), "opt": o_a.state_dict()}, buf)
    sd = o_a.state_dict()
    for per_param in sd["state"].values():
        for v in per_param.values():
            assert v._base is None and v.untyped_storage().nbytes() == v.numel() * v.element_size()
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    m_b.load_state_dict(ckpt["model"])
    o_b.load_state_dict(ckpt["opt"])
    if direction == "unfused_to_fused":
        fuse_optimizer(o_b)
    for step in range(5, 12):
        for m, o in ((m_a, o_a), (m_b, o_b)):
            o.zero_grad(set_to_none=False)
            backward(m, step)
            getattr(o, "fuse_step", o.step)()
    assert_same_params(m_a, m_b)
    assert_same_state(o_a, o_b)


def test_load_state_dict_into_fused_optimizer_is_copied_into_buffers_silently():
    m1, o1, m2, o2 = twins(lambda m: torch.optim.Adam(m.parameters(), lr=1e-2))
    fuse_optimizer(o2)
    for step in range(3):
        for m, o in ((m1, o1), (m2, o2)):
            o.zero_grad(set_to_none=False)
            backward(m, step)
        o1.step()
        o2.fuse_step()
    o2.load_state_dict(copy.deepcopy(o1.state_dict()))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FlattenWarning)
        for step in range(3, 6):
            for m, o in ((m1, o1), (m2, o2)):
                o.zero_grad(set_to_none=False)
                backward(m, step)
            o1.step()
            o2.fuse_step()
    assert_same_params(m1, m2)
    assert opt_state_in_buffers(o2)


def opt_state_in_buffers(opt) -> bool:
    ps = [p for g in opt.param_groups for p in g["params"]]
    return len({opt.state[p]["exp_avg"].untyped_storage().data_ptr() for p in ps}) == 1


@pytest.mark.filterwarnings("ignore::bagua.optim.FlattenWarning")  # set_to_none=True on purpose
@pytest.mark.parametrize("ctor", [OPTIMIZERS[1][1], OPTIMIZERS[3][1], OPTIMIZERS[12][1]], ids=["sgd_momentum", "adam", "rprop"])
def test_params_without_grad_are_skipped_as_torch_does(ctor):
    m1, o1, m2, o2 = twins(lambda m: ctor(groups(m)), branch=True)
    fuse_optimizer(o2)
    for step in range(12):
        for m, o in ((m1, o1), (m2, o2)):
            o.zero_grad(set_to_none=True if step % 4 == 1 else False)
            backward(m, step)
        if step % 2 == 1:  # the branch is unused: zero grads (kept) or None (freed at step 1 mod 4)
            assert (m2.branch.weight.grad is None) == (step % 4 == 1)
        o1.step()
        o2.fuse_step()
    assert_same_params(m1, m2)
    assert_same_state(o1, o2)


# On CPU, fuse_step runs Adam/AdamW/Adagrad (and SGD without bf16/fp16 params) through torch's fused
# (single-pass) CPU kernel, which rounds bf16 once per step instead of once per op: compare those
# with torch's fused=True.
@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
        lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.9, weight_decay=0.1),
    ],
    ids=["adamw", "rmsprop"],
)
def test_frozen_params_and_mixed_dtypes(make):
    torch.manual_seed(0)
    m1 = Net()
    m1.fc2.to(torch.bfloat16)
    m1.fc2.bias.requires_grad_(False)
    m2 = copy.deepcopy(m1)

    def run(model, opt, fuse):
        for step in range(10):
            opt.zero_grad(set_to_none=False)
            x = torch.randn(8, 10, generator=torch.Generator().manual_seed(step))
            h = torch.tanh(model.norm(model.fc1(x)))
            model.fc2(h.to(torch.bfloat16)).float().pow(2).mean().backward()
            (opt.fuse_step if fuse else opt.step)()

    frozen = m2.fc2.bias.detach().clone()
    o1 = make(list(m1.parameters()))
    o2 = fuse_optimizer(make(list(m2.parameters())))
    run(m1, o1, False)
    run(m2, o2, True)
    assert torch.equal(m2.fc2.bias.detach(), frozen)
    state_keys = [k for k, v in o2.state[m2.fc2.weight].items() if isinstance(v, torch.Tensor) and v.dim() == 2]
    assert m2.fc2.weight.dtype == torch.bfloat16 and o2.state[m2.fc2.weight][state_keys[0]].dtype == torch.bfloat16
    dtypes = sorted(str(b.dtype) for b in o2._bagua_fuse.groups[0][2])
    assert dtypes == ["torch.bfloat16", "torch.float32"]  # separate buffers per dtype
    assert_same_params(m1, m2, rtol=1e-5, atol=1e-6)  # the same op sequence, also in bf16


def test_sparse_gradient_raises():
    emb = torch.nn.Embedding(10, 4, sparse=True)
    opt = fuse_optimizer(torch.optim.SGD(emb.parameters(), lr=0.1))
    emb(torch.tensor([1, 2])).sum().backward()
    before = emb.weight.detach().clone()
    with pytest.raises(ValueError, match="sparse"):
        opt.fuse_step()
    assert torch.equal(emb.weight.detach(), before)


@pytest.mark.parametrize(
    "make, name",
    [
        (lambda ps: O.Adafactor(ps), "Adafactor"),
        (lambda ps: O.LBFGS(ps), "LBFGS"),
        (lambda ps: O.SparseAdam(ps), "SparseAdam"),
        (lambda ps: O.Muon([p for p in ps if p.dim() == 2]), "Muon"),
        (lambda ps: type("Lamb", (O.Adam,), {})(ps), "Lamb"),
    ],
)
def test_per_tensor_optimizers_are_refused(make, name):
    with pytest.raises(ValueError, match=f"cannot fuse {name}"):
        fuse_optimizer(make(list(Net().parameters())))


def test_the_guide_and_the_docstring_name_every_refused_optimizer():
    """The lists a user reads are the code's: every name the refusal matches, and torch's own."""
    from pathlib import Path

    guide = " ".join((Path(__file__).resolve().parents[2] / "docs" / "optimizers.md").read_text().lower().split())
    doc = " ".join(fused_mod.__doc__.lower().split())
    names = fused_mod._PER_TENSOR_NAMES.pattern.split("|") + ["lbfgs", "sparseadam"]
    for name in names:
        assert name in guide and name in doc, name


def test_grads_freed_by_zero_grad_set_to_none_warn_once_and_stay_correct():
    m1, o1, m2, o2 = twins(lambda m: torch.optim.Adam(groups(m), lr=1e-2, weight_decay=1e-2))
    fuse_optimizer(o2)
    with pytest.warns(FlattenWarning, match="set_to_none") as rec:
        for step in range(6):
            for m, o in ((m1, o1), (m2, o2)):
                o.zero_grad()  # set_to_none=True: frees the gradient views
                backward(m, step)
            o1.step()
            o2.fuse_step()
    assert sum(issubclass(w.category, FlattenWarning) for w in rec) == 1
    assert_same_params(m1, m2)
    assert all(p.grad._base is not None for p in m2.parameters())  # back in the flat buffer


def test_replaced_grad_param_and_state_are_repaired():
    m1, o1, m2, o2 = twins(lambda m: torch.optim.SGD(groups(m), lr=0.05, momentum=0.9, weight_decay=1e-2))
    fuse_optimizer(o2)
    for step in range(8):
        for m, o in ((m1, o1), (m2, o2)):
            o.zero_grad(set_to_none=False)
            backward(m, step)
        if step == 2:
            for m in (m1, m2):
                m.fc1.weight.grad = m.fc1.weight.grad * 0.5  # clipping that replaces the tensor
        if step == 4:
            o2.state[m2.fc2.weight]["momentum_buffer"] = o2.state[m2.fc2.weight]["momentum_buffer"].clone()
        if step == 5:
            for m in (m1, m2):
                m.fc1.bias.data = m.fc1.bias.data.clone() * 0.9
        o1.step()
        if step in (2, 4, 5):
            with pytest.warns(FlattenWarning, match=["gradient left", "state 'momentum_buffer'", ".data was replaced"][[2, 4, 5].index(step)]) as rec:
                o2.fuse_step()
            assert rec[0].filename == __file__  # points at the caller
        else:
            o2.fuse_step()
    assert o2._bagua_fuse.warned == {"grad", "state", "param"}
    assert_same_params(m1, m2)
    assert_same_state(o1, o2)
    b = o2._bagua_fuse.groups[0][2][0]
    assert len(b.runs) == 1 and not b.singles  # contiguity restored


def test_add_param_group_is_flattened_and_warned():
    m1, o1, m2, o2 = twins(lambda m: torch.optim.Adam([{"params": m.fc1.parameters()}], lr=1e-2))
    fuse_optimizer(o2)
    for step in range(6):
        if step == 2:
            o1.add_param_group({"params": list(m1.fc2.parameters()), "lr": 5e-3})
            o2.add_param_group({"params": list(m2.fc2.parameters()), "lr": 5e-3})
        for m, o in ((m1, o1), (m2, o2)):
            o.zero_grad(set_to_none=False)
            backward(m, step)
        o1.step()
        if step == 2:
            with pytest.warns(FlattenWarning, match="add_param_group"):
                o2.fuse_step()
        else:
            o2.fuse_step()
    assert_same_params(m1, m2)
    assert len(o2._bagua_fuse.groups) == 2


def test_check_flatten_false_is_silent():
    model = Net()
    opt = fuse_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), check_flatten=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FlattenWarning)
        for step in range(3):
            opt.zero_grad()
            backward(model, step)
            opt.fuse_step()


def test_lr_scheduler_hyperparameters_are_read_every_step():
    make = lambda m: torch.optim.SGD(groups(m), lr=0.1, momentum=0.9)  # noqa: E731
    m1, o1, m2, o2 = twins(make)
    fuse_optimizer(o2)
    s1 = torch.optim.lr_scheduler.LambdaLR(o1, lambda e: 0.7**e)
    s2 = torch.optim.lr_scheduler.LambdaLR(o2, lambda e: 0.7**e)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "lr_scheduler.step() before optimizer.step()" warning
        for step in range(8):
            for m, o in ((m1, o1), (m2, o2)):
                o.zero_grad(set_to_none=False)
                backward(m, step)
            o1.step()
            o2.fuse_step()
            s1.step()
            s2.step()
    assert o2.param_groups[0]["lr"] == pytest.approx(0.1 * 0.7**8)
    assert_same_params(m1, m2)


def test_gradient_clipping_on_views_works():
    m1, o1, m2, o2 = twins(lambda m: torch.optim.Adam(m.parameters(), lr=1e-2))
    fuse_optimizer(o2)
    for step in range(5):
        for m, o in ((m1, o1), (m2, o2)):
            o.zero_grad(set_to_none=False)
            backward(m, step)
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.01)
        o1.step()
        o2.fuse_step()
    assert_same_params(m1, m2)
    assert not o2._bagua_fuse.warned


def test_do_flatten_false_moves_nothing_and_matches():
    m1, o1, m2, o2 = twins(lambda m: torch.optim.RMSprop(groups(m), lr=1e-3, momentum=0.9))
    ptrs = [p.data_ptr() for p in m2.parameters()]
    fuse_optimizer(o2, do_flatten=False)
    assert [p.data_ptr() for p in m2.parameters()] == ptrs
    for step in range(6):
        for m, o in ((m1, o1), (m2, o2)):
            o.zero_grad(set_to_none=False)
            backward(m, step)
        o1.step()
        o2.fuse_step()
    assert [p.data_ptr() for p in m2.parameters()] == ptrs
    assert_same_params(m1, m2)
    assert_same_state(o1, o2)


def test_do_flatten_false_fuses_params_already_adjacent():
    flat = torch.randn(60)
    ps = [torch.nn.Parameter(flat[i * 20 : (i + 1) * 20]) for i in range(3)]
    gflat = torch.randn(60)
    for i, p in enumerate(ps):
        p.grad = gflat[i * 20 : (i + 1) * 20]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    for r, p in zip(ref, ps):
        r.grad = p.grad.clone()
    o_ref = torch.optim.SGD(ref, lr=0.1, weight_decay=0.1)
    opt = fuse_optimizer(torch.optim.SGD(ps, lr=0.1, weight_decay=0.1), do_flatten=False)
    for _ in range(3):
        o_ref.step()
        opt.fuse_step()
    b = opt._bagua_fuse.groups[0][2][0]
    assert len(b.runs) == 1 and b.runs[0].numel == 60 and not b.singles  # one flat update
    assert flat.data_ptr() == ps[0].data_ptr()  # in the caller's buffer, nothing moved
    for r, p in zip(ref, ps):
        torch.testing.assert_close(p.detach(), r.detach())
    # Adagrad allocates its state per parameter: not adjacent, so each param is its own run
    o_ref2 = torch.optim.Adagrad(ref, lr=0.1)
    opt2 = fuse_optimizer(torch.optim.Adagrad(ps, lr=0.1), do_flatten=False)
    for _ in range(3):
        o_ref2.step()
        opt2.fuse_step()
    assert len(opt2._bagua_fuse.groups[0][2][0].runs) == 3
    for r, p in zip(ref, ps):
        torch.testing.assert_close(p.detach(), r.detach())


def test_steady_state_takes_the_fast_path_and_leaves_groups_as_they_were(monkeypatch):
    m1, o1, m2, o2 = twins(lambda m: torch.optim.Adam(groups(m), lr=1e-2))
    fuse_optimizer(o2)
    calls = []
    real = FlatBucket.analyze
    monkeypatch.setattr(FlatBucket, "analyze", lambda self, st: (calls.append(1), real(self, st))[1])
    for step in range(6):
        for m, o in ((m1, o1), (m2, o2)):
            o.zero_grad(set_to_none=False)
            backward(m, step)
        o1.step()
        o2.fuse_step()
    # 2 buckets analysed at the first step, again after the state was created, then never
    assert len(calls) == 4
    assert o1.state_dict()["param_groups"] == o2.state_dict()["param_groups"]  # fused/foreach restored
    assert o2.param_groups[0]["fused"] is None and o2.param_groups[0]["foreach"] is None
    assert_same_params(m1, m2)


@pytest.mark.parametrize("numel, chunk, want", [
    (10, 4, [(0, 4), (4, 8), (8, 10)]),
    (9, 4, [(0, 4), (4, 9)]),  # a 1-element tail is merged: no piece is mistaken for a scalar
    (1000 + 100, 1000, [(0, 1100)]),  # tails under a quarter chunk are merged too
    (5, 100, [(0, 5)]),
])
def test_chunk_bounds(numel, chunk, want):
    assert fused_mod._chunk_bounds(numel, chunk) == want
