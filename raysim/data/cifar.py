"""CIFAR-10 and CIFAR-100 from the publisher's python-pickle batches, in torchvision's layout.

Images are returned as uint8 (n, 3, 32, 32), train batches then test batch pooled, as FLAME and FedAPM pool
CIFAR-10 (FLAME, Table II; FedAPM, Table 2, App. B.1); the partitions make the splits. Normalization constants:
- CIFAR-10: mean 0.5 / std 0.5 per channel, as the FLAME and FedAPM code normalize it (FLAME, Table II;
  FedAPM, Table 2, App. B.1); `normalization: dataset` takes its training set's own per-channel statistics instead,
  FedSLR's "per-dataset mean/std" (FedSLR, App. B.1, which gives no values).
- CIFAR-100 (used by FedSLR only): the usual per-channel statistics of its training set.

The batches are pickles, so they are read with an unpickler that can only build dicts, lists, bytes, str,
ints and numpy arrays: a tampered file cannot run code.
"""

from __future__ import annotations

import codecs
import pickle
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np
from numpy._core.multiarray import _reconstruct  # numpy >= 2's array reconstructor; pickles name either module
from pydantic import Field

from raysim.data.dataset import DATASETS, Dataset, DownloadSettings
from raysim.data.download import extract, fetch, resolve_root
from raysim.data.footprint import Footprint, image_rows
from raysim.errors import DataError

CIFAR10_MEAN, CIFAR10_STD = (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)
CIFAR10_DATASET_MEAN, CIFAR10_DATASET_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
"""CIFAR-10's 50,000 training images' per-channel mean and standard deviation (of pixel values in [0, 1])."""
CIFAR100_MEAN, CIFAR100_STD = (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)

CIFAR10_ARCHIVE: tuple[str, str] = (
    "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",
    "c58f30108f718f92721af3b95e74349a",
)
"""(URL, md5) of CIFAR-10's python archive, as torchvision downloads it."""
CIFAR100_ARCHIVE: tuple[str, str] = (
    "https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz",
    "eb9058c3a382ffc7106e4002c42a8d85",
)
"""(URL, md5) of CIFAR-100's python archive, as torchvision downloads it."""

_ALLOWED: dict[tuple[str, str], Any] = {
    ("numpy.core.multiarray", "_reconstruct"): _reconstruct,
    ("numpy._core.multiarray", "_reconstruct"): _reconstruct,
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
    ("_codecs", "encode"): codecs.encode,  # how protocol-2 pickles written by Python 3 store bytes
}


class _RestrictedUnpickler(pickle.Unpickler):
    """Builds only plain containers and numpy arrays; any other global is refused."""

    def find_class(self, module: str, name: str) -> Any:
        try:
            return _ALLOWED[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in a CIFAR batch") from None


def _read_batch(path: Path, label_key: bytes) -> tuple[np.ndarray, np.ndarray]:
    """One batch file -> (uint8 images (n, 3, 32, 32), int64 labels (n,))."""
    try:
        with open(path, "rb") as handle:
            batch = _RestrictedUnpickler(handle, encoding="bytes").load()
    except (OSError, EOFError, pickle.UnpicklingError, ValueError, TypeError) as error:
        raise DataError(f"{path}: not a readable CIFAR batch ({error})") from None
    if not isinstance(batch, dict) or b"data" not in batch or label_key not in batch:
        keys = ", ".join(repr(k) for k in batch) if isinstance(batch, dict) else type(batch).__name__
        raise DataError(f"{path}: a CIFAR batch needs keys b'data' and {label_key!r}; found {keys}")
    data, labels = batch[b"data"], np.asarray(batch[label_key])
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072:
        shape = getattr(data, "shape", None)
        raise DataError(f"{path}: b'data' must be uint8 of shape (n, 3072), got {getattr(data, 'dtype', data)} {shape}")
    if labels.ndim != 1 or len(labels) != len(data) or not np.issubdtype(labels.dtype, np.integer):
        raise DataError(
            f"{path}: {label_key!r} must hold {len(data)} integer labels, got {labels.dtype} {labels.shape}"
        )
    return data.reshape(-1, 3, 32, 32), labels.astype(np.int64)


def _load(
    request: DownloadSettings,
    folder: str,
    files: tuple[str, ...],
    label_key: bytes,
    archive: tuple[str, str],
    num_classes: int,
    mean: tuple[float, ...],
    std: tuple[float, ...],
) -> Dataset:
    root = resolve_root(request.root)
    primary = root / folder
    directory = next((d for d in (primary, root) if all((d / f).is_file() for f in files)), None)
    if directory is None and request.download:
        url, md5 = archive
        tarball = fetch(url, root / url.rsplit("/", 1)[-1], md5)
        extract(tarball, root)
        tarball.unlink(missing_ok=True)
        directory = primary if all((primary / f).is_file() for f in files) else None
    if directory is None:
        missing = next(f for f in files if not (primary / f).is_file())
        raise DataError(
            f"{request.name}: {primary / missing} not found (nor in {root}); set dataset.download: true on a "
            f"machine with internet, or copy the python batches ({', '.join(files)}) to {primary}"
        )
    parts = [_read_batch(directory / f, label_key) for f in files]
    x = np.ascontiguousarray(np.concatenate([images for images, _ in parts]))
    y = np.concatenate([labels for _, labels in parts])
    if y.min() < 0 or y.max() >= num_classes:
        raise DataError(f"{directory}: labels span {y.min()}..{y.max()}, outside 0..{num_classes - 1}")
    test_start = len(y) - len(parts[-1][1])  # the last file is the test batch
    return Dataset(request.name, x, y, num_classes, mean=mean, std=std, test_start=test_start)


@DATASETS.register()
class Cifar10Settings(DownloadSettings):
    name: Literal["cifar10"] = "cifar10"
    about: ClassVar[str] = "60,000 32x32 colour images, 10 classes (FLAME, FedSLR, FedAPM)"
    layout: ClassVar[str] = "cifar-10-batches-py/ (the python version)"
    get: ClassVar[str] = "`dataset.download: true` online (cs.toronto.edu, md5-checked)"
    markers: ClassVar[tuple[str, ...]] = ("cifar-10-batches-py/data_batch_1",)
    normalization: Literal["half", "dataset"] = Field(
        "half",
        description="per-channel mean/std: 0.5/0.5 (FLAME's and FedAPM's code) or the training set's own statistics "
        "(FedSLR's per-dataset normalization, FedSLR, App. B.1)",
    )

    def footprint(self) -> Footprint:
        return image_rows(60_000, (3, 32, 32))

    def load(self, seed: int) -> Dataset:
        return cifar10(self)


@DATASETS.register()
class Cifar100Settings(DownloadSettings):
    name: Literal["cifar100"] = "cifar100"
    about: ClassVar[str] = "60,000 32x32 colour images, 100 classes (FedSLR; AugFL-style few-shot splits)"
    layout: ClassVar[str] = "cifar-100-python/"
    get: ClassVar[str] = "`dataset.download: true` online (cs.toronto.edu, md5-checked)"
    markers: ClassVar[tuple[str, ...]] = ("cifar-100-python/train",)

    def footprint(self) -> Footprint:
        return image_rows(60_000, (3, 32, 32))

    def load(self, seed: int) -> Dataset:
        return cifar100(self)


def cifar10(request: Cifar10Settings) -> Dataset:
    """The 60,000 CIFAR-10 images (`root/cifar-10-batches-py/data_batch_1..5, test_batch`)."""
    files = (*(f"data_batch_{k}" for k in range(1, 6)), "test_batch")
    own = request.normalization == "dataset"
    mean, std = (CIFAR10_DATASET_MEAN, CIFAR10_DATASET_STD) if own else (CIFAR10_MEAN, CIFAR10_STD)
    return _load(request, "cifar-10-batches-py", files, b"labels", CIFAR10_ARCHIVE, 10, mean, std)


def cifar100(request: DownloadSettings) -> Dataset:
    """The 60,000 CIFAR-100 images with their 100 fine labels (`root/cifar-100-python/train, test`)."""
    return _load(
        request,
        "cifar-100-python",
        ("train", "test"),
        b"fine_labels",
        CIFAR100_ARCHIVE,
        100,
        CIFAR100_MEAN,
        CIFAR100_STD,
    )
