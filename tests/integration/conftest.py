"""The configuration matrix's session set-up: the partition files its examples replay, and one MLflow store."""

from __future__ import annotations

import pytest

from raysim.config import validate_config
from raysim.examples import ExampleContext
from raysim.runtime.problem import save_partition
from tests.support.matrix import VALIDATION, base_tree


@pytest.fixture(scope="session")
def matrix_store(tmp_path_factory) -> str:
    return f"sqlite:///{tmp_path_factory.mktemp('matrix-mlflow') / 'mlflow.db'}"


@pytest.fixture(scope="session")
def contexts(tmp_path_factory, fmnist_tenth) -> dict[float, ExampleContext]:
    """One example context per validation setting: the base on the tenth of Fashion-MNIST (tests/conftest.py), its
    partition written as a file."""
    folder = tmp_path_factory.mktemp("matrix-partitions")
    made = {}
    for val in VALIDATION:
        base = base_tree(val, fmnist_tenth)
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
