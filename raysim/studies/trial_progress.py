"""The rounds of a sweep's trials in flight, shown while they run. Trials run in Ray workers and log to the
tracking store; their own progress lines would reach this console only through Ray's log forwarding, which folds
lines that differ only in numbers (every trial's "round k/T"), so the sweep shows the rounds each trial reports to
Ray Tune (raysim.studies.sweep), or reads them from the store (its `time/round` history, one point per round)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from raysim.tracking.mlflow_writer import MlflowWriter

ROUND_METRIC = "time/round"


class TrialProgress:
    """Every `every_s` seconds, the rounds done by each trial in flight (name -> total rounds): a live bar per
    trial on a terminal; elsewhere (job logs, CI) a line when a trial has done another tenth of its rounds."""

    def __init__(self, writer: MlflowWriter, parent: str, console: Console | None = None, every_s: float = 2.0):
        self.writer = writer
        self.parent = parent
        self.console = console or Console()
        self.every_s = every_s
        self.live = self.console.is_terminal
        self.last_look = 0.0
        self.shown: dict[str, int] = {}
        """trial name -> rounds last shown"""
        self.tasks: dict[str, TaskID] = {}
        self.progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=self.console,
        )
        if self.live:
            self.progress.start()

    def rounds_done(self, names: Iterable[str]) -> dict[str, int]:
        """Rounds logged so far by the running child runs of these names."""
        wanted = set(names)
        client = self.writer.client
        running = client.search_runs(
            [self.writer.experiment_id],
            f"tags.mlflow.parentRunId = '{self.parent}' and attributes.status = 'RUNNING'",
        )
        return {
            run.info.run_name: len(client.get_metric_history(run.info.run_id, ROUND_METRIC))
            for run in running
            if run.info.run_name in wanted
        }

    def look(self, in_flight: dict[str, int], force: bool = False, counts: dict[str, int] | None = None) -> None:
        """Show the progress of the trials in flight (run name -> its total rounds), at most every `every_s`:
        `counts` (run name -> rounds done, as the trials report them to Ray Tune), or else read from the store."""
        now = time.monotonic()
        if not in_flight or (not force and now - self.last_look < self.every_s):
            return
        self.last_look = now
        if counts is None:
            counts = self.rounds_done(in_flight)
        for name, total in in_flight.items():
            if name not in counts:
                continue
            done = counts[name]
            if self.live:
                if name not in self.tasks:
                    self.tasks[name] = self.progress.add_task(name, total=total)
                self.progress.update(self.tasks[name], completed=done)
            elif done // max(1, total // 10) > self.shown.get(name, 0) // max(1, total // 10):
                self.console.print(f"{name}: round {done}/{total}", highlight=False, soft_wrap=True)
            self.shown[name] = done

    def ended(self, name: str) -> None:
        """A trial ended: its bar goes (its outcome line says the rest)."""
        self.shown.pop(name, None)
        task = self.tasks.pop(name, None)
        if task is not None:
            self.progress.remove_task(task)

    def close(self) -> None:
        if self.live:
            with contextlib.suppress(OSError):
                self.progress.stop()
