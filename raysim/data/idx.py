"""MNIST and EMNIST from their IDX files, in torchvision's layout or directly in `dataset.root`.

Images are returned as uint8 (n, 1, 28, 28) with MNIST's normalization constants (0.1307, 0.3081), which
FLAME uses for the whole MNIST family (FLAME, Table II); the trainers normalize batches on the fly. The official
train and test files are pooled (train first), as FLAME pools them: the partitions make the splits.
"""

from __future__ import annotations

import gzip
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar, Literal, get_args

import numpy as np
from pydantic import Field

from raysim.data.dataset import DATASETS, Dataset, DownloadSettings
from raysim.data.decoded import decoded
from raysim.data.download import extract, fetch, resolve_root
from raysim.data.footprint import Footprint, image_rows
from raysim.errors import DataError

_IDX_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: np.int16, 0x0C: np.int32, 0x0D: np.float32}
MNIST_MEAN, MNIST_STD = (0.1307,), (0.3081,)

_MNIST_URL = "https://ossci-datasets.s3.amazonaws.com/mnist/"
MNIST_RESOURCES: dict[str, tuple[str, str]] = {
    "train-images-idx3-ubyte.gz": (_MNIST_URL + "train-images-idx3-ubyte.gz", "f68b3c2dcbeaaa9fbdd348bbdeb94873"),
    "train-labels-idx1-ubyte.gz": (_MNIST_URL + "train-labels-idx1-ubyte.gz", "d53e105ee54ea40749a09fcbcd1e9432"),
    "t10k-images-idx3-ubyte.gz": (_MNIST_URL + "t10k-images-idx3-ubyte.gz", "9fb629c4189551a2d022fa330f9573f3"),
    "t10k-labels-idx1-ubyte.gz": (_MNIST_URL + "t10k-labels-idx1-ubyte.gz", "ec29112dd5afa0611ce80d1b7f02629c"),
}
"""File name -> (URL, md5), as torchvision's MNIST downloads them (its first mirror)."""

EMNIST_ARCHIVE: tuple[str, str] = (
    "https://biometrics.nist.gov/cs_links/EMNIST/gzip.zip",
    "58c8d27c78d21e728a6bc7b3cc06412e",
)
"""(URL, md5) of the one archive holding every EMNIST split, as torchvision downloads it."""

EmnistSplit = Literal["byclass", "bymerge", "balanced", "letters", "digits", "mnist"]
EMNIST_CLASSES = dict(zip(get_args(EmnistSplit), (62, 47, 47, 26, 10, 10), strict=True))
EMNIST_SAMPLES = dict(zip(get_args(EmnistSplit), (814_255, 814_255, 131_600, 145_600, 280_000, 70_000), strict=True))
"""Train + test images of each split (Cohen et al., 2017, Table II)."""


def read_idx(path: Path) -> np.ndarray:
    """Read one IDX file (optionally gzipped) into a numpy array, checking its declared size."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as handle:
            raw = handle.read()
    except (OSError, EOFError) as error:
        raise DataError(f"{path}: cannot read IDX file ({error})") from error
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
        raise DataError(f"{path}: not an IDX file (bad magic number)")
    ndim = raw[3]
    dims = [int.from_bytes(raw[4 + 4 * k : 8 + 4 * k], "big") for k in range(ndim)]
    dtype = np.dtype(_IDX_DTYPES[raw[2]]).newbyteorder(">")
    offset = 4 + 4 * ndim
    expected = int(np.prod(dims)) * dtype.itemsize
    if len(raw) - offset != expected:
        raise DataError(
            f"{path}: truncated or corrupt IDX file (header says {expected} data bytes, found {len(raw) - offset})"
        )
    return np.frombuffer(raw, dtype=dtype, offset=offset).reshape(dims).astype(dtype.newbyteorder("="))


def find_idx(directories: list[Path], stem: str) -> Path | None:
    """The first of `directories` holding `stem` or `stem.gz`."""
    for directory in directories:
        for candidate in (directory / stem, directory / f"{stem}.gz"):
            if candidate.is_file():
                return candidate
    return None


def _missing(what: str, primary: Path, stem: str, root: Path) -> DataError:
    return DataError(
        f"{what}: {primary / stem}[.gz] not found (nor in {root}); set dataset.download: true on a machine with "
        f"internet, or copy the IDX files to {primary}"
    )


def read_train_test(
    what: str, stems: Sequence[str], directories: list[Path], root: Path
) -> tuple[np.ndarray, np.ndarray]:
    """Read train+test images and labels (stems in that order: train images, train labels, test images, test
    labels) and pool them, train first; from their decoded copy when there is one (raysim.data.decoded)."""
    paths = []
    for stem in stems:
        path = find_idx(directories, stem)
        if path is None:
            raise _missing(what, directories[0], stem, root)
        paths.append(path)
    images, labels = decoded(what, paths, ("x", "y"), lambda: _pooled(paths))
    return images, labels


def _pooled(paths: list[Path]) -> tuple[np.ndarray, np.ndarray]:
    """The IDX files `paths` (train images, train labels, test images, test labels) read, checked and pooled."""
    train_x, train_y, test_x, test_y = (read_idx(p) for p in paths)
    splits = ((train_x, train_y, paths[0], paths[1]), (test_x, test_y, paths[2], paths[3]))
    for images, labels, image_path, label_path in splits:
        if images.dtype != np.uint8 or images.ndim != 3:
            raise DataError(f"{image_path}: expected uint8 images (n, H, W), got {images.dtype} {images.shape}")
        if labels.ndim != 1 or len(labels) != len(images):
            raise DataError(f"{label_path}: {labels.shape} labels for {len(images)} images in {image_path}")
    if train_x.shape[1:] != test_x.shape[1:]:
        raise DataError(f"{paths[0]} and {paths[2]}: image sizes differ ({train_x.shape[1:]} vs {test_x.shape[1:]})")
    return np.concatenate([train_x, test_x]), np.concatenate([train_y, test_y]).astype(np.int64)


def _dataset(name: str, images: np.ndarray, labels: np.ndarray, num_classes: int, source: Path) -> Dataset:
    if labels.min() < 0 or labels.max() >= num_classes:
        raise DataError(
            f"{source}: labels span {labels.min()}..{labels.max()}, outside 0..{num_classes - 1} for {name}"
        )
    x = np.ascontiguousarray(images[:, None, :, :])
    return Dataset(name, x, labels, num_classes, mean=MNIST_MEAN, std=MNIST_STD)


@DATASETS.register()
class MnistSettings(DownloadSettings):
    name: Literal["mnist"] = "mnist"
    about: ClassVar[str] = "70,000 28x28 grey digits, 10 classes (FLAME)"
    layout: ClassVar[str] = "MNIST/raw/ (torchvision) or the four IDX files"
    get: ClassVar[str] = "`dataset.download: true` online (torchvision's mirror, md5-checked)"
    markers: ClassVar[tuple[str, ...]] = ("MNIST/raw/train-images-idx3-ubyte*",)  # bare IDX files could be FMNIST's

    def footprint(self) -> Footprint:
        return image_rows(70_000, (1, 28, 28))

    def load(self, seed: int) -> Dataset:
        return mnist(self)


@DATASETS.register()
class EmnistSettings(DownloadSettings):
    name: Literal["emnist"] = "emnist"
    split: EmnistSplit = Field(description="which EMNIST split (62, 47, 47, 26, 10 and 10 classes)")
    about: ClassVar[str] = "EMNIST, `dataset.split` byclass/bymerge/balanced/letters/digits/mnist"
    layout: ClassVar[str] = "EMNIST/raw/emnist-<split>-*-ubyte(.gz)"
    get: ClassVar[str] = "`dataset.download: true` online (NIST's gzip.zip, md5-checked)"
    markers: ClassVar[tuple[str, ...]] = ("EMNIST/raw/emnist-*", "emnist-*")

    def footprint(self) -> Footprint:
        return image_rows(EMNIST_SAMPLES[self.split], (1, 28, 28), 3.0)  # and the transposed copy

    def load(self, seed: int) -> Dataset:
        return emnist(self)


def mnist(request: MnistSettings) -> Dataset:
    """The 70,000 MNIST digits (`root/MNIST/raw/` or `root`; downloaded to the former when allowed)."""
    root = resolve_root(request.root)
    raw = root / "MNIST" / "raw"
    stems = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
    directories = [raw, root]
    if request.download and any(find_idx(directories, stem) is None for stem in stems):
        for file, (url, md5) in MNIST_RESOURCES.items():
            if find_idx(directories, file.removesuffix(".gz")) is None:
                fetch(url, raw / file, md5)
    images, labels = read_train_test("mnist", stems, directories, root)
    return _dataset(request.name, images, labels, 10, raw)


def _download_emnist(raw: Path) -> None:
    """Fetch torchvision's EMNIST archive and keep its gzipped IDX files (all splits) in `raw`."""
    url, md5 = EMNIST_ARCHIVE
    archive = fetch(url, raw / "gzip.zip", md5)
    extract(archive, raw)
    folder = raw / "gzip"
    for member in sorted(folder.glob("*.gz")) if folder.is_dir() else []:
        member.replace(raw / member.name)
    shutil.rmtree(folder, ignore_errors=True)
    archive.unlink(missing_ok=True)


def emnist(request: EmnistSettings) -> Dataset:
    """One EMNIST split (`dataset.split`), train+test pooled, images turned upright.

    The IDX files store every image transposed; torchvision returns them as stored (users add a transpose
    transform), here they are transposed once at load. `letters` labels are 1..26 in the files (torchvision
    keeps them, with an unused class 0 "N/A"); here they are shifted to 0..25 so there are 26 classes."""
    split = request.split
    root = resolve_root(request.root)
    raw = root / "EMNIST" / "raw"
    stems = tuple(
        f"emnist-{split}-{part}-{kind}"
        for part in ("train", "test")
        for kind in ("images-idx3-ubyte", "labels-idx1-ubyte")
    )
    directories = [raw, root]
    if request.download and any(find_idx(directories, stem) is None for stem in stems):
        _download_emnist(raw)
    images, labels = read_train_test(f"emnist ({split})", stems, directories, root)
    images = images.transpose(0, 2, 1)
    if split == "letters":
        labels = labels - 1
    return _dataset(request.name, images, labels, EMNIST_CLASSES[split], raw)
