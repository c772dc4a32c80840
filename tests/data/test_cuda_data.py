"""The data side with CUDA tensors (marked ``gpu``; skipped without a CUDA device; run by
``make gpu-check``): the LMDB cache, the load-balanced sampler and a checkpoint round trip.

A cache holds values, not devices: a CUDA tensor in a sample is stored as its bytes and comes
back from the cache on the CPU (as every DataLoader sample does; move it in the training loop).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import bagua
from bagua.checkpoint import load_checkpoint, save_checkpoint
from tests.harness import run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


class _CudaSamples(torch.utils.data.Dataset):
    def __init__(self):
        self.calls = 0

    def __len__(self):
        return 6

    def __getitem__(self, i):
        self.calls += 1
        g = torch.Generator().manual_seed(i)
        x = torch.randn(3, 5, generator=g).cuda()
        return {"x": x, "y": torch.tensor(i, device="cuda"), "half": x.to(torch.bfloat16)}


def test_lmdb_cache_serves_cuda_samples_by_value(tmp_path, monkeypatch):
    monkeypatch.setenv("BAGUA_CACHE_DIR", str(tmp_path))  # (the cache_dir fixture needs redis)
    source = _CudaSamples()
    ds = bagua.data.CachedDataset(source, backend="lmdb", dataset_name="cuda-samples")
    first = [ds[i] for i in range(len(ds))]
    ds.flush()
    again = bagua.data.CachedDataset(_CudaSamples(), backend="lmdb", dataset_name="cuda-samples")
    for i, want in enumerate(first):
        got = again[i]
        for key in want:
            assert torch.equal(got[key].cpu(), want[key].cpu()), (i, key)
            assert got[key].dtype == want[key].dtype
    assert again.dataset.calls == 0, "cached samples were computed again"
    ds.close()
    again.close()


def test_sampler_takes_cuda_complexities():
    lengths = torch.tensor([5.0, 1.0, 9.0, 3.0, 7.0, 2.0, 8.0, 4.0])
    on_cpu = bagua.data.LoadBalancingDistributedSampler(range(8), complexities=lengths, num_replicas=2, rank=1, seed=3)
    on_gpu = bagua.data.LoadBalancingDistributedSampler(range(8), complexities=lengths.cuda(), num_replicas=2, rank=1, seed=3)
    assert list(on_gpu) == list(on_cpu)


def _resume_on_cuda(rank: int, path: str) -> dict:
    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)).cuda()
        opt = bagua.optim.fuse_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
        return bagua.DistributedDataParallel(model, [opt], algorithm="bytegrad"), opt

    g = torch.Generator().manual_seed(7)
    batches = [(torch.randn(4, 8, generator=g).cuda(), torch.randint(0, 2, (4,), generator=g).cuda()) for _ in range(6)]

    def steps(ddp, opt, part):
        for x, y in part:
            opt.zero_grad()
            F.cross_entropy(ddp(x), y).backward()
            opt.step()

    ddp, opt = build()
    steps(ddp, opt, batches[:3])
    save_checkpoint(path, step=3, model=ddp, optimizers=[opt])
    steps(ddp, opt, batches[3:])
    straight = [p.detach().cpu() for p in ddp.parameters()]

    ddp2, opt2 = build()
    assert load_checkpoint(path, model=ddp2, optimizers=[opt2]) == 3
    devices = {s.device.type for st in opt2.state.values() for s in st.values() if isinstance(s, torch.Tensor) and s.dim()}
    steps(ddp2, opt2, batches[3:])
    resumed = [p.detach().cpu() for p in ddp2.parameters()]
    return {"equal": all(torch.equal(a, b) for a, b in zip(straight, resumed)), "state_devices": devices}


def test_checkpoint_round_trip_with_cuda_tensors_resumes_exactly(tmp_path):
    (res,) = run_ranks(_resume_on_cuda, 1, str(tmp_path / "ckpt.pt"), init_kwargs={}, timeout=90)
    assert res["state_devices"] == {"cuda"}
    assert res["equal"], "the resumed run differs from the uninterrupted one"
