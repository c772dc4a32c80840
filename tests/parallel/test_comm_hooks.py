"""bagua.comm_hooks on real ranks: torch's own DistributedDataParallel with our hook sends the bits
of bagua's wrapper with the same algorithm (bytegrad, onebit_grad with error feedback, through
torch's rebucketing after its first iteration), resumes exactly from a checkpoint of the hook's
state, and moves the bytes the codec promises."""

from __future__ import annotations

import datetime
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import bagua
import bagua.comm_hooks
from tests.harness import run_ranks
from tests.parallel.models import flat_params, make_model, rank_batches

STEPS = 6
SPLIT = 3  # the resumed run stops and restarts after this many steps


def _torch_ddp(options: dict, bucket_cap_mb: float = 0.004, device: str = "cpu"):
    model = make_model(width=256).to(device)  # 4.6k parameters: several codec blocks and, at 4 KB, several buckets
    ids = {"device_ids": [0]} if device == "cuda" else {}
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb, **ids)
    algorithm = options.pop("algorithm")
    state = bagua.comm_hooks.register(ddp, algorithm, **options)
    return model, ddp, state, torch.optim.SGD(model.parameters(), lr=0.05)


def _train(ddp, opt, batches, sent: list | None = None) -> list[torch.Tensor]:
    trace = []
    for x, y in batches:
        opt.zero_grad()
        before = bagua.comm.bytes_sent() if bagua.is_initialized() else 0
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
        if sent is not None:
            sent.append(bagua.comm.bytes_sent() - before)
        trace.append(flat_params(ddp.module if hasattr(ddp, "module") else ddp).cpu())
    return trace


def _hook_against_wrapper(rank: int, options: dict, device: str = "cpu") -> dict:
    dist.init_process_group("gloo")  # a plain torch job: the hook joins it at its first call
    batches = [(x.to(device), y.to(device)) for x, y in rank_batches(rank, STEPS)]
    layouts = []
    model, ddp, state, opt = _torch_ddp(dict(options), device=device)
    hook = state.allreduce

    def spy(bucket):  # the bucket layouts torch hands over, before and after its rebucketing
        layouts.append((state.steps, tuple(g.numel() for g in bucket.gradients())))
        return hook(bucket)

    state.allreduce = spy
    hooked_bytes = []
    hooked = _train(ddp, opt, batches, hooked_bytes)
    residuals = state.state_dict().get("residuals")

    # the same algorithm through bagua's wrapper, same model, seeds and data
    name = options.pop("algorithm")
    model = make_model(width=256).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    wrapped = bagua.DistributedDataParallel(model, [opt], name, **options)
    native_bytes = []
    native = _train(wrapped, opt, batches, native_bytes)
    native_residuals = wrapped.impl.state_dict() if name == "onebit_grad" else None
    wrapped.close()
    return {"hooked": hooked, "native": native, "layouts": layouts, "residuals": residuals,
            "native_residuals": native_residuals, "bytes": (hooked_bytes, native_bytes)}


def _assert_same_as_wrapper(results: list[dict]) -> None:
    for r in results:
        for step, (a, b) in enumerate(zip(r["hooked"], r["native"])):
            assert torch.equal(a, b), f"step {step + 1}: torch DDP + hook differs from bagua's wrapper"
        assert torch.equal(r["hooked"][-1], results[0]["hooked"][-1])  # identical replicas
        # the steps after torch's rebucketing (the first steps add one-time checks of each new layout)
        hooked_bytes, native_bytes = (sum(sent[2:]) for sent in r["bytes"])
        assert hooked_bytes > 0 and abs(hooked_bytes - native_bytes) <= 0.05 * native_bytes, r["bytes"]


def test_bytegrad_hook_sends_the_wrappers_bits():
    results = run_ranks(_hook_against_wrapper, 2, {"algorithm": "bytegrad"}, timeout=120, init=False)
    _assert_same_as_wrapper(results)
    assert not torch.equal(results[0]["hooked"][0], results[0]["hooked"][-1])  # it trained


def test_onebit_hook_carries_its_residuals_through_torchs_rebucketing():
    options = {"algorithm": "onebit_grad", "warmup_steps": 0}  # residuals from the first step on
    results = run_ranks(_hook_against_wrapper, 2, options, timeout=120, init=False)
    _assert_same_as_wrapper(results)
    by_step = {}
    for step, numels in results[0]["layouts"]:
        by_step.setdefault(step, []).append(numels)
    assert by_step[0] != by_step[1], by_step  # torch rebuilt its buckets after the first step
    assert all(by_step[s] == by_step[1] for s in range(1, STEPS)), by_step
    for r in results:
        mine, native = r["residuals"]["worker"], r["native_residuals"]["worker"]
        assert len(mine) == len(native) == 6
        flat_mine = torch.cat([mine[k].reshape(-1) for k in sorted(mine)])
        flat_native = torch.cat([native[k].reshape(-1) for k in sorted(native)])
        assert flat_mine.abs().sum() > 0 and torch.equal(flat_mine, flat_native)


def _resume(rank: int, options: dict) -> dict:
    dist.init_process_group("gloo")
    batches = rank_batches(rank, STEPS)
    _, ddp, state, opt = _torch_ddp(dict(options))
    whole = _train(ddp, opt, batches)
    state.close()

    model, ddp, state, opt = _torch_ddp(dict(options))
    _train(ddp, opt, batches[:SPLIT])
    saved = {"model": {k: v.clone() for k, v in model.state_dict().items()}, "opt": opt.state_dict(),
             "hook": state.state_dict()}
    state.close()
    # a new process's view: a fresh model, wrapper and hook state, loaded before the first step
    model, ddp, state, opt = _torch_ddp(dict(options))
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    state.load_state_dict(saved["hook"])
    resumed = _train(ddp, opt, batches[SPLIT:])
    return {"whole": whole, "resumed": resumed, "steps": state.steps, "saved": saved["hook"]}


def test_onebit_hook_resumes_exactly_from_its_state():
    options = {"algorithm": "onebit_grad", "warmup_steps": 2}
    results = run_ranks(_resume, 2, options, timeout=120, init=False)
    for r in results:
        assert r["saved"]["steps"] == SPLIT and r["steps"] == STEPS
        assert any(t.abs().sum() > 0 for t in r["saved"]["residuals"]["worker"].values())
        for step, (a, b) in enumerate(zip(r["whole"][SPLIT:], r["resumed"])):
            assert torch.equal(a, b), f"resumed step {SPLIT + step + 1} differs"


def _bad_options(rank: int) -> list[str]:
    errors = []
    for name, options in (("gradient_allreduce", {}), ("bytegrad", {"average": False}), ("bytegrad", {"block_size": 3}),
                          ("onebit_grad", {"warmup_steps": -1})):
        try:
            bagua.comm_hooks.CompressionHookState(name, **options)
        except (ValueError, TypeError) as e:
            errors.append(str(e))
    try:
        bagua.comm_hooks.register(make_model(), "bytegrad")
    except TypeError as e:
        errors.append(str(e))
    return errors


def test_bad_hook_options_fail_where_the_state_is_built():
    errors = run_ranks(_bad_options, 1, init=False)[0]
    assert len(errors) == 5, errors
    assert "gradient_allreduce" in errors[0] and "average=False" in errors[1] and "block_size" in errors[2]
    assert "warmup_steps" in errors[3] and "DistributedDataParallel" in errors[4]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("algorithm", ["bytegrad", "onebit_grad"])
def test_the_hook_on_cuda_tensors_sends_the_wrappers_bits(algorithm):
    # two ranks sharing one GPU over Gloo with CUDA tensors (NCCL refuses two ranks on one GPU):
    # the hook's CUDA path (in the hook, on the current stream) against the wrapper's
    options = {"algorithm": algorithm, **({"warmup_steps": 1} if algorithm == "onebit_grad" else {})}
    results = run_ranks(_hook_against_wrapper, 2, options, "cuda", timeout=150, init=False)
    _assert_same_as_wrapper(results)


class _WithUnused(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = make_model(width=256)
        self.unused = torch.nn.Linear(4, 4)  # no gradient: torch DDP sends its bitmap of unused parameters

    def forward(self, x):
        return self.net(x)


def _find_unused(rank: int) -> list[float]:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    model = _WithUnused()
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.004, find_unused_parameters=True)
    bagua.comm_hooks.register(ddp, "bytegrad")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for x, y in rank_batches(rank, 150):  # torch DDP's bitmap allreduce during every backward, beside the hook's
        opt.zero_grad()
        loss = F.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_the_hook_beside_torch_ddps_own_collectives_with_find_unused_parameters():
    # the hook's thread has a communicator of its own: on torch DDP's group the two ranks could
    # issue the hook's allreduce and torch's bitmap allreduce in different orders and wait forever
    losses = run_ranks(_find_unused, 2, timeout=120, init=False)
    assert all(len(l) == 150 for l in losses)


def _everyday_loop(rank: int, via: str) -> dict:
    """onebit_grad (error feedback from step 2) in a loop as people train: accumulation of two
    half-batches under no_sync, GradScaler with an overflowing step 3 on rank 1, clip_grad_norm_
    after unscale_; through torch DDP with the hook, or through bagua's wrapper."""
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    model = make_model(width=256)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if via == "hook":
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.004)
        state = bagua.comm_hooks.register(ddp, "onebit_grad", warmup_steps=1)
    else:
        ddp = bagua.DistributedDataParallel(model, [opt], "onebit_grad", warmup_steps=1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1000)
    trace, scales = [], []
    for step, (x, y) in enumerate(rank_batches(rank, STEPS)):
        opt.zero_grad()
        (x0, x1), (y0, y1) = x.chunk(2), y.chunk(2)
        with ddp.no_sync():
            scaler.scale(F.cross_entropy(ddp(x0), y0) / 2).backward()
        loss = F.cross_entropy(ddp(x1), y1) / 2
        if step == 2 and rank == 1:
            loss = loss * math.inf
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        trace.append(flat_params(model))
    if via == "hook":
        state.close()
    else:
        ddp.close()
    return {"trace": trace, "scales": scales}


def _both_ways(rank: int) -> dict:
    return {via: _everyday_loop(rank, via) for via in ("hook", "wrapper")}


def test_the_hook_in_the_everyday_loop_equals_bagua_s_wrapper():
    results = run_ranks(_both_ways, 2, timeout=120, init=False)
    for r in results:
        hook, wrapper = r["hook"], r["wrapper"]
        for step, (a, b) in enumerate(zip(hook["trace"], wrapper["trace"])):
            assert torch.equal(a, b), f"step {step + 1}: torch DDP + hook differs from bagua's wrapper"
        assert hook["scales"] == wrapper["scales"] == [1024.0, 1024.0, 512.0] + [512.0] * (STEPS - 3)
        assert torch.equal(hook["trace"][2], hook["trace"][1])  # the overflow step was skipped on this rank too
        assert not torch.equal(hook["trace"][-1], hook["trace"][2])  # and it trained on afterwards
    assert torch.equal(results[0]["hook"]["trace"][-1], results[1]["hook"]["trace"][-1])
