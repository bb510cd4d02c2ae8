"""The tracking store's unfinished runs: which can be continued (`raysim resume` without a run id), and where a run's
checkpoints are (`raysim resume RUN_ID`)."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path

from raysim.credentials import connect_uri, redact
from raysim.errors import CheckpointError
from raysim.tracking.mlflow_writer import resolve_tracking_uri, sqlite_file

DRIVER_TAG = "raysim.driver"
"""Run tag: `host:pid` of the driver process that writes the run."""
RUN_COLOR_TAG = "mlflow.runColor"
"""Run tag: the run's colour in MLflow's charts (`tracking.color`). The UI reads it when it loads the runs and
writes it when a user picks a colour (MLflow 3's `mlflow.runColor`)."""


@dataclass(frozen=True)
class ResumableRun:
    """A run that did not finish and has a checkpoint to continue from."""

    run_id: str
    experiment: str
    status: str
    driver: str
    """`alive (host:pid)`, `gone (host:pid)` (killed outright: the run still says RUNNING), or `on host` when
    the driver ran on another machine."""
    checkpoint: str
    started: float


def resumable_runs(tracking_uri: str | None = None) -> list[ResumableRun]:
    """Every run of the tracking store that has a checkpoint and is not FINISHED, newest first. A driver
    killed with SIGKILL cannot mark its run: it stays RUNNING, and `driver` says whether its process is gone."""
    from mlflow.tracking import MlflowClient

    uri = resolve_tracking_uri(tracking_uri)
    database = sqlite_file(uri)
    if database is not None and not database.is_file():  # no store, no run: MLflow would create an empty one
        return []
    client = MlflowClient(connect_uri(uri))
    experiments = {e.experiment_id: e.name for e in client.search_experiments()}
    found = []
    for run in client.search_runs(list(experiments), "attributes.status != 'FINISHED'", max_results=1000):
        tags = run.data.tags
        if "raysim.checkpoint" not in tags:
            continue
        found.append(
            ResumableRun(
                run.info.run_id,
                experiments[run.info.experiment_id],
                run.info.status,
                _driver_state(tags.get(DRIVER_TAG, "")),
                tags["raysim.checkpoint"],
                run.info.start_time / 1000,
            )
        )
    return sorted(found, key=lambda r: -r.started)


def _driver_state(tag: str) -> str:
    host, _, pid = tag.rpartition(":")
    if not pid.isdigit():
        return "unknown"
    if host != socket.gethostname():
        return f"on {host}"
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return f"gone ({tag})"
    except PermissionError:
        pass
    return f"alive ({tag})"


def run_checkpoints(run_id: str, tracking_uri: str | None = None) -> Path:
    """The folder of a run's checkpoints (the parent of the one its `raysim.checkpoint` tag names), the run looked up
    by id in `tracking_uri` (default: $MLFLOW_TRACKING_URI or sqlite)."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    uri = resolve_tracking_uri(tracking_uri)
    database = sqlite_file(uri)
    if database is not None and not database.is_file():  # MLflow would create an empty store to look in
        raise CheckpointError(f"{run_id}: neither a checkpoint folder nor a run id ({redact(uri)}: no such store)")
    try:
        tags = MlflowClient(connect_uri(uri)).get_run(run_id).data.tags
    except MlflowException:
        raise CheckpointError(f"{run_id}: neither a checkpoint folder nor a run id in {redact(uri)}") from None
    if "raysim.checkpoint" not in tags:
        raise CheckpointError(f"run {run_id} has no checkpoint (tracking.checkpoint_every was 0)")
    return Path(tags["raysim.checkpoint"]).parent
