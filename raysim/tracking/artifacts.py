"""The artifacts every run logs, as a round callback: the partition at the start, the resolved config, the
per-client table and the convergence plot at the end."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from raysim.data.partitions import label_counts
from raysim.tracking.callbacks import RoundCallback
from raysim.tracking.mlflow_writer import MlflowWriter
from raysim.tracking.reports import (
    write_client_table,
    write_convergence_plot,
    write_partition_heatmap,
    write_partition_table,
    write_table_json,
)

if TYPE_CHECKING:
    from raysim.config import ExperimentConfig
    from raysim.runtime.problem import Problem
    from raysim.runtime.rounds import RunResult


class RunArtifacts(RoundCallback):
    """partition.parquet and partition.png when a run starts (not again on resume); config.yaml (credentials
    redacted), clients.parquet and convergence.png when it ends."""

    def __init__(self, config: ExperimentConfig, problem: Problem, writer: MlflowWriter):
        self.config, self.problem, self.writer = config, problem, writer

    def on_start(self, result: RunResult, rounds_done: int, resumed: bool) -> None:
        if not resumed:
            self.write_partition()

    def on_end(self, result: RunResult) -> None:
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
            write_convergence_plot(result.history, title, folder / "convergence.png")
            for name in ("config.yaml", "clients.parquet", "convergence.png"):
                self.writer.log_artifact(folder / name)
            self.writer.log_table(folder / "clients.json")

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
            write_partition_heatmap(counts, title, folder / "partition.png")
            write_table_json(folder / "partition.parquet", folder / "partition.json")
            for name in ("partition.parquet", "partition.png"):
                self.writer.log_artifact(folder / name)
            self.writer.log_table(folder / "partition.json")
