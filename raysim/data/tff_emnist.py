"""Federated EMNIST from TensorFlow Federated's HDF5 files (`dataset.name: femnist`, `dataset.format: tff_h5`): the
set FLAME's paper uses (FLAME, Table II), read without TensorFlow.

TFF builds it from LEAF's preprocessing of NIST SD19, one client per writer, every writer's samples split between the
two files. `tff.simulation.datasets.emnist.load_data` downloads and unpacks them (into ~/.keras/datasets by default):

- digits only (`dataset.split: digits`): fed_emnist_digitsonly_train.h5 + fed_emnist_digitsonly_test.h5, 3,383
  writers, 341,873 + 40,832 samples, labels 0-9;
- all 62 classes (`dataset.split: all`): fed_emnist_train.h5 + fed_emnist_test.h5, 3,400 writers, 671,585 + 77,483.

Each file holds `examples/<writer id>/pixels` (float32 [n, 28, 28] in [0, 1], 1.0 = background, as LEAF's JSON) and
`examples/<writer id>/label` (integer [n]).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Literal

import numpy as np

from raysim.errors import DataError

CLASSES = 62
"""EMNIST's 62 classes (digits, upper-case, lower-case); the digits-only files hold labels 0-9."""
SIDE = 28
FILES = {
    "digits": ("fed_emnist_digitsonly_train.h5", "fed_emnist_digitsonly_test.h5"),
    "all": ("fed_emnist_train.h5", "fed_emnist_test.h5"),
}
"""The train and test file of each `dataset.split`, as TFF's archives unpack them."""
HOW_TO_GET = (
    "download them with tff.simulation.datasets.emnist.load_data(only_digits=...) (they land in ~/.keras/datasets) "
    "or from https://storage.googleapis.com/tff-datasets-public/fed_emnist_digitsonly.tar.bz2 "
    "(fed_emnist.tar.bz2 for all classes), unpack, and point dataset.root at the folder"
)


def _read(file: Path, pixels: dict[str, list[np.ndarray]], labels: dict[str, list[np.ndarray]], top: int) -> None:
    """Add one file's writers to `pixels`/`labels` (uint8 round(255 v), as raysim.data.leaf stores LEAF's floats);
    labels must lie in 0..top-1."""
    import h5py

    try:
        handle = h5py.File(file, "r")
    except OSError as error:
        raise DataError(f"{file}: not a readable HDF5 file ({error})") from None
    with handle:
        examples = handle.get("examples")
        if not isinstance(examples, h5py.Group):
            raise DataError(f"{file}: no group 'examples' (TFF's layout: examples/<writer id>/pixels and label)")
        for writer, group in examples.items():
            where = f"{file}: examples/{writer}"
            if not isinstance(group, h5py.Group) or not {"pixels", "label"} <= set(group):
                raise DataError(f"{where}: must be a group holding the datasets 'pixels' and 'label'")
            x, y = group["pixels"][()], group["label"][()]
            if x.ndim != 3 or x.shape[1:] != (SIDE, SIDE) or y.shape != (len(x),):
                raise DataError(
                    f"{where}: 'pixels' must be [n, {SIDE}, {SIDE}] and 'label' [n], got {x.shape} and {y.shape}"
                )
            if len(y) == 0:
                continue
            if not np.issubdtype(y.dtype, np.integer) or y.min() < 0 or y.max() >= top:
                raise DataError(f"{where}: 'label' must hold integers in 0..{top - 1}")
            if not np.issubdtype(x.dtype, np.floating) or not np.isfinite(x).all() or x.min() < 0 or x.max() > 1:
                raise DataError(f"{where}: 'pixels' must be floats in [0, 1]")
            pixels[writer].append(np.rint(x * 255.0).astype(np.uint8))
            labels[writer].append(y.astype(np.int64))


def read_tff_emnist(root: Path, split: Literal["all", "digits"]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x uint8 (n, 1, 28, 28), y int64 and groups int64 (the writer's index among the sorted writer ids), writer by
    writer, each writer's train samples before its test samples (the two files pooled: FLAME splits every client's
    samples 80/20 itself, in the authors' code)."""
    names = FILES[split]
    missing = [name for name in names if not (root / name).is_file()]
    if missing:
        raise DataError(f"dataset.root: {root}: no {' or '.join(missing)} (TFF's federated EMNIST; {HOW_TO_GET})")
    pixels: dict[str, list[np.ndarray]] = defaultdict(list)
    labels: dict[str, list[np.ndarray]] = defaultdict(list)
    for name in names:  # train, then test: each writer's train chunk comes first
        _read(root / name, pixels, labels, 10 if split == "digits" else CLASSES)
    writers = sorted(pixels)
    if not writers:
        raise DataError(f"dataset.root: {root}: the files {' and '.join(names)} hold no samples")
    sizes = [sum(len(chunk) for chunk in labels[writer]) for writer in writers]
    x = np.concatenate([chunk for writer in writers for chunk in pixels[writer]])[:, None, :, :]
    y = np.concatenate([chunk for writer in writers for chunk in labels[writer]])
    return x, y, np.repeat(np.arange(len(writers), dtype=np.int64), sizes)
