"""The console's progress bar of a run: a round callback."""

from __future__ import annotations

from pathlib import Path

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
    """Rounds done of all, the latest PM/GM/HM accuracy and seconds per round, on stderr."""

    def __init__(self, console: Console, total_rounds: int):
        self.console = console
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
        self.progress.start()

    def on_round(self, step: int, metrics: dict[str, float]) -> None:
        shown = {k: f"{metrics[f'{k}/acc']:.4f}" for k in ("pm", "gm", "hm") if f"{k}/acc" in metrics}
        self.progress.update(self.task, completed=step, **shown, secs=f"{metrics['time/round']:.2f}s/round")

    def on_restore(self, step: int, checkpoint: Path, rounds_done: int, reason: str) -> None:
        self.console.print(f"[yellow]round {step}: actor lost ({reason}); restoring {checkpoint}[/]")
        self.progress.update(self.task, completed=rounds_done)

    def close(self) -> None:
        self.progress.stop()
