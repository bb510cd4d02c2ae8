"""AugFL's mathematics (augfl.md 1.6-1.8) on the real host/coordinator code: the finite-difference Hessian-vector
product, the dual identity y_i = -w_i d_i, the closed-form global recursion, the stationary point regularized by
the teacher, the teacher's settings and their old `pm_*` names, and a CLI run."""

from __future__ import annotations

import pytest
import yaml

from tests.support.augfl import META
from tests.support.cli import HOSTS_IN_PROCESS, raysim, run_cli
from tests.support.experiments import tiny_config


@pytest.mark.slow
def test_augfl_runs_through_the_cli_and_logs_its_metrics(tmp_path, mlflow_uri):
    settings = {"name": "augfl", "alpha": 0.1, "rho": 0.7, "lambda": 0.0}
    partition = {"scheme": "dirichlet", "beta": 0.5, "val_fraction": 0.5}
    config = tiny_config(
        algorithm=settings, partition=partition, tracking={"uri": mlflow_uri, "experiment": "augfl"}, rounds=3
    )
    run = run_cli(tmp_path, config, *HOSTS_IN_PROCESS)
    metrics = run.data.metrics
    assert run.data.tags["algorithm"] == "augfl"
    assert metrics["update/query_loss"] > 0 and metrics["server/effective_step"] == pytest.approx(1 / (4 * 0.7))
    assert metrics["traffic/uplink_bytes"] == pytest.approx(2 * metrics["traffic/downlink_bytes"])  # theta_i and y_i
    assert 0 <= metrics["pm/acc"] <= 1


def test_pretrain_subcommand_rejects_non_meta_partitions(tmp_path):
    (tmp_path / "dirichlet.yaml").write_text(yaml.safe_dump(tiny_config()))
    refused = raysim("pretrain", str(tmp_path / "dirichlet.yaml"), "--out", str(tmp_path / "t.npz"), cwd=tmp_path)
    assert refused.returncode == 2 and refused.stderr.startswith("error: partition.scheme")
    assert not list(tmp_path.glob("*.npz"))


@pytest.mark.slow
def test_augfl_with_crd_and_heldout_clients_runs_through_the_cli(tmp_path, mlflow_uri, monkeypatch):
    monkeypatch.setenv("RAYSIM_CACHE", str(tmp_path))
    settings = {"name": "augfl", "alpha": 0.1, "regularizer": "crd", "transfer": {"negatives": 64}}
    config = tiny_config(
        algorithm=settings,
        partition={**META, "val_fraction": 0.0},
        clients={"count": 10, "heldout": 0.2},
        model={"name": "mlp"},  # hidden features for CRD (mlr's are its inputs)
        tracking={"uri": mlflow_uri, "experiment": "augfl"},
        rounds=3,
    )
    run = run_cli(tmp_path, config, *HOSTS_IN_PROCESS)
    metrics = run.data.metrics
    assert metrics["server/transfer_loss"] > 0 and metrics["server/regularizer_gradient_norm"] > 0
    assert 0 <= metrics["heldout/pm/acc"] <= 1
    assert metrics["round/selected_clients"] == 8  # full participation of the training clients only
