"""Every shipped `configs/paper/*.yaml` runs as the README says, `raysim run CONFIG --set dataset.root=...`,
on a small folder in its dataset's standard layout (one round, a few clients; Fashion-MNIST is the real one)."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import yaml

from tests.cluster import ROOT
from tests.conftest import run_through_cli
from tests.test_datasets_files import MNIST_STEMS, _cifar_batch, _write_cifar100, _write_emnist, _write_idx
from tests.test_datasets_folders import write_leaf, write_medmnist, write_tiny_imagenet

PAPER = ROOT / "configs" / "paper"


def _mnist(root: Path) -> list[str]:
    rng = np.random.default_rng(0)
    arrays = []
    for n in (240, 60):
        labels = np.repeat(np.arange(10, dtype=np.uint8), n // 10)
        arrays += [rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8), labels]
    for stem, array in zip(MNIST_STEMS, arrays, strict=True):
        _write_idx(root / "MNIST" / "raw" / stem, array, gz=True)
    return []


def _cifar10(root: Path) -> list[str]:
    rng = np.random.default_rng(0)
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    for name in (*(f"data_batch_{k}" for k in range(1, 6)), "test_batch"):
        (folder / name).write_bytes(pickle.dumps(_cifar_batch(60, b"labels", 10, rng), protocol=2))
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
    "flame_cifar10.yaml": _cifar10,
    "flame_mmnist.yaml": _medical_mnist,
    "flame_femnist.yaml": _femnist,
    # ResNet-18-GN trains at ~100 s a round on two cores even here: the run uses the CIFAR CNN, the network has
    # its own test (tests/test_models.py)
    "fedslr_cifar10.yaml": lambda root: [*_cifar10(root), "clients.count=6", "clients.per_round=2", "model.name=cnn"],
    "fedapm_cifar10.yaml": lambda root: [*_cifar10(root), "clients.count=6"],
}


def _emnist(root: Path) -> list[str]:
    rng = np.random.default_rng(0)
    upright = {}
    for part, n in (("train", 16), ("test", 4)):
        upright[f"{part}_x"] = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        upright[f"{part}_y"] = rng.integers(1, 27, size=n).astype(np.uint8)
    _write_emnist(root / "EMNIST" / "raw", "letters", upright, gz=True)
    return ["dataset.name=emnist", "dataset.split=letters"]


def _cifar100(root: Path) -> list[str]:
    _write_cifar100(root)
    return ["dataset.name=cifar100"]


def _medmnist(root: Path) -> list[str]:
    write_medmnist(root, "pathmnist", rgb=True)
    return ["dataset.name=medmnist", "dataset.subset=pathmnist"]


def _tiny_imagenet(root: Path) -> list[str]:
    write_tiny_imagenet(root)
    return ["dataset.name=tiny_imagenet"]


OTHER_LOADERS = {"emnist": _emnist, "cifar100": _cifar100, "medmnist": _medmnist, "tiny_imagenet": _tiny_imagenet}


def test_every_paper_config_has_a_test():
    assert sorted(p.name for p in PAPER.glob("*.yaml")) == sorted(DATA)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(DATA))
def test_paper_config_runs_from_a_folder_in_the_standard_layout(name, tmp_path, ray_local, mlflow_uri):
    root = tmp_path / "data"
    root.mkdir()
    overrides = DATA[name](root)
    sets = [f"dataset.root={root}", "rounds=1", f"tracking.uri={mlflow_uri}", "runtime.num_hosts=1", *overrides]
    if name == "flame_fmnist.yaml":
        sets.remove(f"dataset.root={root}")
    run = run_through_cli(PAPER / name, mlflow_uri, *sets)
    assert run.info.status == "FINISHED"
    assert 0.0 <= run.data.metrics["pm/acc"] <= 1.0 and 0.0 <= run.data.metrics["gm/acc"] <= 1.0


@pytest.mark.slow
@pytest.mark.parametrize("loader", sorted(OTHER_LOADERS))
def test_the_other_loaders_run_end_to_end_with_a_cnn(loader, tmp_path, ray_local, mlflow_uri):
    """The loaders no paper config names, through `raysim run` on their written files, with the CIFAR CNN."""
    root = tmp_path / "data"
    root.mkdir()
    config = yaml.safe_load((PAPER / "flame_cifar10.yaml").read_text())
    config["partition"] = {"scheme": "iid"}
    sets = [*OTHER_LOADERS[loader](root), f"dataset.root={root}", "clients.count=2", "rounds=1"]
    run = run_through_cli(config, mlflow_uri, *sets, f"tracking.uri={mlflow_uri}", "runtime.num_hosts=1")
    assert run.info.status == "FINISHED" and run.data.params["dataset.name"] == loader
