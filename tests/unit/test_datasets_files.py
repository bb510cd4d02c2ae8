"""The file-backed image sources (MNIST, EMNIST, CIFAR-10/100) read small files written in the real on-disk
formats, download through a local HTTP server, refuse corrupt downloads, and run end to end through the CLI."""

from __future__ import annotations

import io
import pickle
import socket
import tarfile
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest

from raysim.data import cifar
from raysim.data.download import extract, fetch
from raysim.data.sources import load_dataset
from raysim.errors import ConfigError, DataError
from tests.support.data_files import mnist_arrays, write_cifar10, write_cifar100, write_emnist, write_mnist


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.parametrize(("layout", "gz"), [("torchvision", False), ("torchvision", True), ("flat", False)])
def test_mnist_pools_train_then_test_as_uint8_images(tmp_path, layout, gz):
    arrays = mnist_arrays()
    directory = tmp_path / "MNIST" / "raw" if layout == "torchvision" else tmp_path
    write_mnist(directory, arrays, gz)
    data = load_dataset("mnist", root=tmp_path, download=False)
    assert data.x.dtype == np.uint8 and data.x.shape == (10, 1, 28, 28)
    assert data.y.dtype == np.int64 and data.num_classes == 10
    np.testing.assert_array_equal(data.x[:, 0], np.concatenate([arrays["train_x"], arrays["test_x"]]))
    np.testing.assert_array_equal(data.y, np.concatenate([arrays["train_y"], arrays["test_y"]]))
    assert data.mean == (0.1307,) and data.std == (0.3081,)


@pytest.mark.parametrize(("split", "classes", "low"), [("balanced", 47, 0), ("letters", 26, 1)])
def test_emnist_turns_images_upright_and_numbers_classes_from_zero(tmp_path, split, classes, low):
    upright = mnist_arrays(seed=1, classes=classes, low=low)
    for part in ("train", "test"):  # make every image visibly non-symmetric
        upright[f"{part}_x"][:, 0, :] = 255
        upright[f"{part}_x"][:, 1:, 0] = 0
    write_emnist(tmp_path / "EMNIST" / "raw", split, upright, gz=True)
    data = load_dataset("emnist", root=tmp_path, download=False, split=split)
    assert data.x.dtype == np.uint8 and data.x.shape == (10, 1, 28, 28)
    assert data.num_classes == classes
    np.testing.assert_array_equal(data.x[:, 0], np.concatenate([upright["train_x"], upright["test_x"]]))
    np.testing.assert_array_equal(data.y, np.concatenate([upright["train_y"], upright["test_y"]]).astype(int) - low)
    assert data.y.min() >= 0 and data.y.max() < classes


def test_emnist_split_must_be_one_of_the_six(tmp_path):
    with pytest.raises(
        ConfigError,
        match=r"dataset\.split: must be 'byclass', 'bymerge', 'balanced', 'letters', 'digits' or "
        r"'mnist' \(got 'bogus'\)",
    ):
        load_dataset("emnist", root=tmp_path, download=False, split="bogus")
    with pytest.raises(ConfigError, match=r"^dataset\.split: Field required$"):
        load_dataset("emnist", root=tmp_path, download=False)


def test_cifar10_reads_pickled_batches_as_nchw_uint8_in_file_order(tmp_path):
    batches = write_cifar10(tmp_path)
    data = load_dataset("cifar10", root=tmp_path, download=False)
    assert data.x.dtype == np.uint8 and data.x.shape == (24, 3, 32, 32) and data.x.flags.c_contiguous
    assert data.y.dtype == np.int64 and data.num_classes == 10
    first = batches[0][b"data"][0]
    np.testing.assert_array_equal(data.x[0, 0], first[:1024].reshape(32, 32))  # red plane
    np.testing.assert_array_equal(data.x[0, 2], first[2048:].reshape(32, 32))  # blue plane
    np.testing.assert_array_equal(data.y, np.concatenate([b[b"labels"] for b in batches]))
    np.testing.assert_array_equal(data.x[-4:].reshape(4, -1), batches[-1][b"data"])  # test batch last
    assert data.mean == (0.5, 0.5, 0.5) and data.std == (0.5, 0.5, 0.5)
    own = load_dataset("cifar10", root=tmp_path, download=False, normalization="dataset")  # FedSLR's
    assert (own.mean, own.std) == ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
    np.testing.assert_array_equal(own.x, data.x)
    with pytest.raises(ConfigError, match=r"dataset\.normalization.*'half'.*'dataset'"):
        load_dataset("cifar10", root=tmp_path, download=False, normalization="imagenet")


def test_cifar100_uses_the_fine_labels(tmp_path):
    batches = write_cifar100(tmp_path)
    data = load_dataset("cifar100", root=tmp_path, download=False)
    assert data.x.shape == (10, 3, 32, 32) and data.num_classes == 100
    np.testing.assert_array_equal(data.y, batches[0][b"fine_labels"] + batches[1][b"fine_labels"])
    assert len(data.mean) == 3 and len(data.std) == 3


def test_a_cifar_batch_that_asks_for_other_globals_is_refused_without_running_them(tmp_path):
    write_cifar10(tmp_path)
    marker = tmp_path / "ran"

    class Exploit:
        def __reduce__(self):
            return (Path.touch, (marker,))

    (tmp_path / "cifar-10-batches-py" / "data_batch_3").write_bytes(pickle.dumps({b"data": Exploit()}, protocol=2))
    with pytest.raises(DataError, match=r"data_batch_3: not a readable CIFAR batch .*not allowed"):
        load_dataset("cifar10", root=tmp_path, download=False)
    assert not marker.exists()


@pytest.mark.parametrize(
    ("name", "split", "expected"),
    [
        ("mnist", None, "MNIST/raw/train-images-idx3-ubyte"),
        ("emnist", "digits", "EMNIST/raw/emnist-digits-train-images-idx3-ubyte"),
        ("cifar10", None, "cifar-10-batches-py/data_batch_1"),
        ("cifar100", None, "cifar-100-python/train"),
    ],
)
def test_a_missing_file_is_one_line_naming_the_path_and_both_ways_to_get_it(tmp_path, name, split, expected):
    with pytest.raises(DataError) as caught:
        load_dataset(name, root=tmp_path, download=False, split=split)
    message = str(caught.value)
    assert "\n" not in message
    assert str(tmp_path / expected) in message
    assert "dataset.download: true" in message and "copy" in message


def test_a_truncated_idx_file_names_the_file(tmp_path):
    paths = write_mnist(tmp_path, mnist_arrays())
    paths[2].write_bytes(paths[2].read_bytes()[:-5])
    with pytest.raises(DataError, match=r"t10k-images-idx3-ubyte: truncated or corrupt IDX file"):
        load_dataset("mnist", root=tmp_path, download=False)


def test_an_unreachable_url_fails_at_once_naming_it(tmp_path, monkeypatch):
    url = f"http://127.0.0.1:{_closed_port()}/cifar-10-python.tar.gz"
    monkeypatch.setattr(cifar, "CIFAR10_ARCHIVE", (url, "0" * 32))
    started = time.monotonic()
    with pytest.raises(DataError) as caught:
        load_dataset("cifar10", root=tmp_path, download=True)
    assert time.monotonic() - started < 10
    message = str(caught.value)
    assert message.startswith(url) and "offline" in message and "dataset.root" in message and "\n" not in message
    assert list(tmp_path.iterdir()) == []


def test_fetch_keeps_a_file_already_present_without_checking_it(tmp_path):
    target = tmp_path / "file.bin"
    target.write_bytes(b"mine")
    assert fetch("http://127.0.0.1:1/never", target, md5="0" * 32) == target
    assert target.read_bytes() == b"mine"


def test_extract_refuses_members_escaping_the_folder(tmp_path):
    evil_tar = tmp_path / "evil.tar.gz"
    with tarfile.open(evil_tar, "w:gz") as bundle:
        info = tarfile.TarInfo("../escaped.txt")
        info.size = 3
        bundle.addfile(info, io.BytesIO(b"bad"))
    evil_zip = tmp_path / "evil.zip"
    with zipfile.ZipFile(evil_zip, "w") as bundle:
        bundle.writestr("inner/../../escaped.txt", b"bad")
    for archive in (evil_tar, evil_zip):
        with pytest.raises(DataError, match="outside"):
            extract(archive, tmp_path / "into")
    assert not (tmp_path / "escaped.txt").exists()
