"""Fashion-MNIST from IDX files: one loader, three places to look.

1. `root` (config `dataset.root` or $RAYSIM_DATA), either holding the four IDX files directly or in
   torchvision's layout `FashionMNIST/raw/`;
2. the Debian package `dataset-fashion-mnist` (`/usr/share/datasets/fashion-mnist/`);
3. torchvision's downloader, into `~/.cache/raysim/` (needs internet).
Files may be gzipped or not. When none has the data, the error names every place tried.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import ClassVar, Literal

import numpy as np

from raysim.data.dataset import DATASETS, Dataset, DownloadSettings
from raysim.data.footprint import Footprint, image_rows
from raysim.data.idx import MNIST_MEAN, MNIST_STD, find_idx, read_train_test
from raysim.errors import DataError

DEBIAN_DIR = Path("/usr/share/datasets/fashion-mnist")
CACHE_DIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "raysim"
FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}


def _read_dir(directory: Path) -> tuple[np.ndarray, np.ndarray] | None:
    """The pooled train + test images and labels if `directory` holds all four IDX files, else None."""
    stems = tuple(FILES.values())  # train images, train labels, test images, test labels
    if any(find_idx([directory], stem) is None for stem in stems):
        return None
    return read_train_test("Fashion-MNIST", stems, [directory], directory)


def candidate_dirs(root: str | Path | None) -> list[Path]:
    """Where the IDX files are looked for, in order."""
    places: list[Path] = []
    for base in (root, os.environ.get("RAYSIM_DATA")):
        if base:
            places += [Path(base), Path(base) / "FashionMNIST" / "raw"]
    places += [DEBIAN_DIR, CACHE_DIR / "FashionMNIST" / "raw"]
    return places


def load_fashion_mnist(root: str | Path | None = None, download: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Return (images uint8 [70000, 28, 28], labels int64 [70000])."""
    places = candidate_dirs(root)
    if root:  # the folder named is read or refused; the places after it stand in only when it holds none of the files
        given = Path(root).expanduser()
        if not given.is_dir():
            raise DataError(f"dataset.root: {given}: no such folder (Fashion-MNIST's four IDX files)")
        for directory in (given, given / "FashionMNIST" / "raw"):
            if any(find_idx([directory], stem) is not None for stem in FILES.values()):
                return read_train_test("Fashion-MNIST", tuple(FILES.values()), [directory], directory)
    for directory in places:
        found = _read_dir(directory)
        if found is not None:
            return found
    download_error = "download disabled"
    if download:
        try:
            from raysim.torchvision_compat import import_torchvision

            datasets = import_torchvision().datasets
            for train in (True, False):
                datasets.FashionMNIST(str(CACHE_DIR), train=train, download=True)
            found = _read_dir(CACHE_DIR / "FashionMNIST" / "raw")
            if found is not None:
                return found
            download_error = "torchvision downloaded nothing usable"
        except Exception as error:  # any network or torchvision failure ends in the one error below
            download_error = f"torchvision download failed: {error}"
    tried = "; ".join(str(p) for p in places)
    raise DataError(
        "Fashion-MNIST not found. Looked for the IDX files "
        f"({', '.join(FILES.values())}, optionally .gz) in: {tried}; {download_error}. "
        "Fix: `apt-get install dataset-fashion-mnist`, or set dataset.root / RAYSIM_DATA."
    )


@DATASETS.register()
class FashionMnistSettings(DownloadSettings):
    """The 70,000 Fashion-MNIST images (official train + test, as FLAME uses them, FLAME, Table II), stored as uint8
    (55 MB in the object store instead of 220) and normalized as they are read with MNIST's constants, as in the
    FLAME authors' code: the same float32 bits as normalizing the whole array up front."""

    name: Literal["fashion_mnist"] = "fashion_mnist"
    about: ClassVar[str] = "70,000 28x28 grey images, 10 classes (FLAME)"
    layout: ClassVar[str] = "the four IDX files, or FashionMNIST/raw/"
    get: ClassVar[str] = "`make setup` (Debian package dataset-fashion-mnist), or torchvision's download"
    markers: ClassVar[tuple[str, ...]] = ("train-images-idx3-ubyte*", "FashionMNIST/raw/train-images-idx3-ubyte*")

    def footprint(self) -> Footprint:
        return image_rows(70_000, (1, 28, 28))

    def load(self, seed: int) -> Dataset:
        images, labels = load_fashion_mnist(self.root, download=self.download)
        x = np.ascontiguousarray(images[:, None, :, :])
        return Dataset("fashion_mnist", x, labels.astype(np.int64), num_classes=10, mean=MNIST_MEAN, std=MNIST_STD)
