"""A tiny CIFAR-shaped uint8 image source with crop-and-flip augmentation, and the runs of its tests."""

from __future__ import annotations

import numpy as np

from raysim.config import validate_config
from raysim.data.dataset import Dataset
from tests.support.experiments import tiny_config

MEAN, STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


SHAPE = (3, 8, 8)


def images(n: int, seed: int, low: int = 0) -> tuple[np.ndarray, np.ndarray]:
    generator = np.random.default_rng(seed)
    x = generator.integers(low, 256, size=(n, *SHAPE), dtype=np.uint8)
    y = (x[:, 0].mean(axis=(1, 2)) > 128).astype(np.int64) + 2 * (x[:, 2, :4].mean(axis=(1, 2)) > 128)
    return x, y


def tiny_images(seed: int) -> Dataset:
    """A small uint8 CIFAR-like dataset (stands in for the cifar10 source in the runtime tests)."""
    x, y = images(240, seed=seed)
    return Dataset("tiny_images", x, y, 4, mean=MEAN, std=STD)


def augmented_config(
    mode: str = "sequential", num_hosts: int = 2, augment: str = "crop_flip", rounds: int = 3, **sections
):
    return validate_config(
        tiny_config(
            dataset={"name": "cifar10", "augment": augment},
            model={"name": "mlp"},
            clients={"count": 5, "per_round": 3},
            runtime={"num_hosts": num_hosts, "host_cpus": 0.5, "client_training": mode, "vectorize_chunk": 2},
            rounds=rounds,
            **sections,
        )
    )
