"""What a dataset is in memory (`Dataset`), what a dataset source is (a `DatasetSettings` subclass: the config's
`dataset` section for that source, and how it loads), and the registry `dataset.name` chooses a source from
(DATASETS). The built-in sources (raysim.data.sources, fashion_mnist, idx, cifar, medmnist, image_folder, leaf,
huggingface) register here exactly as a plugin's do.

A source loads a whole dataset as numpy arrays, once, in the driver: the driver puts the arrays into Ray's object
store once; host actors read them zero-copy and only ever receive index arrays for their clients.
"""

from __future__ import annotations

import zipfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import ClassVar, Literal

import numpy as np
from pydantic import Field

from raysim.data.footprint import Footprint, file_footprint
from raysim.data.modalities import Modalities
from raysim.errors import DataError
from raysim.registry import Registry
from raysim.settings import Settings

Task = Literal["classification", "regression"]


@dataclass(frozen=True)
class Dataset:
    """A whole dataset in memory.

    `x` is float32 of shape (n, *input_shape); `y` is int64 class labels for classification and
    float32 targets for regression. A multimodal dataset stores each sample as one packed row (n, width) and
    says in `modalities` how the row splits into its named inputs (raysim.data.modalities).
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
    modalities: Modalities | None = None
    """The named inputs packed in each row of `x` (None: `x` holds one input of shape x.shape[1:])."""
    test_start: int | None = None
    """Where the publisher's test set begins: samples [0, test_start) are its training set, [test_start, n) its test
    set, pooled in that order (CIFAR's test batch, Tiny-ImageNet's val folder); None: the source records no split.
    `partition.test_pool: official` reads it."""

    def __post_init__(self) -> None:
        """Normalized on the fly means uint8 images (n, C, H, W) with one mean and std per channel: anything else
        would be fed to the model unnormalized or fail deep inside a host. Packed multimodal rows are float32
        (n, width of the modalities)."""
        if self.modalities is not None and (
            self.x.dtype != np.float32 or self.x.shape[1:] != tuple(self.modalities) or self.mean is not None
        ):
            raise DataError(
                f"dataset {self.name}: {self.modalities} are packed as float32 rows (n, {self.modalities[0]}), "
                f"got x of dtype {self.x.dtype} and shape {self.x.shape}"
            )
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
        """A sample's shape: x.shape[1:], or the Modalities (a tuple (width,) with its named parts)."""
        return self.modalities if self.modalities is not None else tuple(self.x.shape[1:])

    @property
    def output_dim(self) -> int:
        return self.num_classes if self.task == "classification" else 1

    def __len__(self) -> int:
        return len(self.y)

    def standardized_per_pixel(self) -> Dataset:
        """Each input coordinate (pixel and channel) standardized over the pooled samples, (x - mean) / (std + 0.001)
        on the stored values (0-255 for uint8 images), as AugFL's authors' code normalizes (`norm` in their
        DataDivision.py); in place of the per-channel normalization on the fly."""
        if self.modalities is not None:
            raise DataError(f"dataset {self.name}: standardize=pixel standardizes single inputs, not multimodal rows")
        x = self.x.astype(np.float32)
        mean, std = x.mean(axis=0), x.std(axis=0)
        return replace(self, x=(x - mean) / (std + np.float32(0.001)), mean=None, std=None)


def open_npz(file: Path, where: str, expected: str) -> np.lib.npyio.NpzFile:
    """An .npz archive opened without pickle; anything else is one DataError starting with `where` and saying
    what was `expected`."""
    try:
        archive = np.load(file, allow_pickle=False)
    except EOFError:  # numpy's answer to an empty file
        raise DataError(f"{where}: an empty file, not {expected}") from None
    except (OSError, ValueError, zipfile.BadZipFile) as error:  # BadZipFile: a truncated archive
        raise DataError(f"{where}: not a readable .npz archive ({error})") from None
    if not isinstance(archive, np.lib.npyio.NpzFile):
        raise DataError(f"{where}: a single .npy array, not {expected}")
    return archive


class DatasetSettings(Settings):
    """The `dataset` section: `dataset.name` chooses the source, whose settings these are. A source subclasses this
    with `name: Literal["its_name"] = "its_name"`, its own options and `load`, and registers with
    `@DATASETS.register()`; the class variables are what `raysim datasets` shows of it."""

    name: str
    augment: Literal["none", "crop_flip"] = Field(
        "none",
        description="training-time augmentation of images: crop_flip = random crop after zero padding and "
        "horizontal flip (FedSLR on CIFAR and Tiny-ImageNet, FedSLR, App. B.1), drawn from each client's seeded stream",
    )
    crop_padding: int = Field(4, ge=0, description="crop_flip: zero padding before the crop (Tiny-ImageNet: 8)")
    crop_probability: float = Field(
        0.5, ge=0, le=1, description="crop_flip: share of samples cropped (0.5 as FedSLR; 1: always)"
    )
    standardize: Literal["channel", "pixel"] = Field(
        "channel",
        description="how inputs are standardized: per channel with the source's mean and std (channel), or each "
        "pixel over the pooled samples, (x - mean) / (std + 0.001), as AugFL's authors' code (pixel)",
    )

    about: ClassVar[str] = ""
    """One line on what the data are (default: the class docstring's first line)."""
    layout: ClassVar[str] = "generated"
    """What `dataset.root` must hold (torchvision's or the publisher's layout)."""
    get: ClassVar[str] = "always there"
    """Where to get the data."""
    markers: ClassVar[tuple[str, ...]] = ()
    """Paths under a root (glob patterns) any of which shows the data are there; empty: nothing to look for."""
    seeded: ClassVar[bool] = False
    """The data are drawn from the experiment seed (else every seed loads the same data)."""

    @classmethod
    def summary(cls) -> str:
        """`about`, else the first line of the class docstring."""
        return cls.about or (cls.__doc__ or "").strip().split("\n")[0]

    def load(self, seed: int) -> Dataset:
        """The whole dataset these settings name (`seed` draws the generated ones); a source implements it."""
        raise NotImplementedError(f"dataset.name={self.name} implements no load")

    def loaded(self, seed: int) -> Dataset:
        """What a run trains on: the source's `load`, standardized as `standardize` says."""
        dataset = self.load(seed)
        return dataset.standardized_per_pixel() if self.standardize == "pixel" else dataset

    def footprint(self) -> Footprint | None:
        """What `load` will take in memory, estimated without loading anything (raysim.data.footprint), so that a
        run that cannot fit is refused before it fills the machine (raysim.runtime.memory). A source overrides it;
        by default, the size of the file a `path` setting names, if any (a first guess: a text file is larger than
        its numbers, a compressed one smaller), else None: unknown, and only the clients' states are checked."""
        return file_footprint(getattr(self, "path", None))


class RootSettings(DatasetSettings):
    """A source read from files under a folder."""

    root: str | None = Field(None, description="directory holding the dataset files (else the default places)")


class DownloadSettings(RootSettings):
    """A source read from files that raysim can also download."""

    download: bool = Field(True, description="download the files when no local copy exists")


def _check_source(name: str, entry: type[DatasetSettings]) -> None:
    if not (isinstance(entry, type) and issubclass(entry, DatasetSettings)):
        raise TypeError(f"dataset {name!r}: {entry!r} must subclass raysim.data.dataset.DatasetSettings")


DATASETS: Registry[type[DatasetSettings]] = Registry(
    "dataset", "dataset.name", settings=lambda entry: entry, check=_check_source
)
"""The dataset sources by `dataset.name`: settings classes registered with `@DATASETS.register()`."""
