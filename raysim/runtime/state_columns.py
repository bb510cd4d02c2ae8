"""Client state in columns addressed by client id, that every host of a node reads and writes (issue 49.1).

With `runtime.state_store` = `memory` or `disk`, or `auto` (the default) resolved to one of them
(raysim.runtime.memory.choose_store), no host owns a client's state: the run's client states are one
column per state field, a [clients, ...] array memory-mapped from one `.npy` file per field (rows by client id), in
a folder the driver makes for the run (`disk`: under runtime.spill_dir or the system temp folder; `memory`: under
/dev/shm, the node's shared memory). A host touches only the rows of the chunk it is training (`rows`: a copy read
with pread, or in /dev/shm, for consecutive clients, a view of the mapped file that the step updates in place) and
writes them back (`store`); so a round's clients can be dealt to whichever host is free
(raysim.runtime.simulation.deal), and the page cache, not a host, holds what is hot.

A row is the client's state only once written (`written`, one byte a client); before, the client has its initial
state, made again on demand (`initial`: Algorithm.init_client is a function of the client and the initial model),
so the files of 100,000 clients are sparse: disk is used by the clients that trained. Rows read back are the
values stored, bit for bit (the columns keep each field's dtype), so results do not depend on the hosts.

A checkpoint is a snapshot of the store (`snapshot`: the written rows of each column, one `.npy` per field, and
their ids), not a second encoding of every client; `restore` forgets every row written since and writes the
snapshot's back. Only one process writes the snapshot or restores it (the driver asks host 0), while no host trains.

Multi-node: the folder must be one path every host sees (runtime.spill_dir on a shared file system); a host that
cannot see it stops with one line naming runtime.spill_dir. Over Ray's object store instead of a file system is
left to do (issue 49): the interface (`rows`, `store`, `__getitem__`) is what such a store would implement.
"""

from __future__ import annotations

import dataclasses
import fcntl
import functools
import json
import mmap
import os
import tempfile
import typing
from collections.abc import Callable, Iterator, MutableMapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from raysim.algorithms.interface import ClientInfo
from raysim.data.scheme import ClientSplit
from raysim.execution.stacking import own_arrays, stack
from raysim.runtime.state_store import (
    FOLDER_PREFIX,
    StoreStats,
    _remove_folder,
    _take_owner_lock,
    remove_orphaned_folders,
)
from raysim.runtime.state_table import same_memory

LAYOUT = "layout.json"
WRITTEN = "written.npy"
SNAPSHOT_IDS = "state-ids.npy"
SNAPSHOT_BLOCK_BYTES = 64 * 2**20
"""Rows copied at a time by `snapshot` and `restore` (a store's columns may be far larger than memory)."""
SHARED_MEMORY = Path("/dev/shm")
"""The node's shared memory (tmpfs), where a `memory` store's folder is made: its columns are mapped (`Column`)."""


def store_folder(kind: str, spill_dir: str | None) -> tuple[Path, Callable[[], None]]:
    """A new folder for a run's columns, `memory` in /dev/shm (when there is one), `disk` under `spill_dir`
    (default: the system temp folder), and the function that removes it (call it once). Its maker holds the
    folder's owner lock while it lives, so a later store removes it if that process was killed
    (state_store.remove_orphaned_folders)."""
    if kind == "memory" and SHARED_MEMORY.is_dir():
        parent = SHARED_MEMORY
    else:
        parent = Path(spill_dir) if spill_dir is not None else Path(tempfile.gettempdir())
    parent.mkdir(parents=True, exist_ok=True)
    remove_orphaned_folders(parent)
    folder = Path(tempfile.mkdtemp(prefix=f"{FOLDER_PREFIX}columns-", dir=parent))
    lock = _take_owner_lock(folder)
    return folder, functools.partial(_remove_folder, folder, lock)


class ClientColumns(Sequence[tuple[ClientInfo, ClientSplit]]):
    """A run's (ClientInfo, ClientSplit) pairs as a few arrays, which a shared store's driver sends every host (each
    may be dealt any client): 100,000 clients' pairs as a list took 15 s to pickle and 17 s and 250 MB of every
    host's memory to unpickle (a numpy array per split part per client); as columns, milliseconds and the indices'
    own bytes. A pair is made when asked for, equal to the one packed (the index arrays are read-only views)."""

    PARTS = ("train", "test", "val")

    def __init__(self, clients: Sequence[tuple[ClientInfo, ClientSplit]]):
        infos, splits = [info for info, _ in clients], [split for _, split in clients]
        self.ids = np.array([info.id for info in infos], np.int64)
        self.num_train = np.array([info.num_train for info in infos], np.int64)
        self.weight = np.array([info.weight for info in infos], np.float64)
        self.num_clients = np.array([info.num_clients for info in infos], np.int64)
        self.split_ids = np.array([split.client_id for split in splits], np.int64)
        self.noise_std = np.array([split.noise_std for split in splits], np.float64)
        self.bounds: dict[str, np.ndarray] = {}
        self.indices: dict[str, np.ndarray] = {}
        for part in self.PARTS:
            arrays = [np.asarray(getattr(split, part)) for split in splits]
            self.bounds[part] = np.cumsum([0, *map(len, arrays)], dtype=np.int64)
            self.indices[part] = np.concatenate(arrays) if arrays else np.zeros(0, np.int64)
        self.order = np.argsort(self.ids, kind="stable")

    def __len__(self) -> int:
        return len(self.ids)

    @typing.overload
    def __getitem__(self, index: int) -> tuple[ClientInfo, ClientSplit]: ...

    @typing.overload
    def __getitem__(self, index: slice) -> list[tuple[ClientInfo, ClientSplit]]: ...

    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            return [self[position] for position in range(len(self))[index]]
        position = range(len(self))[index]  # IndexError past the end, as a list's
        info = ClientInfo(
            int(self.ids[position]),
            int(self.num_train[position]),
            float(self.weight[position]),
            int(self.num_clients[position]),
        )
        parts = {}
        for part in self.PARTS:
            view = parts[part] = self.indices[part][self.bounds[part][position] : self.bounds[part][position + 1]]
            view.flags.writeable = False  # a view of every client's indices (writable again after a pickle)
        return info, ClientSplit(int(self.split_ids[position]), **parts, noise_std=float(self.noise_std[position]))

    def infos(self) -> list[ClientInfo]:
        """Every ClientInfo, in order, without making the splits (100,000 pairs take seconds to make)."""
        columns = (self.ids.tolist(), self.num_train.tolist(), self.weight.tolist(), self.num_clients.tolist())
        return [ClientInfo(*row) for row in zip(*columns, strict=True)]

    def split(self, client_id: int) -> ClientSplit:
        """The split of the client whose ClientInfo.id is `client_id` (KeyError if none)."""
        found = int(np.searchsorted(self.ids, client_id, sorter=self.order))
        if found == len(self.ids) or self.ids[self.order[found]] != client_id:
            raise KeyError(client_id)
        return self[int(self.order[found])][1]


def _fields(state: Any) -> list[tuple[str, Any]]:
    return [(f.name, getattr(state, f.name)) for f in dataclasses.fields(state)]


class ColumnStates(MutableMapping[int, Any]):
    """Client id -> state of `num_clients` clients, as rows of memory-mapped columns in `folder` (shared by the
    hosts of a node). Each field has a column, made by the first host that writes a value of it (its dtype and
    row shape from that value; under a file lock), and a mask of the rows where the field is not None (a field may
    be None until a client first trains, as FedSLR's). `template`: a client's state, whose fields the store has;
    `initial(client)`: a client's state before it was first written."""

    def __init__(self, folder: str | Path, num_clients: int, template: Any, initial: Callable[[int], Any]):
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise FileNotFoundError(
                f"runtime.spill_dir: the client-state folder {self.folder} is not on this host's node (set "
                "runtime.spill_dir to a folder of a file system every node shares)"
            )
        self.num_clients = num_clients
        self.mapped = self.folder.resolve().is_relative_to(SHARED_MEMORY.resolve())
        self.initial = initial
        self.kind = type(template)
        self.names = [name for name, _ in _fields(template)]
        self.columns: dict[str, Column] = {}
        self.present: dict[str, np.ndarray] = {}
        with self._locked():
            if not (self.folder / LAYOUT).exists():
                for name in self.names:
                    self._new_file(f"{name}.present.npy", np.uint8, (num_clients,))
                self._new_file(WRITTEN, np.uint8, (num_clients,))
                (self.folder / LAYOUT).write_text(json.dumps({"columns": {}}))
        for name in self.names:
            self.present[name] = np.lib.format.open_memmap(self.folder / f"{name}.present.npy", mode="r+")
        self.written = np.lib.format.open_memmap(self.folder / WRITTEN, mode="r+")

    def _locked(self) -> Any:
        """The folder's layout lock, held while the layout is read or changed."""
        return _FileLock(self.folder / ".layout.lock")

    def _new_file(self, name: str, dtype: Any, shape: tuple[int, ...]) -> None:
        """A sparse array file (only the rows written take disk)."""
        np.lib.format.open_memmap(self.folder / name, mode="w+", dtype=dtype, shape=shape)

    def _column(self, name: str, row: np.ndarray | None = None) -> Column:
        """The column of field `name`, opened when first needed; made (rows like `row`) by the first writer."""
        column = self.columns.get(name)
        if column is not None:
            return column
        with self._locked():
            layout = json.loads((self.folder / LAYOUT).read_text())
            if name not in layout["columns"]:
                if row is None:
                    raise KeyError(f"client state field {name!r} has no column yet")
                self._new_file(f"{name}.npy", row.dtype, (self.num_clients, *row.shape))
                layout["columns"][name] = True
                (self.folder / LAYOUT).write_text(json.dumps(layout))
        column = self.columns[name] = Column(self.folder / f"{name}.npy", self.mapped)
        return column

    def _checked(self, name: str, array: np.ndarray, stacked: bool) -> np.ndarray:
        """`array` (one client's value, or `stacked` rows of several), refused in one line when its rows are not
        its column's."""
        column = self._column(name, array[0] if stacked else array)
        rows = array.shape[1:] if stacked else array.shape
        if rows != column.shape[1:]:
            raise ValueError(
                f"runtime.state_store: client state field {name!r} has rows of shape {rows}, its column "
                f"{column.shape[1:]} (client states whose shapes differ between clients need runtime.state_store=hosts)"
            )
        return array

    def __getitem__(self, client: int) -> Any:
        if not 0 <= client < self.num_clients:
            raise KeyError(client)
        if not self.written[client]:
            return self.initial(client)
        values: dict[str, Any] = {}
        for name in self.names:
            if not self.present[name][client]:
                values[name] = None
                continue
            value = self._column(name).read([client])[0]
            values[name] = value.item() if value.ndim == 0 else value
        return self.kind(**values)

    def __setitem__(self, client: int, state: Any) -> None:
        for name, value in _fields(state):
            if value is not None:
                array = self._checked(name, np.asarray(value), stacked=False)
                self.columns[name].write([client], array[None])
            self.present[name][client] = value is not None
        self.written[client] = 1

    def __delitem__(self, client: int) -> None:
        self.written[client] = 0

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.num_clients))

    def __len__(self) -> int:
        return self.num_clients

    def __contains__(self, client: object) -> bool:
        return isinstance(client, int) and 0 <= client < self.num_clients

    def rows(self, clients: Sequence[int]) -> Any:
        """The stacked state of `clients` (Algorithm.stacks), as raysim.execution.stacking.stack makes it of their
        states: read from the columns when every client was written and each field is present in all their rows or
        in none, else stacked from their states one by one. Read from mapped columns, the rows of consecutive
        clients are views of the mapping, which a step may update in place (ClientChunk.in_place) as it does a
        StateTable's rows (`store` then skips them); other rows are new arrays."""
        ids = np.asarray(clients, dtype=np.int64)
        values: dict[str, Any] = {}
        gathered = bool(self.written[ids].all())
        for name in self.names if gathered else ():
            present = self.present[name][ids]
            if not present.any():
                values[name] = None
            elif present.all():
                column = self._column(name)
                view = column.view(ids)
                values[name] = view if view is not None else column.read(ids)
            else:
                gathered = False
        if gathered:
            return self.kind(**values)
        return stack([own_arrays(self[c]) for c in clients])

    def store(self, clients: Sequence[int], new: Any, kept: np.ndarray | None = None) -> None:
        """Write the new stacked state of `clients` into their rows, only those `kept` (a mask; default all)."""
        ids = np.asarray(clients, dtype=np.int64)
        mask = np.ones(len(ids), bool) if kept is None else np.asarray(kept, bool)
        if not mask.any():
            return
        chosen = ids[mask]
        for name, value in _fields(new):
            if value is not None:
                array = self._checked(name, np.asarray(value), stacked=True)
                column = self.columns[name]
                view = column.view(ids)
                if view is None or not same_memory(view, array):  # else the step wrote the rows in place
                    column.write(chosen, array[mask])
            self.present[name][chosen] = value is not None
        self.written[chosen] = 1

    def written_ids(self) -> np.ndarray:
        return np.flatnonzero(self.written)

    def stats(self) -> StoreStats:
        """Clients written (`spilled`: their rows are in the files) and the files' bytes on disk (allocated blocks:
        the columns are sparse)."""
        files = [path for path in self.folder.iterdir() if path.suffix == ".npy"]
        disk = sum(os.stat(path).st_blocks * 512 for path in files)
        return StoreStats(0, int(self.written.sum()), 0, disk, 0, 0)

    def _existing(self, name: str) -> Column | None:
        """The column of `name` if a host made it, else None."""
        try:
            return self._column(name)
        except KeyError:
            return None

    def snapshot(self, directory: str | Path) -> None:
        """Write the written rows of the store into `directory`, synced, as a checkpoint's files are: their ids
        (`state-ids.npy`), and of each field its mask (`state-<field>.present.npy`) and rows
        (`state-<field>.npy`, when some host made its column), a block of rows at a time."""
        directory = Path(directory)
        ids = self.written_ids()
        _save(directory / SNAPSHOT_IDS, ids)
        for name in self.names:
            _save(directory / f"state-{name}.present.npy", np.asarray(self.present[name][ids]))
            column = self._existing(name)
            if column is None:
                continue
            path = directory / f"state-{name}.npy"
            target = np.lib.format.open_memmap(path, mode="w+", dtype=column.dtype, shape=(len(ids), *column.shape[1:]))
            step = max(1, SNAPSHOT_BLOCK_BYTES // max(1, column.row_bytes))
            for begin in range(0, len(ids), step):
                target[begin : begin + step] = column.read(ids[begin : begin + step])
            target.flush()
            del target
            with open(path, "rb+") as handle:
                os.fsync(handle.fileno())

    def restore(self, directory: str | Path) -> None:
        """Make the store what `snapshot` wrote into `directory`: every row written since is forgotten."""
        directory = Path(directory)
        ids = np.load(directory / SNAPSHOT_IDS, allow_pickle=False)
        self.written[:] = 0
        for name in self.names:
            self.present[name][:] = 0
            self.present[name][ids] = np.load(directory / f"state-{name}.present.npy", allow_pickle=False)
            path = directory / f"state-{name}.npy"
            if not path.exists():
                continue
            saved = np.load(path, mmap_mode="r", allow_pickle=False)
            column = self._column(name, np.zeros(saved.shape[1:], saved.dtype))
            step = max(1, SNAPSHOT_BLOCK_BYTES // max(1, column.row_bytes))
            for begin in range(0, len(ids), step):
                column.write(ids[begin : begin + step], np.asarray(saved[begin : begin + step]))
        self.written[ids] = 1

    def close(self) -> None:
        """Let go of the files (the folder is the driver's to remove)."""
        for column in self.columns.values():
            column.close()
        self.columns.clear()
        self.present.clear()


class Column:
    """One field's column: a `.npy` file of [clients, ...] rows, read and written a row at a time with pread and
    pwrite: the rows a host reads and writes go through the page cache without staying in its resident memory (a
    mapped file's touched pages count in the RSS of every process that maps it). In shared memory (`mapped`: a
    `memory` store) the rows of consecutive clients are also given as views of the file's mapping (`view`), which a
    step updates in place, as it does the rows of a host's own StateTable: no copy in or out (1,000 FLAME MLP
    clients on one host: 0.88-1.07 CPU s a round, 1.12-1.16 copied). Only those pages stay mapped; as a round's
    clients are dealt in the same runs to the same hosts (raysim.runtime.simulation.deal), each counts in one host's
    RSS."""

    def __init__(self, path: Path, mapped: bool = False):
        with open(path, "rb") as handle:
            version = np.lib.format.read_magic(handle)
            if version == (1, 0):
                shape, _, dtype = np.lib.format.read_array_header_1_0(handle)
            else:
                shape, _, dtype = np.lib.format.read_array_header_2_0(handle)
            self.offset = handle.tell()
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.row_bytes = self.dtype.itemsize * int(np.prod(self.shape[1:], dtype=np.int64))
        self.descriptor = os.open(path, os.O_RDWR)
        self.path = path
        self.rows: np.ndarray | None = None
        """The mapped [clients, ...] rows (`mapped` only; the array keeps the mapping)."""
        if mapped:
            self.rows = np.ndarray(self.shape, self.dtype, buffer=mmap.mmap(self.descriptor, 0), offset=self.offset)

    @property
    def mapped(self) -> bool:
        return self.rows is not None

    def view(self, ids: np.ndarray) -> np.ndarray | None:
        """The rows of `ids` as a view of the mapping when the column is mapped and `ids` are consecutive, else None."""
        if self.rows is None or len(ids) == 0 or not (np.diff(ids) == 1).all():
            return None
        return self.rows[ids[0] : ids[0] + len(ids)]

    def read(self, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """The rows of `ids`, in a new array."""
        out = np.empty((len(ids), *self.shape[1:]), self.dtype)
        flat = out.reshape(len(ids), -1).view(np.uint8)
        for row, client in zip(flat, np.asarray(ids, np.int64).tolist(), strict=True):
            if os.preadv(self.descriptor, [row.data], self.offset + client * self.row_bytes) != self.row_bytes:
                raise OSError(f"{self.path}: row {client} cut short")
        return out

    def write(self, ids: Sequence[int] | np.ndarray, rows: np.ndarray) -> None:
        """Write `rows` (one per id, this column's dtype and row shape) into the rows of `ids`."""
        flat = np.ascontiguousarray(rows, self.dtype).reshape(len(ids), -1).view(np.uint8)
        for row, client in zip(flat, np.asarray(ids, np.int64).tolist(), strict=True):
            os.pwrite(self.descriptor, row.data, self.offset + client * self.row_bytes)

    def close(self) -> None:
        """Let go of the file; the mapping goes once no view of it is left (a step's rows may outlive the store)."""
        self.rows = None
        os.close(self.descriptor)


def _save(path: Path, array: np.ndarray) -> None:
    """np.save, synced."""
    with open(path, "wb") as handle:
        np.save(handle, array, allow_pickle=False)
        handle.flush()
        os.fsync(handle.fileno())


class _FileLock:
    """An exclusive flock on `path` (made if new) for the duration of a with-block."""

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self) -> None:
        self.handle = open(self.path, "a+")  # noqa: SIM115  # closed in __exit__
        fcntl.flock(self.handle, fcntl.LOCK_EX)

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self.handle, fcntl.LOCK_UN)
        self.handle.close()
