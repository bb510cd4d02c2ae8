"""The small FLAME run of the reliability tests (checkpoints every 2 rounds), and what it logged."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mlflow.tracking import MlflowClient

from raysim.config import validate_config
from raysim.runtime.driver import run_experiment
from raysim.tracking.callbacks import RunResult
from tests.support.experiments import tiny_config
from tests.support.stores import fresh_store

ROUNDS = 5


def reliability_config(
    mlflow_uri: str | None, tmp_path: Path, runtime: dict[str, Any] | None = None, **tracking: Any
) -> dict[str, Any]:
    """ROUNDS rounds of 4 of 6 clients, checkpointed every 2 rounds into tmp_path/ckpt; the hosts on the session's Ray
    (tiny_config's runtime) unless `runtime` says otherwise; `tracking` overrides its tracking section."""
    sections = {"runtime": runtime} if runtime is not None else {}
    return tiny_config(
        rounds=ROUNDS,
        clients={"count": 6, "per_round": 4},
        tracking={
            "experiment": "tests",
            "uri": mlflow_uri,
            "checkpoint_every": 2,
            "checkpoint_dir": str(tmp_path / "ckpt"),
            **tracking,
        },
        **sections,
    )


def baseline_run(folder: Path, runtime: dict[str, Any] | None = None) -> RunResult:
    """The uninterrupted run (logged into `folder`) every failure test must reproduce exactly."""
    return run_experiment(validate_config(reliability_config(fresh_store(folder / "m.db"), folder, runtime)), False)


def steps_logged(uri: str, run_id: str, key: str) -> list[int]:
    """The steps at which a run logged `key`."""
    return [m.step for m in MlflowClient(uri).get_metric_history(run_id, key)]
