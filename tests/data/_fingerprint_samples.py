"""Datasets and transforms for the fingerprint tests (module-level, so spawned workers import them)."""

from __future__ import annotations

import functools

import torch

from bagua.data.fingerprint import dataset_fingerprint


class Numbers(torch.utils.data.Dataset):
    """``transform(i)`` for i < n; counts the calls in this process."""

    def __init__(self, n: int, transform):
        self.n, self.transform, self.calls = n, transform, 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if not 0 <= i < self.n:
            raise IndexError(i)
        self.calls += 1
        return self.transform(i)


def scale(factor: int):
    """A closure over ``factor`` and a set of strings (its order follows PYTHONHASHSEED)."""
    names = {"alpha", "beta", "gamma", "delta", "epsilon"}
    return lambda i: i * factor + 0 * len(names)


class Shift:
    """A transform object with object's repr (its fields are what tell two apart)."""

    def __init__(self, by: int):
        self.by = by

    def __call__(self, i: int) -> int:
        return i + self.by


def power(i: int, exponent: int) -> int:
    return i ** exponent


def numbers_with(transform: str) -> Numbers:
    """The transforms the tests switch between, by name."""
    return Numbers(20, {"x1": scale(1), "x10": scale(10), "shift1": Shift(1), "shift2": Shift(2),
                        "square": functools.partial(power, exponent=2), "cube": functools.partial(power, exponent=3)}[transform])


class FingerprintsInWorker(torch.utils.data.Dataset):
    """Each item: the fingerprints of ``numbers_with(t)`` for each of ``transforms``, computed in
    the process reading it."""

    def __init__(self, transforms: list[str]):
        self.transforms = transforms

    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int) -> list[str]:
        return [dataset_fingerprint(numbers_with(t), version="v1").digest for t in self.transforms]
