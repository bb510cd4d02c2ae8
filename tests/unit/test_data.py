"""Data sources and the foundation's partitions."""

from __future__ import annotations

import gzip

import numpy as np
import pytest

from raysim.data import fashion_mnist as fm
from raysim.data import load_dataset, partition_dataset
from raysim.data.partitions import DirichletSettings, IIDSettings, NaturalSettings, QLabelSettings
from raysim.errors import DataError, PartitionError
from tests.support.data_files import write_npz


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
    monkeypatch.setenv("RAYSIM_DATA", str(tmp_path / "data"))
    with pytest.raises(DataError) as error:
        fm.load_fashion_mnist(None, download=False)
    for place in ("data", "debian", "cache"):
        assert str(tmp_path / place) in str(error.value)
    assert "apt-get install dataset-fashion-mnist" in str(error.value)


def test_a_dataset_root_that_is_no_folder_is_refused_not_replaced_by_another_copy(tmp_path):
    """A `dataset.root` given is read or refused: a copy found in the default places does not stand in for it."""
    (tmp_path / "a-file").write_text("x")
    for root in (tmp_path / "missing", tmp_path / "a-file"):
        with pytest.raises(DataError, match=rf"^dataset.root: {root}: no such folder"):
            fm.load_fashion_mnist(root, download=False)


def test_fashion_mnist_is_the_full_70000():
    """Stored as uint8 and normalized as read, with the bits of the FLAME authors' normalization of the whole array
    ((v / 255 - 0.1307) / 0.3081 in float32)."""
    from raysim.training.local import model_inputs

    dataset = load_dataset("fashion_mnist")
    assert dataset.x.shape == (70000, 1, 28, 28) and dataset.x.dtype == np.uint8
    assert np.bincount(dataset.y).tolist() == [7000] * 10
    rows = dataset.x[::97]
    expected = (rows.astype(np.float32) / np.float32(255.0) - np.float32(0.1307)) / np.float32(0.3081)
    assert np.array_equal(model_inputs(rows, dataset.mean, dataset.std), expected)


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


def test_synthetic_writers_have_natural_groups_with_their_own_style_and_labels():
    dataset = load_dataset("synthetic_writers", seed=3)
    again = load_dataset("synthetic_writers", seed=3)
    np.testing.assert_array_equal(dataset.x, again.x)
    assert not np.array_equal(dataset.x[:100], load_dataset("synthetic_writers", seed=4).x[:100])
    groups = dataset.groups
    assert groups is not None and groups.shape == dataset.y.shape and dataset.num_classes == 10
    assert np.unique(groups).tolist() == list(range(300)) and np.all(np.diff(groups) >= 0)  # writer by writer
    sizes = np.bincount(groups)
    assert sizes.min() >= 20 and sizes.max() <= 60 and 6_000 <= len(dataset) <= 18_000
    # each writer prefers some labels: its top label share is far above the 1/10 of a uniform writer
    top = [np.bincount(dataset.y[groups == g], minlength=10).max() / sizes[g] for g in range(300)]
    assert np.mean(top) > 0.35
    # and writes in its own style: per-writer feature means (class centres removed) differ across writers
    centred = dataset.x.copy()
    for k in range(10):
        centred[dataset.y == k] -= dataset.x[dataset.y == k].mean(axis=0)
    writer_means = np.stack([centred[groups == g].mean(axis=0) for g in range(300)])
    assert writer_means.std(axis=0).mean() > 3 * (1 / np.sqrt(sizes.mean()))  # well above sampling noise


def test_natural_partition_of_synthetic_writers_gives_each_client_whole_writers():
    dataset = load_dataset("synthetic_writers", seed=1)
    splits = partition_dataset(dataset.y, 10, NaturalSettings(), seed=1, groups=dataset.groups)
    for client, split in enumerate(splits):
        writers = np.unique(dataset.groups[np.concatenate([split.train, split.test])])
        assert writers.tolist() == list(range(30 * client, 30 * (client + 1)))  # 300 // 10 writers each
        assert abs(len(split.test) - 0.2 * split.num_samples) <= 1


def test_npz_source_reads_features_labels_and_groups(tmp_path):
    generator = np.random.default_rng(0)
    x = generator.normal(size=(50, 3, 4)).astype(np.float64)
    y = generator.integers(0, 5, size=50).astype(np.int32)
    groups = np.arange(50) // 5
    file = write_npz(tmp_path / "mine.npz", x=x, y=y, groups=groups)
    dataset = load_dataset("npz", path=file)
    assert dataset.name == "mine" and dataset.task == "classification" and dataset.input_shape == (3, 4)
    assert dataset.x.dtype == np.float32 and dataset.y.dtype == np.int64 and dataset.num_classes == int(y.max()) + 1
    np.testing.assert_array_equal(dataset.groups, groups)
    np.testing.assert_allclose(dataset.x, x.astype(np.float32))
    assert load_dataset("npz", root=file).groups is not None  # dataset.root may name the file instead
    plain = load_dataset("npz", path=write_npz(tmp_path / "plain.npz", x=x, y=y))
    assert plain.groups is None
    regression = load_dataset("npz", path=write_npz(tmp_path / "reg.npz", x=x, y=y.astype(np.float64) / 3))
    assert regression.task == "regression" and regression.num_classes == 0 and regression.y.dtype == np.float32


@pytest.mark.parametrize(
    ("arrays", "message"),
    [
        ({"y": np.zeros(4, np.int64)}, "has no array 'x' (it has: y)"),
        ({"x": np.zeros((4, 2))}, "has no array 'y' (it has: x)"),
        ({"x": np.zeros((4, 2)), "y": np.zeros(3, np.int64)}, "'x' must have shape (3, features...), got (4, 2)"),
        ({"x": np.zeros(4), "y": np.zeros(4, np.int64)}, "'x' must have shape (4, features...)"),
        ({"x": np.zeros((4, 2)), "y": np.zeros((4, 2), np.int64)}, "'y' must be one non-empty row of labels"),
        ({"x": np.zeros((4, 2)), "y": np.array([0, 1, -1, 2])}, "class labels 'y' must be >= 0, got -1"),
        ({"x": np.full((2, 2), np.nan), "y": np.zeros(2, np.int64)}, "'x' must be finite numbers"),
        ({"x": np.zeros((4, 2)), "y": np.zeros(4, np.int64), "groups": np.zeros(3, np.int64)}, "'groups' must be 4"),
        ({"x": np.zeros((2, 2)), "y": np.array(["a", "b"])}, "'y' must be integer labels or finite float targets"),
    ],
)
def test_npz_errors_name_the_key_the_file_and_what_is_expected(tmp_path, arrays, message):
    file = write_npz(tmp_path / "bad.npz", **arrays)
    with pytest.raises(DataError) as error:
        load_dataset("npz", path=file)
    text = str(error.value)
    assert text.startswith(f"dataset.path: {file}") and message in text and "\n" not in text


def test_npz_file_problems_are_one_line_each(tmp_path):
    with pytest.raises(DataError, match=r"^dataset.path: dataset.name=npz needs the path of a .npz file"):
        load_dataset("npz")
    with pytest.raises(DataError, match=rf"^dataset.path: {tmp_path / 'none.npz'}: no such file"):
        load_dataset("npz", path=tmp_path / "none.npz")
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(DataError, match="not a readable .npz archive"):
        load_dataset("npz", path=tmp_path / "junk.npz")
    np.save(tmp_path / "one.npy", np.zeros(3))
    with pytest.raises(DataError, match="a single .npy array, not a .npz archive"):
        load_dataset("npz", path=tmp_path / "one.npy")
    np.savez(tmp_path / "objects.npz", x=np.array([{"a": 1}, None], dtype=object), y=np.zeros(2, np.int64))
    with pytest.raises(DataError, match="arrays must be numeric, not objects"):
        load_dataset("npz", path=tmp_path / "objects.npz")


def test_config_takes_the_new_sources():
    from raysim.config import validate_config
    from raysim.errors import ConfigError
    from tests.support.experiments import tiny_config

    config = validate_config(tiny_config(dataset={"name": "npz", "path": "/data/mine.npz"}))
    assert config.dataset.path == "/data/mine.npz"
    assert validate_config(tiny_config(dataset={"name": "synthetic_writers"})).dataset.name == "synthetic_writers"
    unknown = r"^dataset.name: unknown dataset 'femnst'; did you mean 'femnist'\? \(allowed: mnist, .*, npz\)$"
    with pytest.raises(ConfigError, match=unknown):
        validate_config(tiny_config(dataset={"name": "femnst"}))
    with pytest.raises(
        ConfigError,
        match=r"^dataset.path: unknown key \(allowed: name, augment, crop_padding, "
        r"crop_probability, standardize\)$",
    ):
        validate_config(tiny_config(dataset={"name": "digits", "path": "/data/mine.npz"}))  # each source its keys
