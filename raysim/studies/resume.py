"""Continuing a stopped suite or sweep (`raysim run STUDY.yaml --resume PARENT_RUN`).

The parent run is reopened, and each child it should have is matched by its run name (a suite's `name/seedN`,
a sweep's `sweep/tNNN setting seed=N`, unique within the parent) to what the store holds:

- FINISHED: kept as it is (its metrics are read back for the parent's reports, nothing is logged again);
- unfinished with a checkpoint (`tracking.checkpoint_every` > 0): continued from it in the same MLflow run, as
  `raysim resume RUN_ID` would;
- unfinished without one: deleted (MLflow's soft delete) and run again from the start, so the parent never
  holds two children of one setting and seed;
- missing: run.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raysim.errors import ConfigError
from raysim.runtime import checkpoint
from raysim.runtime.rounds import RunResult, summary_from_logged
from raysim.tracking.mlflow_writer import MlflowWriter

HISTORY_METRICS = ("pm/acc", "gm/acc", "hm/acc", "heldout/pm/acc")
"""The per-round series a kept child contributes to the parent's plots."""


@dataclass
class Previous:
    """What a stopped study left: its children by run name."""

    children: dict[str, Any]

    def state(self, run_name: str) -> str:
        """`new`, `finished`, `checkpointed` or `restart` for the child of that name (see the module docstring)."""
        run = self.children.get(run_name)
        if run is None:
            return "new"
        if run.info.status == "FINISHED":
            return "finished"
        folder = run.data.tags.get("raysim.checkpoint")
        if folder and Path(folder).exists() and _has_checkpoint(Path(folder).parent):
            return "checkpointed"
        return "restart"


def _has_checkpoint(folder: Path) -> bool:
    try:
        checkpoint.latest_checkpoint(folder)
    except checkpoint.CheckpointError:
        return False
    return True


def reopen_parent(writer: MlflowWriter, parent: str, kind: str, name: str) -> Previous:
    """Reopen the parent run of the `kind` ("suite" or "sweep") called `name` and collect its children; a
    ConfigError if `parent` is no such run."""
    from mlflow.exceptions import MlflowException

    try:
        run = writer.client.get_run(parent)
    except MlflowException:
        raise ConfigError(f"--resume {parent}: no such run in {writer.shown_uri}") from None
    found = run.data.tags.get(kind)
    if found != name:
        other = next((f"the {k} {run.data.tags[k]!r}" for k in ("suite", "sweep") if k in run.data.tags), "no study")
        raise ConfigError(f"--resume {parent}: that run is the parent run of {other}, not of the {kind} {name!r}")
    if run.info.experiment_id != writer.experiment_id:
        raise ConfigError(f"--resume {parent}: that run is in another experiment than this {kind} logs to")
    writer.reopen(parent)
    children = writer.client.search_runs(
        [writer.experiment_id], f"tags.mlflow.parentRunId = '{parent}'", max_results=50000,
        order_by=["attributes.start_time ASC"],
    )  # fmt: skip
    by_name: dict[str, Any] = {}
    for child in children:  # a finished child wins over an unfinished one of the same name
        name_of = child.info.run_name or ""
        if name_of not in by_name or by_name[name_of].info.status != "FINISHED":
            by_name[name_of] = child
    return Previous(by_name)


def kept_result(writer: MlflowWriter, run: Any) -> RunResult:
    """A finished child as a RunResult, read back from the store: its summaries and accuracy series."""
    client, run_id = writer.client, run.info.run_id
    history: dict[int, dict[str, float]] = {}
    for key in HISTORY_METRICS:
        if key in run.data.metrics:
            for metric in client.get_metric_history(run_id, key):
                history.setdefault(metric.step, {})[key] = metric.value
    summary = summary_from_logged(run.data.metrics)
    malicious = [int(c) for c in run.data.tags.get("malicious_clients", "").split(",") if c]
    return RunResult(run_id, history, [], summary, malicious)


def discard(writer: MlflowWriter, run: Any) -> None:
    """Delete an unfinished child that cannot be continued (it is run again from the start)."""
    writer.client.delete_run(run.info.run_id)
