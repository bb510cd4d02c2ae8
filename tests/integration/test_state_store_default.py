"""The default client-state store (runtime.state_store: auto, issue 49.1) on a run with held-out clients: the store
has a row for every client, held-out ones (ids m and past, evaluated but never trained) too, and the run equals the
hosts that own their clients' state, bit for bit; the run's tag names the store auto chose."""

from __future__ import annotations

from typing import Any

from mlflow.tracking import MlflowClient

from raysim.config import validate_config
from raysim.runtime.driver import STATE_STORE_TAG, run_experiment
from tests.support.experiments import tiny_config


def _run(mlflow_uri: str, **runtime: Any):
    config = tiny_config(
        clients={"count": 6, "heldout": 0.34},
        rounds=2,
        runtime={"actors": "in_process", "num_hosts": 2, **runtime},
        tracking={"uri": mlflow_uri, "experiment": "default-store"},
    )
    return run_experiment(validate_config(config), show_progress=False)


def test_held_out_clients_on_the_default_store_equal_the_hosts_own_state(mlflow_uri):
    owned = _run(mlflow_uri, state_store="hosts")
    default = _run(mlflow_uri)
    assert default.summary == owned.summary
    assert repr(default.final) == repr(owned.final)
    client = MlflowClient(mlflow_uri)
    assert client.get_run(default.run_id).data.tags[STATE_STORE_TAG] == "memory"
    assert client.get_run(owned.run_id).data.tags[STATE_STORE_TAG] == "hosts"
    assert client.get_run(default.run_id).data.params["runtime.state_store"] == "auto"
