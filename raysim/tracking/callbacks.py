"""Round callbacks: what watches a run without steering it (the progress display, the artifact writers), and the
run's result they are shown (RunResult, what a run returns).

The round loop (raysim.runtime.rounds) calls them in order at fixed points, as pfl-research's callbacks: a
new display or report is a callback, not an edit of the loop.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from raysim.evaluation.records import ClientEvaluation

if TYPE_CHECKING:
    import numpy as np


@dataclass
class RunResult:
    """What a run returns (raysim.runtime.driver.run_experiment): its MLflow run id, every step's metrics, every
    client's final scores and the summaries."""

    run_id: str | None
    history: dict[int, dict[str, float]] = field(default_factory=dict)
    """Metrics logged at each step (round number, 0 = before training)."""
    final: list[ClientEvaluation] = field(default_factory=list)
    """Every client's final scores, attackers included (the summaries exclude them)."""
    summary: dict[str, float] = field(default_factory=dict)
    """Final and best-round summaries (`final/...`, `best/...`) over benign clients; in MLflow the final values
    are the curves' latest ones and the best accuracies are `pm/best_acc`, `gm/best_acc`, `hm/best_acc`."""
    malicious: list[int] = field(default_factory=list)
    model_tables: dict[str, dict[str, list]] = field(default_factory=dict)
    """The algorithm's tables of the final global model (Algorithm.model_tables), logged as artifacts."""


@dataclass(frozen=True)
class FinalModels:
    """A finished run's final models as flat float32 vectors, for the callbacks that save them (tracking.save_models);
    not part of RunResult, so that a study's many results never hold clients x parameters arrays."""

    global_params: np.ndarray
    """The coordinator's final global model (Algorithm.global_model), laid out as the network's parameters."""
    client_models: Callable[[], Iterator[tuple[np.ndarray, np.ndarray]]] | None = None
    """With save_models = all: each call yields every client's final model (the one its final scores are of) a block
    at a time in client-id order, as (client ids, float32 rows [clients x parameters])
    (raysim.runtime.simulation.Simulation.personalized_models): the clients x parameters array, 0.4 GB for 1,000
    MLP clients, is never whole in one process."""


class RoundCallback:
    """Hooks of one run; every method does nothing unless overridden."""

    def on_start(self, result: RunResult, rounds_done: int, resumed: bool) -> None:
        """The MLflow run exists, the actors are up, `rounds_done` rounds are behind (0, or a resumed run's)."""

    def on_round(self, step: int, metrics: dict[str, float]) -> None:
        """Round `step` (1-based) is done and logged; `metrics` are its metrics."""

    def on_restore(self, step: int, checkpoint: Path, rounds_done: int, reason: str) -> None:
        """Round `step` lost an actor; the run went back to `checkpoint`, `rounds_done` rounds in."""

    def on_end(self, result: RunResult) -> None:
        """Every round is done; `result` holds the final evaluations and summaries."""

    def on_models(self, models: FinalModels) -> None:
        """After on_end, when tracking.save_models is not none: the run's final models."""

    def close(self) -> None:
        """The run is over, finished or not (called after on_end, and after a failure)."""
