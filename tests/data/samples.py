"""Datasets for the cache tests (module-level so spawned workers can unpickle them)."""

from __future__ import annotations

import os
import time

import numpy as np
import torch


def make_sample(i: int):
    """A deterministic sample with the usual mix of types, including a NaN (bitwise check)."""
    g = torch.Generator().manual_seed(i)
    img = torch.randn(3, 8, 8, generator=g)
    img[0, 0, 0] = float("nan") if i % 7 == 0 else img[0, 0, 0]
    feats = np.random.default_rng(i).standard_normal(16).astype(np.float32)
    return img, feats, i % 10, {"name": f"s{i}", "half": torch.tensor(i, dtype=torch.float16)}


def same(a, b) -> bool:
    """Equal values with equal types, tensors and arrays compared bit for bit."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return (a.dtype == b.dtype and a.shape == b.shape and a.requires_grad == b.requires_grad
                and torch.equal(a.detach().contiguous().view(-1).view(torch.uint8),
                                b.detach().contiguous().view(-1).view(torch.uint8)))
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


class SampleDataset(torch.utils.data.Dataset):
    """``make_sample(i)`` for i < n; counts computations in this process."""

    def __init__(self, n: int, cost_s: float = 0.0):
        self.n, self.cost_s, self.computed = n, cost_s, 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if not 0 <= i < self.n:
            raise IndexError(i)
        self.computed += 1
        if self.cost_s:
            time.sleep(self.cost_s)
        return make_sample(i)


class LoggingDataset(SampleDataset):
    """Also appends "pid index" lines to a file, to count computations across processes."""

    def __init__(self, n: int, log_path: str):
        super().__init__(n)
        self.log_path = log_path

    def __getitem__(self, i: int):
        with open(self.log_path, "a") as f:
            f.write(f"{os.getpid()} {i}\n")
        return super().__getitem__(i)


class Unpicklable:
    def __reduce__(self):
        raise TypeError("this object refuses to be pickled")


class BadSampleDataset(SampleDataset):
    """Index 3 returns an object that cannot be pickled."""

    def __getitem__(self, i: int):
        return (Unpicklable(), i) if i == 3 else super().__getitem__(i)


class BigSampleDataset(torch.utils.data.Dataset):
    """16 KB float32 arrays, ``np.full(4096, i)``."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return np.full(4096, i, dtype=np.float32)
