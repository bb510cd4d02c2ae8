"""Helpers shared by several test modules (moved from test_paper_configs.py)."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np

from tests.support.data_files import (
    cifar_batch,
    write_tiny_imagenet,
)


def cifar10(root: Path) -> list[str]:
    rng = np.random.default_rng(0)
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    for name in (*(f"data_batch_{k}" for k in range(1, 6)), "test_batch"):
        (folder / name).write_bytes(pickle.dumps(cifar_batch(60, b"labels", 10, rng), protocol=2))
    return []


SMALL_RESNET_RUN = ["clients.count=6", "clients.per_round=2", "model.name=cnn"]
"""FedSLR's ResNet-18-GN trains at ~100 s a round on two cores even here: the runs use the CIFAR CNN, the network has
its own test (tests/test_models.py)."""


def cifar100_few_classes(root: Path) -> list[str]:
    """CIFAR-100's layout holding enough samples of five of its classes for FedSLR's label-prior split."""
    rng = np.random.default_rng(0)
    folder = root / "cifar-100-python"
    folder.mkdir(parents=True)
    for name, n in (("train", 160), ("test", 40)):
        (folder / name).write_bytes(pickle.dumps(cifar_batch(n, b"fine_labels", 5, rng), protocol=2))
    return ["dataset.name=cifar100"]


def tiny_imagenet_larger(root: Path) -> list[str]:
    write_tiny_imagenet(root, per_class=12, val_per_class=4)
    return ["dataset.name=tiny_imagenet"]


FEDSLR_TABLE1 = {"cifar10": cifar10, "cifar100": cifar100_few_classes, "tiny_imagenet": tiny_imagenet_larger}


LABEL_PRIOR_FIXTURE = ["partition.test_samples=4", "partition.test_fraction=0.5"]
"""FedSLR's label-prior split on the fixtures: 100 test samples per client need more than they hold."""


SUITE_DATA = {
    f"fedslr_table1_{data}_{split}.yaml": lambda root, data=data, split=split: [
        *FEDSLR_TABLE1[data](root),
        *SMALL_RESNET_RUN,
        *([] if data == "cifar10" else ["clients.count=2"]),
        *(LABEL_PRIOR_FIXTURE if split == "noniid" else []),
    ]
    for data in FEDSLR_TABLE1
    for split in ("iid", "noniid")
} | {
    f"fedslr_sensitivity_{study}_cifar100.yaml": lambda root: [
        *cifar100_few_classes(root),
        *SMALL_RESNET_RUN,
        "clients.count=2",
        *LABEL_PRIOR_FIXTURE,
    ]
    for study in ("lambda", "mu", "eta_g", "phase1_epochs", "pure_personal")
}
"""The fixture folders of the suites whose base is inline (not a configs/paper file), by suite file (the CIFAR-100
and Tiny-ImageNet fixtures hold a few samples: two clients)."""


BUILT_IN = {
    "digits": [],
    "crisismmd_synthetic": ["dataset.samples=200", "dataset.image_dim=24", "dataset.text_dim=8", "dataset.tokens=6"],
    "kuhar_synthetic": ["dataset.samples=160", "dataset.window=32"],
    "cremad_synthetic": ["dataset.samples=288", "dataset.frames=24", "dataset.mfcc=8", "dataset.video_dim=16"],
}
"""Data sets inside the package (FedAPM's offline substitutes, fedapm.md 7.3), with the overrides that keep one
round of their suites lean: fewer and smaller samples (the models read their sizes from the data); the epochs are
made light with every run's (tests/support/light.py)."""
