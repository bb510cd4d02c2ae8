"""The small data folders each shipped config runs on in the tests, in its dataset's standard layout (the paper
configs' `DATA`, the suites' `SUITE_DATA`, the other loaders'), and the scaled-down built-in data sets."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np

from tests.support.data_files import (
    MNIST_STEMS,
    cifar_batch,
    write_cifar100,
    write_emnist,
    write_idx,
    write_leaf,
    write_medmnist,
    write_tiny_imagenet,
)
from tests.support.paths import ROOT

PAPER = ROOT / "configs" / "paper"


def cifar10(root: Path) -> list[str]:
    rng = np.random.default_rng(0)
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    for name in (*(f"data_batch_{k}" for k in range(1, 6)), "test_batch"):
        (folder / name).write_bytes(pickle.dumps(cifar_batch(60, b"labels", 10, rng), protocol=2))
    return []


SMALL_RESNET_RUN = ["clients.count=6", "clients.per_round=2", "model.name=cnn"]
"""FedSLR's ResNet-18-GN trains at ~100 s a round on two cores even here: the runs use the CIFAR CNN, the network has
its own test (tests/unit/test_models.py)."""


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
"""FedSLR's label-matched test sets on the fixtures: 100 test samples per client need more than they hold."""


SUITE_DATA = {
    f"fedslr_table1_{data}_{split}.yaml": lambda root, data=data, split=split: [
        *FEDSLR_TABLE1[data](root),
        *SMALL_RESNET_RUN,
        *([] if data == "cifar10" else ["clients.count=2"]),
        *LABEL_PRIOR_FIXTURE,  # both columns draw label-matched test sets from the fixture's small test batch
        *(["partition.test_samples=10"] if split == "iid" else []),  # IID shares of 0.1-0.3: floor(0.2 * 4) = 0
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
SUITE_DATA["field_benchmark_cifar10.yaml"] = lambda root: [*cifar10(root), "clients.count=6", "clients.per_round=2"]
FEDAPM_RESNET_RUN = ["clients.count=2", "model.name=cnn"]
"""FedAPM's Table 4 ResNet-18 columns on the CIFAR-100 and Tiny-ImageNet fixtures: two clients, the CIFAR CNN (every
method of theirs ran a round on ResNet-18-GN once, at 3-70 s each on two cores: too slow for each run of the tests)."""
SUITE_DATA |= {
    f"fedapm_table4_{data}.yaml": lambda root, data=data: [*FEDSLR_TABLE1[data](root), *FEDAPM_RESNET_RUN]
    for data in ("cifar100", "tiny_imagenet")
}
"""The fixture folders of the suites whose base is inline (not a configs/paper file), by suite file (the CIFAR-100
and Tiny-ImageNet fixtures hold a few samples: two clients; the field benchmark's CIFAR-10
fixture six)."""


BUILT_IN = {
    "digits": [],
    "crisismmd_synthetic": ["dataset.samples=200", "dataset.image_dim=24", "dataset.text_dim=8", "dataset.tokens=6"],
    "kuhar_synthetic": ["dataset.samples=160", "dataset.window=32"],
    "cremad_synthetic": ["dataset.samples=288", "dataset.frames=24", "dataset.mfcc=8", "dataset.video_dim=16"],
}
"""Data sets inside the package (FedAPM's offline substitutes, fedapm.md 7.3), with the overrides that keep one
round of their suites lean: fewer and smaller samples (the models read their sizes from the data); the epochs are
made light with every run's (tests/support/light.py)."""


def _mnist(root: Path) -> list[str]:
    rng = np.random.default_rng(0)
    arrays = []
    for n in (240, 60):
        labels = np.repeat(np.arange(10, dtype=np.uint8), n // 10)
        arrays += [rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8), labels]
    for stem, array in zip(MNIST_STEMS, arrays, strict=True):
        write_idx(root / "MNIST" / "raw" / stem, array, gz=True)
    return []


def _medical_mnist(root: Path) -> list[str]:
    """Kaggle's layout: one folder of 64x64 grey JPEGs per class (six classes, as the real set)."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for name in ("AbdomenCT", "BreastMRI", "CXR", "ChestCT", "Hand", "HeadCT"):
        (root / name).mkdir(parents=True)
        for k in range(20):
            Image.fromarray(rng.integers(0, 256, size=(64, 64), dtype=np.uint8)).save(root / name / f"{k:06d}.jpeg")
    return []


def _femnist(root: Path) -> list[str]:
    write_leaf(root, samples=80)
    return ["clients.count=3"]  # three writers


def _fashion_mnist(root: Path) -> list[str]:
    return []  # the real data, installed by `make setup`


DATA = {
    "flame_mnist.yaml": _mnist,
    "flame_fmnist.yaml": _fashion_mnist,
    "flame_cifar10.yaml": cifar10,
    "flame_mmnist.yaml": _medical_mnist,
    "flame_femnist.yaml": _femnist,
    "fedslr_cifar10.yaml": lambda root: [*cifar10(root), *SMALL_RESNET_RUN, *LABEL_PRIOR_FIXTURE],
    "fedapm_cifar10.yaml": lambda root: [*cifar10(root), "clients.count=6"],
}


def _emnist(root: Path) -> list[str]:
    rng = np.random.default_rng(0)
    upright = {}
    for part, n in (("train", 16), ("test", 4)):
        upright[f"{part}_x"] = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        upright[f"{part}_y"] = rng.integers(1, 27, size=n).astype(np.uint8)
    write_emnist(root / "EMNIST" / "raw", "letters", upright, gz=True)
    return ["dataset.name=emnist", "dataset.split=letters"]


def _cifar100(root: Path) -> list[str]:
    write_cifar100(root)
    return ["dataset.name=cifar100"]


def _medmnist(root: Path) -> list[str]:
    write_medmnist(root, "pathmnist", rgb=True)
    return ["dataset.name=medmnist", "dataset.subset=pathmnist"]


def _tiny_imagenet(root: Path) -> list[str]:
    write_tiny_imagenet(root)
    return ["dataset.name=tiny_imagenet"]


OTHER_LOADERS = {"emnist": _emnist, "cifar100": _cifar100, "medmnist": _medmnist, "tiny_imagenet": _tiny_imagenet}


def _emnist_letters(root: Path) -> list[str]:
    """EMNIST letters' IDX files holding 20 samples of each of four letters (labels 1..4 in the files)."""
    rng = np.random.default_rng(0)
    upright = {}
    for part, n in (("train", 64), ("test", 16)):
        upright[f"{part}_x"] = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        upright[f"{part}_y"] = np.tile(np.arange(1, 5, dtype=np.uint8), n // 4)
    write_emnist(root / "EMNIST" / "raw", "letters", upright, gz=True)
    return []


def _tiny_imagenet_few_shot(root: Path) -> list[str]:
    write_tiny_imagenet(root, per_class=20, val_per_class=4)
    return []


FEW_SHOT_FIXTURE = ["clients.count=3", "partition.shots=2", "partition.reserved=4", "partition.server_samples=4"]
"""AugFL's Table II settings on the fixtures: 2 training clients and one target client of 2-4 samples, 4 samples each
to pretrain the ResNet32x4 teacher (or FedLP's ResNet8x4) and for the server's distillation (a ResNet32x4 step on a
CPU costs seconds)."""
TABLE2 = {
    "cifar10": cifar10,
    "cifar100": cifar100_few_classes,
    "emnist": _emnist_letters,
    "tiny_imagenet": _tiny_imagenet_few_shot,
}
SUITE_DATA |= {
    f"augfl_{data}_table2.yaml": lambda root, data=data: [*TABLE2[data](root), *FEW_SHOT_FIXTURE] for data in TABLE2
}
TABLE2_SUITES = sorted((PAPER / "suites").glob("augfl_*_table2.yaml"))
"""AugFL's Table II, one suite per dataset row: every setting runs (`test_every_setting_of_augfls_table2_...`)."""
AUGFL_STUDIES = sorted((PAPER / "suites").glob("augfl_*_fig*.yaml"))
"""AugFL's figure studies (augfl.md 6), one suite per figure and dataset: each one's first setting trains a round in
process (tests/system/test_paper_suites.py), on its Table II row's fixture."""
STUDY_DATA = {path.name: path.stem.removeprefix("augfl_").rsplit("_", 1)[0] for path in AUGFL_STUDIES}
"""Each study's dataset, as its Table II row's file names it."""
SUITE_DATA |= {
    name: lambda root, data=data: [*TABLE2[data](root), *FEW_SHOT_FIXTURE]
    for name, data in STUDY_DATA.items()
    if data != "fmnist"
}


def _femnist_tff(root: Path) -> list[str]:
    from tests.support.data_files import write_tff_emnist

    write_tff_emnist(root)
    return ["clients.count=2"]  # five writers: two each


SUITE_DATA |= {
    **{
        f"flame_{grid}_{name}.yaml": fixture
        for grid in ("table3", "sensitivity")
        for name, fixture in (("mnist", _mnist), ("cifar10", cifar10), ("mmnist", _medical_mnist))
    },
    "flame_table3_femnist.yaml": _femnist_tff,
    **{
        f"flame_robustness_{name}{partition}.yaml": fixture
        for name, fixture in (("mnist", _mnist), ("cifar10", cifar10), ("mmnist", _medical_mnist))
        for partition in ("", "_q2", "_dir_label", "_quality", "_dir_quantity")
    },
    "flame_robustness_femnist.yaml": _femnist_tff,
}
"""FLAME's Table III, robustness and sensitivity suites on the datasets that are not installed
(tests/system/test_flame_grids.py)."""
