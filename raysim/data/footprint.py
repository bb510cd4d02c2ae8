"""What a dataset will take in memory, estimated before anything is loaded (`DatasetSettings.footprint`).

The run's memory check (raysim.runtime.memory) adds the partition and the clients' states to it and refuses, in one
line, a run that cannot fit, before a source starts to fill the machine's memory (issue 51: a substitute with
`samples: 1000000000` took the process to 13.8 GB in 110 s before anything said no). An estimate reads nothing but
the settings, the sizes the publishers document and, for files on disk, their headers: never the data.

Two figures: `nbytes`, what the loaded `Dataset` holds (x, y and groups, as stored: uint8 images stay uint8), and
`peak`, what loading takes at its highest, the loaded arrays together with the temporaries beside them (the parts a
source concatenates, the unpacked modalities it packs, float64 draws it rounds to float32). Each source's peak factor
was measured with tracemalloc on a small load of its own (tests/unit/test_memory_check.py checks them).
"""

from __future__ import annotations

import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

LABEL_BYTES = 8
"""An int64 label (or a float32 target, counted as 8: an upper bound)."""
GROUP_BYTES = 8
"""An int64 natural id (`Dataset.groups`)."""


@dataclass(frozen=True)
class Footprint:
    """A dataset's memory, estimated without loading it."""

    samples: int | None
    """Rows of the loaded dataset (None: unknown, as for a file whose rows are not read)."""
    nbytes: int
    """What the loaded Dataset holds: x, y and groups as stored."""
    peak: int
    """What loading takes at its highest: the loaded arrays and the temporaries beside them (at least `nbytes`)."""
    setting: str | None = None
    """The dataset setting whose value scales it (`dataset.samples`), named in a refusal; None: a fixed size."""

    @classmethod
    def rows(cls, samples: int, row_bytes: float, peak_factor: float = 1.0, setting: str | None = None) -> Footprint:
        """`samples` rows of `row_bytes` each (x's row, its label and group), `peak_factor` times that at the
        peak of loading."""
        nbytes = int(samples * row_bytes)
        return cls(samples, nbytes, int(nbytes * max(peak_factor, 1.0)), setting)


def image_rows(samples: int, shape: tuple[int, ...], peak_factor: float = 2.0, groups: bool = False) -> Footprint:
    """`samples` uint8 images of `shape` with their int64 labels (and natural ids): the layout of every image source.
    Loading concatenates parts read whole (IDX files, CIFAR's batches), which holds two copies: a peak of 2."""
    row = int(np.prod(shape)) + LABEL_BYTES + (GROUP_BYTES if groups else 0)
    return Footprint.rows(samples, row, peak_factor)


def npz_members(file: Path) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Each array of an .npz archive: its shape and dtype, read from the members' .npy headers (no array data is
    read, compressed archives included); empty when the file is not a readable archive (its loader says why)."""
    members: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
    try:
        with zipfile.ZipFile(file) as archive:
            for name in archive.namelist():
                if not name.endswith(".npy"):
                    continue
                with archive.open(name) as member:
                    version = np.lib.format.read_magic(member)
                    if version == (1, 0):
                        shape, _, dtype = np.lib.format.read_array_header_1_0(member)
                    else:
                        shape, _, dtype = np.lib.format.read_array_header_2_0(member)
                members[name.removesuffix(".npy")] = (tuple(shape), np.dtype(dtype))
    except (OSError, ValueError, zipfile.BadZipFile, EOFError):
        return {}
    return members


def member_bytes(shape: tuple[int, ...], dtype: np.dtype | type) -> int:
    """Bytes of an array of `shape` and `dtype`."""
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize


def file_footprint(path: str | Path | None) -> Footprint | None:
    """The generic estimate of a dataset read from one file: the file's bytes (a first guess; an .npz of raysim's npz
    source: its arrays' bytes, x widened to float32 as the loader widens it). None when no file is named or it is not
    there (the loader then says what is missing)."""
    if path is None:
        return None
    file = Path(path).expanduser()
    if not file.is_file():
        return None
    members = npz_members(file) if file.suffix == ".npz" else {}
    if "x" in members and "y" in members:  # raysim's npz source: x as float32, labels int64, groups as stored
        (x_shape, _), (y_shape, _) = members["x"], members["y"]
        samples = y_shape[0] if y_shape else 0
        nbytes = member_bytes(x_shape, np.float32) + samples * LABEL_BYTES
        if "groups" in members:
            nbytes += member_bytes(*members["groups"])
        stored = sum(member_bytes(*member) for member in members.values())
        return Footprint(samples, nbytes, nbytes + stored)  # the archive's arrays are read, then converted
    size = file.stat().st_size
    return Footprint(None, size, size)
