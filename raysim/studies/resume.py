"""Continuing a stopped suite or sweep (`raysim run STUDY.yaml --resume PARENT_RUN`).

The parent run is reopened, and each child it should have is matched by its run name (a suite's `name/seedN`,
a sweep's `sweep/tNNN setting seed=N`, unique within the parent) to what the store holds:

- FINISHED: kept as it is (its metrics are read back for the parent's reports, nothing is logged again), a sweep's
  trial stopped early by its scheduler included (it is FINISHED with a `raysim.stopped_early` tag);
- failed or unfinished (FAILED, KILLED, or RUNNING after its driver was killed outright) with a checkpoint
  (`tracking.checkpoint_every` > 0) written with the setting the study now asks for: continued from it in the
  same MLflow run, as `raysim resume RUN_ID` would;
- failed or unfinished otherwise (no checkpoint, or its setting was changed in the study's file since, e.g. to
  fix what made it fail): deleted (MLflow's soft delete) and run again from the start, so the parent never holds
  two children of one setting and seed;
- missing: run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from raysim.config import ExperimentConfig
from raysim.errors import ConfigError
from raysim.runtime import checkpoint
from raysim.runtime.rounds import summary_from_logged
from raysim.studies.children import ChildOutcome
from raysim.tracking.mlflow_writer import MlflowWriter

STOPPED_TAG = "raysim.stopped_early"
"""Run tag of a sweep's trial that its scheduler stopped early (raysim.studies.sweep): kept as a finished one."""

HISTORY_METRICS = ("pm/acc", "gm/acc", "hm/acc", "heldout/pm/acc")
"""The per-round series a kept child contributes to the parent's plots."""


@dataclass
class Previous:
    """What a stopped study left: its children by run name."""

    children: dict[str, Any]

    def state(self, config: ExperimentConfig) -> str:
        """`new`, `finished`, `checkpointed` or `restart` for the child of this config (module docstring)."""
        run = self.children.get(config.tracking.run_name or "")
        if run is None:
            return "new"
        if run.info.status == "FINISHED":
            return "finished"
        folder = run.data.tags.get("raysim.checkpoint")
        wanted = _setting(config)
        if folder and Path(folder).exists() and _checkpointed_setting(Path(folder).parent, wanted) == wanted:
            return "checkpointed"
        return "restart"


def _setting(config: ExperimentConfig) -> dict[str, Any]:
    """What decides a run's results: its config but where it is logged (`tracking`)."""
    return {key: value for key, value in config.shown().items() if key != "tracking"}


def _checkpointed_setting(folder: Path, wanted: dict[str, Any]) -> dict[str, Any] | None:
    """The setting a run's latest complete checkpoint under `folder` was written with, as `wanted` (`_setting`)
    names it: a checkpoint names the store that runtime.state_store=auto chose, which a continued run of `auto`
    takes again (raysim.runtime.driver); None without a checkpoint."""
    try:
        manifest = checkpoint.read_manifest(checkpoint.latest_checkpoint(folder))
    except checkpoint.CheckpointError:
        return None
    setting = {key: value for key, value in yaml.safe_load(manifest["config"]).items() if key != "tracking"}
    if wanted["runtime"]["state_store"] == "auto":
        setting["runtime"] = {**setting["runtime"], "state_store": "auto"}
    return setting


@dataclass
class ResumePlan:
    """A resumed study's children by run name: the finished ones kept, the ones continued from a checkpoint."""

    kept: dict[str, ChildOutcome] = field(default_factory=dict)
    continued: dict[str, str] = field(default_factory=dict)
    """Run name -> the MLflow run id to continue."""

    def summary(self) -> str:
        """The progress line of a resumed study ("" when nothing is kept or continued)."""
        if not (self.kept or self.continued):
            return ""
        return f"resuming: {len(self.kept)} finished children kept, {len(self.continued)} continued from checkpoints"


def plan_resume(writer: MlflowWriter, previous: Previous, configs: list[ExperimentConfig]) -> ResumePlan:
    """Sort a resumed study's children (`configs`) by what the store holds of them (module docstring); the
    unfinished ones that start again are deleted here."""
    plan = ResumePlan()
    for config in configs:
        name = config.tracking.run_name or ""
        state = previous.state(config)
        if state == "finished":
            plan.kept[name] = kept_outcome(writer, previous.children[name])
        elif state == "checkpointed":
            plan.continued[name] = previous.children[name].info.run_id
        elif state == "restart":
            discard(writer, previous.children[name])
    return plan


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
        [writer.experiment_id],
        f"tags.mlflow.parentRunId = '{parent}'",
        max_results=50000,
        order_by=["attributes.start_time ASC"],
    )
    by_name: dict[str, Any] = {}
    for child in children:  # a finished child wins over an unfinished one of the same name
        name_of = child.info.run_name or ""
        if name_of not in by_name or by_name[name_of].info.status != "FINISHED":
            by_name[name_of] = child
    return Previous(by_name)


def kept_outcome(writer: MlflowWriter, run: Any) -> ChildOutcome:
    """A finished child's outcome, read back from the store: its summaries and accuracy series."""
    client, run_id = writer.client, run.info.run_id
    history: dict[int, dict[str, float]] = {}
    for key in HISTORY_METRICS:
        if key in run.data.metrics:
            for metric in client.get_metric_history(run_id, key):
                history.setdefault(metric.step, {})[key] = metric.value
    stopped_at = run.data.tags.get(STOPPED_TAG, "")
    summary = summary_from_logged(run.data.metrics)
    return ChildOutcome("stopped" if stopped_at else "finished", run_id, history, summary, stopped_at=stopped_at)


def discard(writer: MlflowWriter, run: Any) -> None:
    """Delete an unfinished child that cannot be continued (it is run again from the start)."""
    writer.client.delete_run(run.info.run_id)
