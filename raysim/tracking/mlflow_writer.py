"""The driver's MLflow writer: batched logging through `MlflowClient.log_batch`.

SQLite rejects concurrent writers ("database is locked") and single calls are slow (platform.md), so
exactly one process, the driver, writes, with one `log_batch` per round.
"""

from __future__ import annotations

import math
import os
import subprocess
import time
from pathlib import Path

from mlflow.entities import Metric, Param, RunTag
from mlflow.tracking import MlflowClient

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"
MAX_METRICS, MAX_PARAMS, MAX_TAGS = 1000, 100, 100  # log_batch limits


def resolve_tracking_uri(configured: str | None) -> str:
    """The config's `tracking.uri`, else $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db in the working dir."""
    return configured or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI


def git_commit() -> str:
    try:
        result = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, cwd=Path(__file__).parent
        )
        return result.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


class MlflowWriter:
    def __init__(self, tracking_uri: str, experiment: str):
        self.tracking_uri = tracking_uri
        self.client = MlflowClient(tracking_uri)
        found = self.client.get_experiment_by_name(experiment)
        self.experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
        self.run_id: str | None = None

    def start(
        self, run_name: str | None, params: dict[str, object], tags: dict[str, str], parent: str | None = None
    ) -> str:
        if parent:
            tags = {**tags, "mlflow.parentRunId": parent}
        run = self.client.create_run(self.experiment_id, run_name=run_name, tags=tags)
        self.run_id = run.info.run_id
        items = [Param(k, str(v)[:6000]) for k, v in params.items()]
        for start in range(0, len(items), MAX_PARAMS):
            self.client.log_batch(self.run_id, params=items[start : start + MAX_PARAMS])
        return self.run_id

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        """Log one step's metrics (non-finite values are skipped) in as few requests as allowed."""
        stamp = int(time.time() * 1000)
        items = [Metric(k, float(v), stamp, step) for k, v in metrics.items() if math.isfinite(v)]
        for start in range(0, len(items), MAX_METRICS):
            self.client.log_batch(self.run_id, metrics=items[start : start + MAX_METRICS])

    def set_tags(self, tags: dict[str, str]) -> None:
        items = [RunTag(k, str(v)) for k, v in tags.items()]
        for start in range(0, len(items), MAX_TAGS):
            self.client.log_batch(self.run_id, tags=items[start : start + MAX_TAGS])

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        self.client.log_artifact(self.run_id, str(path), artifact_path)

    def finish(self, status: str = "FINISHED") -> None:
        if self.run_id is not None:
            self.client.set_terminated(self.run_id, status)
