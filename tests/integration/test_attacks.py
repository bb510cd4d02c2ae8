"""Attacks (flame.md 4.2): the forged messages, who attacks, and that exactly the attackers' messages change."""

from __future__ import annotations

import numpy as np
import pytest

from raysim.config import validate_config
from raysim.runtime.problem import prepare
from tests.support.experiments import IN_PROCESS, tiny_config


@pytest.mark.slow
def test_run_logs_attackers_partition_summary_and_benign_metrics(mlflow_uri):
    import mlflow
    import pyarrow.parquet as pq

    from raysim.runtime.driver import run_experiment

    config = validate_config(
        tiny_config(
            clients={"count": 6},
            attack={"kind": "label_poisoning", "fraction": 0.5},
            aggregation={"rule": "multi_krum"},
            tracking={"uri": mlflow_uri, "experiment": "attacks", "figures": ["png"]},
            runtime=IN_PROCESS,
        )
    )
    result = run_experiment(config, show_progress=False)
    assert len(result.malicious) == 3
    client = mlflow.tracking.MlflowClient(mlflow_uri)
    run = client.get_run(result.run_id)
    assert run.data.tags["malicious_clients"] == ",".join(map(str, result.malicious))
    benign = [e.pm.test_acc for e in result.final if e.client_id not in result.malicious]
    assert result.summary["final/pm/acc"] == pytest.approx(np.mean(benign))
    assert {"partition.parquet", "partition.png"} <= {a.path for a in client.list_artifacts(result.run_id)}
    table = pq.read_table(client.download_artifacts(result.run_id, "partition.parquet")).to_pylist()
    problem = prepare(config)
    assert sum(r["train"] + r["test"] + r["val"] for r in table) == sum(s.num_samples for _, s in problem.clients)
    assert {r["client_id"] for r in table if r["malicious"]} == set(result.malicious)
