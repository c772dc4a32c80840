"""The wrapper on CUDA (marked ``gpu``; skipped without a CUDA device; run by ``make gpu-check``).

- Two ranks sharing one GPU over Gloo with CUDA tensors (NCCL refuses two ranks on one GPU): the
  engine's side stream and events under real asynchrony, every algorithm for a few steps, the
  result equal to the same job on CPU within the algorithm's tolerance (exact algorithms: float32
  rounding of a different summation order; 8-bit ones: a code may flip when its input moves by
  rounding, one quantization step; async, whose rounds depend on timing: within twice its move of
  CPU's result, and its loss at most ``LEARNED`` times the start's).
- One rank on NCCL: bit-equal to torch DDP on the same loop, with the fused optimizer's Triton
  kernel in the loop.
- SyncBatchNorm on CUDA tensors against BatchNorm over the whole batch.
- qadam's momentum averaged during backward (on the engine's side stream) against averaged in
  ``step()``: the same bits.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import bagua
from bagua.algorithms.qadam_speculation import SpeculationStats
from tests.harness import run_ranks
from tests.parallel.models import set_flat_params

HAS_CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")]

STEPS = 4
ALGORITHMS = ["gradient_allreduce", "bytegrad", "decentralized", "low_precision_decentralized", "qadam", "async"]
EXACT = {"gradient_allreduce", "decentralized"}  # fp32 on the wire
IDENTICAL = {"gradient_allreduce", "bytegrad", "qadam"}  # replicas identical on every rank
# the loss over both ranks' batches after STEPS steps, at most this fraction of the start's (every
# algorithm on CPU: 0.65 to 0.71; a model that never trained: 1)
LEARNED = 0.85


def _model(device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4)
    ).to(device)


def _batches(rank: int, device: str):
    g = torch.Generator().manual_seed(1000 + rank)
    xs = [torch.randn(16, 32, generator=g) for _ in range(STEPS)]
    return [(x.to(device), x[:, :4].argmax(dim=1).to(device)) for x in xs]


def _algorithm(name: str, opt):
    if name == "qadam":
        return bagua.algorithms.QAdamAlgorithm(opt)
    if name == "async":
        return bagua.algorithms.AsyncModelAverageAlgorithm(sync_interval_ms=1, warmup_steps=1)
    return name


def _optimizer(name: str, model):
    if name == "qadam":
        return bagua.optim.QAdamOptimizer(model.parameters(), lr=1e-2, warmup_steps=2)
    return torch.optim.Adam(model.parameters(), lr=1e-2)


def _train_every_algorithm(rank: int, device: str) -> dict:
    """Each algorithm's final weights (flat, on CPU) after STEPS steps on ``device``."""
    out = {}
    for name in ALGORITHMS:
        model = _model(device)
        opt = _optimizer(name, model)
        algorithm = _algorithm(name, opt)
        ddp = bagua.DistributedDataParallel(model, optimizers=[opt], algorithm=algorithm)
        for x, y in _batches(rank, device):
            opt.zero_grad()
            F.cross_entropy(ddp(x), y).backward()
            opt.step()
        if name == "async":
            algorithm.abort(ddp)  # stops on every rank with identical weights
        if device == "cuda":
            torch.cuda.synchronize()
        out[name] = torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()])
    return out


def _loss(flat: torch.Tensor) -> float:
    """The mean loss of ``_model`` with the weights ``flat`` over both ranks' batches, on CPU."""
    model = _model("cpu")
    set_flat_params(model, flat)
    with torch.no_grad():
        losses = [F.cross_entropy(model(x), y) for rank in range(2) for x, y in _batches(rank, "cpu")]
    return float(torch.stack(losses).mean())


@pytest.fixture(scope="module")
def cuda_and_cpu_runs():
    init = {"backend": "gloo"}
    cuda = run_ranks(_train_every_algorithm, 2, "cuda", init_kwargs=init, timeout=120)
    cpu = run_ranks(_train_every_algorithm, 2, "cpu", init_kwargs=init, timeout=120)
    start = torch.cat([p.detach().reshape(-1) for p in _model("cpu").parameters()])
    return cuda, cpu, start


@pytest.mark.parametrize("name", ALGORITHMS)
def test_gloo_cuda_tensors_match_the_cpu_path(cuda_and_cpu_runs, name):
    cuda, cpu, start = cuda_and_cpu_runs
    for rank in range(2):
        got, want = cuda[rank][name], cpu[rank][name]
        assert torch.isfinite(got).all()
        moved = float((want - start).abs().max())
        diff = float((got - want).abs().max())
        if name == "async":  # averaging rounds depend on timing: moved alike and learned, not equal
            assert diff <= 2 * moved, f"async on CUDA moved {diff:.3g} away from CPU (update scale {moved:.3g})"
            loss, first = _loss(got), _loss(start)
            assert loss <= LEARNED * first, f"async on CUDA rank {rank}: loss {loss:.4f}, {first:.4f} at the start"
            continue
        tolerance = 1e-4 * moved + 1e-6 if name in EXACT else 0.05 * moved
        assert diff <= tolerance, f"{name} rank {rank}: CUDA vs CPU max |diff| {diff:.3g} > {tolerance:.3g}"
    if name in IDENTICAL or name == "async":
        assert torch.equal(cuda[0][name], cuda[1][name]), f"{name}: replicas differ across ranks on CUDA"


def _nccl_one_rank(rank: int) -> dict:
    assert bagua.comm.get_default_group().backend_for("cuda") == "nccl"
    results = {}
    for wrapper in ("torch", "bagua"):
        model = _model("cuda")
        opt = bagua.optim.fuse_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01))
        if wrapper == "torch":
            ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[0])
        else:
            ddp = bagua.DistributedDataParallel(model, optimizers=[opt], algorithm="gradient_allreduce")
        for x, y in _batches(rank, "cuda"):
            opt.zero_grad(set_to_none=False)
            F.cross_entropy(ddp(x), y).backward()
            opt.fuse_step()  # the Triton AdamW kernel over the flat buffers
        torch.cuda.synchronize()
        results[wrapper] = torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()])
    results["kernel_updates"] = bagua.optim.fused.fused_update_count(opt)
    return results


def test_one_rank_on_nccl_equals_torch_ddp():
    (res,) = run_ranks(_nccl_one_rank, 1, init_kwargs={}, timeout=90)
    assert torch.equal(res["bagua"], res["torch"])
    assert res["kernel_updates"] > 0


def _qadam_both_ways(rank: int) -> dict:
    """qadam's momentum averaged during backward on the engine's side stream, and in step(): 8
    steps, fused; step 5 is clipped hard (a miss)."""
    out = {}
    for overlap in (True, False):
        model = _model("cuda")
        opt = bagua.optim.fuse_optimizer(_optimizer("qadam", model))
        ddp = bagua.DistributedDataParallel(model, [opt], bagua.algorithms.QAdamAlgorithm(opt, overlap=overlap),
                                            bucket_size_bytes=8192)
        for step, (x, y) in enumerate(_batches(rank, "cuda") * 2):
            opt.zero_grad()
            F.cross_entropy(ddp(x), y).backward()
            if step == 5:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
            opt.fuse_step()
        torch.cuda.synchronize()
        out[overlap] = (torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()]), ddp.impl.speculation.stats)
        ddp.close()
    return out


def test_qadam_overlapped_on_cuda_has_the_bits_of_averaging_in_step():
    results = run_ranks(_qadam_both_ways, 2, init_kwargs={"backend": "gloo"}, timeout=120)
    for r in results:
        assert torch.equal(r[True][0], r[False][0])
        # steps 2-7 after warm-up: 2-4 hit, 5 (clipped) misses, 6 pauses, 7 probes
        assert r[True][1] == SpeculationStats(hits=3, misses=1, paused=1, probes=1)
    assert torch.equal(results[0][True][0], results[1][True][0])


def _sync_batchnorm(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    x_all = torch.randn(8, 6, 5, device="cuda") * 3 + 1
    mine = x_all[4 * rank:4 * rank + 4].clone().requires_grad_(True)
    bn = bagua.parallel.SyncBatchNorm(6).cuda()
    out = bn(mine)
    (out * torch.arange(5, device="cuda")).sum().backward()
    torch.cuda.synchronize()
    return out.detach().cpu(), mine.grad.cpu()


def test_sync_batchnorm_on_cuda_matches_whole_batch():
    res = run_ranks(_sync_batchnorm, 2, init_kwargs={"backend": "gloo"}, timeout=120)
    torch.manual_seed(0)
    x_all = (torch.randn(8, 6, 5, device="cuda") * 3 + 1).requires_grad_(True)
    out = torch.nn.BatchNorm1d(6).cuda()(x_all)
    (out * torch.arange(5, device="cuda")).sum().backward()
    torch.testing.assert_close(torch.cat([r[0] for r in res]), out.detach().cpu(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat([r[1] for r in res]), x_all.grad.cpu(), rtol=1e-4, atol=1e-5)
