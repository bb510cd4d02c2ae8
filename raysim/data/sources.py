"""The built-in sources that need no files in a publisher's layout: scikit-learn's digits, the generated datasets of
the tests and the convex checks, and one `.npz` file of your own; and `load_dataset`, any source by name.

The other sources have a module each (fashion_mnist, idx, cifar, medmnist, image_folder, leaf, huggingface); every
one registers its settings with raysim.data.dataset.DATASETS.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal

import numpy as np
from pydantic import Field, ValidationError

from raysim.data.dataset import DATASETS, Dataset, DatasetSettings, open_npz
from raysim.data.footprint import GROUP_BYTES, LABEL_BYTES, Footprint, file_footprint
from raysim.errors import ConfigError, DataError


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
    """y = x . theta + noise, the linear-regression task of FLAME's convex analysis (FLAME, App. B-A)."""
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


@DATASETS.register()
class DigitsSettings(DatasetSettings):
    name: Literal["digits"] = "digits"
    about: ClassVar[str] = "scikit-learn's 1,797 8x8 digits"
    layout: ClassVar[str] = "inside scikit-learn"

    def footprint(self) -> Footprint:
        return Footprint.rows(1797, 64 * 4 + LABEL_BYTES, 4.0)  # float64 images, then float32

    def load(self, seed: int) -> Dataset:
        return digits()


@DATASETS.register()
class SyntheticClassificationSettings(DatasetSettings):
    name: Literal["synthetic_classification"] = "synthetic_classification"
    about: ClassVar[str] = "Gaussian class clusters (tests)"
    seeded: ClassVar[bool] = True

    def footprint(self) -> Footprint:
        return Footprint.rows(2000, 20 * 4 + LABEL_BYTES, 4.0)  # drawn in float64, then float32

    def load(self, seed: int) -> Dataset:
        return synthetic_classification(seed=seed)


@DATASETS.register()
class SyntheticRegressionSettings(DatasetSettings):
    name: Literal["synthetic_regression"] = "synthetic_regression"
    about: ClassVar[str] = "linear regression (convex checks)"
    seeded: ClassVar[bool] = True

    def footprint(self) -> Footprint:
        return Footprint.rows(1000, 5 * 4 + LABEL_BYTES, 4.0)

    def load(self, seed: int) -> Dataset:
        return synthetic_regression(seed=seed)


@DATASETS.register()
class SyntheticWritersSettings(DatasetSettings):
    name: Literal["synthetic_writers"] = "synthetic_writers"
    about: ClassVar[str] = "FEMNIST-like groups (tests)"
    seeded: ClassVar[bool] = True

    def footprint(self) -> Footprint:
        return Footprint.rows(300 * 40, 20 * 4 + LABEL_BYTES + GROUP_BYTES, 6.0)  # 300 writers of 20-60 samples

    def load(self, seed: int) -> Dataset:
        return synthetic_writers(seed=seed)


@DATASETS.register()
class NpzSettings(DatasetSettings):
    name: Literal["npz"] = "npz"
    path: str | None = Field(None, description=f"the .npz file, holding {NPZ_KEYS}")
    root: str | None = Field(None, description="the .npz file, when `path` is not set")
    about: ClassVar[str] = "x, y and optional groups in one .npz (`dataset.path`)"
    layout: ClassVar[str] = "one .npz file"
    get: ClassVar[str] = "your own"

    def footprint(self) -> Footprint | None:
        return file_footprint(self.path if self.path is not None else self.root)

    def load(self, seed: int) -> Dataset:
        return npz_dataset(self.path if self.path is not None else self.root)


def load_dataset(name: str, seed: int = 0, **options: object) -> Dataset:
    """The dataset of the source `name` (`dataset.name`) with these settings (`options`: the source's keys of the
    config's `dataset` section, paths as str or Path; None leaves a key at its default); `seed` draws the generated
    ones."""
    given = {key: str(value) if isinstance(value, Path) else value for key, value in options.items()}
    given = {key: value for key, value in given.items() if value is not None}
    try:
        settings = DATASETS.get(name).model_validate({"name": name, **given})
    except ValidationError as error:
        first = error.errors()[0]
        got = "" if first["type"] == "missing" else f" (got {first['input']!r})"
        message = first["msg"].replace("Input should be", "must be")
        raise ConfigError(f"dataset.{'.'.join(map(str, first['loc']))}: {message}{got}") from None
    return settings.loaded(seed)
