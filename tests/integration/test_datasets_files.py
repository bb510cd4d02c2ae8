"""The file-backed image sources (MNIST, EMNIST, CIFAR-10/100) read small files written in the real on-disk
formats, download through a local HTTP server, refuse corrupt downloads, and run end to end through the CLI."""

from __future__ import annotations

import functools
import http.server
import tarfile
import threading
import zipfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from raysim.data import cifar, idx
from raysim.data.sources import load_dataset
from raysim.errors import DataError
from tests.support.data_files import mnist_arrays, write_cifar10, write_emnist, write_mnist
from tests.support.experiments import IN_PROCESS, run_through_cli, tiny_config


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


def test_mnist_downloads_into_an_empty_root(tmp_path, server, monkeypatch):
    base, served = server
    arrays = mnist_arrays(seed=3)
    files = write_mnist(served, arrays, gz=True)
    monkeypatch.setattr(idx, "MNIST_RESOURCES", {f.name: (f"{base}/{f.name}", _md5(f)) for f in files})
    root = tmp_path / "data"
    data = load_dataset("mnist", root=root, download=True)
    assert sorted(p.name for p in (root / "MNIST" / "raw").iterdir()) == sorted(f.name for f in files)
    np.testing.assert_array_equal(data.y, np.concatenate([arrays["train_y"], arrays["test_y"]]))
    monkeypatch.setattr(idx, "MNIST_RESOURCES", {})  # present files are used as they are, with no network
    np.testing.assert_array_equal(load_dataset("mnist", root=root, download=True).x, data.x)


def test_emnist_downloads_the_zip_and_keeps_every_split(tmp_path, server, monkeypatch):
    base, served = server
    upright = mnist_arrays(seed=4, classes=26, low=1)
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
    batches = write_cifar10(staging)
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
    files = write_mnist(served, mnist_arrays(), gz=True)
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


@pytest.mark.slow  # about 30-60 s on 2 cores: Ray actors, torch and MLflow start-up
def test_fedavg_runs_two_rounds_on_written_cifar10_through_the_cli(tmp_path, mlflow_uri):
    from mlflow.tracking import MlflowClient

    root = tmp_path / "data"
    write_cifar10(root, per_batch=20)
    config = tiny_config(
        algorithm={"name": "fedavg", "lr": 0.05, "batch_size": 8},
        dataset={"name": "cifar10", "root": str(root), "download": False},
        partition={"scheme": "iid"},
        model={"name": "cnn"},
        clients={"count": 4},
        tracking={"uri": mlflow_uri, "experiment": "cifar"},
        runtime=IN_PROCESS,
    )
    run = run_through_cli(config, mlflow_uri, "rounds=2")
    client = MlflowClient(mlflow_uri)
    assert run.info.status == "FINISHED" and run.data.params["rounds"] == "2"
    history = client.get_metric_history(run.info.run_id, "gm/acc")
    assert history and all(0.0 <= m.value <= 1.0 for m in history)
