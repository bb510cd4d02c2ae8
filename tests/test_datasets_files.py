"""The file-backed image sources (MNIST, EMNIST, CIFAR-10/100) read small files written in the real on-disk
formats, download through a local HTTP server, refuse corrupt downloads, and run end to end through the CLI."""

from __future__ import annotations

import functools
import http.server
import io
import pickle
import socket
import tarfile
import threading
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from raysim.data import cifar, idx
from raysim.data.download import extract, fetch
from raysim.data.sources import load_dataset
from raysim.errors import ConfigError, DataError
from tests.support.data_files import MNIST_STEMS, cifar_batch, write_cifar100, write_emnist, write_idx
from tests.support.experiments import run_through_cli, tiny_config


def _mnist_arrays(seed: int = 0, classes: int = 10, low: int = 0) -> dict[str, np.ndarray]:
    """Train (6) and test (4) images and labels, distinct per sample."""
    rng = np.random.default_rng(seed)
    arrays = {}
    for part, n in (("train", 6), ("test", 4)):
        arrays[f"{part}_x"] = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        arrays[f"{part}_y"] = rng.integers(low, low + classes, size=n).astype(np.uint8)
    return arrays


def _write_mnist(directory: Path, arrays: dict[str, np.ndarray], gz: bool = False) -> list[Path]:
    keys = ("train_x", "train_y", "test_x", "test_y")
    return [write_idx(directory / stem, arrays[key], gz) for stem, key in zip(MNIST_STEMS, keys, strict=True)]


def _write_cifar10(root: Path, per_batch: int = 4, seed: int = 0) -> list[dict[bytes, object]]:
    rng = np.random.default_rng(seed)
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True, exist_ok=True)
    batches = []
    for name in (*(f"data_batch_{k}" for k in range(1, 6)), "test_batch"):
        batch = cifar_batch(per_batch, b"labels", 10, rng)
        (folder / name).write_bytes(pickle.dumps(batch, protocol=2))
        batches.append(batch)
    return batches


def _md5(path: Path) -> str:
    import hashlib

    return hashlib.md5(path.read_bytes()).hexdigest()


@pytest.fixture
def server(tmp_path) -> Iterator[tuple[str, Path]]:
    """A local HTTP server on 127.0.0.1 serving a fresh folder: (base URL, folder)."""
    served = tmp_path / "served"
    served.mkdir()

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(served)))
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", served
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join()


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# ---------------------------------------------------------------- reading files already on disk


@pytest.mark.parametrize(("layout", "gz"), [("torchvision", False), ("torchvision", True), ("flat", False)])
def test_mnist_pools_train_then_test_as_uint8_images(tmp_path, layout, gz):
    arrays = _mnist_arrays()
    directory = tmp_path / "MNIST" / "raw" if layout == "torchvision" else tmp_path
    _write_mnist(directory, arrays, gz)
    data = load_dataset("mnist", root=tmp_path, download=False)
    assert data.x.dtype == np.uint8 and data.x.shape == (10, 1, 28, 28)
    assert data.y.dtype == np.int64 and data.num_classes == 10
    np.testing.assert_array_equal(data.x[:, 0], np.concatenate([arrays["train_x"], arrays["test_x"]]))
    np.testing.assert_array_equal(data.y, np.concatenate([arrays["train_y"], arrays["test_y"]]))
    assert data.mean == (0.1307,) and data.std == (0.3081,)


@pytest.mark.parametrize(("split", "classes", "low"), [("balanced", 47, 0), ("letters", 26, 1)])
def test_emnist_turns_images_upright_and_numbers_classes_from_zero(tmp_path, split, classes, low):
    upright = _mnist_arrays(seed=1, classes=classes, low=low)
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
    batches = _write_cifar10(tmp_path)
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
    _write_cifar10(tmp_path)
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
    paths = _write_mnist(tmp_path, _mnist_arrays())
    paths[2].write_bytes(paths[2].read_bytes()[:-5])
    with pytest.raises(DataError, match=r"t10k-images-idx3-ubyte: truncated or corrupt IDX file"):
        load_dataset("mnist", root=tmp_path, download=False)


# ---------------------------------------------------------------- downloading


def test_mnist_downloads_into_an_empty_root(tmp_path, server, monkeypatch):
    base, served = server
    arrays = _mnist_arrays(seed=3)
    files = _write_mnist(served, arrays, gz=True)
    monkeypatch.setattr(idx, "MNIST_RESOURCES", {f.name: (f"{base}/{f.name}", _md5(f)) for f in files})
    root = tmp_path / "data"
    data = load_dataset("mnist", root=root, download=True)
    assert sorted(p.name for p in (root / "MNIST" / "raw").iterdir()) == sorted(f.name for f in files)
    np.testing.assert_array_equal(data.y, np.concatenate([arrays["train_y"], arrays["test_y"]]))
    monkeypatch.setattr(idx, "MNIST_RESOURCES", {})  # present files are used as they are, with no network
    np.testing.assert_array_equal(load_dataset("mnist", root=root, download=True).x, data.x)


def test_emnist_downloads_the_zip_and_keeps_every_split(tmp_path, server, monkeypatch):
    base, served = server
    upright = _mnist_arrays(seed=4, classes=26, low=1)
    staging = tmp_path / "staging" / "gzip"
    written = write_emnist(staging, "letters", upright, gz=True)
    archive = served / "gzip.zip"
    with zipfile.ZipFile(archive, "w") as bundle:
        for path in written:
            bundle.write(path, f"gzip/{path.name}")
    monkeypatch.setattr(idx, "EMNIST_ARCHIVE", (f"{base}/gzip.zip", _md5(archive)))
    root = tmp_path / "data"
    data = load_dataset("emnist", root=root, download=True, split="letters")
    raw = root / "EMNIST" / "raw"
    assert sorted(p.name for p in raw.iterdir()) == sorted(p.name for p in written)
    np.testing.assert_array_equal(data.x[:, 0], np.concatenate([upright["train_x"], upright["test_x"]]))


def test_cifar10_downloads_and_extracts_the_tarball(tmp_path, server, monkeypatch):
    base, served = server
    staging = tmp_path / "staging"
    batches = _write_cifar10(staging)
    tarball = served / "cifar-10-python.tar.gz"
    with tarfile.open(tarball, "w:gz") as bundle:
        bundle.add(staging / "cifar-10-batches-py", arcname="cifar-10-batches-py")
    monkeypatch.setattr(cifar, "CIFAR10_ARCHIVE", (f"{base}/cifar-10-python.tar.gz", _md5(tarball)))
    root = tmp_path / "data"
    data = load_dataset("cifar10", root=root, download=True)
    assert data.x.shape == (24, 3, 32, 32)
    np.testing.assert_array_equal(data.y, np.concatenate([b[b"labels"] for b in batches]))
    assert sorted(p.name for p in root.iterdir()) == ["cifar-10-batches-py"]


def test_a_download_with_the_wrong_checksum_is_not_kept(tmp_path, server, monkeypatch):
    base, served = server
    files = _write_mnist(served, _mnist_arrays(), gz=True)
    table = {f.name: (f"{base}/{f.name}", _md5(f)) for f in files}
    table["t10k-images-idx3-ubyte.gz"] = (table["t10k-images-idx3-ubyte.gz"][0], "0" * 32)
    monkeypatch.setattr(idx, "MNIST_RESOURCES", table)
    root = tmp_path / "data"
    with pytest.raises(
        DataError,
        match=r"t10k-images-idx3-ubyte\.gz: checksum mismatch \(md5 [0-9a-f]{32}, expected 0{32}\); "
        r"the file was not kept",
    ):
        load_dataset("mnist", root=root, download=True)
    raw = root / "MNIST" / "raw"
    assert not (raw / "t10k-images-idx3-ubyte.gz").exists()
    assert not [p for p in raw.iterdir() if p.name.endswith(".part")]


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


# ---------------------------------------------------------------- end to end


@pytest.mark.slow  # about 30-60 s on 2 cores: Ray actors, torch and MLflow start-up
def test_fedavg_runs_two_rounds_on_written_cifar10_through_the_cli(tmp_path, ray_local, mlflow_uri):
    from mlflow.tracking import MlflowClient

    root = tmp_path / "data"
    _write_cifar10(root, per_batch=20)
    config = tiny_config(
        algorithm={"name": "fedavg", "lr": 0.05, "batch_size": 8},
        dataset={"name": "cifar10", "root": str(root), "download": False},
        partition={"scheme": "iid"},
        model={"name": "cnn"},
        clients={"count": 4},
        tracking={"uri": mlflow_uri, "experiment": "cifar"},
    )
    run = run_through_cli(config, mlflow_uri, "rounds=2")
    client = MlflowClient(mlflow_uri)
    assert run.info.status == "FINISHED" and run.data.params["rounds"] == "2"
    history = client.get_metric_history(run.info.run_id, "gm/acc")
    assert history and all(0.0 <= m.value <= 1.0 for m in history)
