"""What the reliability tests of several tiers share."""

from __future__ import annotations

from mlflow.tracking import MlflowClient

from tests.support.experiments import tiny_config

ROUNDS = 5


def _config(mlflow_uri, tmp_path, **tracking):
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
    )


def _steps(uri: str, run_id: str, key: str) -> list[int]:
    return [m.step for m in MlflowClient(uri).get_metric_history(run_id, key)]
