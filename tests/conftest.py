"""Shared fixtures: one real local Ray instance per test session, and a fresh sqlite MLflow store per test."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("RAY_DEDUP_LOGS", "0")


@pytest.fixture(scope="session")
def ray_local():
    """A real local Ray instance (2 CPUs, small object store) shared by the tests that need Ray."""
    import ray

    ray.init(
        address="local",
        num_cpus=2,
        object_store_memory=512 * 2**20,
        include_dashboard=False,
        logging_level=logging.WARNING,
    )
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module", autouse=True)
def no_crew_left():
    """The actors a module's runs kept (runtime.reuse_actors: tiny_config's default) hold CPUs of the session's Ray
    that the next module's runs need."""
    yield
    from raysim.runtime import crews

    crews.dismiss_parked()


@pytest.fixture(scope="module")
def cluster():
    """A head and two worker nodes started with `ray start` on 127.0.0.1 (tests.test_cluster.LocalCluster), for
    the tests of one module; afterwards none of its processes is left."""
    from tests.cluster import LocalCluster

    started = LocalCluster()
    try:
        yield started.start()
    finally:
        started.stop()
        assert not started.own_pids()


@pytest.fixture(scope="session")
def fmnist_tenth(tmp_path_factory) -> Path:
    """A tenth of the installed Fashion-MNIST as a `dataset.root` in its standard layout (the four IDX files):
    the first 6,000 training and 1,000 test images, real ones, read by the real loader and normalized as uint8
    images like the whole set, at a tenth of the cost of every pass over the data."""
    from raysim.data.fashion_mnist import FILES, load_fashion_mnist
    from tests.test_datasets_files import _write_idx

    x, y = load_fashion_mnist(download=False)
    root = tmp_path_factory.mktemp("fashion-mnist-tenth")
    for part, rows in (("train", slice(0, 6000)), ("test", slice(60000, 61000))):
        _write_idx(root / FILES[f"{part}_images"], x[rows])
        _write_idx(root / FILES[f"{part}_labels"], y[rows].astype("uint8"))
    return root


@pytest.fixture
def mlflow_uri(tmp_path) -> str:
    """A fresh sqlite tracking store for one test."""
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


NO_FIGURES = {"figures": [], "save_models": "none"}
"""tiny_config's tracking default: a run's two figures in three formats took 1-2.5 s of a tiny run's few seconds;
the tests of figures ask for them (tracking.figures), and the shipped configs' runs draw them. Nor are the final
models saved (tracking.save_models): tests/test_saved_models.py asks for them."""
REUSED_ACTORS = {"num_hosts": 2, "reuse_actors": True}
"""tiny_config's runtime section unless a test gives its own: a run on the session's Ray takes the actors of the
one before (runtime.reuse_actors: a 3-round run took 7 s on new actors, 0.3 s on renewed ones; tests/test_crews.py
shows renewed actors give a new crew's results)."""


def tiny_config(**sections: Any) -> dict[str, Any]:
    """A small, fast experiment (synthetic classification, MLR-sized model, no figures or saved models unless the
    tracking section names `figures` or `save_models`, actors reused unless a runtime section is given) as a raw
    config dict; keyword arguments replace or extend whole sections."""
    config: dict[str, Any] = {
        "algorithm": {"name": "flame", "lambda": 1.0, "rho": 0.25, "lr": 0.05, "batch_size": 32},
        "dataset": {"name": "synthetic_classification"},
        "partition": {"scheme": "dirichlet", "beta": 0.5},
        "model": {"name": "mlr"},
        "clients": {"count": 4},
        "rounds": 3,
        "seed": 7,
        "runtime": REUSED_ACTORS,
        "tracking": {"experiment": "tests", **NO_FIGURES},
    }
    for key, value in sections.items():
        config[key] = value
    config["tracking"] = {**NO_FIGURES, **config["tracking"]}
    return config


def run_through_cli(config: dict[str, Any] | Path, tracking_uri: str, *assignments: str) -> Any:
    """`raysim run CONFIG --quiet --set ...` in this process (a config dict is written next to the tracking
    store first); asserts exit 0 and returns the one MLflow run the store then holds."""
    import yaml
    from mlflow.tracking import MlflowClient

    from raysim.cli import main

    if isinstance(config, dict):
        path = Path(tracking_uri.removeprefix("sqlite:///")).parent / "experiment.yaml"
        path.write_text(yaml.safe_dump(config))
        config = path
    argv = ["run", str(config), "--quiet"]
    for assignment in assignments:
        argv += ["--set", assignment]
    assert main(argv) == 0
    client = MlflowClient(tracking_uri)
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    return run
