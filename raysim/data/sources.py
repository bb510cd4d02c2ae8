"""Dataset sources: each returns a whole dataset as numpy arrays, loaded once in the driver.

The driver puts the arrays into Ray's object store once; host actors read them zero-copy and only
ever receive index arrays for their clients.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from raysim.data.fashion_mnist import load_fashion_mnist
from raysim.data.idx import MNIST_MEAN, MNIST_STD
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
    mean: tuple[float, ...] | None = None
    """Per-channel mean for on-the-fly normalization when `x` is stored as uint8 images (None: `x` is ready)."""
    std: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        """Normalized on the fly means uint8 images (n, C, H, W) with one mean and std per channel: anything else
        would be fed to the model unnormalized or fail deep inside a host."""
        if self.mean is None and self.std is None:
            return
        channels = self.x.shape[1] if self.x.ndim == 4 else None
        if self.mean is None or self.std is None or not len(self.mean) == len(self.std) == channels:
            raise DataError(
                f"dataset {self.name}: mean {self.mean} and std {self.std} need one value per channel of x "
                f"{self.x.shape}"
            )
        if self.x.dtype != np.uint8 or min(self.std) <= 0:
            raise DataError(
                f"dataset {self.name}: per-channel mean/std normalize uint8 images with positive std, got x of dtype "
                f"{self.x.dtype} and std {self.std}"
            )

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x.shape[1:])

    @property
    def output_dim(self) -> int:
        return self.num_classes if self.task == "classification" else 1

    def __len__(self) -> int:
        return len(self.y)


def fashion_mnist(root: str | Path | None = None, download: bool = True) -> Dataset:
    """The 70,000 Fashion-MNIST images (official train + test, as FLAME uses them, flame.md 6.1), stored as uint8
    (55 MB in the object store instead of 220) and normalized as they are read with MNIST's constants, as in the
    FLAME authors' code (flame.md 11): the same float32 bits as normalizing the whole array up front."""
    images, labels = load_fashion_mnist(root, download=download)
    x = np.ascontiguousarray(images[:, None, :, :])
    return Dataset("fashion_mnist", x, labels.astype(np.int64), num_classes=10, mean=MNIST_MEAN, std=MNIST_STD)


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


def synthetic_writers(
    num_writers: int = 300,
    num_features: int = 20,
    num_classes: int = 10,
    samples: tuple[int, int] = (20, 60),
    seed: int = 0,
) -> Dataset:
    """LEAF/FEMNIST-like data with natural groups, so the `natural` partition has something to split by.

    Classes share Gaussian centres; every writer has its own style (a feature offset and a scale, as stroke
    width and slant differ between FEMNIST writers), its own label preference ~ Dir(0.5) and U(samples)
    samples. `groups` is the writer id; samples are stored writer by writer."""
    generator = np.random.default_rng(seed)
    centers = generator.normal(0.0, 2.0, size=(num_classes, num_features))
    offsets = generator.normal(0.0, 0.75, size=(num_writers, num_features))
    scales = np.exp(generator.normal(0.0, 0.2, size=num_writers))
    preferences = generator.dirichlet(np.full(num_classes, 0.5), size=num_writers)
    sizes = generator.integers(samples[0], samples[1] + 1, size=num_writers)
    groups = np.repeat(np.arange(num_writers), sizes)
    y = np.concatenate([generator.choice(num_classes, size, p=p) for size, p in zip(sizes, preferences, strict=True)])
    noise = generator.normal(size=(len(y), num_features))
    x = scales[groups, None] * (centers[y] + noise) + offsets[groups]
    return Dataset("synthetic_writers", x.astype(np.float32), y.astype(np.int64), num_classes, groups=groups)


def open_npz(file: Path, where: str, expected: str) -> np.lib.npyio.NpzFile:
    """An .npz archive opened without pickle; anything else is one DataError starting with `where` and saying
    what was `expected`."""
    try:
        archive = np.load(file, allow_pickle=False)
    except (OSError, ValueError) as error:
        raise DataError(f"{where}: not a readable .npz archive ({error})") from None
    if not isinstance(archive, np.lib.npyio.NpzFile):
        raise DataError(f"{where}: a single .npy array, not {expected}")
    return archive


NPZ_KEYS = "x (features, n x ...), y (labels or targets, n) and optionally groups (natural ids, n)"


def npz_dataset(path: str | Path | None) -> Dataset:
    """A dataset from one .npz file: `x`, `y` and optional `groups`; integer `y` are class labels (the number
    of classes is max(y) + 1), floating `y` regression targets."""
    if path is None:
        raise DataError(f"dataset.path: dataset.name=npz needs the path of a .npz file holding {NPZ_KEYS}")
    file = Path(path).expanduser()
    if not file.is_file():
        raise DataError(f"dataset.path: {file}: no such file (expected a .npz holding {NPZ_KEYS})")
    with open_npz(file, f"dataset.path: {file}", f"a .npz archive holding {NPZ_KEYS}") as archive:
        for key in ("x", "y"):
            if key not in archive.files:
                raise DataError(
                    f"dataset.path: {file} has no array {key!r} (it has: {', '.join(archive.files) or 'nothing'}); "
                    f"expected {NPZ_KEYS}"
                )
        try:
            x, y = archive["x"], archive["y"]
            groups = archive["groups"] if "groups" in archive.files else None
        except ValueError as error:  # object arrays need pickle, which is refused
            raise DataError(f"dataset.path: {file}: arrays must be numeric, not objects ({error})") from None
    n = len(y) if y.ndim else 0
    if y.ndim != 1 or n == 0:
        raise DataError(f"dataset.path: {file}: 'y' must be one non-empty row of labels, got shape {y.shape}")
    if x.ndim < 2 or len(x) != n:
        raise DataError(f"dataset.path: {file}: 'x' must have shape ({n}, features...), got {x.shape}")
    if not (np.issubdtype(x.dtype, np.number) or x.dtype == bool) or not np.isfinite(x).all():
        raise DataError(f"dataset.path: {file}: 'x' must be finite numbers, got dtype {x.dtype}")
    if groups is not None and (groups.shape != (n,) or not np.issubdtype(groups.dtype, np.integer)):
        raise DataError(f"dataset.path: {file}: 'groups' must be {n} integer ids, got {groups.dtype} {groups.shape}")
    name = file.stem
    if np.issubdtype(y.dtype, np.integer) or y.dtype == bool:
        if y.min() < 0:
            raise DataError(f"dataset.path: {file}: class labels 'y' must be >= 0, got {int(y.min())}")
        labels = y.astype(np.int64)
        return Dataset(name, x.astype(np.float32), labels, int(labels.max()) + 1, groups=groups)
    if not np.issubdtype(y.dtype, np.floating) or not np.isfinite(y).all():
        raise DataError(f"dataset.path: {file}: 'y' must be integer labels or finite float targets, got {y.dtype}")
    return Dataset(name, x.astype(np.float32), y.astype(np.float32), 0, "regression", groups)


SEEDED_SOURCES = ("synthetic_classification", "synthetic_regression", "synthetic_writers")
"""Sources whose data are drawn from the experiment seed (the others load the same data whatever the seed)."""


@dataclass(frozen=True)
class DataRequest:
    """What `dataset` in a config asks for; each file-backed source reads the fields it needs."""

    name: str
    root: str | Path | None = None
    download: bool = True
    seed: int = 0
    path: str | Path | None = None
    split: str | None = None
    subset: str | None = None
    image: str = "image"
    label: str = "label"
    size: int | None = None
    channels: int | None = None


_BUILTIN = ("fashion_mnist", "digits", "synthetic_classification", "synthetic_regression", "synthetic_writers", "npz")
FILE_SOURCES: dict[str, str] = {
    "mnist": "raysim.data.idx:mnist",
    "emnist": "raysim.data.idx:emnist",
    "cifar10": "raysim.data.cifar:cifar10",
    "cifar100": "raysim.data.cifar:cifar100",
    "medmnist": "raysim.data.medmnist:medmnist",
    "image_folder": "raysim.data.image_folder:image_folder",
    "tiny_imagenet": "raysim.data.image_folder:tiny_imagenet",
    "femnist": "raysim.data.leaf:femnist",
    "huggingface": "raysim.data.huggingface:huggingface",
}
"""Sources read from files in their publisher's layout: config name -> `module:function` taking a DataRequest
(imported only when used, so a source's optional dependencies load only for its users)."""

SOURCES = (*_BUILTIN, *FILE_SOURCES)


def load_dataset(
    name: str,
    root: str | Path | None = None,
    download: bool = True,
    seed: int = 0,
    path: str | Path | None = None,
    **options: object,
) -> Dataset:
    """Load a dataset by its config name (`dataset.name`); `npz` reads `path` (else `root`, naming the file);
    `options` are the other DataRequest fields (split, subset, image, label, size)."""
    if name == "fashion_mnist":
        return fashion_mnist(root, download=download)
    if name == "digits":
        return digits()
    if name == "synthetic_classification":
        return synthetic_classification(seed=seed)
    if name == "synthetic_regression":
        return synthetic_regression(seed=seed)
    if name == "synthetic_writers":
        return synthetic_writers(seed=seed)
    if name == "npz":
        return npz_dataset(path if path is not None else root)
    if name in FILE_SOURCES:
        module, _, function = FILE_SOURCES[name].partition(":")
        loader = getattr(importlib.import_module(module), function)
        return loader(DataRequest(name, root, download, seed, path, **options))  # type: ignore[arg-type]
    raise DataError(f"dataset.name: unknown dataset {name!r}; allowed: {', '.join(SOURCES)}")
