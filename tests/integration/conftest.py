"""The configuration matrix's session set-up: the partition files its examples replay, and one MLflow store."""

from __future__ import annotations

from pathlib import Path

import pytest

from raysim.config import validate_config
from raysim.examples import ExampleContext
from raysim.runtime.problem import save_partition
from tests.support.matrix import VALIDATION, base_tree


@pytest.fixture(scope="session")
def matrix_store(tmp_path_factory) -> str:
    """The matrix's one store, on tmpfs where the machine has one (tests/support/stores.py memory_folder: each of
    the 700 runs' MLflow requests commits, and a commit on the disk waits for its fsyncs), copied from the
    process's empty store (fresh_store: no schema migrations of its own)."""
    from tests.support.stores import fresh_store, memory_folder

    folder = memory_folder("matrix-mlflow") or tmp_path_factory.mktemp("matrix-mlflow")
    return fresh_store(folder / "mlflow.db")


MATRIX_SAMPLES = {"train": 2000, "test": 500}
"""The matrix's share of Fashion-MNIST: a cell checks that its settings run together and log every key, which does
not depend on how much data its 4 clients hold, while every pass over the data (one epoch, the evaluations of the
training and test splits) costs in it. 2,000 training and 500 test images (of the tenth's 6,000 and 1,000): a
third of a cell's CPU time less, and enough for every cell's partition (FedSLR's label-matched test sets take 100
test samples per client from a held-out pool, which 200 test images do not hold)."""


@pytest.fixture(scope="session")
def fmnist_matrix(tmp_path_factory, fmnist_tenth) -> Path:
    """The first MATRIX_SAMPLES images of the tenth of Fashion-MNIST (tests/conftest.py), real ones in the standard
    IDX layout (the real loader reads them)."""
    from raysim.data.fashion_mnist import FILES, load_fashion_mnist
    from tests.support.data_files import write_idx

    x, y = load_fashion_mnist(fmnist_tenth, download=False)
    root = tmp_path_factory.mktemp("fashion-mnist-matrix")
    for part, rows in (
        ("train", slice(0, MATRIX_SAMPLES["train"])),
        ("test", slice(6000, 6000 + MATRIX_SAMPLES["test"])),
    ):
        write_idx(root / FILES[f"{part}_images"], x[rows])
        write_idx(root / FILES[f"{part}_labels"], y[rows].astype("uint8"))
    return root


@pytest.fixture(scope="session")
def contexts(tmp_path_factory, fmnist_matrix) -> dict[float, ExampleContext]:
    """One example context per validation setting: the base on the matrix's share of Fashion-MNIST (`fmnist_matrix`),
    its partition written as a file."""
    folder = tmp_path_factory.mktemp("matrix-partitions")
    made = {}
    for val in VALIDATION:
        base = base_tree(val, fmnist_matrix)
        path = folder / f"partition-val{val:g}.parquet"
        save_partition(validate_config(base), path)
        made[val] = ExampleContext(base, path)
    return made


@pytest.fixture(scope="session")
def pretrained_cache(tmp_path_factory):
    """AugFL's pretrained teachers are cached in a folder of the session, never the user's."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAYSIM_CACHE", str(tmp_path_factory.mktemp("raysim-cache")))
        yield
