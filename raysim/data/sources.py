"""Dataset sources: each returns a whole dataset as numpy arrays, loaded once in the driver.

The driver puts the arrays into Ray's object store once; host actors read them zero-copy and only
ever receive index arrays for their clients.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from raysim.data.fashion_mnist import load_fashion_mnist
from raysim.errors import DataError

Task = Literal["classification", "regression"]


@dataclass(frozen=True)
class Dataset:
    """A whole dataset in memory.

    `x` is float32 of shape (n, *input_shape); `y` is int64 class labels for classification and
    float32 targets for regression.
    """

    name: str
    x: np.ndarray
    y: np.ndarray
    num_classes: int
    task: Task = "classification"
    groups: np.ndarray | None = None
    """A natural id per sample (writer, speaker) for the `natural` partition; None if the dataset has none."""

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x.shape[1:])

    @property
    def output_dim(self) -> int:
        return self.num_classes if self.task == "classification" else 1

    def __len__(self) -> int:
        return len(self.y)


# Fashion-MNIST is normalized with MNIST's constants, as in the FLAME authors' code (flame.md 11).
MNIST_MEAN, MNIST_STD = 0.1307, 0.3081


def fashion_mnist(root: str | Path | None = None, download: bool = True) -> Dataset:
    """The 70,000 Fashion-MNIST images (official train + test, as FLAME uses them, flame.md 6.1)."""
    images, labels = load_fashion_mnist(root, download=download)
    x = ((images.astype(np.float32) / 255.0 - MNIST_MEAN) / MNIST_STD)[:, None, :, :]
    return Dataset("fashion_mnist", np.ascontiguousarray(x), labels.astype(np.int64), num_classes=10)


def digits() -> Dataset:
    """scikit-learn's 1,797 8x8 handwritten digits (shipped inside the wheel; no download)."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = (bunch.images.astype(np.float32) / 16.0 - 0.5) / 0.5
    return Dataset("digits", x[:, None, :, :], bunch.target.astype(np.int64), num_classes=10)


def synthetic_classification(
    num_samples: int = 2000, num_features: int = 20, num_classes: int = 4, seed: int = 0
) -> Dataset:
    """Gaussian class clusters: a small, fast, learnable task for tests."""
    generator = np.random.default_rng(seed)
    centers = generator.normal(0.0, 2.0, size=(num_classes, num_features))
    y = generator.integers(0, num_classes, size=num_samples)
    x = centers[y] + generator.normal(size=(num_samples, num_features))
    return Dataset("synthetic_classification", x.astype(np.float32), y.astype(np.int64), num_classes)


def synthetic_regression(num_samples: int = 1000, num_features: int = 5, noise: float = 0.1, seed: int = 0) -> Dataset:
    """y = x . theta + noise, the linear-regression task of FLAME's convex analysis (flame.md 1.6)."""
    generator = np.random.default_rng(seed)
    theta = generator.normal(size=num_features)
    x = generator.normal(size=(num_samples, num_features))
    y = x @ theta + noise * generator.normal(size=num_samples)
    return Dataset("synthetic_regression", x.astype(np.float32), y.astype(np.float32), 0, "regression")


SOURCES = ("fashion_mnist", "digits", "synthetic_classification", "synthetic_regression")


def load_dataset(name: str, root: str | Path | None = None, download: bool = True, seed: int = 0) -> Dataset:
    """Load a dataset by its config name (`dataset.name`)."""
    if name == "fashion_mnist":
        return fashion_mnist(root, download=download)
    if name == "digits":
        return digits()
    if name == "synthetic_classification":
        return synthetic_classification(seed=seed)
    if name == "synthetic_regression":
        return synthetic_regression(seed=seed)
    raise DataError(f"dataset.name: unknown dataset {name!r}; allowed: {', '.join(SOURCES)}")
