"""What the original examples take from torchvision, without torchvision or a download:
``datasets.MNIST`` serves scikit-learn's 1797 handwritten 8x8 digits (shipped with the package,
read from its ``digits.csv.gz`` as ``sklearn.datasets.load_digits`` reads it, without importing
scikit-learn: that import, which pulls in SciPy, costs each rank about a second) scaled up to MNIST's 28x28 uint8 images (80% train, 20% test, a fixed split),
``transforms.Compose``/``ToTensor``/``Normalize`` do what torchvision's do to such an image, and
``models.small_cnn`` stands in for torchvision's ImageNet models in the synthetic benchmark
(3x224x224 images, 1000 classes; a ResNet-50 step takes seconds on 2 CPU cores).

Example::

    from mnist_from_digits import datasets, transforms
    ds = datasets.MNIST("../data", train=True, download=True,
                        transform=transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.1307,), (0.3081,))]))
    image, label = ds[0]          # float32 [1, 28, 28], int
"""

from __future__ import annotations

import gzip
import importlib.util
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch


def load_digits_xy():
    """``sklearn.datasets.load_digits(return_X_y=True)``: the same file, parsed the same way."""
    sklearn_dir = Path(importlib.util.find_spec("sklearn").submodule_search_locations[0])
    with gzip.open(sklearn_dir / "datasets" / "data" / "digits.csv.gz", "rt") as compressed:
        data = np.loadtxt(compressed, delimiter=",")
    return data[:, :-1], data[:, -1].astype(int, copy=False)


class MNIST(torch.utils.data.Dataset):
    def __init__(self, root: str, train: bool = True, download: bool = False, transform=None):
        x, y = load_digits_xy()
        order = np.random.default_rng(0).permutation(len(y))
        cut = int(0.8 * len(y))
        keep = order[:cut] if train else order[cut:]
        small = torch.tensor(x[keep] * (255.0 / 16.0), dtype=torch.float32).view(-1, 1, 8, 8)
        big = torch.nn.functional.interpolate(small, size=(28, 28), mode="bilinear", align_corners=False)
        self.data = big.round().clamp(0, 255).to(torch.uint8).squeeze(1).numpy()
        self.targets = [int(label) for label in y[keep]]
        self.transform = transform

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int):
        image = self.data[index]
        return (self.transform(image) if self.transform else image), self.targets[index]


class Compose:
    def __init__(self, steps):
        self.steps = list(steps)

    def __call__(self, image):
        for step in self.steps:
            image = step(image)
        return image


class ToTensor:
    def __call__(self, image: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(image)).float().div(255.0).unsqueeze(0)


class Normalize:
    def __init__(self, mean, std):
        self.mean = torch.tensor(mean).view(-1, 1, 1)
        self.std = torch.tensor(std).view(-1, 1, 1)

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        return (tensor - self.mean) / self.std


def small_cnn() -> torch.nn.Module:
    """An ImageNet-shaped classifier small enough for a CPU test."""
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, kernel_size=8, stride=8), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(4),
        torch.nn.Flatten(), torch.nn.Linear(128, 1000),
    )


datasets = SimpleNamespace(MNIST=MNIST)
models = SimpleNamespace(small_cnn=small_cnn)
transforms = SimpleNamespace(Compose=Compose, ToTensor=ToTensor, Normalize=Normalize)
