"""FEMNIST, with the writer as each sample's natural group: from LEAF's per-writer JSON files (`dataset.format:
leaf_json`, here) or TensorFlow Federated's HDF5 files (`tff_h5`, raysim.data.tff_emnist: FLAME's FEMNIST).

LEAF (github.com/TalwalkarLab/leaf) builds the files with its own scripts from NIST Special Database 19;
there is nothing to download here. Its layout, under `dataset.root` (else `default_root()/femnist`), or
under `<root>/data`: `train/*.json` and `test/*.json` (a split made by `preprocess.sh -t sample` or
`-t user`), else `all_data/*.json` (the unsplit files). Each file holds
{"users": [...], "num_samples": [...], "user_data": {user: {"x": [[784 floats]], "y": [labels]}}}.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import ClassVar, Literal

import numpy as np
from pydantic import Field

from raysim.data.dataset import DATASETS, Dataset, RootSettings
from raysim.data.download import resolve_root
from raysim.data.footprint import Footprint, image_rows
from raysim.data.tff_emnist import read_tff_emnist
from raysim.errors import DataError

CLASSES = 62
"""LEAF's FEMNIST labels: 0-9 digits, 10-35 upper-case, 36-61 lower-case letters."""
PIXELS = 28 * 28
HOW_TO_GET = (
    "generate it with LEAF's data/femnist/preprocess.sh (e.g. `./preprocess.sh -s niid --sf 1.0 -k 0 -t sample`) "
    "and point dataset.root at leaf/data/femnist/data"
)


def _json_files(root: Path) -> list[Path]:
    """train + test files if either exists, else all_data (they hold the same samples, so never both)."""
    for base in (root, root / "data"):
        split = sorted((base / "train").glob("*.json")) + sorted((base / "test").glob("*.json"))
        if split:
            return split
        unsplit = sorted((base / "all_data").glob("*.json"))
        if unsplit:
            return unsplit
    return []


def _read(file: Path, pixels: dict[str, list[np.ndarray]], labels: dict[str, list[np.ndarray]]) -> None:
    """Add one JSON file's writers to `pixels`/`labels`, converted to uint8 at once (the parsed JSON of a
    whole FEMNIST file is large; only one file's worth is held at a time)."""
    try:
        with file.open() as handle:
            content = json.load(handle)
        users = content["user_data"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise DataError(f"{file}: not a LEAF JSON file with 'user_data' ({error})") from None
    for user, data in users.items():
        try:
            x = np.asarray(data["x"], dtype=np.float32)
            y = np.asarray(data["y"])
        except (KeyError, TypeError, ValueError) as error:
            message = f"'x' must be lists of {PIXELS} floats and 'y' labels ({error})"
            raise DataError(f"{file}: writer {user}: {message}") from None
        if len(y) == 0:
            continue
        if x.shape != (len(y), PIXELS):
            raise DataError(f"{file}: writer {user}: 'x' must be {len(y)} rows of {PIXELS} floats, got {x.shape}")
        if not np.issubdtype(y.dtype, np.integer) or y.min() < 0 or y.max() >= CLASSES:
            raise DataError(f"{file}: writer {user}: labels 'y' must be integers in 0..{CLASSES - 1}")
        if not np.isfinite(x).all() or x.min() < 0.0 or x.max() > 1.0:
            raise DataError(f"{file}: writer {user}: pixel values must lie in [0, 1]")
        pixels[user].append(np.rint(x * 255.0).astype(np.uint8))
        labels[user].append(y.astype(np.int64))


@DATASETS.register()
class FemnistSettings(RootSettings):
    name: Literal["femnist"] = "femnist"
    split: Literal["all", "digits"] = Field(
        "all", description="all 62 classes, or the digits only (FLAME's 10-class FEMNIST)"
    )
    format: Literal["leaf_json", "tff_h5"] = Field(
        "leaf_json",
        description="LEAF's per-writer JSON, or TensorFlow Federated's federated EMNIST HDF5 files (FLAME's FEMNIST: "
        "split digits reads fed_emnist_digitsonly_{train,test}.h5, 3,383 writers; all reads fed_emnist_*.h5)",
    )
    about: ClassVar[str] = "FEMNIST (LEAF's or TFF's), a group per writer (FLAME's feature skew: scheme natural)"
    layout: ClassVar[str] = (
        "LEAF's JSON: train/*.json and test/*.json, or all_data/*.json; tff_h5: TFF's fed_emnist*_{train,test}.h5"
    )
    get: ClassVar[str] = (
        "LEAF's preprocess.sh (github.com/TalwalkarLab/leaf, data/femnist); tff_h5: "
        "tff.simulation.datasets.emnist.load_data"
    )
    markers: ClassVar[tuple[str, ...]] = ("train/*.json", "all_data/*.json", "fed_emnist*_train.h5")

    def footprint(self) -> Footprint:
        """LEAF's 805,263 samples (all read, then the digits kept) or TFF's files' 749,068 (digits only: 382,705); a
        LEAF file's parsed JSON, Python floats of about 3 times its text, adds to the peak."""
        samples = (382_705 if self.split == "digits" else 749_068) if self.format == "tff_h5" else 805_263
        images = image_rows(samples, (1, 28, 28), groups=True)
        root = Path(self.root).expanduser() if self.root else resolve_root(None) / "femnist"
        files = _json_files(root) if self.format == "leaf_json" and root.is_dir() else []
        sizes = [file.stat().st_size for file in files if file.is_file()]  # a dangling link: load names it
        return Footprint(images.samples, images.nbytes, images.peak + 3 * max(sizes, default=0))

    def load(self, seed: int) -> Dataset:
        return femnist(self)


def femnist(request: FemnistSettings) -> Dataset:
    """FEMNIST from LEAF's JSON or TFF's HDF5 (`dataset.format`): x uint8 (n, 1, 28, 28), 62 classes, `groups` =
    writer index (writer ids sorted), so `partition.scheme: natural` splits by writer; a writer's train and test
    samples share one group. `dataset.split: digits` keeps the digit samples only (FLAME's 10-class FEMNIST; TFF's
    digits-only files); the model keeps 62 outputs, as the authors' CNN2 does.

    Pixel values are kept as LEAF gives them (1.0 = white background, dark strokes: NIST's scans are not
    inverted as in EMNIST), stored as round(255 v); mean 0 and std 1 make the trainers' (x/255 - mean)/std
    give back LEAF's floats, which is what LEAF's own models train on."""
    root = Path(request.root).expanduser() if request.root else resolve_root(None) / "femnist"
    if request.format == "tff_h5":
        if not root.is_dir():
            raise DataError(f"dataset.root: {root}: no such folder (TFF's federated EMNIST HDF5 files)")
        x, y, groups = read_tff_emnist(root, request.split)
        return Dataset("femnist", x, y, CLASSES, groups=groups, mean=(0.0,), std=(1.0,))
    if not root.is_dir():
        raise DataError(f"dataset.root: {root}: no such folder (LEAF FEMNIST JSON; {HOW_TO_GET})")
    files = _json_files(root)
    if not files:
        raise DataError(
            f"dataset.root: {root}: no LEAF FEMNIST JSON (looked for train/*.json, test/*.json and "
            f"all_data/*.json, also under data/); {HOW_TO_GET}"
        )
    pixels: dict[str, list[np.ndarray]] = defaultdict(list)
    labels: dict[str, list[np.ndarray]] = defaultdict(list)
    for file in files:
        _read(file, pixels, labels)
    writers = sorted(pixels)
    if not writers:
        raise DataError(f"dataset.root: {root}: the LEAF JSON files hold no samples")
    sizes = [sum(len(chunk) for chunk in labels[writer]) for writer in writers]
    x = np.concatenate([chunk for writer in writers for chunk in pixels[writer]]).reshape(-1, 1, 28, 28)
    y = np.concatenate([chunk for writer in writers for chunk in labels[writer]])
    groups = np.repeat(np.arange(len(writers), dtype=np.int64), sizes)
    if request.split == "digits":  # the digits of LEAF's writers (TFF's digits-only set, FLAME's, has 3,383: tff_h5)
        keep = y < 10
        x, y, groups = x[keep], y[keep], np.unique(groups[keep], return_inverse=True)[1].astype(np.int64)
    return Dataset("femnist", x, y, CLASSES, groups=groups, mean=(0.0,), std=(1.0,))
