"""Client state that does not fit a memory budget: the least recently used states spill to disk.

A host simulating many clients keeps one state per client across rounds (an ADMM method keeps three
model-sized vectors each), which can exceed its memory long before its compute is the limit. `ClientStateStore` is a
mapping client id -> state that keeps states in memory up to a byte budget and writes the least recently
used ones to one file per client, in the checkpoint encoding (`checkpoint.save_tree`: .npz, no pickle,
written to a temporary name and renamed), so that a state read back is bit for bit the one stored: dtypes,
None, numbers and nested dataclasses included.

Values are treated as immutable: a state changes by storing a new one (as `ClientHost.train` does), never
by changing its arrays in place. So reading a spilled state loads a fresh copy without bringing it back
into memory (the caller is about to replace it, or only evaluates it), which keeps reads from evicting
other states; memory then holds at most the budget plus the one state being read.

Spilled states are read whole rather than memory-mapped: np.load cannot map the members of an .npz, and
a state is used whole (trained, evaluated) as soon as it is read.

A host killed outright (SIGKILL, the OOM killer, a lost node) cannot remove its folder. So each folder
holds an owner lock (an flock the owning process holds while it lives and the kernel releases when it
dies), and a store that makes its folder first removes the sibling folders whose lock nobody holds.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
import weakref
from collections import OrderedDict
from collections.abc import Iterator, MutableMapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from raysim.execution.stacking import own_arrays, stack, unstack
from raysim.runtime import checkpoint

FOLDER_PREFIX = "raysim-states-"
OWNER_LOCK = ".owner.lock"
"""File in a spill folder, flock-ed by the store's process for as long as it lives."""


@dataclass(frozen=True)
class StoreStats:
    """Where a store's states are and how much moved: counts of clients and bytes (array bytes in memory,
    file bytes on disk), and files written (spills) and read (loads) since the store was made."""

    in_memory: int
    spilled: int
    memory_bytes: int
    disk_bytes: int
    spills: int
    loads: int


class _ArrayBytes:
    """An ArraySink that only adds up the bytes of the arrays `checkpoint.encode_tree` hands it."""

    def __init__(self) -> None:
        self.count = 0
        self.nbytes = 0

    def __len__(self) -> int:
        return self.count

    def __setitem__(self, key: str, array: np.ndarray) -> None:
        self.count += 1
        self.nbytes += array.nbytes


def state_nbytes(state: Any) -> int:
    """Bytes of the numpy arrays in a state tree: what a state costs in memory (its Python objects aside)."""
    sizes = _ArrayBytes()
    checkpoint.encode_tree(state, sizes)
    return sizes.nbytes


class ClientStateStore(MutableMapping[int, Any]):
    """Client id -> state, holding at most `budget_bytes` of states in memory (None: no limit) and the
    rest in `directory` (default: a new folder in the system temp folder; a given folder gets a new
    subfolder, so hosts can share it). The folder is removed by `close`, or when the store is collected."""

    def __init__(self, budget_bytes: int | None = None, directory: str | Path | None = None):
        if budget_bytes is not None and budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self._parent = None if directory is None else Path(directory)
        self._folder: Path | None = None
        self._remove_folder: weakref.finalize | None = None
        self._owner_lock: int | None = None
        """File descriptor holding the folder's owner lock."""
        self._keys: dict[int, None] = {}
        """Every key, in insertion order (iteration order does not depend on where a state lives)."""
        self._memory: OrderedDict[int, tuple[Any, int]] = OrderedDict()
        """Key -> (state, array bytes), least recently used first."""
        self._disk: dict[int, int] = {}
        """Key -> file bytes of a spilled state."""
        self._memory_bytes = 0
        self._spills = 0
        self._loads = 0

    @property
    def folder(self) -> Path:
        """The folder of the spill files, made on first use."""
        if self._folder is None:
            parent = Path(tempfile.gettempdir()) if self._parent is None else self._parent
            parent.mkdir(parents=True, exist_ok=True)
            remove_orphaned_folders(parent)
            self._folder = Path(tempfile.mkdtemp(prefix=FOLDER_PREFIX, dir=parent))
            self._owner_lock = _take_owner_lock(self._folder)
            self._remove_folder = weakref.finalize(self, _remove_folder, self._folder, self._owner_lock)
        return self._folder

    def _path(self, key: int) -> Path:
        return self.folder / f"client-{key}.npz"

    def __getitem__(self, key: int) -> Any:
        if key in self._memory:
            self._memory.move_to_end(key)
            return self._memory[key][0]
        if key not in self._disk:
            raise KeyError(key)
        self._loads += 1
        return checkpoint.load_tree(self._path(key))

    def __setitem__(self, key: int, state: Any) -> None:
        nbytes = state_nbytes(state)
        self._drop(key)
        self._keys[key] = None
        self._memory[key] = (state, nbytes)
        self._memory_bytes += nbytes
        if self.budget_bytes is not None:
            while self._memory_bytes > self.budget_bytes and self._memory:
                self._spill()

    def _spill(self) -> None:
        """Write the least recently used state in memory to its file, then let go of it."""
        key, (state, nbytes) = next(iter(self._memory.items()))
        path = self._path(key)
        checkpoint.save_tree(path, state, durable=False)  # scratch: a crash loses the host anyway
        del self._memory[key]
        self._memory_bytes -= nbytes
        self._disk[key] = path.stat().st_size
        self._spills += 1

    def _drop(self, key: int) -> None:
        """Forget the stored state of `key` (memory or file), keeping its place in the key order."""
        if key in self._memory:
            self._memory_bytes -= self._memory.pop(key)[1]
        elif key in self._disk:
            del self._disk[key]
            self._path(key).unlink()

    def __delitem__(self, key: int) -> None:
        if key not in self._keys:
            raise KeyError(key)
        self._drop(key)
        del self._keys[key]

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __iter__(self) -> Iterator[int]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def rows(self, clients: Sequence[int]) -> Any:
        """The stacked state of `clients` (Algorithm.stacks), a copy: states spill one by one, so no table keeps
        them as rows."""
        return stack([self[c] for c in clients])

    def store(self, clients: Sequence[int], new: Any, kept: np.ndarray | None = None) -> None:
        """Store each row of the new stacked state of `clients` that is `kept` (default all) as its client's own
        copy (a row view would keep the whole chunk's array)."""
        rows = unstack(new, len(clients))
        for client, state, ok in zip(clients, rows, [True] * len(clients) if kept is None else kept, strict=True):
            if ok:
                self[client] = own_arrays(state)

    def stats(self) -> StoreStats:
        return StoreStats(
            in_memory=len(self._memory),
            spilled=len(self._disk),
            memory_bytes=self._memory_bytes,
            disk_bytes=sum(self._disk.values()),
            spills=self._spills,
            loads=self._loads,
        )

    def close(self) -> None:
        """Forget every state and remove the spill folder."""
        self._keys.clear()
        self._memory.clear()
        self._disk.clear()
        self._memory_bytes = 0
        if self._remove_folder is not None:
            self._remove_folder()
        self._folder = self._remove_folder = self._owner_lock = None

    def __enter__(self) -> ClientStateStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _take_owner_lock(folder: Path) -> int:
    """Lock a new file and only then give it its name in `folder`, so no sweep ever sees it unlocked."""
    pending = folder / f"{OWNER_LOCK}.{os.getpid()}"
    descriptor = os.open(pending, os.O_CREAT | os.O_WRONLY, 0o600)
    fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    pending.rename(folder / OWNER_LOCK)
    return descriptor


def _remove_folder(folder: Path, owner_lock: int) -> None:
    shutil.rmtree(folder, ignore_errors=True)
    os.close(owner_lock)


def remove_orphaned_folders(parent: Path) -> list[Path]:
    """Remove the spill folders in `parent` whose owner lock no live process holds (their host was killed
    before it could clean up); returns them. Folders without a lock (being made, or not ours) are kept."""
    removed = []
    for folder in parent.glob(f"{FOLDER_PREFIX}*"):
        try:
            descriptor = os.open(folder / OWNER_LOCK, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(descriptor)
            continue
        _remove_folder(folder, descriptor)
        removed.append(folder)
    return removed
