"""File-backed image datasets (MedMNIST .npz, ImageFolder, Tiny-ImageNet, LEAF FEMNIST) read from small files
written here in each publisher's real layout, plus two runs through the CLI and a download from a local server."""

from __future__ import annotations

import hashlib
import io
import threading
import zipfile
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from raysim.data import image_folder as image_folder_module
from raysim.data import medmnist as medmnist_module
from raysim.data.sources import load_dataset
from raysim.errors import DataError

# ---------------------------------------------------------------- writers of the real formats
from tests.support.data_files import write_image_folder, write_leaf, write_medmnist, write_tiny_imagenet
from tests.support.experiments import run_through_cli, tiny_config
from tests.support.stores import fresh_store


class QuietHandler(SimpleHTTPRequestHandler):
    """Serves files without logging each request to stderr."""

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def http_root(tmp_path):
    """A folder served over HTTP on 127.0.0.1 (a thread of this process); yields (folder, base URL)."""
    served = tmp_path / "served"
    served.mkdir()
    handler = partial(QuietHandler, directory=str(served))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield served, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_medmnist_downloads_and_checks_the_md5(tmp_path, http_root, monkeypatch):
    served, url = http_root
    source = write_medmnist(served, "dermamnist", rgb=True, classes=7)
    md5 = hashlib.md5(source.read_bytes()).hexdigest()
    monkeypatch.setattr(medmnist_module, "RECORD", url)
    monkeypatch.setitem(medmnist_module.MD5, "dermamnist", ("0" * 32, md5, md5, md5))
    with pytest.raises(DataError, match="checksum mismatch"):
        load_dataset("medmnist", root=tmp_path / "cache", subset="dermamnist")
    assert not (tmp_path / "cache" / "dermamnist.npz").exists()
    monkeypatch.setitem(medmnist_module.MD5, "dermamnist", (md5, md5, md5, md5))
    data = load_dataset("medmnist", root=tmp_path / "cache", subset="dermamnist")
    assert data.x.shape == (11, 3, 28, 28) and (tmp_path / "cache" / "dermamnist.npz").is_file()


def test_tiny_imagenet_downloads_and_extracts_the_zip(tmp_path, http_root, monkeypatch, capfd):
    served, url = http_root
    tree = write_tiny_imagenet(tmp_path / "source")
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as bundle:
        for path in sorted(tree.rglob("*")):
            bundle.write(path, path.relative_to(tree.parent).as_posix())
    (served / "tiny-imagenet-200.zip").write_bytes(buffer.getvalue())
    monkeypatch.setattr(image_folder_module, "TINY_IMAGENET_URL", f"{url}/tiny-imagenet-200.zip")
    monkeypatch.setattr(image_folder_module, "TINY_IMAGENET_MD5", hashlib.md5(buffer.getvalue()).hexdigest())
    data = load_dataset("tiny_imagenet", root=tmp_path / "cache")
    assert data.x.shape == (15, 3, 64, 64) and (tmp_path / "cache" / "tiny-imagenet-200" / "wnids.txt").is_file()
    assert "GET /tiny-imagenet-200.zip" not in capfd.readouterr().err  # the server logs no request


def _run(tmp_path: Path, dataset: dict, partition: dict, model: str, clients: int) -> None:
    from mlflow.tracking import MlflowClient

    uri = fresh_store(tmp_path / "mlflow.db")
    config = tiny_config(
        dataset=dataset,
        partition=partition,
        model={"name": model},
        clients={"count": clients},
        rounds=2,
        runtime={"num_hosts": 1},
        tracking={"uri": uri, "experiment": "files"},
    )
    run = run_through_cli(config, uri)
    assert run.info.status == "FINISHED"
    client = MlflowClient(uri)
    history = client.get_metric_history(run.info.run_id, "pm/acc")
    assert [m.step for m in history] == [0, 1, 2] and all(0.0 <= m.value <= 1.0 for m in history)


@pytest.mark.slow
def test_femnist_by_writer_runs_through_the_cli(tmp_path):
    write_leaf(tmp_path / "femnist", samples=20)
    _run(tmp_path, {"name": "femnist", "root": str(tmp_path / "femnist")}, {"scheme": "natural"}, "cnn_femnist", 3)


@pytest.mark.slow
def test_image_folder_runs_through_the_cli(tmp_path):
    write_image_folder(tmp_path / "pets", per_class=12, color=True)
    _run(tmp_path, {"name": "image_folder", "root": str(tmp_path / "pets")}, {"scheme": "iid"}, "cnn", 2)
