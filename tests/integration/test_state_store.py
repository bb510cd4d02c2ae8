"""Client state spilled to disk beyond a memory budget (runtime.state_memory_mb): states come back bit for
bit, the least recently used spill first, files are complete or absent and removed at the end, and runs and
checkpoints with nearly every state on disk equal the in-memory ones."""

from __future__ import annotations

from typing import Any

from raysim.config import validate_config
from raysim.runtime.driver import run_experiment
from tests.support.experiments import tiny_config


def test_a_ray_run_with_a_tiny_budget_equals_the_in_memory_run(ray_local, mlflow_uri, tmp_path):
    """Through the driver: the same summary and final evaluations, spilled-state counts logged, and the
    hosts' spill folders removed at the end."""
    from mlflow.tracking import MlflowClient

    def config(**runtime: Any):
        data = tiny_config(clients={"count": 6, "per_round": 4}, tracking={"uri": mlflow_uri})
        data["runtime"] = {**data["runtime"], "host_cpus": 0.5, "state_store": "hosts", **runtime}
        return validate_config(data)

    baseline = run_experiment(config(), show_progress=False)
    spill = tmp_path / "spill"
    result = run_experiment(config(state_memory_mb=0.0001, spill_dir=str(spill)), show_progress=False)
    assert result.summary == baseline.summary
    assert repr(result.final) == repr(baseline.final)
    assert result.history[3]["state/spilled_clients"] == 6 and "state/spilled_clients" not in baseline.history[3]
    metrics = MlflowClient(mlflow_uri).get_run(result.run_id).data.metrics
    assert metrics["state/spilled_clients"] == 6 and metrics["state/disk_bytes"] > 0
    assert list(spill.iterdir()) == []
