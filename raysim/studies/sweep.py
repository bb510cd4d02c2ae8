"""Sweeps: a grid and random draws over config keys, times seeds, run as concurrent trials on a Ray cluster.

A sweep file has a `base` experiment (inline, or `base_config`: a path relative to the sweep file), a
`grid` (dotted key -> list of values; every combination), optional `random` draws (count, seed and a
distribution per dotted key; every draw is combined with every grid point) and `seeds`. A setting is
one grid point with one draw; each setting runs once per seed. Each trial is a Ray task (no CPU of its
own) running `run_experiment`, whose hosts and coordinator are nested actors; at most `max_concurrent`
trials run at once (default: as many as the cluster's CPUs hold). The trials' MLflow runs are nested
under one parent run, which only this process creates and which gets the summary table
(summary.parquet) and the plots (accuracy vs round per trial; final accuracy mean +/- std over seeds per
setting). Every trial's config is validated and every distinct partition made (`suite.check_partitions`)
before the parent run or any Ray work, so an impossible request fails at once naming its trial. A trial
that fails later is recorded as failed (status and error in the table, its MLflow run marked FAILED) and
the others go on, as a suite's children do (raysim.studies.children).
"""

from __future__ import annotations

import copy
import functools
import itertools
import json
import math
import re
import tempfile
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import ray
from pydantic import Field, model_validator

from raysim.config import ExperimentConfig, ExperimentFamily, set_value, validate_config
from raysim.credentials import held, lent
from raysim.errors import ConfigError, raise_pending
from raysim.plugins import carry
from raysim.runtime.crews import dismiss_parked
from raysim.runtime.session import ray_session, started_here
from raysim.settings import Settings
from raysim.studies.children import ChildOutcome, ParentRun, one_line, outcome_line, run_child
from raysim.studies.resume import ResumePlan, plan_resume, reopen_parent
from raysim.studies.suite import check_partitions, write_summary
from raysim.studies.table import write_tables
from raysim.studies.trial_progress import TrialProgress
from raysim.tracking.identity import source_tags
from raysim.tracking.mlflow_writer import MlflowWriter, git_commit, resolve_tracking_uri, sqlite_file
from raysim.tracking.views import compare_command

SUMMARY_METRICS = ("final/pm/acc", "final/gm/acc", "final/hm/acc", "best/pm/acc")


class _Model(Settings):
    """The sweep file's own sections."""


class Distribution(_Model):
    """Exactly one of: choice [values], uniform [low, high], loguniform [low, high], randint [low, high] (inclusive)."""

    choice: list[Any] | None = Field(None, min_length=1)
    uniform: tuple[float, float] | None = None
    loguniform: tuple[float, float] | None = None
    randint: tuple[int, int] | None = None

    @model_validator(mode="after")
    def _one(self) -> Distribution:
        given = [k for k in ("choice", "uniform", "loguniform", "randint") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError("set exactly one of choice, uniform, loguniform, randint")
        low_high = getattr(self, given[0]) if given[0] != "choice" else None
        if low_high is not None and low_high[0] > low_high[1]:
            raise ValueError(f"{given[0]}: low {low_high[0]} exceeds high {low_high[1]}")
        if self.loguniform is not None and self.loguniform[0] <= 0:
            raise ValueError("loguniform: bounds must be positive")
        return self

    def draw(self, generator: np.random.Generator) -> Any:
        if self.choice is not None:
            return self.choice[int(generator.integers(len(self.choice)))]
        if self.uniform is not None:
            return float(generator.uniform(*self.uniform))
        if self.loguniform is not None:
            return float(math.exp(generator.uniform(math.log(self.loguniform[0]), math.log(self.loguniform[1]))))
        assert self.randint is not None  # _one: the other three are None
        low, high = self.randint
        return int(generator.integers(low, high + 1))


class RandomSearch(_Model):
    count: int = Field(ge=1, description="number of random draws")
    seed: int = Field(0, ge=0, description="seed of the draws (not of the experiments)")
    params: dict[str, Distribution] = Field(min_length=1, description="dotted key -> distribution")


class SweepConfig(ExperimentFamily):
    kind: ClassVar[str] = "sweep"
    grid: dict[str, list[Any]] = Field(default_factory=dict, description="dotted key -> values (all combinations)")
    random: RandomSearch | None = None
    seeds: list[int] | None = Field(None, min_length=1, description="run every setting with each seed")
    max_concurrent: int | None = Field(None, ge=1, description="trials at once (default: what the cluster holds)")

    @model_validator(mode="after")
    def _check(self) -> SweepConfig:
        for key, values in self.grid.items():
            if not values:
                raise ValueError(f"grid.{key}: needs at least one value")
        if self.random is not None and set(self.random.params) & set(self.grid):
            raise ValueError(f"random.params: keys also in grid: {sorted(set(self.random.params) & set(self.grid))}")
        return self

    def settings(self) -> list[dict[str, Any]]:
        """Every setting: grid point x random draw, as dotted key -> value."""
        keys = list(self.grid)
        points = [dict(zip(keys, values, strict=True)) for values in itertools.product(*self.grid.values())]
        if self.random is None:
            return points
        generator = np.random.default_rng(self.random.seed)
        draws = [{k: d.draw(generator) for k, d in self.random.params.items()} for _ in range(self.random.count)]
        return [{**point, **draw} for point in points for draw in draws]

    def trials(self, tracking_uri: str) -> list[Trial]:
        """Every trial (setting x seed), validated; all log to `tracking_uri`."""
        from raysim.tracking.plots import group_colors

        base = self.base_tree()
        trials: list[Trial] = []
        seeds: list[int | None] = [*self.seeds] if self.seeds else [None]
        settings = self.settings()
        colors = group_colors(setting_label(setting) or "base" for setting in settings)
        for setting_index, setting in enumerate(settings):
            label = setting_label(setting) or "base"
            for seed in seeds:
                tree = copy.deepcopy(base)
                tracking = tree.setdefault("tracking", {})
                if not isinstance(tracking, dict):
                    raise ConfigError("sweep.base: tracking must be a section")
                tracking.setdefault("color", colors[label])
                tracking.setdefault("group", label)
                for key, value in setting.items():
                    set_value(tree, key, value)
                if seed is not None:
                    tree["seed"] = seed
                index = len(trials)
                tracking["uri"] = tracking_uri
                tracking["run_name"] = f"{self.name}/t{index:03d} {label} seed={tree.get('seed', 1)}"
                try:
                    config = validate_config(tree)
                except ConfigError as error:
                    raise ConfigError(f"sweep trial {index} ({label}): {error}") from None
                trials.append(Trial(index, setting_index, label, setting, config))
        return trials


def setting_label(setting: dict[str, Any]) -> str:
    """Short name of a setting: last key part = value, e.g. `rho=0.1,lr=0.003`."""
    return ",".join(f"{k.rsplit('.', 1)[-1]}={f'{v:.4g}' if isinstance(v, float) else v}" for k, v in setting.items())


@dataclass
class Trial:
    index: int
    setting_index: int
    label: str
    setting: dict[str, Any]
    config: ExperimentConfig


@dataclass
class SweepResult:
    parent_run_id: str
    tracking_uri: str
    trials: list[Trial]
    outcomes: list[ChildOutcome]
    table: list[dict[str, Any]]

    @property
    def failed(self) -> list[int]:
        return [t.index for t, o in zip(self.trials, self.outcomes, strict=True) if not o.finished]


def load_sweep(
    path: str | Path, overrides: list[str] | tuple[str, ...] = (), extra_plugins: list[str] | tuple[str, ...] = ()
) -> SweepConfig:
    """Read a sweep YAML and import its plugins and `extra_plugins` (`--plugin`); `--set` overrides apply to its base
    experiment."""
    return SweepConfig.load(path, overrides, extra_plugins)


def parse_sweep(data: dict[str, Any], where: str = "sweep") -> SweepConfig:
    return SweepConfig.parse(data, where)


def absolute_tracking_uri(configured: str | None) -> str:
    """The tracking URI every trial uses: a relative sqlite path is made absolute (trials run in other dirs)."""
    uri = resolve_tracking_uri(configured)
    database = sqlite_file(uri)
    if database is None or database.is_absolute():
        return uri
    query = urllib.parse.urlsplit(uri).query
    return f"sqlite:///{database.resolve()}" + (f"?{query}" if query else "")


@ray.remote(num_cpus=0, max_retries=0)
def _run_trial(
    config: ExperimentConfig,
    parent: str,
    continue_run: str | None,
    command: str | None,
    credentials: dict[str, str] | None,
) -> ChildOutcome:
    """One trial on the cluster (raysim.studies.children.run_child): errors are returned. `command`: the sweep's,
    the trial's MLflow source (its own process is a Ray worker). `credentials`: the tracking credentials the
    trial's run is written with, lent to this worker while it runs (raysim.credentials.lent; a local Ray's
    workers hold none of their own). The actors a trial keeps (runtime.reuse_actors) are ended with it: kept in
    the idle worker process, they held their CPUs for ever, and the driver's next run waited for them."""
    try:
        with lent(credentials or {}):
            outcome = run_child(config, parent, continue_run, command=command)
    finally:
        dismiss_parked()
    outcome.node = ray.get_runtime_context().get_node_id()
    return outcome


def trial_cpus(config: ExperimentConfig) -> float | None:
    """CPUs one trial reserves, or None when its host count follows the cluster (then it takes all of them)."""
    runtime = config.runtime
    if runtime.num_hosts is None:
        return None
    return runtime.num_hosts * runtime.host_cpus + runtime.coordinator_cpus


def concurrency(sweep: SweepConfig, trials: list[Trial]) -> int:
    """`max_concurrent`, else as many trials as the cluster's CPUs hold at once (at least one)."""
    if sweep.max_concurrent is not None:
        return sweep.max_concurrent
    needs = [trial_cpus(t.config) for t in trials]
    known = [n for n in needs if n]  # a need of None (unknown) or 0 runs the trials one at a time
    if len(known) < len(needs):
        return 1
    return max(1, int(ray.cluster_resources().get("CPU", 1) // max(known)))


def run_sweep(
    sweep: SweepConfig, show_progress: bool = True, resume: str | None = None, command: str | None = None
) -> SweepResult:
    """Run every trial on the cluster under one parent MLflow run; log the summary, the result tables and the
    plots. A trial that fails is recorded FAILED and the others run (raysim.studies.children); Ctrl-C or SIGTERM
    stops the sweep, its parent run KILLED. `resume`: the parent run of this sweep stopped earlier, continued
    (raysim.studies.resume). `command`: the command line that runs this sweep, for the line that says how to
    continue it."""
    base = validate_config(sweep.base_tree())
    uri = absolute_tracking_uri(base.tracking.uri)
    trials = sweep.trials(uri)
    check_partitions([(f"sweep trial {t.index} ({t.label}, seed {t.config.seed})", t.config) for t in trials])
    writer = MlflowWriter(uri, base.tracking.experiment)
    params: dict[str, object] = {
        "sweep.trials": len(trials),
        "sweep.settings": len({t.setting_index for t in trials}),
        "sweep.seeds": sweep.seeds or [base.seed],
        **{f"sweep.grid.{k}": v for k, v in sweep.grid.items()},
    }
    if sweep.random is not None:
        params |= {f"sweep.random.{k}": v.model_dump(exclude_none=True) for k, v in sweep.random.params.items()}
    if resume is None:
        tags = {"sweep": sweep.name, "mlflow.source.git.commit": git_commit(), **source_tags(command)}
        parent = writer.start(sweep.name, params, tags)
        plan = ResumePlan()
    else:
        parent = resume
        plan = plan_resume(writer, reopen_parent(writer, resume, "sweep", sweep.name), [t.config for t in trials])
    say = print if show_progress else (lambda *_, **__: None)
    say(f"sweep {sweep.name}: parent run {parent} at {writer.shown_uri}, {len(trials)} trials", flush=True)
    say(f"  compare its trials in MLflow: {compare_command(writer)}", flush=True)
    with ParentRun(writer, "sweep", sweep.name, command) as parent_run:
        with ray_session(base):
            dismiss_parked()  # this process's kept actors (runtime.reuse_actors) hold resources the trials wait for
            limit = concurrency(sweep, trials)
            say(f"running up to {limit} trials at once", flush=True)
            if plan.summary():
                say(plan.summary(), flush=True)
            progress = TrialProgress(writer, parent) if show_progress else None
            try:
                outcomes = _schedule(writer, trials, parent, limit, say, plan, parent_run, progress)
            finally:
                if progress is not None:
                    progress.close()
        parent_run.record([(t.config, o) for t, o in zip(trials, outcomes, strict=True)], [t.label for t in trials])
        table = summary_rows(trials, outcomes)
        _log_parent(writer, sweep, trials, outcomes, table)
    return SweepResult(parent, uri, trials, outcomes, table)


def _schedule(
    writer: MlflowWriter,
    trials: list[Trial],
    parent: str,
    limit: int,
    say,
    plan: ResumePlan,
    parent_run: ParentRun,
    progress: TrialProgress | None = None,
) -> list[ChildOutcome]:
    """Keep up to `limit` trial tasks in flight; a task that dies (worker crash, OOM) is a failed trial. The
    plan's kept trials (a resumed sweep's finished ones) do not run; its continued ones resume their run from its
    checkpoint. Ctrl-C or SIGTERM cancels the trials in flight (each marks its run KILLED) and is re-raised."""
    name = {t.index: t.config.tracking.run_name or "" for t in trials}
    outcomes = {t.index: plan.kept[name[t.index]] for t in trials if name[t.index] in plan.kept}
    queue = [t for t in trials if t.index not in outcomes]
    pending: dict[ray.ObjectRef, Trial] = {}
    lending = held() if started_here() else None  # a cluster's workers have their nodes' own (docs/cluster.md)
    try:
        while queue or pending:
            while queue and len(pending) < limit:
                trial = queue.pop(0)
                continued = plan.continued.get(name[trial.index])
                pending[_run_trial.remote(carry(trial.config), parent, continued, parent_run.command, lending)] = trial
            parent_run.doing = f"with {len(outcomes)} of {len(trials)} trials done"
            in_flight = {name[t.index]: t.config.rounds for t in pending.values()}
            done = _wait_for_one(list(pending), functools.partial(progress.look, in_flight) if progress else None)
            for ref in done:
                trial = pending.pop(ref)
                if progress is not None:
                    progress.ended(name[trial.index])
                try:
                    outcome = ray.get(ref)
                except Exception as error:  # noqa: BLE001 - the task itself died
                    outcome = ChildOutcome("failed", error=one_line(error))
                outcomes[trial.index] = outcome
                say(
                    f"trial {trial.index:3d} {outcome_line(f'{trial.label} seed={trial.config.seed}', outcome)}",
                    flush=True,
                )
    except KeyboardInterrupt:
        _cancel(writer, parent, pending)
        raise
    return [outcomes[t.index] for t in trials]


def _wait_for_one(
    refs: list[ray.ObjectRef], between: Callable[[], None] | None = None, poll_s: float = 0.2
) -> list[ray.ObjectRef]:
    """The refs done once at least one is, waited for in Python between non-blocking looks (`between` runs
    at each: the trials' progress): a signal's exception (raysim.errors.Interrupted, which knows the signal)
    raised while Ray itself waits comes out of ray.wait as a plain KeyboardInterrupt, and the sweep would report
    SIGTERM as SIGINT."""
    while True:
        raise_pending()
        done, _ = ray.wait(refs, num_returns=1, timeout=0)
        if done:
            return done
        if between is not None:
            between()
        time.sleep(poll_s)


def _cancel(writer: MlflowWriter, parent: str, pending: dict[ray.ObjectRef, Trial], wait_s: float = 20.0) -> None:
    """Stop the trials in flight: each task gets a KeyboardInterrupt, so its run ends KILLED as an interrupted
    run does (raysim.runtime.driver: "interrupted by SIGINT"); a run still RUNNING `wait_s` later is marked KILLED
    from here."""
    for ref in pending:
        ray.cancel(ref, recursive=False)  # its own actors' tasks go on until it closes them, so it ends KILLED
    ray.wait(list(pending), num_returns=len(pending), timeout=wait_s)
    names = {t.config.tracking.run_name for t in pending.values()}
    running = writer.client.search_runs(
        [writer.experiment_id], f"tags.mlflow.parentRunId = '{parent}' and attributes.status = 'RUNNING'"
    )
    for run in running:
        if run.info.run_name in names:
            writer.client.set_tag(run.info.run_id, "raysim.error", "interrupted: its sweep was stopped")
            writer.client.set_terminated(run.info.run_id, "KILLED")


def summary_rows(trials: list[Trial], outcomes: list[ChildOutcome]) -> list[dict[str, Any]]:
    """One row per trial: index, setting, seed, status, run id, swept values, final/best metrics."""
    keys = list(dict.fromkeys(k for t in trials for k in t.setting))
    rows = []
    for trial, outcome in zip(trials, outcomes, strict=True):
        row: dict[str, Any] = {
            "trial": trial.index,
            "setting": trial.label,
            "seed": trial.config.seed,
            "status": outcome.status,
            "run_id": outcome.run_id or "",
            "error": outcome.error,
            "node": outcome.node,
            "seconds": outcome.seconds,
        }
        row |= {k: json.dumps(trial.setting.get(k)) for k in keys}
        row |= {k: outcome.summary.get(k, math.nan) for k in SUMMARY_METRICS}
        rows.append(row)
    return rows


def setting_stats(
    trials: list[Trial], outcomes: list[ChildOutcome], metric: str
) -> list[tuple[str, float, float, int]]:
    """(setting label, mean, std, finished seeds) of a final metric over the seeds of each setting."""
    stats = []
    for setting_index in dict.fromkeys(t.setting_index for t in trials):
        values = [
            o.summary[metric]
            for t, o in zip(trials, outcomes, strict=True)
            if t.setting_index == setting_index and o.finished and metric in o.summary
        ]
        label = next(t.label for t in trials if t.setting_index == setting_index)
        mean = float(np.mean(values)) if values else math.nan
        std = float(np.std(values)) if values else math.nan
        stats.append((label, mean, std, len(values)))
    return stats


def _log_parent(writer, sweep: SweepConfig, trials, outcomes, table) -> None:
    """The parent's artifacts, made from the trials that finished; the failed ones are marked (their rows' status
    and error, `(failed)` in the curves' legend, named under the tables)."""
    from raysim.tracking.plots import figure_files

    finished = sum(o.finished for o in outcomes)
    metrics = {}
    for label, mean, _, _ in setting_stats(trials, outcomes, "final/pm/acc"):
        metrics[re.sub(r"[^\w\-. :/]", "_", f"setting/{label}/final_pm_acc_mean")[:250]] = mean
    writer.log_metrics(0, metrics)
    with tempfile.TemporaryDirectory() as directory:
        folder = Path(directory)
        write_summary(table, folder / "summary.parquet")
        write_trial_curves(trials, outcomes, sweep.name, folder / "accuracy_vs_round.png")
        write_setting_bars(trials, outcomes, sweep.name, folder / "final_accuracy.png")
        tables = write_tables(writer.tracking_uri, writer.run_id, folder) if finished else []
        figures = (*figure_files("accuracy_vs_round.png"), *figure_files("final_accuracy.png"))
        for name in ("summary.parquet", *figures, *(t.name for t in tables)):
            writer.log_artifact(folder / name)


def write_trial_curves(trials: list[Trial], outcomes: list[ChildOutcome], title: str, path: Path) -> None:
    """PM, GM and HM test accuracy against the round, one line per finished trial (colour: the setting's, as in
    MLflow's charts; style: seed)."""
    from raysim.tracking import plots

    seeds = list(dict.fromkeys(trial.config.seed for trial in trials))
    curves: dict[str, list[plots.Series]] = {"pm": [], "gm": [], "hm": []}
    for trial, outcome in zip(trials, outcomes, strict=True):
        rounds = [r for r in sorted(outcome.history) if "pm/acc" in outcome.history[r]]
        for kind, series in curves.items():
            series.append(
                plots.Series(
                    f"{trial.label} s{trial.config.seed}" + ("" if outcome.finished else " (failed)"),
                    {r: outcome.history[r][f"{kind}/acc"] for r in rounds},
                    color=trial.config.tracking.color,
                    linestyle=plots.LINE_STYLES[seeds.index(trial.config.seed) % len(plots.LINE_STYLES)],
                )
            )
    panels = [
        plots.Panel(f"{kind.upper()} test accuracy", series, "mean over clients" if kind == "pm" else "", bounds=(0, 1))
        for kind, series in curves.items()
    ]
    plots.save(plots.round_curves(panels, title=f"{title}: accuracy per trial"), path)


def write_setting_bars(trials: list[Trial], outcomes: list[ChildOutcome], title: str, path: Path) -> None:
    """Final PM / GM / HM accuracy per setting: mean over seeds with +/- one standard deviation."""
    from raysim.tracking import plots

    labels = [s[0] for s in setting_stats(trials, outcomes, "final/pm/acc")]
    positions = np.arange(len(labels))
    figure, (axis,) = plots.figure(figsize=(max(6, 1.2 * len(labels) + 2), 4.5))
    for offset, kind in zip((-0.27, 0.0, 0.27), ("pm", "gm", "hm"), strict=True):
        stats = setting_stats(trials, outcomes, f"final/{kind}/acc")
        axis.bar(
            positions + offset, [s[1] for s in stats], 0.27, yerr=[s[2] for s in stats], capsize=3, label=kind.upper()
        )
    axis.set_xticks(positions, labels, rotation=20, ha="right", fontsize=8)
    axis.set(ylabel="final test accuracy (mean +/- std over seeds)", title=f"{title}: final accuracy per setting")
    axis.grid(alpha=0.3, axis="y")
    plots.legend_outside(figure, [axis])
    plots.save(figure, path)
