"""MedMNIST (v2/v3 "MedMNIST+") 2-D sets from the `.npz` files MedMNIST publishes on Zenodo.

One file per set and size: `<subset>.npz` (28x28) or `<subset>_<size>.npz` (64, 128, 224), holding
train/val/test images (n, H, W) for grayscale or (n, H, W, 3) for RGB, uint8, and labels (n, 1). The three
splits are pooled (the simulator makes its own per-client splits). Files are looked for in `dataset.root`
(else `default_root()/medmnist`) and, with `dataset.download`, fetched from the Zenodo record the
medmnist 3.0.2 package uses (URLs and md5s copied from its `medmnist/info.py`; not verified from here,
which is offline). Images are normalized with mean = std = 0.5 per channel, as MedMNIST's own examples do.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal

import numpy as np
from pydantic import Field

from raysim.data.dataset import DATASETS, Dataset, DownloadSettings, open_npz
from raysim.data.download import default_root, fetch
from raysim.data.footprint import LABEL_BYTES, Footprint, member_bytes, npz_members
from raysim.errors import DataError

RECORD = "https://zenodo.org/records/10519652/files"
"""The Zenodo record of MedMNIST+ (medmnist 3.0.2); a file's URL is RECORD/<file>?download=1."""

CLASSES: dict[str, int] = {
    "pathmnist": 9,
    "octmnist": 4,
    "pneumoniamnist": 2,
    "dermamnist": 7,
    "retinamnist": 5,
    "breastmnist": 2,
    "bloodmnist": 8,
    "tissuemnist": 8,
    "organamnist": 11,
    "organcmnist": 11,
    "organsmnist": 11,
}
"""Single-label 2-D sets and their class counts (medmnist INFO; retinamnist's ordinal grades are classes)."""

MULTI_LABEL = ("chestmnist",)
SIZES = (28, 64, 128, 224)

MD5: dict[str, tuple[str, str, str, str]] = {
    "pathmnist": (
        "a8b06965200029087d5bd730944a56c1",
        "55aa9c1e0525abe5a6b9d8343a507616",
        "ac42d08fb904d92c244187169d1fd1d9",
        "2c51a510bcdc9cf8ddb2af93af1eadec",
    ),
    "octmnist": (
        "c68d92d5b585d8d81f7112f81e2d0842",
        "e229e9440236b774d9f0dfef9d07bdaf",
        "0a97e76651ace45c5d943ee3f65b63ae",
        "abc493b6d529d5de7569faaef2773ba3",
    ),
    "pneumoniamnist": (
        "28209eda62fecd6e6a2d98b1501bb15f",
        "8f4eceb4ccffa70c672198ea285246c6",
        "05b46931834c231683c68f40c47b2971",
        "d6a3c71de1b945ea11211b03746c1fe1",
    ),
    "dermamnist": (
        "0744692d530f8e62ec473284d019b0c7",
        "b70a2f5635c6199aeaa28c31d7202e1f",
        "2defd784463fa5243564e855ed717de1",
        "8974907d8e169bef5f5b96bc506ae45d",
    ),
    "retinamnist": (
        "bd4c0672f1bba3e3a89f0e4e876791e4",
        "afda852cc34dcda56f86ad2b2457dbcc",
        "e48e916a24454daf90583d4e6efb1a18",
        "eae7e3b6f3fcbda4ae613ebdcbe35348",
    ),
    "breastmnist": (
        "750601b1f35ba3300ea97c75c52ff8f6",
        "742edef2a1fd1524b2efff4bd7ba9364",
        "363e4b3f8d712e9b5de15470a2aaadf1",
        "b56378a6eefa9fed602bb16d192d4c8b",
    ),
    "bloodmnist": (
        "7053d0359d879ad8a5505303e11de1dc",
        "2b94928a2ae4916078ca51e05b6b800b",
        "adace1e0ed228fccda1f39692059dd4c",
        "b718ff6835fcbdb22ba9eacccd7b2601",
    ),
    "tissuemnist": (
        "ebe78ee8b05294063de985d821c1c34b",
        "123ece2eba09d0aa5d698fda57103344",
        "61b955355d7425a89687b06cca3ce0c2",
        "b077128c4a949f0a4eb01517f9037b9c",
    ),
    "organamnist": (
        "68e3f8846a6bd62f0c9bf841c0d9eacc",
        "2dcccc29b88e6da5a01161ef20cda288",
        "eeae80d0a227a8d099027e1b3cfd3b60",
        "50747347e05c87dd3aaf92c49f9f3170",
    ),
    "organcmnist": (
        "b9ceb9546e10131b32923c5bbeaea2b1",
        "3ce34a8724ea6f548e6db4744d03b6a9",
        "773c1f009daa3fe5d9a2a201b2a7ed94",
        "050f5e875dc056f6768abf94ec9995d1",
    ),
    "organsmnist": (
        "9ab87b696fb54e2a387ebe992d6ed5f1",
        "53a6d115339d874c25e309a994ff46d3",
        "ded0c5fa01a95dc4978b956f613e9b8e",
        "b354719e553fbbb2513d5533f52a4cb1",
    ),
}
"""md5 of each set's file for SIZES 28, 64, 128, 224 (medmnist 3.0.2 INFO)."""

SPLITS = ("train", "val", "test")
MEAN_STD = 0.5


def file_name(subset: str, size: int) -> str:
    """MedMNIST's file name for a set at a size."""
    return f"{subset}.npz" if size == 28 else f"{subset}_{size}.npz"


def resource(subset: str, size: int) -> tuple[str, str]:
    """(URL, md5) of a set's file at a size."""
    return f"{RECORD}/{file_name(subset, size)}?download=1", MD5[subset][SIZES.index(size)]


@DATASETS.register()
class MedmnistSettings(DownloadSettings):
    name: Literal["medmnist"] = "medmnist"
    subset: str | None = Field(None, description="which MedMNIST 2-D set (pathmnist, organamnist, ...)")
    size: int | None = Field(None, ge=1, description="image size: 28 (default), 64, 128 or 224")
    about: ClassVar[str] = "a MedMNIST set (`dataset.subset`, e.g. pathmnist; `dataset.size` 28/64/128/224)"
    layout: ClassVar[str] = "<subset>.npz or <subset>_<size>.npz as MedMNIST publishes them"
    get: ClassVar[str] = "`dataset.download: true` online (zenodo), or medmnist.com"
    markers: ClassVar[tuple[str, ...]] = ("*mnist*.npz",)

    def footprint(self) -> Footprint | None:
        """From the file's array headers: its images and labels, read, pooled and laid out channels first (about
        2 copies at the peak: the members and their concatenation); None before the file is downloaded."""
        subset, size = (self.subset or "").lower(), self.size or 28
        if subset not in CLASSES or size not in SIZES:
            return None  # load refuses it
        folder = Path(self.root).expanduser() if self.root else default_root() / "medmnist"
        members = npz_members(folder / file_name(subset, size))
        images = [members[f"{split}_images"] for split in SPLITS if f"{split}_images" in members]
        if not images:
            return None
        samples = sum(shape[0] for shape, _ in images)
        nbytes = sum(member_bytes(*image) for image in images) + samples * LABEL_BYTES
        return Footprint(samples, nbytes, 2 * nbytes)

    def load(self, seed: int) -> Dataset:
        return medmnist(self)


def _check_request(request: MedmnistSettings) -> tuple[str, int]:
    allowed = ", ".join(CLASSES)
    subset = (request.subset or "").lower()
    if subset in MULTI_LABEL:
        raise DataError(
            f"dataset.subset: {subset} is multi-label (14 binary labels per image), which the simulator's "
            f"single-label classifiers cannot train on; allowed: {allowed}"
        )
    if subset not in CLASSES:
        given = f"{request.subset!r} is not a MedMNIST 2-D set" if request.subset else "dataset.name=medmnist needs it"
        raise DataError(f"dataset.subset: {given}; allowed: {allowed}")
    size = request.size or 28
    if size not in SIZES:
        raise DataError(f"dataset.size: MedMNIST publishes {', '.join(map(str, SIZES))} pixels, not {size}")
    return subset, size


def _images(array: np.ndarray, file: Path, key: str, size: int) -> np.ndarray:
    """(n, H, W) or (n, H, W, 3) uint8 as (n, C, H, W)."""
    if array.ndim == 3:
        array = array[:, None]
    elif array.ndim == 4 and array.shape[-1] in (1, 3):
        array = array.transpose(0, 3, 1, 2)
    else:
        raise DataError(f"{file}: {key!r} must be (n, H, W) or (n, H, W, 3) images, got shape {array.shape}")
    if array.shape[2:] != (size, size):
        raise DataError(f"{file}: {key!r} holds {array.shape[2]}x{array.shape[3]} images, expected {size}x{size}")
    if array.dtype != np.uint8:
        raise DataError(f"{file}: {key!r} must be uint8 pixels, got {array.dtype}")
    return array


def _read(file: Path, subset: str, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Pooled (images (n, C, H, W) uint8, labels int64) from one MedMNIST file."""
    expected = [f"{split}_{kind}" for split in SPLITS for kind in ("images", "labels")]
    with open_npz(file, str(file), "a MedMNIST .npz archive") as archive:
        missing = [key for key in expected if key not in archive.files]
        if missing:
            raise DataError(f"{file}: missing {', '.join(missing)} (MedMNIST files hold {', '.join(expected)})")
        images = [_images(archive[f"{split}_images"], file, f"{split}_images", size) for split in SPLITS]
        labels = [archive[f"{split}_labels"] for split in SPLITS]
    for split, image, label in zip(SPLITS, images, labels, strict=True):
        if label.shape not in ((len(image), 1), (len(image),)):
            raise DataError(f"{file}: {split}_labels must be ({len(image)}, 1), got shape {label.shape}")
    if len({image.shape[1] for image in images}) != 1:
        raise DataError(f"{file}: the splits mix grayscale and RGB images")
    y = np.concatenate([label.reshape(-1) for label in labels]).astype(np.int64)
    if len(y) and (y.min() < 0 or y.max() >= CLASSES[subset]):
        raise DataError(f"{file}: labels must lie in 0..{CLASSES[subset] - 1} for {subset}, found {y.min()}..{y.max()}")
    return np.concatenate(images), y


def medmnist(request: MedmnistSettings) -> Dataset:
    """One MedMNIST 2-D set (`dataset.subset`) at `dataset.size` (28 by default), train + val + test pooled."""
    subset, size = _check_request(request)
    folder = Path(request.root).expanduser() if request.root else default_root() / "medmnist"
    file = folder / file_name(subset, size)
    if not file.is_file():
        if not request.download:
            raise DataError(
                f"dataset.root: {file}: no such file (dataset.download is off; get it from {RECORD} or the "
                "medmnist package)"
            )
        url, md5 = resource(subset, size)
        fetch(url, file, md5)
    x, y = _read(file, subset, size)
    channels = x.shape[1]
    return Dataset(
        subset,
        np.ascontiguousarray(x),
        y,
        num_classes=CLASSES[subset],
        mean=(MEAN_STD,) * channels,
        std=(MEAN_STD,) * channels,
    )
