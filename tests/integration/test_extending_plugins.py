"""The term and the executor that docs/extending.md builds, run in process from the page's own files (the page's
command runs them on Ray hosts: tests/system/test_plugins.py): FedHuber's Huber pull is FedProx's while delta exceeds
every |theta - w| and bounds the pull once it binds, and the timed executor runs what sequential runs, bit for bit."""

from __future__ import annotations

from pathlib import Path

import yaml

from raysim.config import load_config
from raysim.runtime.driver import run_experiment
from tests.support.experiments import IN_PROCESS, NO_FIGURES, tiny_config
from tests.support.pages import page_files


def _history(folder: Path, algorithm: dict, client_training: str) -> dict[int, dict[str, float]]:
    """A 2-round in-process run of the page's plugins (listed in the config, as the page's YAML lists them)."""
    for name in ("fedhuber.py", "timed.py"):
        (folder / name).write_text(page_files()[name])
    tree = tiny_config(
        algorithm={"lr": 0.1, "batch_size": 16, **algorithm},
        rounds=2,
        runtime={**IN_PROCESS, "client_training": client_training},
        tracking={"uri": f"sqlite:///{folder / 'mlflow.db'}", **NO_FIGURES},
    )
    path = folder / f"{algorithm['name']}-{client_training}.yaml"
    path.write_text(yaml.safe_dump({"plugins": ["fedhuber.py", "timed.py"], **tree}))
    history = run_experiment(load_config(path), show_progress=False).history
    return {
        step: {k: v for k, v in row.items() if not k.startswith(("time/", "system/"))} for step, row in history.items()
    }


def test_fedhuber_with_a_delta_that_never_binds_is_fedprox(tmp_path):
    huber = _history(tmp_path, {"name": "fedhuber", "mu": 0.5, "delta": 1e9}, "sequential")
    fedprox = _history(tmp_path, {"name": "fedprox", "mu": 0.5}, "sequential")
    assert huber == fedprox


def test_fedhuber_whose_delta_binds_differs_from_fedprox(tmp_path):
    huber = _history(tmp_path, {"name": "fedhuber", "mu": 5.0, "delta": 1e-4}, "sequential")
    fedprox = _history(tmp_path, {"name": "fedprox", "mu": 5.0}, "sequential")
    assert huber[2]["pm/acc"] != fedprox[2]["pm/acc"] or huber[2]["train_loss"] != fedprox[2]["train_loss"]


def test_the_timed_executor_runs_what_sequential_runs(tmp_path):
    """A plugin executor through runtime.client_training, FedHuber's unbatched term and FedAvg's plain requests."""
    for algorithm in ({"name": "fedhuber"}, {"name": "fedavg"}):
        assert _history(tmp_path, algorithm, "timed") == _history(tmp_path, algorithm, "sequential")
