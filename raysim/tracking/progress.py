"""The console's progress bar of a run: a round callback."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from raysim.tracking.callbacks import RoundCallback


class ProgressBar(RoundCallback):
    """Rounds done of all, the latest PM/GM/HM accuracy and seconds per round, on stderr: a live bar on a
    terminal; elsewhere (Ray job logs, CI, nohup) one plain line every `total_rounds // 20` rounds (at least every
    `LINE_EVERY_S` seconds), and after the last."""

    LINE_EVERY_S = 60.0

    def __init__(self, console: Console, total_rounds: int):
        self.console = console
        self.total = total_rounds
        self.live = console.is_terminal
        self.every = max(1, total_rounds // 20)
        self.last_line = time.monotonic()
        self.latest = {"pm": "-", "gm": "-", "hm": "-"}
        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("PM {task.fields[pm]}  GM {task.fields[gm]}  HM {task.fields[hm]}  {task.fields[secs]}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=console,
        )
        self.task = self.progress.add_task("round", total=total_rounds, pm="-", gm="-", hm="-", secs="")

    def on_start(self, result, rounds_done: int, resumed: bool) -> None:
        self.progress.update(self.task, completed=rounds_done)
        if self.live:
            self.progress.start()

    def on_round(self, step: int, metrics: dict[str, float]) -> None:
        shown: dict[str, Any] = {k: f"{metrics[f'{k}/acc']:.4f}" for k in ("pm", "gm", "hm") if f"{k}/acc" in metrics}
        self.latest |= shown
        secs = f"{metrics['time/round']:.2f}s/round"
        self.progress.update(self.task, completed=step, **shown, secs=secs)
        now = time.monotonic()
        due = step % self.every == 0 or step == self.total or now - self.last_line >= self.LINE_EVERY_S
        if not self.live and due:
            self.last_line = now
            accuracy = "  ".join(f"{k.upper()} {v}" for k, v in self.latest.items())
            self.console.print(f"round {step}/{self.total}  {accuracy}  {secs}", highlight=False, soft_wrap=True)

    def on_restore(self, step: int, checkpoint: Path, rounds_done: int, reason: str) -> None:
        self.console.print(f"[yellow]round {step}: actor lost ({reason}); restoring {checkpoint}[/]", soft_wrap=True)
        self.progress.update(self.task, completed=rounds_done)

    def close(self) -> None:
        """Stop the live bar; a terminal that is gone (closed: the run is ending on its SIGHUP) is not an error."""
        if self.live:
            with contextlib.suppress(OSError):
                self.progress.stop()


class TrainingBar:
    """The console's bar of a pretraining (raysim.runtime.problem.TrainingProgress): SGD steps done of all, the
    epoch, the mean loss of the epoch so far; on stderr, live on a terminal, elsewhere one plain line at the end
    of every `epochs // 20`-th epoch and of the last."""

    def __init__(self, console: Console):
        self.console = console
        self.live = console.is_terminal
        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("epoch {task.fields[epoch]}  loss {task.fields[loss]}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=console,
        )
        self.task: Any = None
        self.epochs = 0
        self.per_epoch = 1
        self.done = 0
        self.epoch_losses: list[float] = []

    def begin(self, request: Any, steps: int) -> None:
        self.epochs, self.per_epoch, self.done = request.epochs, max(1, steps // max(1, request.epochs)), 0
        self.epoch_losses = []
        description = f"pretrain {request.model} ({len(request.y)} samples)"
        self.task = self.progress.add_task(description, total=steps, epoch=f"0/{self.epochs}", loss="-")
        if self.live:
            self.progress.start()

    def step(self, epoch: int, loss: float) -> None:
        self.done += 1
        self.epoch_losses.append(loss)
        mean = sum(self.epoch_losses) / len(self.epoch_losses)
        self.progress.update(self.task, completed=self.done, epoch=f"{epoch + 1}/{self.epochs}", loss=f"{mean:.4f}")
        if self.done % self.per_epoch:
            return
        every = max(1, self.epochs // 20)
        if not self.live and ((epoch + 1) % every == 0 or epoch + 1 == self.epochs):
            self.console.print(f"epoch {epoch + 1}/{self.epochs}  loss {mean:.4f}", highlight=False, soft_wrap=True)
        self.epoch_losses = []

    def close(self) -> None:
        if self.live:
            with contextlib.suppress(OSError):
                self.progress.stop()
