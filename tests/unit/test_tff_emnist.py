"""FEMNIST from TensorFlow Federated's HDF5 files (`dataset.format: tff_h5`, raysim.data.tff_emnist), FLAME's
FEMNIST (flame.md 6.1): small files written here with h5py in TFF's layout, examples/<writer id>/{pixels,label}."""

from __future__ import annotations

import h5py
import numpy as np
import pytest

from raysim.data import load_dataset
from raysim.data.catalog import found_at
from raysim.data.dataset import DATASETS
from raysim.data.partitions import NaturalSettings, partition_dataset
from raysim.data.tff_emnist import FILES
from raysim.errors import DataError
from tests.support.data_files import WRITERS, write_tff_emnist


def test_tff_femnist_pools_each_writers_train_and_test_and_groups_by_sorted_writer(tmp_path):
    written = write_tff_emnist(tmp_path)
    data = load_dataset("femnist", root=tmp_path, split="digits", format="tff_h5")
    names = sorted(WRITERS)
    assert data.x.shape == (sum(map(sum, WRITERS.values())), 1, 28, 28) and data.x.dtype == np.uint8
    assert data.num_classes == 62 and data.mean == (0.0,) and data.std == (1.0,)  # CNN2's 62 outputs, LEAF's floats
    assert data.groups.tolist() == [g for g, name in enumerate(names) for _ in range(sum(WRITERS[name]))]
    expected_x = np.concatenate([np.concatenate([written[n][0], written[n][2]]) for n in names])
    expected_y = np.concatenate([np.concatenate([written[n][1], written[n][3]]) for n in names])
    assert np.array_equal(data.x[:, 0], np.rint(expected_x * 255).astype(np.uint8))  # train then test, per writer
    assert np.array_equal(data.y, expected_y) and data.y.dtype == np.int64


def test_the_natural_partition_of_tff_femnist_gives_each_client_whole_writers_in_sorted_runs(tmp_path):
    """FLAME's feature skew (flame.md 6.3 scheme 5): writers // m contiguous sorted writers per client, each with
    all its samples (train and test file) and no other; 5 // 2 = 2 writers each, the fifth unused. The authors' split
    (`draw: authors`) drops one of each client's test indices, as their code does (flame.md 6.1)."""
    write_tff_emnist(tmp_path)
    data = load_dataset("femnist", root=tmp_path, split="digits", format="tff_h5")
    names = sorted(WRITERS)
    for draw in ("raysim", "authors"):
        splits = partition_dataset(data.y, 2, NaturalSettings(draw=draw), 1, groups=data.groups)
        for client, owned_names in zip(splits, (names[0:2], names[2:4]), strict=True):
            owned = np.sort(np.concatenate([client.train, client.test, client.val]))
            expected = np.flatnonzero(np.isin(data.groups, [names.index(n) for n in owned_names]))
            dropped = np.setdiff1d(expected, owned)
            assert np.isin(owned, expected).all() and len(dropped) == (1 if draw == "authors" else 0)
            assert len(client.train) > len(client.test) > 0


def test_tff_femnist_all_classes_and_where_it_is_found(tmp_path):
    write_tff_emnist(tmp_path / "all", split="all")
    data = load_dataset("femnist", root=tmp_path / "all", format="tff_h5")
    assert len(data) == sum(map(sum, WRITERS.values())) and data.y.max() >= 10
    source = DATASETS.get("femnist")
    assert found_at(source, [tmp_path, tmp_path / "all"]) == tmp_path / "all"  # `raysim datasets` sees the files
    with pytest.raises(
        DataError,
        match=r"dataset.root: .*: no fed_emnist_digitsonly_train.h5 or "
        r"fed_emnist_digitsonly_test.h5 \(TFF's federated EMNIST; download",
    ):
        load_dataset("femnist", root=tmp_path / "all", split="digits", format="tff_h5")


def test_tff_femnist_refuses_files_not_in_tffs_layout(tmp_path):
    write_tff_emnist(tmp_path, writers={"f0001_12": (3, 1)})
    with h5py.File(tmp_path / FILES["digits"][1], "a") as handle:
        handle["examples/f0001_12/label"][0] = 12  # a letter in the digits-only file
    with pytest.raises(DataError, match=r"examples/f0001_12: 'label' must hold integers in 0..9"):
        load_dataset("femnist", root=tmp_path, split="digits", format="tff_h5")
    with h5py.File(tmp_path / FILES["digits"][1], "w") as handle:
        handle.create_group("clients")
    with pytest.raises(DataError, match=r"fed_emnist_digitsonly_test.h5: no group 'examples'"):
        load_dataset("femnist", root=tmp_path, split="digits", format="tff_h5")
    (tmp_path / FILES["digits"][1]).write_text("not hdf5")
    with pytest.raises(DataError, match=r"fed_emnist_digitsonly_test.h5: not a readable HDF5 file"):
        load_dataset("femnist", root=tmp_path, split="digits", format="tff_h5")
