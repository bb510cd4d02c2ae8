"""Data sources and the foundation's partitions."""

from __future__ import annotations

import gzip

import numpy as np
import pytest

from raysim.data import fashion_mnist as fm
from raysim.data import load_dataset, partition_dataset
from raysim.data.partitions import DirichletSettings, IIDSettings, QLabelSettings
from raysim.errors import DataError, PartitionError


def _write_idx(path, array: np.ndarray, compress: bool) -> None:
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    payload = header + array.astype(np.uint8).tobytes()
    if compress:
        with gzip.open(str(path) + ".gz", "wb") as handle:
            handle.write(payload)
    else:
        path.write_bytes(payload)


def _fake_fashion_mnist(directory, compress: bool) -> tuple[np.ndarray, np.ndarray]:
    directory.mkdir(parents=True, exist_ok=True)
    generator = np.random.default_rng(0)
    images = generator.integers(0, 256, size=(7, 28, 28))
    labels = generator.integers(0, 10, size=7)
    _write_idx(directory / fm.FILES["train_images"], images[:5], compress)
    _write_idx(directory / fm.FILES["train_labels"], labels[:5], compress)
    _write_idx(directory / fm.FILES["test_images"], images[5:], compress)
    _write_idx(directory / fm.FILES["test_labels"], labels[5:], compress)
    return images, labels


@pytest.mark.parametrize("compress", [True, False])
def test_idx_files_in_a_torchvision_root_are_read_exactly(tmp_path, compress):
    images, labels = _fake_fashion_mnist(tmp_path / "FashionMNIST" / "raw", compress)
    got_images, got_labels = fm.load_fashion_mnist(tmp_path, download=False)
    np.testing.assert_array_equal(got_images, images)
    np.testing.assert_array_equal(got_labels, labels)


def test_truncated_idx_file_is_named(tmp_path):
    _fake_fashion_mnist(tmp_path, compress=False)
    target = tmp_path / fm.FILES["train_images"]
    target.write_bytes(target.read_bytes()[:-10])
    with pytest.raises(DataError, match="train-images-idx3-ubyte: truncated"):
        fm.load_fashion_mnist(tmp_path, download=False)


def test_missing_dataset_error_names_every_place(tmp_path, monkeypatch):
    monkeypatch.setattr(fm, "DEBIAN_DIR", tmp_path / "debian")
    monkeypatch.setattr(fm, "CACHE_DIR", tmp_path / "cache")
    monkeypatch.delenv("RAYSIM_DATA", raising=False)
    with pytest.raises(DataError) as error:
        fm.load_fashion_mnist(tmp_path / "root", download=False)
    for place in ("root", "debian", "cache"):
        assert str(tmp_path / place) in str(error.value)
    assert "apt-get install dataset-fashion-mnist" in str(error.value)


def test_fashion_mnist_is_the_full_70000():
    dataset = load_dataset("fashion_mnist")
    assert dataset.x.shape == (70000, 1, 28, 28) and dataset.x.dtype == np.float32
    assert np.bincount(dataset.y).tolist() == [7000] * 10


@pytest.mark.parametrize(
    "settings", [IIDSettings(), DirichletSettings(beta=0.3), QLabelSettings(q=2)], ids=lambda s: s.scheme
)
def test_partitions_are_disjoint_deterministic_and_split_80_20(settings):
    labels = load_dataset("digits").y
    first = partition_dataset(labels, 8, settings, seed=5)
    again = partition_dataset(labels, 8, settings, seed=5)
    other = partition_dataset(labels, 8, settings, seed=6)
    every = np.concatenate([np.concatenate([c.train, c.test]) for c in first])
    assert len(every) == len(np.unique(every))
    for a, b in zip(first, again, strict=True):
        np.testing.assert_array_equal(a.train, b.train)
        np.testing.assert_array_equal(a.test, b.test)
        assert abs(len(a.test) - 0.2 * a.num_samples) <= 1
    assert any(not np.array_equal(a.train, b.train) for a, b in zip(first, other, strict=True))


def test_q_label_clients_hold_at_most_q_classes():
    labels = load_dataset("digits").y
    for client in partition_dataset(labels, 10, QLabelSettings(q=2), seed=1):
        assert len(np.unique(labels[np.concatenate([client.train, client.test])])) <= 2


def test_too_many_shards_is_a_partition_error():
    labels = load_dataset("digits").y
    with pytest.raises(PartitionError, match="partition.q=4 .*clients.count"):
        partition_dataset(labels, 500, QLabelSettings(q=4), seed=1)
