"""The round loop: rounds, evaluations, checkpoints, recovery from dead actors, and resume; it logs each
step's metrics to MLflow exactly once."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import ray

from raysim.algorithms import Algorithm, build_algorithm
from raysim.config import ExperimentConfig
from raysim.errors import raise_pending
from raysim.evaluation.columns import client_evaluations
from raysim.evaluation.summaries import benign_summary
from raysim.runtime import checkpoint
from raysim.runtime.problem import Problem
from raysim.runtime.simulation import Simulation
from raysim.tracking.callbacks import FinalModels, RoundCallback, RunResult
from raysim.tracking.mlflow_writer import MlflowWriter


def best_key(summary_key: str) -> str:
    """The MLflow key of a best-round summary: `best/pm/acc` is logged as `pm/best_acc`."""
    kind, metric = summary_key.removeprefix("best/").rsplit("/", 1)
    return f"{kind}/best_{metric}"


def summary_from_logged(metrics: dict[str, float]) -> dict[str, float]:
    """A finished run's summary (`final/...`, `best/...`) rebuilt from its logged metrics' latest values (the
    inverse of `best_key` for the best ones)."""
    summary = {}
    for key, value in metrics.items():
        kind, best, metric = key.partition("/best_")
        summary[f"best/{kind}/{metric}" if best else f"final/{key}"] = value
    return summary


class Rounds:
    """The round loop of one run over a `Simulation`: checkpoints every `tracking.checkpoint_every` rounds,
    back to the last one when an actor dies, and resume from one; callbacks watch (RoundCallback)."""

    def __init__(
        self,
        config: ExperimentConfig,
        writer: MlflowWriter,
        result: RunResult,
        problem: Problem,
        resume: Path | None = None,
        callbacks: Sequence[RoundCallback] = (),
        inspect: Callable[[int, Simulation], None] | None = None,
    ):
        """`inspect(round_index, simulation)`, if given, is called after every round (tests check invariants on
        live state with it); `resume` is the checkpoint folder a resumed run continues from."""
        self.config, self.writer, self.result = config, writer, result
        self.callbacks, self.inspect = list(callbacks), inspect
        self.malicious, self.heldout = problem.malicious, problem.heldout
        self.test_sizes = {info.id: len(split.test) for info, split in problem.clients if info.id in self.heldout}
        """The held-out clients' test (query) samples: their accuracy weighted by them (benign_summary)."""
        self.params = problem.params
        """The model's layout, for the algorithm's tables of the final global model (Algorithm.model_tables)."""
        self.resume = resume
        tracking = config.tracking
        assert result.run_id is not None  # run_experiment opens the MLflow run first
        self.folder = Path(tracking.checkpoint_dir).resolve() / result.run_id if tracking.checkpoint_every else None
        if resume is not None:  # keep writing next to the checkpoint resumed from, wherever it was started
            self.folder = resume.resolve().parent
        self.latest: Path | None = resume
        """The newest complete checkpoint of this run."""
        self.logged_through = -1
        """Steps up to this one are in MLflow already (not logged again after a recovery or resume)."""

    def _log(self, step: int, metrics: dict[str, float]) -> None:
        if step > self.logged_through:
            self.writer.log_metrics(step, metrics)
            self.logged_through = step

    def _checkpoint(self, simulation: Simulation, folder: Path, step: int) -> None:
        """Write round `step`'s checkpoint into the run's `folder` whole or not at all; a failure to write stops the
        run with one line naming the last complete checkpoint."""
        directory = checkpoint.round_dir(folder.parent, folder.name, step)
        try:
            with checkpoint.round_folder(directory) as partial:
                self._write_checkpoint(simulation, step, partial)
        except checkpoint.CheckpointError as error:
            kept = (
                f"the last complete one is {self.latest}: free space and continue with `raysim resume "
                f"{self.result.run_id}`"
                if self.latest
                else "no checkpoint of this run is complete"
            )
            raise checkpoint.CheckpointError(f"{error}; {kept}") from None
        self.latest = directory
        self.writer.set_tags({"raysim.checkpoint": str(directory)})
        checkpoint.prune(folder, self.config.tracking.checkpoint_keep)

    def _write_checkpoint(self, simulation: Simulation, step: int, directory: Path) -> None:
        simulation.save_checkpoint(directory)
        checkpoint.write_manifest(
            directory,
            {
                "run_id": self.result.run_id,
                "round": step,
                "tracking_uri": self.writer.shown_uri,
                "config": self.config.to_yaml(),
                "history": self.result.history,
                "uplink_total": simulation.uplink_total,
                "downlink_total": simulation.downlink_total,
                "hosts": len(simulation.hosts),
                "sampler": "none: clients are drawn from a stream keyed by (seed, round), no RNG state to keep",
                "written": time.time(),
            },
        )

    def _restore(self, simulation: Simulation, directory: Path) -> int:
        """Every actor takes its state from the checkpoint; the driver its history; returns the round."""
        simulation.restore_checkpoint(directory)
        manifest = checkpoint.read_manifest(directory)
        self.result.history = {int(k): v for k, v in manifest["history"].items()}
        simulation.uplink_total = manifest["uplink_total"]
        simulation.downlink_total = manifest["downlink_total"]
        return int(manifest["round"])

    def run(self, simulation: Simulation) -> None:
        try:
            self._run(simulation)
        finally:
            for callback in self.callbacks:
                callback.close()

    def _run(self, simulation: Simulation) -> None:
        config, result = self.config, self.result
        evaluations: pa.Table | None = None
        if self.resume is not None:
            round_index = self._restore(simulation, self.resume)
            self.logged_through = max(self.writer.last_step("time/round"), self.writer.last_step("pm/acc"))
            for step in sorted(result.history):  # what the dead driver had not yet sent
                self._log(step, result.history[step])
        else:
            evaluations = simulation.evaluate()
            result.history[0] = benign_summary(evaluations, self.malicious, self.heldout, self.test_sizes)
            self._log(0, result.history[0])
            round_index = 0
            if self.folder is not None:
                self._checkpoint(simulation, self.folder, 0)
        for callback in self.callbacks:
            callback.on_start(result, round_index, self.resume is not None)
        while round_index < config.rounds:
            raise_pending()
            step = round_index + 1
            try:
                metrics, evaluated = self._round(simulation, round_index)
                if self.folder is not None and (step % config.tracking.checkpoint_every == 0):
                    self._checkpoint(simulation, self.folder, step)
            except ray.exceptions.RayActorError as error:
                if self.latest is None:
                    raise
                round_index = self._restore(simulation, self.latest)
                for callback in self.callbacks:
                    callback.on_restore(step, self.latest, round_index, type(error).__name__)
                continue
            evaluations = evaluated if evaluated is not None else evaluations
            if self.inspect is not None:
                self.inspect(round_index, simulation)
            for callback in self.callbacks:
                callback.on_round(step, metrics)
            round_index += 1
        result.final = client_evaluations(evaluations) if evaluations is not None else []
        finals = (
            benign_summary(evaluations, self.malicious, self.heldout, self.test_sizes)
            if evaluations is not None
            else {}
        )
        evaluated_rounds = [r for r in result.history if "pm/acc" in result.history[r]]
        best = {
            f"best/{k}": max(result.history[r][k] for r in evaluated_rounds) for k in ("pm/acc", "gm/acc", "hm/acc")
        }
        result.summary = {f"final/{k}": v for k, v in finals.items()} | best
        # MLflow gets the best accuracies beside their curves (pm/best_acc, ...); the final values are the curves'
        # latest ones, which the runs table shows already: no chart of single points ahead of the curves.
        self.writer.log_metrics(config.rounds, {best_key(k): v for k, v in best.items()})
        assert self.params is not None  # a problem that ran rounds has its model's layout
        algorithm = build_algorithm(config.algorithm, self.params)
        tables = type(algorithm).model_tables is not Algorithm.model_tables
        saved = config.tracking.save_models
        global_params = np.asarray(simulation.global_model()) if tables or saved != "none" else None  # if needed
        if tables and global_params is not None:
            result.model_tables = algorithm.model_tables(global_params)
        for callback in self.callbacks:
            callback.on_end(result)
        if global_params is not None and saved != "none":
            clients = simulation.personalized_models if saved == "all" and self._client_models_fit() else None
            models = FinalModels(np.asarray(global_params, dtype=np.float32), clients)
            for callback in self.callbacks:
                callback.on_models(models)

    def _client_models_fit(self) -> bool:
        """Whether the clients' models stay within tracking.client_models_max_mb; a warning says why not."""
        tracking, clients = self.config.tracking, self.config.clients.count
        assert self.params is not None  # a problem that ran rounds has its model's layout
        megabytes = clients * self.params.size * 4 / 2**20
        if megabytes <= tracking.client_models_max_mb:
            return True
        logging.getLogger(__name__).warning(
            "the clients' models (%d x %d parameters, %.0f MB) are not saved: over tracking.client_models_max_mb = "
            "%g; the global model is",
            clients,
            self.params.size,
            megabytes,
            tracking.client_models_max_mb,
        )
        return False

    def _round(self, simulation: Simulation, round_index: int) -> tuple[dict[str, float], pa.Table | None]:
        start = time.perf_counter()
        metrics = simulation.train_round(round_index)
        step = round_index + 1
        evaluations: pa.Table | None = None
        if step % self.config.tracking.eval_every == 0 or step == self.config.rounds:
            evaluated = time.perf_counter()
            evaluations = simulation.evaluate()
            metrics |= benign_summary(evaluations, self.malicious, self.heldout, self.test_sizes)
            metrics["time/evaluation"] = time.perf_counter() - evaluated
        metrics["time/round"] = time.perf_counter() - start
        self.result.history[step] = metrics
        self._log(step, metrics)
        return metrics, evaluations
