"""FedSLR's figure material from two tiny real runs in one MLflow store (in process): Fig. 3's per-client gains over
FedAvg (raysim figure --gain-over) and Table 9's latency measured on the trained GKR loaded from the run."""

from __future__ import annotations

import numpy as np
import pytest

import raysim
from raysim.cli import main
from raysim.studies.gains import client_gains, read_client_table
from raysim.studies.latency import gkr_latency, load_trained_gkr, parameter_count
from tests.support.experiments import tiny_config

RUNTIME = {"actors": "in_process", "num_hosts": 1}
FEDSLR = {
    "name": "fedslr",
    "lambda": 0.02,
    "eta_g": 10.0,
    "mu": 1e-3,
    "lr": 0.05,
    "batch_size": 32,
    "phase_timing": True,
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from tests.support.stores import fresh_store

    uri = fresh_store(tmp_path_factory.mktemp("fedslr-figures") / "mlflow.db")
    common = {"model": {"name": "mlp"}, "clients": {"count": 6}, "runtime": RUNTIME, "rounds": 3}
    tracking = {"experiment": "fedslr-figures", "figures": [], "save_models": "global"}
    fedslr = raysim.run(tiny_config(algorithm=FEDSLR, tracking=tracking, **common), progress=False, tracking_uri=uri)
    fedavg_algorithm = {"name": "fedavg", "lr": 0.05, "batch_size": 32}
    fedavg = raysim.run(
        tiny_config(algorithm=fedavg_algorithm, tracking=tracking, **common), progress=False, tracking_uri=uri
    )
    return uri, fedslr, fedavg


def test_the_violins_hold_each_clients_gain_over_fedavg(runs, tmp_path):
    from mlflow.tracking import MlflowClient

    uri, fedslr, fedavg = runs
    client = MlflowClient(uri)
    gains = client_gains({"fedslr": read_client_table(client, fedslr.run_id)}, read_client_table(client, fedavg.run_id))
    (pm,) = gains
    expected = fedslr.clients["pm_test_acc"] - fedavg.clients["gm_test_acc"]
    np.testing.assert_allclose(pm.gains, expected.loc[pm.client_ids].to_numpy())
    assert len(pm.gains) == 6
    assert (
        main(["figure", fedslr.run_id, "--gain-over", fedavg.run_id, "--tracking-uri", uri, "--out", str(tmp_path)])
        == 0
    )
    assert all((tmp_path / f"gains.{kind}").stat().st_size > 0 for kind in ("png", "pdf", "svg"))


def test_phase_timings_are_logged_per_round(runs):
    _, fedslr, _ = runs
    history = fedslr.history.loc[1:]
    assert (history["update/phase1_seconds"] > 0).all() and (history["update/phase2_seconds"] > 0).all()


def test_table_9_latency_is_measured_on_the_trained_gkr_loaded_from_the_run(runs):
    uri, fedslr, _ = runs
    gkr = load_trained_gkr(uri, fedslr.run_id)
    final = fedslr.history.iloc[-1]
    assert gkr.ranks == {
        key.removeprefix("server/rank/"): int(final[key]) for key in fedslr.history if key.startswith("server/rank/")
    }
    assert min(gkr.ranks.values()) < 64  # lambda = 0.02 cut the trained GKR's ranks
    np.testing.assert_array_equal(gkr.params, np.concatenate([t.numpy().ravel() for t in fedslr.global_model.values()]))
    assert parameter_count(gkr.spec, gkr.ranks) == gkr.global_params == final["server/global_params"]
    latency = gkr_latency(gkr, fedslr.model_spec.input_shape, batch=20, repeats=3)
    assert latency.params == gkr.global_params and latency.factored_layers >= 1
    assert latency.max_diff < 1e-4 and latency.dense_ms > 0 and latency.factorized_ms > 0
