"""The artifacts every run logs, as a round callback: the partition at the start, the resolved config, the
per-client table and the convergence plot at the end."""

from __future__ import annotations

import logging
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import pyarrow as pa
import pyarrow.parquet as pq

from raysim.data.partitions import label_counts
from raysim.tracking.callbacks import FinalModels, RoundCallback, RunResult
from raysim.tracking.mlflow_writer import MlflowWriter
from raysim.tracking.models import CLIENT_MODELS, GLOBAL_MODEL, save_client_models, save_global_model
from raysim.tracking.plots import figure_files
from raysim.tracking.reports import (
    write_client_table,
    write_convergence_plot,
    write_partition_heatmap,
    write_partition_table,
    write_table_json,
)

if TYPE_CHECKING:
    import numpy as np

    from raysim.algorithms import ClientInfo
    from raysim.config import ExperimentConfig
    from raysim.data.scheme import ClientSplit
    from raysim.models.flat import ModelSpec


class PreparedProblem(Protocol):
    """What the artifacts read of a run's prepared problem: raysim.runtime.problem.Problem, which tracking (a floor
    below the runtime) does not import."""

    y: np.ndarray
    model_spec: ModelSpec
    clients: list[tuple[ClientInfo, ClientSplit]]

    @property
    def malicious(self) -> frozenset[int]: ...


class RunArtifacts(RoundCallback):
    """partition.parquet and partition.png as a run starts (not again on resume), made in a thread while the actors
    start and the first rounds run; config.yaml (credentials redacted), clients.parquet and convergence.png when
    it ends, then its final models (tracking.save_models: `on_models`)."""

    def __init__(self, config: ExperimentConfig, problem: PreparedProblem, writer: MlflowWriter, resumed: bool = False):
        self.config, self.problem, self.writer = config, problem, writer
        self._failure: BaseException | None = None
        self._final_step = 0
        self._final_metrics: dict[str, float] = {}
        """The last step's metrics (on_end): the global model's metrics in MLflow."""
        self._partition = threading.Thread(target=self._write_partition, name="partition-artifacts", daemon=True)
        if not resumed:
            self._partition.start()

    def _write_partition(self) -> None:
        try:
            self.write_partition()
        except BaseException as error:  # noqa: BLE001 - raised again in the round loop's thread (`_wait`)
            self._failure = error

    def _finished(self) -> BaseException | None:
        """Wait for the partition artifacts; what writing them raised (once)."""
        if self._partition.ident is not None:  # started
            self._partition.join()
        failure, self._failure = self._failure, None
        return failure

    def _wait(self) -> None:
        """Wait for the partition artifacts; raise what writing them raised."""
        failure = self._finished()
        if failure is not None:
            raise failure

    def close(self) -> None:
        """The thread is done when the run is (a failure of it is reported, never raised over the run's own)."""
        failure = self._finished()
        if failure is not None:
            logging.getLogger(__name__).warning("partition artifacts not logged: %s", failure)

    def on_end(self, result: RunResult) -> None:
        self._wait()  # one writer of figures at a time
        if result.history:
            self._final_step = max(result.history)
            self._final_metrics = result.history[self._final_step]
        sizes = {
            info.id: {
                "num_train": info.num_train,
                "num_test": len(split.test),
                "malicious": info.id in self.problem.malicious,
                "heldout": info.heldout,
            }
            for info, split in self.problem.clients
        }
        with tempfile.TemporaryDirectory() as directory:
            folder = Path(directory)
            (folder / "config.yaml").write_text(self.config.to_yaml())
            write_client_table(result.final, sizes, folder / "clients.parquet")
            write_table_json(folder / "clients.parquet", folder / "clients.json")
            title = f"{self.config.algorithm.name} on {self.config.dataset.name}"
            formats = self.config.tracking.figures
            write_convergence_plot(result.history, title, folder / "convergence.png", formats)
            for name in ("config.yaml", "clients.parquet", *figure_files("convergence.png", formats)):
                self.writer.log_artifact(folder / name)
            self.writer.log_table(folder / "clients.json")
            for name, columns in result.model_tables.items():  # the algorithm's tables of the final global model
                pq.write_table(pa.table(columns), folder / f"{name}.parquet")
                write_table_json(folder / f"{name}.parquet", folder / f"{name}.json")
                self.writer.log_artifact(folder / f"{name}.parquet")
                self.writer.log_table(folder / f"{name}.json")

    def on_models(self, models: FinalModels) -> None:
        """GLOBAL_MODEL as a LoggedModel of the run (MlflowWriter.log_model: the runs table's Models column, with the
        run's params and final metrics), and with tracking.save_models = all CLIENT_MODELS as an artifact
        (raysim.tracking.models). Both are written whole into a folder before anything is queued (a run that fails or
        is stopped before then saves neither)."""
        with tempfile.TemporaryDirectory() as directory:
            folder = Path(directory)
            save_global_model(self.problem.model_spec, models.global_params, folder / GLOBAL_MODEL)
            if models.client_models is not None:
                save_client_models(models.client_models(), folder / CLIENT_MODELS)
            self.writer.log_model(folder / GLOBAL_MODEL, GLOBAL_MODEL, self._final_step, self._final_metrics)
            if (folder / CLIENT_MODELS).exists():
                self.writer.log_artifact(folder / CLIENT_MODELS)

    def write_partition(self) -> None:
        """partition.parquet (per client and label: train/test/val counts) and partition.png (label shares)."""
        if self.problem.model_spec.task != "classification":
            return
        splits = [split for _, split in self.problem.clients]
        counts = label_counts(splits, self.problem.y, self.problem.model_spec.outputs)
        malicious = self.problem.malicious
        extra = {s.client_id: {"noise_std": s.noise_std, "malicious": s.client_id in malicious} for s in splits}
        with tempfile.TemporaryDirectory() as directory:
            folder = Path(directory)
            write_partition_table(counts, extra, folder / "partition.parquet")
            title = f"{self.config.partition.scheme} partition of {self.config.dataset.name}"
            formats = self.config.tracking.figures
            write_partition_heatmap(counts, title, folder / "partition.png", formats)
            write_table_json(folder / "partition.parquet", folder / "partition.json")
            for name in ("partition.parquet", *figure_files("partition.png", formats)):
                self.writer.log_artifact(folder / name)
            self.writer.log_table(folder / "partition.json")
