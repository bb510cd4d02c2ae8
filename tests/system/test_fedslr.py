"""FedSLR's mathematics (fedslr.md 2-3): the proximal operators, the FedDyn special case, the dual invariant
(eq. 25), the stationary point of (P1) on a convex problem, the factored downlink, and a CLI run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tests.support.cli import HOSTS_IN_PROCESS, run_cli
from tests.support.experiments import tiny_config


@pytest.mark.slow
def test_fedslr_runs_through_the_cli_and_logs_rank_sparsity_and_traffic(tmp_path, mlflow_uri):
    """A real CLI + MLflow run (hosts in process): per-layer ranks, p_i sparsity, factored downlink below FedAvg's
    dense one, and the simulated communication time of a shared 1 Mbit/s link with 5 ms latency each way
    (config.network)."""
    settings = {"name": "fedslr", "lambda": 0.05, "eta_g": 10.0, "mu": 0.01, "lr": 0.05, "batch_size": 32}
    config = tiny_config(algorithm=settings, tracking={"uri": mlflow_uri, "experiment": "fedslr"}, rounds=3)
    config["network"] = {"bandwidth_mbps": 1.0, "latency_ms": 5.0}
    run = run_cli(tmp_path, config, *HOSTS_IN_PROCESS)
    metrics = run.data.metrics
    moved = metrics["traffic/downlink_bytes"] + metrics["traffic/uplink_bytes"]
    assert metrics["traffic/round_seconds"] == pytest.approx(2 * 0.005 + 8 * moved / 1e6)
    assert run.data.tags["algorithm"] == "fedslr"
    assert 0 <= metrics["server/rank/1.weight"] < 4  # mlr 20 -> 4 classes: full rank would be 4
    assert 0 < metrics["update/p_density"] < 1 and metrics["server/svd_seconds"] > 0
    assert metrics["traffic/downlink_bytes"] < metrics["traffic/uplink_bytes"]  # factored GKR vs dense w_i
    assert 0 <= metrics["pm/acc"] <= 1 and 0 <= metrics["gm/acc"] <= 1 and 0 <= metrics["personal/acc"] <= 1
    assert metrics["update/mixed_params"] > metrics["update/p_nonzeros"]  # + the received GKR's count
    assert metrics["update/p_nonzeros_std"] >= 0
    assert 0 <= metrics["update/p_sparsity/1.weight"] <= 1 and metrics["server/nuclear_norm"] > 0
    client = MlflowClient(mlflow_uri)  # the final GKR's spectra as a table: the 4 singular values of the 4 x 20 layer
    spectra = json.loads(Path(client.download_artifacts(run.info.run_id, "spectra.json", str(tmp_path))).read_text())
    assert spectra["columns"] == ["layer", "index", "singular_value"] and len(spectra["data"]) == 4
    logged_tables = json.loads(run.data.tags["mlflow.loggedArtifacts"])
    assert {"path": "spectra.json", "type": "table"} in logged_tables
