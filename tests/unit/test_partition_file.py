"""Partitions as data: `raysim partition CONFIG --out FILE` and `partition: {scheme: file, path: FILE}`."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from raysim.config import validate_config
from raysim.data.partition_file import FileSettings, labels_digest, read_metadata, write_partition
from raysim.data.partitions import ClientSplit, QLabelSettings, partition_dataset
from raysim.errors import ConfigError, PartitionError
from tests.support.data_files import write_partition_table

LABELS = np.array([0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3], dtype=np.int64)


def _replay(path: Path, num_clients: int, labels: np.ndarray = LABELS, **settings) -> list[ClientSplit]:
    return partition_dataset(labels, num_clients, FileSettings(path=str(path), **settings), seed=3)


def test_written_partition_replays_exactly_with_noise_and_attackers(tmp_path):
    labels = np.repeat(np.arange(4), 25)
    splits = partition_dataset(labels, 5, QLabelSettings(q=2, val_fraction=0.2), seed=4)
    noisy = [ClientSplit(s.client_id, s.train, s.test, s.val, 0.01 * s.client_id) for s in splits]
    path = write_partition(tmp_path / "p.parquet", noisy, labels, frozenset({1, 3}), {"scheme": "q_label"})
    replayed = _replay(path, 5, labels)
    for a, b in zip(noisy, replayed, strict=True):
        assert a.client_id == b.client_id and a.noise_std == b.noise_std
        for part in ("train", "test", "val"):
            assert np.array_equal(getattr(a, part), getattr(b, part))
    metadata = read_metadata(path)
    assert metadata["disjoint"] is True and metadata["num_samples"] == 100 and metadata["scheme"] == "q_label"
    assert pq.read_table(path).column("malicious").to_pylist() == [False, True, False, True, False]
    assert [p.name for p in tmp_path.iterdir()] == ["p.parquet"]  # no temporary file left behind


def test_a_file_from_another_tool_with_train_and_test_in_any_client_order(tmp_path):
    path = write_partition_table(
        tmp_path / "other.parquet",
        {"client_id": [1, 0], "train": [[5, 4], [0, 1, 2]], "test": [[3], [11]]},
    )
    clients = _replay(path, 2)
    assert [c.train.tolist() for c in clients] == [[0, 1, 2], [4, 5]]
    assert [c.test.tolist() for c in clients] == [[11], [3]]
    assert [c.val.tolist() for c in clients] == [[], []] and [c.noise_std for c in clients] == [0.0, 0.0]


def test_a_file_with_only_indices_is_split_per_client_by_test_fraction(tmp_path):
    """E.g. flwr-datasets partitioners give each partition's indices; raysim splits them 2:1 here."""
    path = write_partition_table(tmp_path / "flwr.parquet", {"indices": [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]]})
    clients = _replay(path, 2, test_fraction=1 / 3)
    for client, held in zip(clients, ([0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]), strict=True):
        assert sorted(client.train.tolist() + client.test.tolist()) == held
        assert (len(client.train), len(client.test)) == (4, 2)
    assert [c.test.tolist() for c in clients] == [c.test.tolist() for c in _replay(path, 2, test_fraction=1 / 3)]


def test_shared_samples_are_allowed_unless_the_partition_is_declared_disjoint(tmp_path):
    path = write_partition_table(tmp_path / "overlap.parquet", {"train": [[0, 1], [1, 2]], "test": [[3], [4]]})
    assert len(_replay(path, 2)) == 2
    with pytest.raises(PartitionError, match=r"sample 1 belongs to clients 0 and 1, but the partition is declared"):
        _replay(path, 2, disjoint=True)
    claimed = write_partition_table(
        tmp_path / "claimed.parquet", {"train": [[0, 1], [1, 2]], "test": [[3], [4]]}, {"disjoint": True}
    )
    with pytest.raises(PartitionError, match="declared disjoint"):
        _replay(claimed, 2)
    assert len(_replay(claimed, 2, disjoint=False)) == 2


@pytest.mark.parametrize(
    ("columns", "metadata", "clients", "message"),
    [
        ({"train": [[0], [1]]}, None, 2, "needs list columns 'train' and 'test'"),
        ({"train": [[0]], "test": [[1]]}, None, 2, r"holds 1 clients, but clients.count=2; set clients.count: 1"),
        ({"train": [[0, 12]], "test": [[1]]}, None, 1, r"client 0: train index 12 is outside the dataset's 0..11"),
        ({"train": [[0, -1]], "test": [[1]]}, None, 1, "train index -1 is outside"),
        ({"train": [[0, 1]], "test": [[1]]}, None, 1, "sample 1 is in both its train and test parts"),
        ({"train": [[0]], "test": [[1]], "val": [[0]]}, None, 1, "sample 0 is in both its train and val parts"),
        ({"train": [[0], [2]], "test": [[1], []]}, None, 2, "client 1 has no test samples"),
        ({"train": [["a"]], "test": [[1]]}, None, 1, "column 'train' must be lists of integer sample indices"),
        ({"client_id": [0, 0], "train": [[0], [2]], "test": [[1], [3]]}, None, 2, r"the ids 0..1, each once"),
        ({"train": [[0]], "test": [[1]], "noise_std": [-0.5]}, None, 1, "noise_std must be a finite number >= 0"),
        ({"train": [[0]], "test": [[1]]}, {"num_samples": 70000}, 1, "written for a dataset of 70000 samples"),
        ({"train": [[0]], "test": [[1]]}, {"labels_sha256": "0" * 64}, 1, "labels differ from this one's"),
        ({"indices": [[0]]}, None, 1, "client 0 holds 1 samples"),
        ({"train": [[0, None, 2]], "test": [[1]]}, None, 1, r"row 0, column 'train': a missing \(null\) index inside"),
        ({"indices": [[0, 1], [2, None]]}, None, 2, r"row 1, column 'indices': a missing \(null\) index"),
        ({"client_id": [0, None], "train": [[0], [2]], "test": [[1], [3]]}, None, 2, "integer ids 0..1"),
        ({"train": [[0, 2, 0, 2, 0]], "test": [[1]]}, None, 1, r"client 0: train lists sample 0 3 times \(2 samples"),
        ({"train": [[0]], "test": [[1, 1]]}, None, 1, "client 0: test lists sample 1 2 times"),
        ({"indices": [[0, 1, 1]]}, None, 1, "client 0: indices lists sample 1 2 times"),
    ],
)
def test_a_bad_file_is_refused_naming_the_path_and_the_problem(tmp_path, columns, metadata, clients, message):
    path = write_partition_table(tmp_path / "bad.parquet", columns, metadata)
    with pytest.raises(PartitionError, match=message) as error:
        _replay(path, clients)
    assert str(error.value).startswith(f"partition.path={path}") and "\n" not in str(error.value)


def test_a_missing_or_unreadable_file_is_one_line(tmp_path):
    with pytest.raises(PartitionError, match=r"no such file \(write one with `raysim partition CONFIG --out FILE`\)"):
        _replay(tmp_path / "none.parquet", 1)
    (tmp_path / "text.parquet").write_text("client,train\n")
    with pytest.raises(PartitionError, match="not a readable Parquet partition file"):
        _replay(tmp_path / "text.parquet", 1)


def test_the_file_scheme_takes_only_its_own_keys():
    with pytest.raises(ConfigError, match=r"partition.q: unknown key"):
        validate_config({"algorithm": {"name": "flame"}, "partition": {"scheme": "file", "path": "x", "q": 2}})
    with pytest.raises(ConfigError, match=r"partition.path: Field required"):
        validate_config({"algorithm": {"name": "flame"}, "partition": {"scheme": "file"}})


def test_labels_digest_tells_datasets_and_orders_apart():
    assert labels_digest(LABELS) == labels_digest(LABELS.copy())
    assert labels_digest(LABELS) != labels_digest(LABELS[::-1])
    assert labels_digest(LABELS) != labels_digest(LABELS.astype(np.int32))
