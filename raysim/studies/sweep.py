"""Sweeps: a grid and random draws over config keys, times seeds, run as Ray Tune trials on a Ray cluster.

A sweep file has a `base` experiment (inline, or `base_config`: a path relative to the sweep file), a `grid` (dotted
key -> list of values; every combination), optional `random` draws (count, seed and a distribution per dotted key;
every draw is combined with every grid point) and `seeds`. A setting is one grid point with one draw; each setting
runs once per seed. Each trial is a Ray Tune trial whose trainable (`_trainable`, on the head node) runs the trial's
experiment (`run_experiment`: its hosts and coordinator are actors it owns) and reports every round's metrics to
Tune through a round callback (ReportRounds), so that the `scheduler` (ASHA, median stopping) can stop it early and
a `search` algorithm (Optuna) can propose settings; at most `max_concurrent` trials run at once (default: as many as
the cluster's CPUs hold). The trials' MLflow runs are nested under one parent run, which only this process creates
and which gets the summary table (summary.parquet) and the plots (accuracy vs round per trial; final accuracy mean
+/- std over seeds per setting). Every trial's config is validated and every distinct partition made
(`suite.check_partitions`) before the parent run or any Ray work, so an impossible request fails at once naming its
trial. A trial that fails later is recorded as failed (status and error in the table, its MLflow run marked FAILED)
and the others go on, as a suite's children do (raysim.studies.children); a trial stopped early is FINISHED with the
rounds it ran and a `raysim.stopped_early` tag, and a resumed sweep keeps it.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import itertools
import json
import logging
import math
import os
import re
import shutil
import tempfile
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np
import ray
from pydantic import Field, model_validator

from raysim.config import ExperimentConfig, ExperimentFamily, set_value, validate_config
from raysim.credentials import held, lent
from raysim.errors import ConfigError, as_raised, raise_pending
from raysim.plugins import carry
from raysim.runtime.crews import dismiss_parked
from raysim.runtime.session import ray_session, started_here
from raysim.settings import Settings
from raysim.studies.children import ChildOutcome, ParentRun, one_line, outcome_line, run_child
from raysim.studies.resume import STOPPED_TAG, ResumePlan, kept_outcome, plan_resume, reopen_parent
from raysim.studies.suite import check_partitions, write_summary
from raysim.studies.table import write_tables
from raysim.studies.trial_progress import TrialProgress
from raysim.tracking.callbacks import RoundCallback
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

    def domain(self) -> Any:
        """The same distribution as a Ray Tune search space (for a search algorithm that proposes values)."""
        from ray import tune

        if self.choice is not None:
            return tune.choice(self.choice)
        if self.uniform is not None:
            return tune.uniform(*self.uniform)
        if self.loguniform is not None:
            return tune.loguniform(*self.loguniform)
        assert self.randint is not None  # _one: the other three are None
        return tune.randint(self.randint[0], self.randint[1] + 1)  # Tune's upper bound is exclusive


class RandomSearch(_Model):
    count: int = Field(ge=1, description="number of random draws")
    seed: int = Field(0, ge=0, description="seed of the draws (not of the experiments)")
    params: dict[str, Distribution] = Field(min_length=1, description="dotted key -> distribution")


class Scheduler(_Model):
    """Ray Tune's trial scheduler: which trials stop before their last round (docs/usage.md, Sweeps on Ray Tune).
    Written as a name (`scheduler: asha`) or a section (`scheduler: {name: asha, grace_period: 2}`)."""

    name: Literal["none", "asha", "median_stopping"] = Field(
        "none",
        description="none: every trial runs all its rounds; asha: asynchronous successive halving (Li et al. 2020, "
        "ray.tune.schedulers.ASHAScheduler); median_stopping: stop a trial whose best metric so far is worse than "
        "the median of the other trials' running means at that round (Golovin et al. 2017, Google Vizier)",
    )
    metric: str = Field("pm/acc", description="the round metric it compares (any a round logs: pm/acc, pm/loss, ...)")
    mode: Literal["max", "min"] = Field("max", description="whether a larger or a smaller metric is better")
    grace_period: int = Field(1, ge=1, description="rounds every trial runs before it may be stopped")
    max_t: int | None = Field(
        None, ge=1, description="asha: the most rounds a trial runs, its top rung (default: the base's rounds)"
    )
    reduction_factor: float = Field(2.0, gt=1, description="asha: one trial in reduction_factor goes on at a rung")
    min_samples_required: int = Field(
        3, ge=1, description="median_stopping: trials that must have reached a round before one is stopped there"
    )

    @model_validator(mode="before")
    @classmethod
    def _named(cls, data: Any) -> Any:
        return {"name": data} if isinstance(data, str) else data

    @model_validator(mode="after")
    def _fields_of_its_kind(self) -> Scheduler:
        own = {"asha": {"max_t", "reduction_factor"}, "median_stopping": {"min_samples_required"}}
        for name, fields in own.items():
            for field in sorted(fields):
                if self.name != name and getattr(self, field) != type(self).model_fields[field].default:
                    raise ValueError(f"{field} is a setting of the {name} scheduler, not of {self.name}")
        return self

    def build(self, rounds: int) -> Any:
        """The Tune scheduler (None for `none`); its time is the trial's round (the `round` it reports)."""
        from ray.tune.schedulers import ASHAScheduler, MedianStoppingRule

        if self.name == "asha":
            return ASHAScheduler(
                time_attr="round",
                metric=self.metric,
                mode=self.mode,
                grace_period=self.grace_period,
                max_t=self.max_t or rounds,
                reduction_factor=self.reduction_factor,
            )
        if self.name == "median_stopping":
            return MedianStoppingRule(
                time_attr="round",
                metric=self.metric,
                mode=self.mode,
                grace_period=self.grace_period,
                min_samples_required=self.min_samples_required,
            )
        return None


class Search(_Model):
    """How the sweep's trials are chosen. Written as a name (`search: optuna`) or a section."""

    algorithm: Literal["grid", "random", "optuna"] = Field(
        "grid",
        description="grid and random: the trials are every grid point times every draw of the `random` section, "
        "listed before the sweep starts (random insists on a `random` section); optuna: Optuna's TPE sampler "
        "proposes `random.count` settings from `random.params`, each from the results so far (needs the optuna "
        "package: pip install optuna)",
    )
    metric: str = Field("pm/acc", description="optuna: the metric it optimises (the trial's last reported value)")
    mode: Literal["max", "min"] = Field("max", description="optuna: whether a larger or a smaller metric is better")

    @model_validator(mode="before")
    @classmethod
    def _named(cls, data: Any) -> Any:
        return {"algorithm": data} if isinstance(data, str) else data


class SweepConfig(ExperimentFamily):
    kind: ClassVar[str] = "sweep"
    grid: dict[str, list[Any]] = Field(default_factory=dict, description="dotted key -> values (all combinations)")
    random: RandomSearch | None = None
    seeds: list[int] | None = Field(None, min_length=1, description="run every setting with each seed")
    max_concurrent: int | None = Field(None, ge=1, description="trials at once (default: what the cluster holds)")
    scheduler: Scheduler = Field(default_factory=Scheduler, description="Ray Tune's early stopping of trials")
    search: Search = Field(default_factory=Search, description="how the trials are chosen")

    @model_validator(mode="after")
    def _check(self) -> SweepConfig:
        for key, values in self.grid.items():
            if not values:
                raise ValueError(f"grid.{key}: needs at least one value")
        if self.random is not None and set(self.random.params) & set(self.grid):
            raise ValueError(f"random.params: keys also in grid: {sorted(set(self.random.params) & set(self.grid))}")
        if self.search.algorithm in ("random", "optuna") and self.random is None:
            raise ValueError(f"search.algorithm={self.search.algorithm} needs a random section (count, params)")
        if self.search.algorithm == "optuna" and self.grid:
            raise ValueError("search.algorithm=optuna: put the swept keys under random.params (choice), not grid")
        if self.search.algorithm == "optuna" and self.seeds and len(self.seeds) > 1:
            raise ValueError("search.algorithm=optuna: one seed at most (Optuna proposes each setting once)")
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
        trials: list[Trial] = []
        seeds: list[int | None] = [*self.seeds] if self.seeds else [None]
        base = self.base_tree()
        for setting_index, setting in enumerate(self.settings()):
            for seed in seeds:
                trials.append(self.trial(len(trials), setting_index, setting, seed, tracking_uri, base))
        return trials

    def trial(
        self,
        index: int,
        setting_index: int,
        setting: dict[str, Any],
        seed: int | None,
        tracking_uri: str,
        base: dict[str, Any] | None = None,
    ) -> Trial:
        """Trial `index`: the base with `setting` (dotted key -> value) and `seed`, validated, logging to
        `tracking_uri` under its run name `NAME/tNNN LABEL seed=S` (how a resumed sweep finds it)."""
        from raysim.tracking.plots import mlflow_group_color

        tree = copy.deepcopy(base) if base is not None else self.base_tree()
        label = setting_label(setting) or "base"
        tracking = tree.setdefault("tracking", {})
        if not isinstance(tracking, dict):
            raise ConfigError("sweep.base: tracking must be a section")
        tracking.setdefault("color", mlflow_group_color(label))
        tracking.setdefault("group", label)
        for key, value in setting.items():
            set_value(tree, key, value)
        if seed is not None:
            tree["seed"] = seed
        tracking["uri"] = tracking_uri
        tracking["run_name"] = f"{self.name}/t{index:03d} {label} seed={tree.get('seed', 1)}"
        try:
            config = validate_config(tree)
        except ConfigError as error:
            raise ConfigError(f"sweep trial {index} ({label}): {error}") from None
        return Trial(index, setting_index, label, setting, config)


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
        return [t.index for t, o in zip(self.trials, self.outcomes, strict=True) if o.failed]


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


HEAD_MARKER = "node:__internal_head__"
"""The head node's marker resource (1 on the head, none elsewhere): what a trial's Tune actor reserves a share of."""


def trial_limits(sweep: SweepConfig, limit: int) -> tuple[dict[str, float], int | None]:
    """What a trial's Tune actor reserves, and Tune's `max_concurrent_trials`. The actor reserves a share of the head
    node's marker resource, so that it, and the trial's experiment it drives, run on the head, as the sweep's own
    driver does, and the loss of a worker node takes only hosts, which the runtime recovers from its checkpoint, never
    a trial's driver (the experiment's hosts and coordinator reserve their own CPUs, in placement of their own:
    raysim.runtime.actors). Where Tune's actors are reused (`reuse_trainables`), the share is 1/`limit` (floored to
    Ray's 0.0001), so that the head holds `limit` trials at once and Tune, told no limit, queues the others: Tune
    keeps a trainable whose trial ended only for a queued trial, and with `max_concurrent_trials` none is queued
    until one ends (two trials ending together left one trainable stopped and a new process started, most of a
    20-trial sweep's CPU on a loaded machine). Elsewhere (a scheduler, Optuna) the share is a thousandth and
    `max_concurrent_trials` bounds the trials at once, in the order Tune starts them."""
    if not reuse_trainables(sweep) or sweep.search.algorithm == "optuna":
        return {HEAD_MARKER: 0.001}, limit
    return {HEAD_MARKER: max(1e-4, math.floor(1e4 / limit) / 1e4)}, None


class TrialFailed(RuntimeError):
    """A trial's experiment failed; its message is the one-line error (Tune records the trial as ERROR)."""


class ReportRounds(RoundCallback):
    """A trial's round callback: each round's metrics to Tune (`round`, the round's metrics and the node), from the
    Tune actor's training thread that runs the experiment. A function trainable's report returns only once Tune has
    taken the round and asks for the next result, so the scheduler decides at a round before the experiment starts
    the next one: a trial stopped at round k runs k rounds whatever the speed of a round (the stop reaches the
    experiment as SystemExit out of the report, and its actor ends). The last round is kept (`last`) for
    `_trainable` to report once the run has finished (summaries logged, run FINISHED), so that a scheduler deciding
    at the last round never cuts a run short of its end."""

    def __init__(self, node: str, rounds: int):
        self.node, self.rounds = node, rounds
        self.last: dict[str, Any] | None = None

    def on_round(self, step: int, metrics: dict[str, float]) -> None:
        from ray import tune

        finite = {k: float(v) for k, v in metrics.items() if math.isfinite(v)}
        report = {**finite, "round": step, "raysim_node": self.node}
        if step >= self.rounds:
            self.last = report
            return
        tune.report(report)


def reuse_trainables(sweep: SweepConfig) -> bool:
    """Whether a Tune actor that ran a trial to its end runs the next one (Tune's `reuse_actors`): a worker process
    started once per trial slot instead of once per trial. Not under a scheduler: a trial it stops ends with its
    actor (its experiment's hosts and coordinator, which it owns, with it)."""
    return sweep.scheduler.name == "none"


@dataclass
class _Setup:
    """What every trial's trainable needs, shipped once (tune.with_parameters)."""

    sweep: SweepConfig
    trials: dict[int, Trial]
    uri: str
    parent: str
    command: str | None
    credentials: dict[str, str] | None
    continued: dict[str, str]

    def trial_of(self, spec: dict[str, Any]) -> Trial:
        """The trial a Tune trial runs: `{"trial": index}` of the listed ones, or an Optuna proposal `{"setting":
        {...}}`, numbered by Tune's trial counter."""
        if "trial" in spec:
            return self.trials[int(spec["trial"])]
        from ray import tune

        index = int(tune.get_context().get_trial_id().rsplit("_", 1)[-1])
        seed = self.sweep.seeds[0] if self.sweep.seeds else None
        return self.sweep.trial(index, index, dict(spec["setting"]), seed, self.uri)


def _trainable(spec: dict[str, Any], setup: _Setup) -> None:
    """A Tune trial: its experiment, run here (raysim.studies.children.run_child) reporting each round to Tune as it
    ends (ReportRounds), its last round once the run has finished; a failed run raises TrialFailed. `command`: the
    sweep's, the trial's MLflow source (this process is a Ray worker). The tracking credentials the trial's run is
    written with are lent to this worker while it runs (raysim.credentials.lent; a local Ray's workers hold none of
    their own). The actors a trial keeps (runtime.reuse_actors) are ended with it: kept in a reused Tune actor, they
    held their CPUs for ever, and the driver's next run waited for them."""
    from ray import tune

    trial = setup.trial_of(spec)
    config = trial.config
    rounds = ReportRounds(ray.get_runtime_context().get_node_id(), config.rounds)
    continued = setup.continued.get(config.tracking.run_name or "")
    try:
        with lent(setup.credentials or {}):
            outcome = run_child(config, setup.parent, continued, command=setup.command, round_callbacks=[rounds])
    finally:
        dismiss_parked()
    if not outcome.finished:
        raise TrialFailed(outcome.error or "failed")
    if rounds.last is not None:
        tune.report(rounds.last)


def _trial_error(trial: Any) -> BaseException | None:
    """A failed Tune trial's error as Tune has just written it beside the trial (the exception pickled, or the text
    of its traceback; Tune copies them to its storage later)."""
    from ray import cloudpickle
    from ray.tune.error import TuneError

    pickled, text = trial.pickled_error_file, trial.error_file
    with contextlib.suppress(Exception):
        if pickled and Path(pickled).exists():
            return cloudpickle.loads(Path(pickled).read_bytes())
    with contextlib.suppress(OSError):
        if text and Path(text).exists():
            return TuneError(Path(text).read_text())
    return None


def _error_line(error: BaseException | None) -> str:
    """The one line of a Tune trial's error (the exception, or Tune's text of it): a TrialFailed's message, else
    the error's last line."""
    cause = getattr(error, "cause", None) or error
    if isinstance(cause, TrialFailed):
        return str(cause)
    if cause is None:
        return "failed"
    failed = re.findall(r"TrialFailed: (.+)", str(cause))
    return failed[-1].strip() if failed else one_line(cause)


class _Watcher:
    """The sweep's view of Tune's trials (a tune.Callback once `_watching` made it one): the rounds of the trials in
    flight (TrialProgress, from their reports), a line as each ends, and Ctrl-C / SIGTERM raised in the loop."""

    def __init__(self, sweep: SweepConfig, setup: _Setup, total: int, say, parent_run: ParentRun, progress) -> None:
        self.sweep, self.given, self.total, self.say = sweep, setup, total, say
        self.parent_run, self.progress = parent_run, progress
        self.rounds: dict[str, int] = {}
        """run name -> rounds reported, of the trials in flight"""
        self.done: dict[str, tuple[Any, str | None]] = {}
        """Tune trial id -> the Tune trial that ended (its config and last result) and its error line if it failed"""
        self.totals: dict[str, int] = {}
        self.live: dict[str, Any] = {}
        """Tune trial id -> its Tune trial, of the trials running"""
        self.ended = total - len(setup.trials)

    def __getstate__(self) -> dict[str, Any]:
        """Nothing: Tune pickles its run config (callbacks included) to restore an experiment, which a sweep never
        asks of it (raysim resumes sweeps from the tracking store), and the console and writer do not pickle."""
        return {}

    def name_of(self, trial: Any) -> tuple[Trial, str]:
        ours = self.given.trial_of(trial.config) if "trial" in trial.config else None
        if ours is None:
            index = int(trial.trial_id.rsplit("_", 1)[-1])
            seed = self.sweep.seeds[0] if self.sweep.seeds else None
            ours = self.sweep.trial(index, index, dict(trial.config["setting"]), seed, self.given.uri)
        return ours, ours.config.tracking.run_name or ""

    def on_step_begin(self, iteration: int, trials: list, **info: Any) -> None:
        raise_pending()
        self.parent_run.doing = f"with {self.ended} of {self.total} trials done"

    def on_trial_start(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        ours, name = self.name_of(trial)
        self.live[trial.trial_id] = trial
        self.totals[name] = ours.config.rounds

    def on_trial_result(self, iteration: int, trials: list, trial: Any, result: dict, **info: Any) -> None:
        _, name = self.name_of(trial)
        self.rounds[name] = int(result.get("round", 0))
        if self.progress is not None:
            in_flight = {n: self.totals[n] for n in self.rounds if n in self.totals}
            self.progress.look(in_flight, counts=self.rounds)

    def _ended(self, trial: Any, outcome: ChildOutcome) -> None:
        ours, name = self.name_of(trial)
        self.done[trial.trial_id] = (trial, outcome.error if outcome.failed else None)
        self.live.pop(trial.trial_id, None)
        self.rounds.pop(name, None)
        self.ended += 1
        if self.progress is not None:
            self.progress.ended(name)
        self.say(f"trial {ours.index:3d} {outcome_line(f'{ours.label} seed={ours.config.seed}', outcome)}", flush=True)

    def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        ours, _ = self.name_of(trial)
        last = trial.last_result or {}
        reached = int(last.get("round", 0))
        summary = {"final/pm/acc": last.get("pm/acc", math.nan)}
        if reached >= ours.config.rounds:
            self._ended(trial, ChildOutcome("finished", summary=summary))
        else:
            stopped_at = f"{self.sweep.scheduler.name} at round {reached} of {ours.config.rounds}"
            self._ended(trial, ChildOutcome("stopped", summary=summary, stopped_at=stopped_at))

    def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self._ended(trial, ChildOutcome("failed", error=_error_line(_trial_error(trial))))

    def kill_live(self) -> list[str]:
        """End the trials in flight (their experiments end with their Tune actors); returns their run names."""
        names = []
        for trial in list(self.live.values()):
            names.append(self.name_of(trial)[1])
            actor = trial.temporary_state.ray_actor
            if actor is not None:
                with contextlib.suppress(Exception):
                    ray.kill(actor)
        return names


def _watching(*args: Any) -> Any:
    """A _Watcher that is a tune.Callback (ray.tune is imported only when a sweep runs, not with this module)."""
    from ray import tune

    watching = type("Watching", (_Watcher, tune.Callback), {})
    return watching(*args)


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


def require_optuna() -> None:
    """search.algorithm=optuna without the package: one line, before anything starts."""
    if importlib.util.find_spec("optuna") is None:
        raise ConfigError("search.algorithm=optuna needs the optuna package: pip install optuna")


def _working_folder() -> str | None:
    """The process's working folder, or None when it no longer exists."""
    try:
        return os.getcwd()
    except FileNotFoundError:
        return None


def run_sweep(
    sweep: SweepConfig, show_progress: bool = True, resume: str | None = None, command: str | None = None
) -> SweepResult:
    """Run the trials as Ray Tune trials under one parent MLflow run; log the summary, the result tables and the
    plots. A trial that fails is recorded FAILED and the others run (raysim.studies.children); a trial the
    scheduler stops early is FINISHED with the rounds it ran and a `raysim.stopped_early` tag; Ctrl-C or SIGTERM
    stops the sweep, its parent run KILLED. `resume`: the parent run of this sweep stopped earlier, continued
    (raysim.studies.resume). `command`: the command line that runs this sweep, for the line that says how to
    continue it."""
    base = validate_config(sweep.base_tree())
    uri = absolute_tracking_uri(base.tracking.uri)
    optuna = sweep.search.algorithm == "optuna"
    if optuna:
        require_optuna()
        if resume is not None:
            raise ConfigError("--resume: a sweep with search.algorithm=optuna starts again (its study is not stored)")
    listed_trials = [] if optuna else sweep.trials(uri)
    shape = listed_trials or [sweep.trial(0, 0, {}, sweep.seeds[0] if sweep.seeds else None, uri)]
    check_partitions([(f"sweep trial {t.index} ({t.label}, seed {t.config.seed})", t.config) for t in shape])
    writer = MlflowWriter(uri, base.tracking.experiment, artifact_root=base.tracking.artifact_root)
    count = sweep.random.count if optuna and sweep.random is not None else len(listed_trials)
    params: dict[str, object] = {
        "sweep.trials": count,
        "sweep.settings": count if optuna else len({t.setting_index for t in listed_trials}),
        "sweep.seeds": sweep.seeds or [base.seed],
        "sweep.scheduler": sweep.scheduler.name,
        "sweep.search": sweep.search.algorithm,
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
        previous = reopen_parent(writer, resume, "sweep", sweep.name)
        plan = plan_resume(writer, previous, [t.config for t in listed_trials])
    say = print if show_progress else (lambda *_, **__: None)
    say(f"sweep {sweep.name}: parent run {parent} at {writer.shown_uri}, {count} trials", flush=True)
    say(f"  compare its trials in MLflow: {compare_command(writer)}", flush=True)
    with ParentRun(writer, "sweep", sweep.name, command) as parent_run:
        # None started at once: Tune's trainables, the sweep's first actors, do not take them (the two a run's
        # actors would have had stayed idle through a 20-trial sweep, 1.1 CPU s each to start).
        with ray_session(base, workers=0):
            dismiss_parked()  # this process's kept actors (runtime.reuse_actors) hold resources the trials wait for
            limit = concurrency(sweep, shape)
            say(f"running up to {limit} trial{'' if limit == 1 else 's'} at once", flush=True)
            if plan.summary():
                say(plan.summary(), flush=True)
            progress = TrialProgress(writer, parent) if show_progress else None
            try:
                trials, outcomes = _tune(writer, sweep, listed_trials, parent, limit, say, plan, parent_run, progress)
            finally:
                if progress is not None:
                    progress.close()
        parent_run.record([(t.config, o) for t, o in zip(trials, outcomes, strict=True)], [t.label for t in trials])
        table = summary_rows(trials, outcomes)
        _log_parent(writer, sweep, trials, outcomes, table)
    return SweepResult(parent, writer.tracking_uri, trials, outcomes, table)


def _tune(
    writer: MlflowWriter,
    sweep: SweepConfig,
    trials: list[Trial],
    parent: str,
    limit: int,
    say,
    plan: ResumePlan,
    parent_run: ParentRun,
    progress: TrialProgress | None = None,
) -> tuple[list[Trial], list[ChildOutcome]]:
    """Run the trials not kept by `plan` (a resumed sweep's finished ones) as Ray Tune trials, at most `limit` at
    once, under the sweep's scheduler and search; returns every trial with its outcome, read back from the store
    as a resumed sweep reads its kept ones (raysim.studies.resume.kept_outcome). Ctrl-C or SIGTERM ends the
    trials in flight (their runs marked KILLED) and is re-raised."""
    from ray import tune

    name = {t.index: t.config.tracking.run_name or "" for t in trials}
    outcomes = {t.index: plan.kept[name[t.index]] for t in trials if name[t.index] in plan.kept}
    to_run = [t for t in trials if t.index not in outcomes]
    lending = held() if started_here() else None  # a cluster's workers have their nodes' own (docs/cluster.md)
    setup = _Setup(sweep, {t.index: t for t in to_run}, writer.tracking_uri, parent, parent_run.command, lending, {})
    setup.continued = dict(plan.continued)
    optuna = sweep.search.algorithm == "optuna"
    rounds = trials[0].config.rounds if trials else validate_config(sweep.base_tree()).rounds
    total = sweep.random.count if optuna and sweep.random is not None else len(trials)
    watcher = _watching(sweep, setup, total, say, parent_run, progress)
    if optuna:
        from ray.tune.search.optuna import OptunaSearch

        assert sweep.random is not None  # SweepConfig._check: optuna needs a random section
        space = {"setting": {k: d.domain() for k, d in sweep.random.params.items()}}
        search = OptunaSearch(metric=sweep.search.metric, mode=sweep.search.mode, seed=sweep.random.seed)
        samples = sweep.random.count
    else:
        space, search, samples = {"trial": tune.grid_search([t.index for t in to_run])}, None, 1
    if to_run or optuna:
        storage = tempfile.mkdtemp(prefix="raysim-tune-")
        os.environ.setdefault("TUNE_DISABLE_SIGINT_HANDLER", "1")  # Ctrl-C stops the sweep, as it did before Tune
        os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")  # Tune's own tables stay off: the sweep prints its lines
        os.environ.setdefault("TUNE_DISABLE_AUTO_CALLBACK_LOGGERS", "1")  # results go to MLflow, not Tune's files
        logging.getLogger("ray.tune").setLevel(logging.CRITICAL)  # a failed trial: its line, not Tune's traceback
        resources, max_concurrent = trial_limits(sweep, limit)
        tuner = tune.Tuner(
            tune.with_resources(tune.with_parameters(_trainable, setup=carry(setup)), resources),
            param_space=space,
            tune_config=tune.TuneConfig(
                scheduler=sweep.scheduler.build(rounds),
                search_alg=search,
                num_samples=samples,
                max_concurrent_trials=max_concurrent,
                reuse_actors=reuse_trainables(sweep),
            ),
            run_config=tune.RunConfig(
                name=re.sub(r"[^\w.-]", "_", sweep.name),
                storage_path=storage,
                callbacks=[watcher],
                verbose=0,
                failure_config=tune.FailureConfig(max_failures=0),
            ),
        )
        # Tune lists its files relative to the working folder, which the driver of a submitted job can have lost
        # (Ray removes the job's working_dir package from the head node once the tasks there that used it end, the
        # workers' plugin check among them): Tune works in its own folder, and the driver comes back to its own if
        # that still exists.
        working = _working_folder()
        os.chdir(storage)
        fitted_ms = int(time.time() * 1000)
        try:
            tuner.fit()
        except KeyboardInterrupt as interrupt:  # a signal's, which Ray's waits inside Tune's loop raise bare
            interrupted = as_raised(interrupt)
            _mark_killed(writer, parent, watcher.kill_live(), fitted_ms)
            raise interrupted from None
        finally:
            os.chdir(working if working is not None and os.path.isdir(working) else tempfile.gettempdir())
            shutil.rmtree(storage, ignore_errors=True)
    every = {t.index: t for t in trials}
    ended: list[tuple[Trial, str, dict[str, Any]]] = []
    for tuned, error in watcher.done.values():
        trial, run_name = watcher.name_of(tuned)
        every[trial.index] = trial
        if error is not None:
            outcomes[trial.index] = ChildOutcome("failed", error=error)
        else:
            ended.append((trial, run_name, tuned.last_result or {}))
    runs = _settled(writer, parent, [name for _, name, _ in ended])
    for trial, run_name, last in ended:
        run = runs.get(run_name)
        if run is None:
            outcomes[trial.index] = ChildOutcome("failed", error="its run is missing from the store")
            continue
        if run.info.status != "FINISHED":
            reached = int(last.get("round", 0))
            run = _record_stopped(writer, run, f"{sweep.scheduler.name} at round {reached} of {trial.config.rounds}")
        outcome = kept_outcome(writer, run)
        outcome.node = str(last.get("raysim_node", ""))
        outcome.seconds = float(last.get("time_total_s", 0.0))
        outcomes[trial.index] = outcome
    ordered = [every[i] for i in sorted(every)]
    return ordered, [outcomes.get(t.index) or ChildOutcome("failed", error="Tune did not run it") for t in ordered]


def _settled(writer: MlflowWriter, parent: str, names: list[str], wait_s: float = 10.0) -> dict[str, Any]:
    """The sweep's child runs of these names, once none is RUNNING or `wait_s` has passed: the experiment of a
    trial its scheduler stopped ends with the trial's Tune actor (SystemExit out of its report) and, if it goes in
    time, marks its own run FAILED on the way out; either way it writes nothing more once it is settled here. A
    FINISHED run wins over an unfinished one of the same name."""
    wanted, deadline = set(names), time.monotonic() + wait_s
    while True:
        children = writer.client.search_runs(
            [writer.experiment_id], f"tags.mlflow.parentRunId = '{parent}'", max_results=50000
        )
        found: dict[str, Any] = {}
        for run in children:
            name = run.info.run_name or ""
            if name in wanted and (name not in found or run.info.status == "FINISHED"):
                found[name] = run
        if time.monotonic() > deadline or all(run.info.status != "RUNNING" for run in found.values()):
            return found
        time.sleep(0.5)


def _record_stopped(writer: MlflowWriter, run: Any, stopped_at: str) -> Any:
    """A trial its scheduler stopped: its run FINISHED with the rounds it ran and the STOPPED_TAG saying who stopped
    it when, not the error its experiment's end left (the exit of its Ray worker); returns the run as stored."""
    client = writer.client
    if "raysim.error" in run.data.tags:
        client.delete_tag(run.info.run_id, "raysim.error")
    client.set_tag(run.info.run_id, STOPPED_TAG, stopped_at)
    client.set_terminated(run.info.run_id, "FINISHED")
    return client.get_run(run.info.run_id)


def _mark_killed(writer: MlflowWriter, parent: str, names: list[str], since_ms: int, wait_s: float = 3.0) -> None:
    """The trials in flight when the sweep was stopped: their experiments end with their Tune actors (killed by
    `_Watcher.kill_live`), so their runs of this sweep's process (started at `since_ms` or later), `wait_s` later,
    are marked KILLED from here: those still RUNNING, and those a dying experiment marked FAILED on its way out."""
    time.sleep(wait_s)
    children = writer.client.search_runs([writer.experiment_id], f"tags.mlflow.parentRunId = '{parent}'")
    for run in children:
        if (
            run.info.run_name in set(names)
            and run.info.status in ("RUNNING", "FAILED")
            and run.info.start_time >= since_ms
        ):
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
                    f"{trial.label} s{trial.config.seed}" + ("" if outcome.finished else f" ({outcome.status})"),
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
