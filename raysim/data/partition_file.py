"""Partitions as data: one Parquet row per client, written by `raysim partition` and replayed exactly by
`partition: {scheme: file, path: ...}`.

Columns (one row per client):

| column | type | required |
|---|---|---|
| `train`, `test` | list<int64>: indices into the pooled dataset | yes, or `indices` |
| `indices` | list<int64>: all the client's samples, split here (`test_fraction`) | instead of `train`, `test` |
| `client_id` | int64, the ids 0..m-1 in any order | no (row order) |
| `val` | list<int64> | no (empty) |
| `noise_std` | float64, quality-skew noise added at every access | no (0) |
| `malicious` | bool, used as the attacker set when `attack.kind` is not none | no |

A file from another tool (e.g. flwr-datasets' partitioners) needs only `indices`, or `train` and `test`.
raysim's own files also carry, in the schema metadata under `raysim`, the number of samples, a digest of
the labels (so a file is never replayed on another dataset or sample order) and whether the clients'
samples are disjoint, which replay then checks.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import Field

from raysim.data.scheme import PARTITIONS, ClientSplit, SchemeSettings, split_client
from raysim.errors import PartitionError
from raysim.examples import ExampleContext, Fragment
from raysim.seeding import Stream, rng

METADATA_KEY = b"raysim"
PARTS = ("train", "test", "val")


@PARTITIONS.register()
class FileSettings(SchemeSettings):
    """Replay a partition written as Parquet (see the module docstring), with checks: indices in range, no
    sample in two parts of one client, no client without training or test samples, and the clients disjoint
    where the file or `disjoint` claims it."""

    scheme: Literal["file"] = "file"
    global_test: ClassVar[bool] = False
    path: str = Field(description="the Parquet file (`raysim partition CONFIG --out FILE` writes one)")
    disjoint: bool | None = Field(
        None, description="check that no sample belongs to two clients (default: as the file's metadata says)"
    )
    test_fraction: float = Field(0.2, gt=0.0, lt=1.0, description="for a file with only `indices`: test share")
    val_fraction: float = Field(0.0, ge=0.0, lt=1.0, description="for a file with only `indices`: validation share")

    @classmethod
    def example(cls, context: ExampleContext) -> Fragment:
        """The replay of the base experiment's partition, written by `raysim partition`."""
        return {"partition": {"scheme": "file", "path": str(context.partition_file)}}

    def splits(self, labels, num_clients, seed, groups):
        """The clients of the file; a file with only `indices` split here per client."""
        splits = []
        for row in read_partition(self, np.asarray(labels), num_clients):
            if row.indices is not None:
                split = split_client(row.client_id, row.indices, self, rng(seed, Stream.PARTITION, 1, row.client_id))
            else:
                split = ClientSplit(row.client_id, np.sort(row.train), np.sort(row.test), np.sort(row.val))
            splits.append(ClientSplit(split.client_id, split.train, split.test, split.val, row.noise_std))
        return splits

    def malicious(self, labels: np.ndarray, num_clients: int) -> frozenset[int]:
        """The attackers the file marks (its `malicious` column)."""
        rows = read_partition(self, np.asarray(labels), num_clients)
        return frozenset(row.client_id for row in rows if row.malicious)


@dataclass(frozen=True)
class ClientRow:
    """One client as the file holds it; `train`/`test` are None when the file gives only `indices`."""

    client_id: int
    indices: np.ndarray | None
    train: np.ndarray | None
    test: np.ndarray | None
    val: np.ndarray
    noise_std: float
    malicious: bool

    def held(self) -> dict[str, np.ndarray]:
        """The client's index sets as the file gives them: `indices` alone, or train, test and val."""
        if self.indices is not None:
            return {"indices": self.indices}
        assert self.train is not None and self.test is not None  # read_partition: a row without indices has both
        return {"train": self.train, "test": self.test, "val": self.val}


def labels_digest(labels: np.ndarray) -> str:
    """sha256 of the labels in dataset order: the same dataset, pooled the same way, gives the same digest."""
    labels = np.ascontiguousarray(labels)
    return hashlib.sha256(str(labels.dtype).encode() + labels.tobytes()).hexdigest()


def is_disjoint(splits: list[ClientSplit]) -> bool:
    everything = np.concatenate([getattr(s, part) for s in splits for part in PARTS])
    return len(np.unique(everything)) == len(everything)


def write_partition(
    path: str | Path,
    splits: list[ClientSplit],
    labels: np.ndarray,
    malicious: frozenset[int] = frozenset(),
    description: dict[str, Any] | None = None,
) -> Path:
    """Write the partition atomically (a temporary file renamed into place: never a half-written file)."""
    path = Path(path)
    ints = pa.list_(pa.int64())
    table = pa.table(
        {
            "client_id": pa.array([s.client_id for s in splits], pa.int64()),
            **{part: pa.array([getattr(s, part).astype(np.int64) for s in splits], ints) for part in PARTS},
            "noise_std": pa.array([float(s.noise_std) for s in splits], pa.float64()),
            "malicious": pa.array([s.client_id in malicious for s in splits], pa.bool_()),
        }
    )
    metadata = {
        "format": 1,
        "num_samples": len(labels),
        "labels_sha256": labels_digest(labels),
        "disjoint": is_disjoint(splits),
        **(description or {}),
    }
    table = table.replace_schema_metadata({METADATA_KEY: json.dumps(metadata).encode()})
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        pq.write_table(table, partial)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    return path


def _indices(column: pa.ChunkedArray, name: str, where: str) -> list[np.ndarray]:
    if not (pa.types.is_list(column.type) or pa.types.is_large_list(column.type)) or not pa.types.is_integer(
        column.type.value_type
    ):
        raise PartitionError(f"{where}: column {name!r} must be lists of integer sample indices, not {column.type}")
    if column.null_count:
        raise PartitionError(f"{where}: column {name!r} has a missing (null) list")
    lists = column.to_pylist()
    for row, indices in enumerate(lists):
        if None in indices:
            raise PartitionError(
                f"{where}: row {row}, column {name!r}: a missing (null) index inside the list "
                f"(position {indices.index(None)})"
            )
    return [np.asarray(indices, dtype=np.int64) for indices in lists]


def read_metadata(path: str | Path) -> dict[str, Any]:
    """The raysim metadata of a partition file ({} for a file another tool wrote)."""
    raw = pq.read_schema(path).metadata or {}
    return json.loads(raw[METADATA_KEY]) if METADATA_KEY in raw else {}


def read_partition(settings: FileSettings, labels: np.ndarray, num_clients: int) -> list[ClientRow]:
    """The clients of the file, checked against the dataset (`labels`) and `clients.count`; raises
    PartitionError naming `partition.path` and what is wrong."""
    where = f"partition.path={settings.path}"
    path = Path(settings.path).expanduser()
    if not path.is_file():
        raise PartitionError(f"{where}: no such file (write one with `raysim partition CONFIG --out FILE`)")
    try:
        table = pq.read_table(path)
        metadata = read_metadata(path)
    except (pa.ArrowException, OSError, ValueError) as error:
        raise PartitionError(f"{where}: not a readable Parquet partition file ({error})") from None
    columns = set(table.column_names)
    if not ({"train", "test"} <= columns or "indices" in columns):
        raise PartitionError(
            f"{where}: needs list columns 'train' and 'test' (and optionally 'val'), or one 'indices' column; "
            f"found {', '.join(sorted(columns)) or 'none'}"
        )
    if table.num_rows != num_clients:
        raise PartitionError(
            f"{where} holds {table.num_rows} clients, but clients.count={num_clients}; set clients.count: "
            f"{table.num_rows}"
        )
    _check_dataset(metadata, labels, where)
    ids = list(range(num_clients))
    if "client_id" in columns:
        listed = table.column("client_id").to_pylist()
        if not all(isinstance(i, int) for i in listed):
            raise PartitionError(
                f"{where}: column 'client_id' must hold integer ids 0..{num_clients - 1} (found "
                f"{next(i for i in listed if not isinstance(i, int))!r})"
            )
        ids = [int(i) for i in listed]
        if sorted(ids) != list(range(num_clients)):
            raise PartitionError(f"{where}: column 'client_id' must hold the ids 0..{num_clients - 1}, each once")
    empty = [np.arange(0, dtype=np.int64)] * num_clients
    parts = {
        name: _indices(table.column(name), name, where)
        for name in ("train", "test", "val", "indices")
        if name in columns
    }
    noise = table.column("noise_std").to_pylist() if "noise_std" in columns else [0.0] * num_clients
    marked = table.column("malicious").to_pylist() if "malicious" in columns else [False] * num_clients
    rows = [
        ClientRow(
            client_id=ids[r],
            indices=parts["indices"][r] if "indices" in parts and "train" not in parts else None,
            train=parts["train"][r] if "train" in parts else None,
            test=parts["test"][r] if "train" in parts else None,
            val=parts.get("val", empty)[r] if "train" in parts else empty[r],
            noise_std=float(noise[r] or 0.0),
            malicious=bool(marked[r]),
        )
        for r in range(num_clients)
    ]
    for row in rows:
        _check_client(row, len(labels), where)
    claimed = settings.disjoint if settings.disjoint is not None else metadata.get("disjoint", False)
    if claimed:
        _check_disjoint(rows, where)
    return sorted(rows, key=lambda row: row.client_id)


def _check_dataset(metadata: dict[str, Any], labels: np.ndarray, where: str) -> None:
    if "num_samples" in metadata and metadata["num_samples"] != len(labels):
        raise PartitionError(
            f"{where} was written for a dataset of {metadata['num_samples']} samples; this dataset has {len(labels)}"
        )
    if "labels_sha256" in metadata and metadata["labels_sha256"] != labels_digest(labels):
        raise PartitionError(
            f"{where} was written for a dataset whose labels differ from this one's (another dataset, split or "
            "sample order); write the partition again with this config"
        )


def _check_client(row: ClientRow, num_samples: int, where: str) -> None:
    client = f"{where}: client {row.client_id}"
    held = row.held()
    for name, indices in held.items():
        if len(indices) and (indices.min() < 0 or indices.max() >= num_samples):
            bad = int(indices[(indices < 0) | (indices >= num_samples)][0])
            raise PartitionError(f"{client}: {name} index {bad} is outside the dataset's 0..{num_samples - 1}")
        unique, counts = np.unique(indices, return_counts=True)
        if len(unique) < len(indices):
            repeated = counts > 1
            raise PartitionError(
                f"{client}: {name} lists sample {int(unique[repeated][0])} {int(counts[repeated][0])} times "
                f"({int(repeated.sum())} samples listed more than once); a client holds each sample once"
            )
    if row.indices is not None:
        if len(row.indices) < 2:
            raise PartitionError(
                f"{client} holds {len(row.indices)} samples; every client needs a training and a test sample"
            )
        return
    for name in ("train", "test"):
        if len(held[name]) == 0:
            raise PartitionError(f"{client} has no {name} samples; every client needs both")
    for first, second in (("train", "test"), ("train", "val"), ("test", "val")):
        shared = np.intersect1d(held[first], held[second])
        if len(shared):
            raise PartitionError(f"{client}: sample {int(shared[0])} is in both its {first} and {second} parts")
    if not np.isfinite(row.noise_std) or row.noise_std < 0:
        raise PartitionError(f"{client}: noise_std must be a finite number >= 0 (got {row.noise_std})")


def _check_disjoint(rows: list[ClientRow], where: str) -> None:
    owner: dict[int, int] = {}
    for row in rows:
        for index in np.unique(np.concatenate(list(row.held().values()))).tolist():
            if owner.setdefault(index, row.client_id) != row.client_id:
                raise PartitionError(
                    f"{where}: sample {index} belongs to clients {owner[index]} and {row.client_id}, but the "
                    "partition is declared disjoint (partition.disjoint, or the file's metadata); set "
                    "partition.disjoint: false to allow shared samples"
                )
