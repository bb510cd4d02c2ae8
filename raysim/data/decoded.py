"""Decoded copies of compressed dataset files, kept in raysim's cache folder and memory-mapped.

Fashion-MNIST's gzipped IDX files took 0.5-0.66 CPU s to decompress and pool at every run's start (every driver of
a sweep, every trial, every test), for the same 55 MB every time. The arrays a loader builds from its files are
written once, as .npy files under `$RAYSIM_CACHE/decoded/` (default ~/.cache/raysim/decoded), and later runs map
them read-only: a few milliseconds, and the pages are the operating system's, shared by every process of the
machine that maps them.

A copy is named by a digest of its sources (resolved path, size, modification time) and of what the loader calls
them (`what`), so a changed or replaced file gets a new copy; the old one is left for `rm -r` (the folder holds
nothing else). Copies are written under a temporary name and renamed into place, so a run that dies while writing
leaves no half-written copy under a final name; a cache folder that cannot be written (a read-only home) only
costs the decoding each time.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from raysim.files import atomic_file

CACHE_VARIABLE = "RAYSIM_CACHE"
"""Environment variable naming raysim's cache folder (default ~/.cache/raysim), handed to algorithms as
`ServerContext.cache`."""

FORMAT = 1
"""Part of every copy's digest: a change to how copies are written makes new ones."""


def cache_folder() -> Path:
    """raysim's cache folder: $RAYSIM_CACHE, default ~/.cache/raysim."""
    return Path(os.environ.get(CACHE_VARIABLE, "~/.cache/raysim")).expanduser()


def decoded(
    what: str, sources: Sequence[Path], names: Sequence[str], decode: Callable[[], tuple[np.ndarray, ...]]
) -> tuple[np.ndarray, ...]:
    """The arrays `decode()` builds from the files `sources` (one per name of `names`), read-only and mapped from
    their decoded copy when there is one; else decoded, and the copy written for the next run."""
    folder = cache_folder() / "decoded"
    stamp = [FORMAT, what, list(names)] + [_identity(path) for path in sources]
    digest = hashlib.sha256(json.dumps(stamp).encode()).hexdigest()[:24]
    paths = [folder / f"{digest}-{name}.npy" for name in names]
    if all(path.is_file() for path in paths):
        try:
            return tuple(np.asarray(np.load(path, mmap_mode="r")) for path in paths)
        except (OSError, ValueError) as error:  # unreadable or damaged: decoded again, and rewritten
            logging.getLogger(__name__).warning("%s: decoded copy unreadable (%s); decoding again", paths[0], error)
    arrays = decode()
    if len(arrays) != len(names):
        raise ValueError(f"{what}: decode gave {len(arrays)} arrays for the {len(names)} names {list(names)}")
    for array in arrays:  # as a mapped copy will be: a run that writes into its dataset fails on its first run
        array.flags.writeable = False
    try:
        folder.mkdir(parents=True, exist_ok=True)
        for path, array in zip(paths, arrays, strict=True):
            with atomic_file(path, durable=False) as out:  # a copy lost in a crash is only decoded again
                np.save(out, np.ascontiguousarray(array), allow_pickle=False)
    except OSError as error:
        logging.getLogger(__name__).info("%s: no decoded copy kept in %s (%s)", what, folder, error)
    return arrays


def _identity(path: Path) -> list[object]:
    """What names a source's content: its resolved path, size and modification time."""
    status = path.stat()
    return [str(path.resolve()), status.st_size, status.st_mtime_ns]
