"""Data sources and the foundation's partitions."""

from __future__ import annotations

import numpy as np
import pytest

from raysim.data import load_dataset
from tests.support.data_files import write_npz


@pytest.mark.slow
@pytest.mark.parametrize("source", ["synthetic_writers", "npz"])
def test_natural_split_runs_end_to_end(source, tmp_path, mlflow_uri):
    """A real run on the natural split: writers dealt to clients, trained by hosts in process, logged to sqlite
    MLflow."""
    import mlflow
    import pyarrow.parquet as pq

    from raysim.config import validate_config
    from raysim.runtime.driver import run_experiment
    from raysim.runtime.problem import prepare
    from tests.support.experiments import IN_PROCESS, tiny_config

    dataset_section = {"name": "synthetic_writers"}
    if source == "npz":  # the same writers, from a file
        writers = load_dataset("synthetic_writers", seed=7)
        keep = writers.groups < 120
        file = write_npz(tmp_path / "writers.npz", x=writers.x[keep], y=writers.y[keep], groups=writers.groups[keep])
        dataset_section = {"name": "npz", "path": file}
    config = validate_config(
        tiny_config(
            algorithm={"name": "fedavg", "lr": 0.1, "batch_size": 32},
            dataset=dataset_section,
            partition={"scheme": "natural"},
            clients={"count": 8, "per_round": 4},
            rounds=2,
            tracking={"uri": mlflow_uri, "experiment": "natural"},
            runtime=IN_PROCESS,
        )
    )
    problem = prepare(config)
    writers_per_client = (300 if source == "synthetic_writers" else 120) // 8
    for info, split in problem.clients:
        assert info.num_train == len(split.train) > 0
    result = run_experiment(config, show_progress=False)
    client = mlflow.tracking.MlflowClient(mlflow_uri)
    run = client.get_run(result.run_id)
    assert run.info.status == "FINISHED" and run.data.tags["partition"] == "natural"
    assert len(client.get_metric_history(result.run_id, "pm/acc")) == 3  # rounds 0, 1, 2
    assert result.summary["final/gm/acc"] > 0.3  # learnable: well above the 0.1 of chance
    table = pq.read_table(client.download_artifacts(result.run_id, "partition.parquet", str(tmp_path)))
    rows = table.to_pylist()
    assert sum(r["train"] + r["test"] + r["val"] for r in rows) == sum(s.num_samples for _, s in problem.clients)
    groups = load_dataset("synthetic_writers", seed=7).groups if source == "synthetic_writers" else None
    if groups is not None:
        for _, split in problem.clients:
            assert len(np.unique(groups[np.concatenate([split.train, split.test])])) == writers_per_client
