"""Suites: variants of one experiment (and seeds) run as nested MLflow runs under one parent run.

A suite file has a `base` experiment (inline, or `base_config`: a path relative to the suite file) and a
list of `runs`, each a name and `set`: dotted-key overrides of the base (`algorithm: {...}` replaces the
whole section, `algorithm.rho: 0.1` one value). With `seeds`, every run is repeated for each seed. Every
child is an ordinary `run_experiment` whose MLflow run has `mlflow.parentRunId` = the suite's run, so the
MLflow UI charts them side by side; the parent run gets a comparison plot and a Parquet summary table.
All child configs are validated, and their partitions made once (`check_partitions`), before anything runs;
one Ray instance serves every child. A child that fails at run time is marked FAILED and the others run; the
parent's artifacts come from the children that finished (raysim.studies.children).
"""

from __future__ import annotations

import contextlib
import copy
import math
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from pydantic import ConfigDict, Field, model_validator

from raysim.config import ExperimentConfig, ExperimentFamily, set_value, validate_config
from raysim.data import partition_dataset
from raysim.data.partitions import check_classes
from raysim.errors import ConfigError, DataError, PartitionError
from raysim.runtime.session import ray_session
from raysim.settings import Settings
from raysim.studies.children import ChildOutcome, ParentRun, outcome_line, run_child
from raysim.studies.resume import ResumePlan, plan_resume, reopen_parent
from raysim.studies.table import write_tables
from raysim.threats.attacks import check_benign_left
from raysim.tracking.identity import source_tags
from raysim.tracking.mlflow_writer import MlflowWriter, git_commit, resolve_tracking_uri
from raysim.tracking.plots import figure_files
from raysim.tracking.robustness import write_suite_reports
from raysim.tracking.views import compare_command


class SuiteRun(Settings):
    model_config = ConfigDict(populate_by_name=True)
    name: str = Field(min_length=1)
    overrides: dict[str, Any] = Field(default_factory=dict, alias="set", description="dotted key -> value")


class SuiteConfig(ExperimentFamily):
    kind: ClassVar[str] = "suite"
    runs: list[SuiteRun] = Field(min_length=1)
    seeds: list[int] | None = Field(None, min_length=1, description="repeat every run with each seed")

    @model_validator(mode="after")
    def _check(self) -> SuiteConfig:
        names = [r.name for r in self.runs]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"suite.runs: duplicate run names {duplicates}")
        return self

    def trees(self) -> list[tuple[str, dict[str, Any]]]:
        """(run name, raw config tree) for every run and seed, in order, not yet validated (`experiments`
        validates them); each run's seeds share a colour (`tracking.color`, unless the run or the base sets one:
        MLflow's colour of its group, plots.group_colors) and a group (`tracking.group`, the run's name)."""
        from raysim.tracking.plots import group_colors

        base = self.base_tree()
        trees = []
        seeds: list[int | None] = [*self.seeds] if self.seeds else [None]
        colors = group_colors(run.name for run in self.runs)
        for run in self.runs:
            for seed in seeds:
                tree = copy.deepcopy(base)
                tracking = tree.setdefault("tracking", {})
                tracking.setdefault("color", colors[run.name])
                tracking.setdefault("group", run.name)
                for key, value in run.overrides.items():
                    set_value(tree, key, value)
                if seed is not None:
                    tree["seed"] = seed
                tree["tracking"]["run_name"] = run.name if seed is None else f"{run.name}/seed{seed}"
                trees.append((run.name, tree))
        return trees

    def experiments(self) -> list[tuple[str, ExperimentConfig]]:
        """(run name, validated config) for every run and seed, in order (`trees`)."""
        children = []
        for name, tree in self.trees():
            try:
                children.append((name, validate_config(tree)))
            except ConfigError as error:
                raise ConfigError(f"suite run {name!r}: {error}") from None
        return children


@dataclass
class SuiteChild:
    name: str
    config: ExperimentConfig
    outcome: ChildOutcome


@dataclass
class SuiteResult:
    parent_run_id: str
    tracking_uri: str
    children: list[SuiteChild] = field(default_factory=list)
    table: list[dict[str, Any]] = field(default_factory=list)
    """One row per child: run name, seed, algorithm, status, MLflow run id, error and its final/best summary."""

    @property
    def failed(self) -> list[SuiteChild]:
        return [c for c in self.children if not c.outcome.finished]

    def mean_final(self, name: str, metric: str) -> float:
        """Mean over the finished seeds of run `name` of a summary metric (e.g. `final/pm/acc`); NaN if none."""
        values = [
            c.outcome.summary.get(metric, math.nan) for c in self.children if c.name == name and c.outcome.finished
        ]
        return sum(values) / len(values) if values else math.nan


def load_suite(
    path: str | Path, overrides: list[str] | tuple[str, ...] = (), extra_plugins: list[str] | tuple[str, ...] = ()
) -> SuiteConfig:
    """Read a suite YAML and import its plugins and `extra_plugins` (`--plugin`); `--set` overrides apply to its base
    experiment."""
    return SuiteConfig.load(path, overrides, extra_plugins)


def check_partitions(experiments: list[tuple[str, ExperimentConfig]]) -> None:
    """Partition every distinct (dataset, partition, clients, seed) of a suite or sweep once, and check that
    every attack leaves a benign client, so that an impossible request fails with the name of its run
    (`experiments`: (name for the message, config)) before any MLflow run or Ray work; each child would only
    find out inside its own run. Each dataset is loaded once (once per seed for the synthetic ones)."""
    by_dataset: dict[tuple[str, int | None], list[tuple[str, ExperimentConfig]]] = {}
    for where, config in experiments:
        seed = config.seed if config.dataset.seeded else None
        by_dataset.setdefault((config.dataset.model_dump_json(), seed), []).append((where, config))
    done: set[tuple[str, str, int, int]] = set()
    for (dataset_key, _), members in by_dataset.items():
        dataset = None
        for where, config in members:
            key = (dataset_key, config.partition.model_dump_json(), config.clients.count, config.seed)
            try:
                check_benign_left(config.attack, config.clients.training_count)
                if key in done:
                    continue
                if dataset is None:
                    dataset = config.dataset.loaded(config.seed)
                check_classes(config.partition, dataset.y)
                partition_dataset(
                    dataset.y, config.clients.count, config.partition, config.seed, dataset.groups, dataset.test_start
                )
            except (ConfigError, DataError, PartitionError) as error:
                raise type(error)(f"{where}: {error}") from None
            done.add(key)


def run_suite(
    suite: SuiteConfig, show_progress: bool = True, resume: str | None = None, command: str | None = None
) -> SuiteResult:
    """Run every child experiment under one parent MLflow run; log the comparison plot, the summary and the result
    tables. A child that fails is recorded FAILED and the others run (raysim.studies.children); Ctrl-C or
    SIGTERM stops the suite, its parent run KILLED. `resume`: the parent run of this suite stopped earlier,
    continued (raysim.studies.resume). `command`: the command line that runs this suite, for the line that says
    how to continue it."""
    children = suite.experiments()
    check_partitions([(f"suite run {c.tracking.run_name!r}", c) for _, c in children])
    first = children[0][1]
    writer = MlflowWriter(
        resolve_tracking_uri(first.tracking.uri), first.tracking.experiment, artifact_root=first.tracking.artifact_root
    )
    if resume is None:
        params = {"suite.runs": ",".join(r.name for r in suite.runs), "suite.seeds": suite.seeds or [first.seed]}
        tags = {"suite": suite.name, "mlflow.source.git.commit": git_commit(), **source_tags(command)}
        parent = writer.start(suite.name, params, tags)
        plan = ResumePlan()
    else:
        parent = resume
        plan = plan_resume(writer, reopen_parent(writer, resume, "suite", suite.name), [c for _, c in children])
    result = SuiteResult(parent, writer.tracking_uri)
    say = print if show_progress else (lambda *_, **__: None)
    say(f"suite {suite.name}: parent run {parent} at {writer.shown_uri}, {len(children)} children", flush=True)
    say(f"  compare its children in MLflow: {compare_command(writer)}", flush=True)
    with ParentRun(writer, "suite", suite.name, command) as parent_run:
        if plan.summary():
            say(plan.summary(), flush=True)
        in_process = all(config.runtime.actors == "in_process" for _, config in children)
        with contextlib.nullcontext() if in_process else ray_session(first):  # no Ray for hosts in this process
            for index, (name, config) in enumerate(children, start=1):
                run_name = config.tracking.run_name or name
                outcome = plan.kept.get(run_name)
                if outcome is None:
                    say(f"[{index}/{len(children)}] {run_name}", flush=True)
                    parent_run.doing = f"in its child {run_name!r} ({index - 1} of {len(children)} done)"
                    outcome = run_child(config, parent, plan.continued.get(run_name), show_progress)
                    if not outcome.finished:
                        say(f"[{index}/{len(children)}] {outcome_line(run_name, outcome)}", flush=True)
                result.children.append(SuiteChild(name, config, outcome))
        parent_run.record([(c.config, c.outcome) for c in result.children], [c.name for c in result.children])
        result.table = summary_table(result.children)
        _log_parent(writer, suite.name, result)
    return result


def _log_parent(writer: MlflowWriter, title: str, result: SuiteResult) -> None:
    """The parent's artifacts, made from the children that finished; the failed ones are marked (their rows'
    status and error, `(failed)` in the plot's legend, named under the tables)."""
    finished = [c for c in result.children if c.outcome.finished]
    with tempfile.TemporaryDirectory() as directory:
        folder = Path(directory)
        write_summary(result.table, folder / "summary.parquet")
        write_comparison_plot(result.children, title, folder / "comparison.png")
        reports = write_suite_reports(finished, title, folder) if finished else []
        tables = write_tables(writer.tracking_uri, result.parent_run_id, folder) if finished else []
        for name in ("summary.parquet", *figure_files("comparison.png"), *reports, *(t.name for t in tables)):
            writer.log_artifact(folder / name)


def summary_table(children: list[SuiteChild]) -> list[dict[str, Any]]:
    rows = [
        {
            "run": c.name,
            "seed": c.config.seed,
            "algorithm": c.config.algorithm.name,
            "status": c.outcome.status,
            "run_id": c.outcome.run_id or "",
            "error": c.outcome.error,
            **c.outcome.summary,
        }
        for c in children
    ]
    columns = list(dict.fromkeys(k for row in rows for k in row))
    return [{k: row.get(k, math.nan) for k in columns} for row in rows]


def write_summary(rows: list[dict[str, Any]], path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)


def write_comparison_plot(children: list[SuiteChild], title: str, path: Path) -> None:
    """Mean test accuracy against the round, one line per run (mean over its finished seeds), for PM, GM and HM;
    a run with failed seeds says so in the legend (`(failed)`, or `(1 of 2 seeds failed)`) and a run none of
    whose seeds finished has no line, only its legend entry."""
    import numpy as np

    from raysim.tracking import plots

    curves: dict[str, list[plots.Series]] = {"pm": [], "gm": [], "hm": []}
    for name in dict.fromkeys(c.name for c in children):
        members = [c for c in children if c.name == name]
        histories = [c.outcome.history for c in members if c.outcome.finished]
        failed = len(members) - len(histories)
        label = name
        if failed:
            label += " (failed)" if not histories else f" ({failed} of {len(members)} seeds failed)"
        rounds = sorted(set.intersection(*({r for r in h if "pm/acc" in h[r]} for h in histories))) if histories else []
        for kind, series in curves.items():
            means = {r: float(np.mean([h[r][f"{kind}/acc"] for h in histories])) for r in rounds}
            series.append(plots.Series(label, means, color=members[0].config.tracking.color))
    panels = [
        plots.Panel(f"{kind.upper()} test accuracy", series, "mean over clients" if kind == "pm" else "", bounds=(0, 1))
        for kind, series in curves.items()
    ]
    plots.save(plots.round_curves(panels, title=title), path)
