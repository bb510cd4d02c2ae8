"""What the datasets_files tests of several tiers share."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np

from tests.support.data_files import MNIST_STEMS, cifar_batch, write_idx


def _mnist_arrays(seed: int = 0, classes: int = 10, low: int = 0) -> dict[str, np.ndarray]:
    """Train (6) and test (4) images and labels, distinct per sample."""
    rng = np.random.default_rng(seed)
    arrays = {}
    for part, n in (("train", 6), ("test", 4)):
        arrays[f"{part}_x"] = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        arrays[f"{part}_y"] = rng.integers(low, low + classes, size=n).astype(np.uint8)
    return arrays


def _write_mnist(directory: Path, arrays: dict[str, np.ndarray], gz: bool = False) -> list[Path]:
    keys = ("train_x", "train_y", "test_x", "test_y")
    return [write_idx(directory / stem, arrays[key], gz) for stem, key in zip(MNIST_STEMS, keys, strict=True)]


def _write_cifar10(root: Path, per_batch: int = 4, seed: int = 0) -> list[dict[bytes, object]]:
    rng = np.random.default_rng(seed)
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True, exist_ok=True)
    batches = []
    for name in (*(f"data_batch_{k}" for k in range(1, 6)), "test_batch"):
        batch = cifar_batch(per_batch, b"labels", 10, rng)
        (folder / name).write_bytes(pickle.dumps(batch, protocol=2))
        batches.append(batch)
    return batches
