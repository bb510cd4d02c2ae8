"""What MLflow shows about a run before its metrics: its name, MLflow's standard tags, its description and
its dataset (the fields the MLflow UI fills in for runs logged with MLflow's own APIs)."""

from __future__ import annotations

import getpass
import hashlib
import shlex
import sys
import time

import numpy as np

from raysim.config import ExperimentConfig
from raysim.data.partitions import DirichletSettings, QLabelSettings

_DATASET_SHORT = {"fashion_mnist": "fmnist", "cifar10": "cifar10", "cifar100": "cifar100"}


def default_run_name(config: ExperimentConfig) -> str:
    """`flame-fmnist-q2-s1`: algorithm, dataset, partition (with its main setting) and seed."""
    dataset = _DATASET_SHORT.get(config.dataset.name, config.dataset.name.replace("_", ""))
    return f"{config.algorithm.name}-{dataset}-{partition_label(config)}-s{config.seed}"


def partition_label(config: ExperimentConfig) -> str:
    """The partition in a few characters: `iid`, `q2` (q_label), `dir0.5` (dirichlet), else the scheme."""
    partition = config.partition
    if partition.scheme == "q_label" and isinstance(partition, QLabelSettings):
        return f"q{partition.q}"
    if partition.scheme == "dirichlet" and isinstance(partition, DirichletSettings):
        return f"dir{partition.beta:g}"
    return partition.scheme


def command_line() -> str:
    """The command that started this process, as a shell would take it (`raysim run configs/x.yaml ...`)."""
    if not sys.argv:
        return "python"
    launcher = sys.argv[0].endswith(("raysim", "raysim/cli.py", "raysim/__main__.py"))
    return shlex.join(["raysim" if launcher else sys.argv[0], *sys.argv[1:]])


def description(config: ExperimentConfig, command: str) -> str:
    """The run's description (MLflow's `mlflow.note.content`, Markdown): what ran, and the command."""
    attack = "" if config.attack.kind == "none" else f", attack {config.attack.kind}"
    return (
        f"{config.algorithm.name} on {config.dataset.name}, partition {config.partition.scheme}, "
        f"{config.clients.count} clients, {config.rounds} rounds, seed {config.seed}{attack}.\n\n"
        f"Started with `{command}`; the resolved config is the `config.yaml` artifact."
    )


def source_tags(command: str | None = None) -> dict[str, str]:
    """MLflow's user and source tags: the source is `command` (default: this process's command line). Its type is
    JOB, the one type whose name MLflow's runs table shows whole: of a LOCAL source it shows the part after the
    last `/` (`ui.db` of `raysim run x.yaml --tracking-uri sqlite:///ui.db`)."""
    return {
        "mlflow.user": getpass.getuser(),
        "mlflow.source.type": "JOB",
        "mlflow.source.name": command or command_line(),
    }


def standard_tags(config: ExperimentConfig, commit: str, command: str | None = None) -> dict[str, str]:
    """MLflow's own tags: user, source (source_tags), git commit, description."""
    tags = source_tags(command)
    tags["mlflow.note.content"] = description(config, tags["mlflow.source.name"])
    if commit != "unknown":
        tags["mlflow.source.git.commit"] = commit
    return tags


def partition_digest(labels: np.ndarray, splits: list) -> str:
    """A short digest of the data each client holds (labels and every client's index lists): two runs with the
    same digest trained on the same partition."""
    digest = hashlib.sha256(np.ascontiguousarray(labels).tobytes())
    for split in splits:
        for part in (split.train, split.test, split.val):
            digest.update(np.asarray(part, np.int64).tobytes())
            digest.update(b"|")
    return digest.hexdigest()[:16]


def log_dataset(client, run_id: str, config: ExperimentConfig, labels: np.ndarray, splits: list) -> None:
    """The dataset as the run's MLflow input (the Datasets column of the runs table), named by dataset and
    partition, with the partition's digest."""
    from mlflow.entities import Dataset, DatasetInput, InputTag

    dataset = Dataset(
        name=f"{config.dataset.name}/{partition_label(config)}",
        digest=partition_digest(labels, splits),
        source_type="local",
        source=f'{{"dataset": "{config.dataset.name}", "partition": "{config.partition.scheme}", '
        f'"clients": {config.clients.count}, "seed": {config.seed}}}',
        profile=f'{{"samples": {len(labels)}, "clients": {len(splits)}}}',
    )
    inputs = [DatasetInput(dataset, [InputTag("mlflow.data.context", "training")])]
    for attempt in range(DATASET_TRIES):
        try:
            client.log_inputs(run_id, datasets=inputs)
            return
        except Exception:  # noqa: BLE001 - the race below, or the store's own error: raised at the last try
            if attempt == DATASET_TRIES - 1:
                raise
            time.sleep(0.2 * (attempt + 1))


DATASET_TRIES = 3
"""Tries of a run's dataset input: MLflow records a dataset once per experiment (its name and digest), looking for it
and inserting it in one transaction, so two runs of one experiment logging the same dataset at once (a sweep's
first trials) can both insert it; the second's transaction fails whole (IntegrityError, a trial FAILED in the
20-trial sweep test on a loaded machine), and its retry finds the dataset and links it."""
