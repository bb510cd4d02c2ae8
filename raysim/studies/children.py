"""What suites and sweeps do alike with their children, the experiments run as MLflow runs nested under the study's
parent run.

A child that fails is a result, not the end of the study: `run_child` returns it as a failed `ChildOutcome` with
its one-line error, `record_failures` leaves it a FAILED MLflow run with that error in its `raysim.error` tag, the
other children run, and the study ends with the failed ones listed (`failure_lines`) and a non-zero exit. Ctrl-C
or SIGTERM still stops the whole study: `ParentRun` marks the parent run KILLED and says, in one line, which
command continues it (`raysim run STUDY.yaml --resume PARENT`, raysim.studies.resume).
"""

from __future__ import annotations

import re
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import TracebackType

from raysim.config import ExperimentConfig
from raysim.credentials import redact_text
from raysim.errors import Interrupted, RayLost, RaysimError
from raysim.runtime.driver import resume_experiment, run_experiment
from raysim.studies.table import listed
from raysim.tracking.callbacks import RoundCallback, RunResult
from raysim.tracking.identity import source_tags
from raysim.tracking.mlflow_writer import MlflowWriter
from raysim.tracking.views import share_children_view

ERROR_TAG = "raysim.error"
"""Run tag: the one line that says why a run (child or parent) did not finish."""


@dataclass
class ChildOutcome:
    """How one child ended: `finished` with its metrics, `failed` with its one-line error, or `stopped` early by a
    sweep's scheduler (Ray Tune's ASHA or median stopping: its MLflow run is FINISHED with the rounds it ran and a
    `raysim.stopped_early` tag, and a resumed sweep keeps it as it keeps a finished one)."""

    status: str
    """finished, failed or stopped"""
    run_id: str | None = None
    history: dict[int, dict[str, float]] = field(default_factory=dict)
    """Metrics logged at each step (round number)."""
    summary: dict[str, float] = field(default_factory=dict)
    """Final and best-round summaries (`final/...`, `best/...`; RunResult.summary)."""
    error: str = ""
    node: str = ""
    """The Ray node it ran on (sweep trials)."""
    seconds: float = 0.0
    stopped_at: str = ""
    """Of a stopped child: who stopped it and when (e.g. `asha at round 2 of 8`)."""

    @property
    def finished(self) -> bool:
        return self.status == "finished"

    @property
    def failed(self) -> bool:
        return self.status == "failed"

    @classmethod
    def of(cls, result: RunResult, seconds: float = 0.0) -> ChildOutcome:
        return cls("finished", result.run_id, result.history, result.summary, seconds=seconds)


FOOTNOTE = "(Background on this error at: "
"""The last line SQLAlchemy adds to its errors (a link to its docs), which MLflow's errors of a SQL store carry: their
first line says what happened (the lines between are the statement and its parameters)."""


def one_line(error: BaseException) -> str:
    """An error as one line, credentials redacted: a RaysimError's message (the line `raysim run` would print);
    anything else its last line (a Ray task error's is the exception raised inside the task; a SQL store's error its
    first, FOOTNOTE), led by its type."""
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    if any(line.startswith(FOOTNOTE) for line in lines):
        lines = lines[:1]
    last = lines[-1].strip() if lines else ""
    if not isinstance(error, RaysimError) and not re.match(r"^[\w.]+(Error|Exception)\b", last):
        last = f"{type(error).__name__}: {last}" if last else type(error).__name__
    return redact_text(last)[:500]


def run_child(
    config: ExperimentConfig,
    parent: str,
    continue_run: str | None = None,
    show_progress: bool = False,
    command: str | None = None,
    round_callbacks: Sequence[RoundCallback] = (),
) -> ChildOutcome:
    """Run one child nested under `parent`, or continue `continue_run` from its checkpoint (a resumed study); an
    error is returned as a failed outcome. Ctrl-C and SIGTERM (KeyboardInterrupt) are not caught: they stop the
    study. `round_callbacks` watch its rounds (run_experiment's)."""
    start = time.perf_counter()
    try:
        if continue_run is not None:
            result = resume_experiment(
                continue_run, config.tracking.uri, show_progress=show_progress, round_callbacks=round_callbacks
            )
        else:
            result = run_experiment(
                config, show_progress=show_progress, parent=parent, command=command, round_callbacks=round_callbacks
            )
    except Exception as error:  # noqa: BLE001 - a failed child is a result, not the end of the study
        return ChildOutcome("failed", error=one_line(error), seconds=time.perf_counter() - start)
    return ChildOutcome.of(result, time.perf_counter() - start)


def outcome_line(name: str, outcome: ChildOutcome) -> str:
    """The progress line of a child that ended."""
    if outcome.finished:
        return f"{name}: finished, final PM {outcome.summary.get('final/pm/acc', float('nan')):.4f}"
    if outcome.status == "stopped":
        last = outcome.summary.get("final/pm/acc", float("nan"))
        return f"{name}: stopped early by {outcome.stopped_at}, last PM {last:.4f}"
    return f"{name}: FAILED: {outcome.error}"


Children = list[tuple[ExperimentConfig, ChildOutcome]]
"""A study's children as run: each one's config (its run name is `config.tracking.run_name`) and outcome."""


HEADLINE = ("final/pm/acc", "final/gm/acc", "final/hm/acc")
"""The metrics a study's parent run shows per setting."""


def setting_means(children: Children, settings: list[str]) -> dict[str, float]:
    """`<setting>/pm/acc` (and gm, hm): the mean over a setting's finished children (its seeds) of their final
    accuracy, so that the parent's row of MLflow's runs table compares the settings at a glance. Characters MLflow
    refuses in a metric key (`=` and `,` of a sweep's labels) become `_`."""
    values: dict[str, list[float]] = {}
    for setting, (_, outcome) in zip(settings, children, strict=True):
        if outcome.finished:
            safe = re.sub(r"[^\w./ -]", "_", setting)
            for metric in HEADLINE:
                if metric in outcome.summary:
                    key = f"{safe}/{metric.removeprefix('final/')}"
                    values.setdefault(key, []).append(outcome.summary[metric])
    return {key: sum(v) / len(v) for key, v in values.items()}


def record_failures(writer: MlflowWriter, parent: str, children: Children, command: str | None = None) -> None:
    """Leave every failed child a FAILED MLflow run under `parent` whose `raysim.error` tag says why: the run it
    started (its driver has usually marked it already; a trial whose Ray task died left it RUNNING), or, for a
    child that failed before its run existed, a new one with its config as params and the study's `command` as
    its source. Sets each outcome's run id."""
    failed = [(config, outcome) for config, outcome in children if outcome.failed]
    if not failed:
        return
    runs = writer.client.search_runs(
        [writer.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{parent}'", max_results=50000
    )
    by_name = {run.info.run_name: run for run in runs}
    for config, outcome in failed:
        name = config.tracking.run_name
        run = by_name.get(name)
        if run is not None and run.info.status == "FAILED" and ERROR_TAG in run.data.tags:
            outcome.run_id = run.info.run_id
            continue
        child = MlflowWriter(
            writer.tracking_uri, config.tracking.experiment, artifact_root=config.tracking.artifact_root
        )
        if run is None:
            tags = {"algorithm": config.algorithm.name, **source_tags(command)}
            child.start(name, config.flat(), tags, parent=parent)
        else:
            child.run_id = run.info.run_id
        child.set_tags({ERROR_TAG: outcome.error or "failed"})
        child.finish("FAILED")
        outcome.run_id = child.run_id


def failure_lines(kind: str, children: Children, resume: str) -> list[str]:
    """What a study that ran to its end prints about its failed children: how many, each one's error, and the
    command that reruns them (`resume`); no lines if none failed."""
    failed = [(config.tracking.run_name, outcome) for config, outcome in children if outcome.failed]
    if not failed:
        return []
    lines = [
        f"{len(failed)} of {len(children)} {kind} children failed (marked FAILED, error in their raysim.error tag):"
    ]
    lines += [f"  {name}: {outcome.error}" for name, outcome in failed]
    lines.append(f"rerun the failed ones (finished ones are kept) with `{resume}`")
    return lines


def resume_command(kind: str, command: str | None, parent: str) -> str:
    """The command that continues a study: the one that ran it (`command`, without --resume) or, not known, the
    general form, with `--resume PARENT`."""
    return f"{command or f'raysim run {kind.upper()}.yaml'} --resume {parent}"


class ParentRun:
    """Ends a study's parent run with the study: FINISHED when it runs to its end (tagged with the failed
    children, if any: `record`); KILLED on Ctrl-C or SIGTERM, re-raised as one Interrupted line that
    names the command continuing the study; FAILED on any other error (a lost local Ray included), re-raised."""

    def __init__(self, writer: MlflowWriter, kind: str, name: str, command: str | None = None):
        self.writer, self.kind, self.name, self.command = writer, kind, name, command
        self.doing = ""
        """What the study is doing now, for the interrupt line (e.g. `in its child 'b/seed1' (2 of 6 done)`)."""

    def __enter__(self) -> ParentRun:
        share_children_view(self.writer)
        return self

    def record(self, children: Children, settings: list[str]) -> None:
        """The children have run: leave each failed one its FAILED run (`record_failures`), log how many finished
        and failed and each setting's headline means (`setting_means`; `settings`: each child's setting), and tag
        the parent with the failed ones (a resumed study whose children all finish has no such tag:
        MlflowWriter.reopen removes it). They are logged at the study's attempt: step 0 when it first ends, one
        step more each time it is resumed, so that each metric has one value at a step (the last is the study as
        it stands)."""
        self.doing = "while writing its summary"
        record_failures(self.writer, self.writer.run_id or "", children, self.command)
        failed = [config.tracking.run_name or "" for config, outcome in children if outcome.failed]
        stopped = sum(outcome.status == "stopped" for _, outcome in children)
        counts = {"children/finished": len(children) - len(failed) - stopped, "children/failed": len(failed)}
        if stopped:
            counts["children/stopped"] = stopped
        attempt = self.writer.last_step("children/finished") + 1
        self.writer.log_metrics(attempt, counts | setting_means(children, settings))
        if failed:
            self.writer.set_tags({ERROR_TAG: f"{len(failed)} of {len(children)} children failed: {listed(failed)}"})

    def __exit__(
        self, _type: type[BaseException] | None, error: BaseException | None, _traceback: TracebackType | None
    ) -> None:
        if error is None:
            self.writer.finish("FINISHED")
            return
        if isinstance(error, RayLost) or not isinstance(error, KeyboardInterrupt):  # a lost Ray fails, not stops
            self.writer.set_tags({ERROR_TAG: one_line(error)})
            self.writer.finish("FAILED")
            return
        number = getattr(error, "signal_number", signal.SIGINT)
        received = signal.Signals(number).name
        parent = self.writer.run_id or ""
        self.writer.set_tags({ERROR_TAG: f"interrupted by {received}{self.doing and ' ' + self.doing}"})
        self.writer.finish("KILLED")
        raise Interrupted(
            f"{self.kind} {self.name} interrupted by {received}{self.doing and ' ' + self.doing}: parent run "
            f"{parent} marked KILLED; continue with `{resume_command(self.kind, self.command, parent)}`",
            number,
        ) from None
