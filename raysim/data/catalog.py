"""What each `dataset.name` reads, where it looks, and how to get it: the table behind `raysim datasets`.

The check is cheap (a file or folder that marks the layout exists); loading reads and validates the files.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from raysim.data.download import default_root
from raysim.data.sources import SOURCES

__all__ = ["CATALOG", "DatasetInfo", "default_root", "found_at", "missing_from_catalog"]


@dataclass(frozen=True)
class DatasetInfo:
    name: str
    about: str
    layout: str
    """What `dataset.root` must hold (torchvision's or the publisher's layout)."""
    get: str
    """Where to get it."""
    markers: tuple[str, ...] = ()
    """Paths under a root (glob patterns) any of which shows the data are there; empty: nothing to check."""


CATALOG: dict[str, DatasetInfo] = {
    info.name: info
    for info in (
        DatasetInfo(
            "fashion_mnist",
            "70,000 28x28 grey images, 10 classes (FLAME)",
            "the four IDX files, or FashionMNIST/raw/",
            "`make setup` (Debian package dataset-fashion-mnist), or torchvision's download",
            ("train-images-idx3-ubyte*", "FashionMNIST/raw/train-images-idx3-ubyte*"),
        ),
        DatasetInfo(
            "mnist",
            "70,000 28x28 grey digits, 10 classes (FLAME)",
            "MNIST/raw/ (torchvision) or the four IDX files",
            "`dataset.download: true` online (torchvision's mirror, md5-checked)",
            ("MNIST/raw/train-images-idx3-ubyte*",),  # bare IDX files could be Fashion-MNIST's: same names
        ),
        DatasetInfo(
            "emnist",
            "EMNIST, `dataset.split` byclass/bymerge/balanced/letters/digits/mnist",
            "EMNIST/raw/emnist-<split>-*-ubyte(.gz)",
            "`dataset.download: true` online (NIST's gzip.zip, md5-checked)",
            ("EMNIST/raw/emnist-*", "emnist-*"),
        ),
        DatasetInfo(
            "femnist",
            "LEAF's FEMNIST, one group per writer (FLAME's feature skew: partition.scheme natural)",
            "LEAF's JSON: train/*.json and test/*.json, or all_data/*.json",
            "LEAF's preprocess.sh (github.com/TalwalkarLab/leaf, data/femnist)",
            ("train/*.json", "all_data/*.json"),
        ),
        DatasetInfo(
            "cifar10",
            "60,000 32x32 colour images, 10 classes (FLAME, FedSLR, FedAPM)",
            "cifar-10-batches-py/ (the python version)",
            "`dataset.download: true` online (cs.toronto.edu, md5-checked)",
            ("cifar-10-batches-py/data_batch_1",),
        ),
        DatasetInfo(
            "cifar100",
            "60,000 32x32 colour images, 100 classes (FedSLR; AugFL-style few-shot splits)",
            "cifar-100-python/",
            "`dataset.download: true` online (cs.toronto.edu, md5-checked)",
            ("cifar-100-python/train",),
        ),
        DatasetInfo(
            "medmnist",
            "a MedMNIST set (`dataset.subset`, e.g. pathmnist; `dataset.size` 28/64/128/224)",
            "<subset>.npz or <subset>_<size>.npz as MedMNIST publishes them",
            "`dataset.download: true` online (zenodo), or medmnist.com",
            ("*mnist*.npz",),
        ),
        DatasetInfo(
            "image_folder",
            "any ImageFolder tree, e.g. Kaggle's Medical MNIST (FLAME's MMNIST, `dataset.size: 64`)",
            "one folder per class holding the images",
            "your own files; Medical MNIST: kaggle.com/datasets/andrewmvd/medical-mnist",
            ("*/*.png", "*/*.jpg", "*/*.jpeg", "*/*.JPEG"),
        ),
        DatasetInfo(
            "tiny_imagenet",
            "Tiny-ImageNet-200: 64x64 colour, 200 classes (FedSLR)",
            "tiny-imagenet-200/ (train/<wnid>/images, val/val_annotations.txt, wnids.txt)",
            "`dataset.download: true` online (cs231n.stanford.edu)",
            ("tiny-imagenet-200/wnids.txt",),
        ),
        DatasetInfo(
            "huggingface",
            "any Hugging Face dataset (`dataset.path`, `split`, `image`, `label` columns)",
            "a folder written by `save_to_disk` (dataset.path), or a hub name online",
            "`datasets.load_dataset(...).save_to_disk(folder)` on a machine online",
        ),
        DatasetInfo("npz", "x, y and optional groups in one .npz (`dataset.path`)", "one .npz file", "your own"),
        DatasetInfo("digits", "scikit-learn's 1,797 8x8 digits", "inside scikit-learn", "always there"),
        DatasetInfo("synthetic_classification", "Gaussian class clusters (tests)", "generated", "always there"),
        DatasetInfo("synthetic_regression", "linear regression (convex checks)", "generated", "always there"),
        DatasetInfo("synthetic_writers", "FEMNIST-like groups (tests)", "generated", "always there"),
    )
}


def found_at(info: DatasetInfo, roots: list[Path]) -> Path | None:
    """The first root under which the dataset's layout is present (None if it is in none; a dataset without
    markers is always available)."""
    if not info.markers:
        return Path("-")
    for root in roots:
        if any(next(root.glob(marker), None) is not None for marker in info.markers):
            return root
    return None


def missing_from_catalog() -> list[str]:
    """Source names without a catalog entry (kept empty by a test)."""
    return [name for name in SOURCES if name not in CATALOG]
