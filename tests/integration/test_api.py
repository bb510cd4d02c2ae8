"""The Python API (raysim.run, raysim.run_suite): real runs (their hosts in process), read back from a sqlite MLflow
store. The result's tables are what MLflow logged, its final models score on the clients' test splits what the run
logged, and every way of giving a config gives the same one; bad input is the command line's one line."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
import yaml
from mlflow.tracking import MlflowClient

import raysim
from raysim.api import experiment_config
from tests.support.experiments import IN_PROCESS, tiny_config
from tests.support.stores import fresh_store

pytestmark = pytest.mark.xdist_group("integration-api")
"""One worker runs this module's tests: its FLAME run is made once."""

BEST_KEYS = {"pm/best_acc", "gm/best_acc", "hm/best_acc"}
"""Logged once, beside the curves, at the last step (their values are in Result.summary as best/...)."""


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    return fresh_store(tmp_path_factory.mktemp("api") / "mlflow.db")


@pytest.fixture(scope="module")
def flame(store) -> raysim.Result:
    """FLAME on 4 synthetic clients, one a label-poisoning attacker, given as a dict with overrides."""
    tree = tiny_config(attack={"kind": "label_poisoning", "fraction": 0.25}, rounds=3, runtime=IN_PROCESS)
    return raysim.run(tree, "rounds=2", "algorithm.rho=0.5", progress=False, tracking_uri=store)


def _accuracy(network: torch.nn.Module, inputs: torch.Tensor, labels: torch.Tensor) -> float:
    with torch.no_grad():
        return (network(inputs).argmax(dim=1) == labels).double().mean().item()


@pytest.mark.slow
def test_the_history_is_what_mlflow_logged(flame, store):
    client = MlflowClient(store)
    run = client.get_run(flame.run_id)
    assert run.info.status == "FINISHED" and flame.tracking_uri == store
    assert repr(flame).startswith(f"Result(run {flame.run_id}: flame on synthetic_classification, 2 rounds, 4 clients;")
    assert list(flame.history.index) == [0, 1, 2] and flame.history.index.name == "round"
    logged = {key for key in run.data.metrics if not key.startswith("system/")}
    assert logged == set(flame.history.columns) | BEST_KEYS
    for key in flame.history.columns:
        column = flame.history[key].dropna()
        assert {m.step: m.value for m in client.get_metric_history(flame.run_id, key)} == column.to_dict(), key
    assert flame.history.loc[0, "pm/acc"] == pytest.approx(flame.history.loc[0, "gm/acc"])  # both the initial model
    assert np.isnan(flame.history.loc[0, "time/round"]) and flame.history.loc[2, "time/round"] > 0
    assert flame.summary["final/gm/acc"] == flame.history.loc[2, "gm/acc"]
    assert flame.summary["best/pm/acc"] == run.data.metrics["pm/best_acc"] == flame.history["pm/acc"].max()


@pytest.mark.slow
def test_the_clients_table_is_the_logged_artifact(flame, store, tmp_path):
    artifact = MlflowClient(store).download_artifacts(flame.run_id, "clients.parquet", str(tmp_path))
    logged = pd.read_parquet(artifact).set_index("client_id")
    assert list(flame.clients.index) == [0, 1, 2, 3]
    pd.testing.assert_frame_equal(flame.clients, logged[flame.clients.columns], check_dtype=False)
    assert set(logged.columns) == set(flame.clients.columns)
    assert flame.clients["malicious"].sum() == 1 and not flame.clients["heldout"].any()
    assert (flame.clients["num_test"] == [len(s.test) for s in flame.splits]).all()


@pytest.mark.slow
def test_the_final_models_score_what_the_run_logged(flame):
    """The global and personalized models, rebuilt as the config's network and scored on each benign client's test
    split, give the logged final gm/acc and pm/acc (means over clients), and each client's row of the table."""
    benign = [c for c in flame.clients.index if not flame.clients.loc[c, "malicious"]]
    assert len(benign) == 3 and sorted(flame.personalized_models) == [0, 1, 2, 3]
    network = flame.model()
    assert set(flame.global_model) == {name for name, _ in network.named_parameters()}
    gm, pm = [], []
    for client_id in benign:
        x, y = flame.test_data(client_id)
        gm.append(_accuracy(network, x, y))
        pm.append(_accuracy(flame.model(client_id), x, y))
        assert gm[-1] == pytest.approx(flame.clients.loc[client_id, "gm_test_acc"], abs=1e-12)
        assert pm[-1] == pytest.approx(flame.clients.loc[client_id, "pm_test_acc"], abs=1e-12)
    assert np.mean(gm) == pytest.approx(flame.summary["final/gm/acc"], abs=1e-12)
    assert np.mean(pm) == pytest.approx(flame.summary["final/pm/acc"], abs=1e-12)
    assert not all(torch.equal(flame.personalized_models[0][k], v) for k, v in flame.global_model.items())
    x, y = flame.test_data()
    assert len(y) == flame.clients["num_test"].sum() and x.dtype == torch.float32


@pytest.mark.slow
def test_an_experiment_config_runs_and_fedavg_has_no_personalized_models(store):
    config = experiment_config(
        tiny_config(algorithm={"name": "fedavg", "lr": 0.05, "batch_size": 32}, rounds=1, runtime=IN_PROCESS)
    )
    result = raysim.run(config, "clients.count=3", progress=False, tracking_uri=store)
    assert result.config.clients.count == 3 and result.config.algorithm.name == "fedavg"
    assert result.personalized_models == {} and len(result.clients) == 3
    params = MlflowClient(store).get_run(result.run_id).data.params
    assert params["clients.count"] == "3" and params["algorithm.name"] == "fedavg"
    x, y = result.test_data()
    assert _accuracy(result.model(), x, y) >= 0.0
    with pytest.raises(KeyError, match="client 0 has no personalized model"):
        result.model(0)


@pytest.mark.slow
def test_a_personalized_model_that_is_not_the_network_scores_what_the_run_logged(store):
    """FedCP's PM is its gated heads around the network (Algorithm.personalized_network): `model(i)` builds that
    module from `personalized_models[i]`, and it scores each client's logged pm/acc; `model()` is the plain GM."""
    tree = tiny_config(algorithm={"name": "fedcp", "lr": 0.1, "batch_size": 16}, model={"name": "mlp"}, rounds=1)
    result = raysim.run(
        tree, "clients.count=3", "runtime.num_hosts=1", "runtime.actors=in_process", progress=False, tracking_uri=store
    )
    assert result.personalized_network is not None and sorted(result.personalized_models) == [0, 1, 2]
    assert any(name.startswith("policy.") for name in result.personalized_models[0])
    for client_id in range(3):
        x, y = result.test_data(client_id)
        assert _accuracy(result.model(client_id), x, y) == pytest.approx(
            result.clients.loc[client_id, "pm_test_acc"], abs=1e-12
        )
        assert _accuracy(result.model(), x, y) == pytest.approx(result.clients.loc[client_id, "gm_test_acc"], abs=1e-12)


@pytest.mark.slow
def test_run_suite_returns_every_child_s_summary_and_history(store, tmp_path):
    suite = {
        "name": "api-suite",
        "base": tiny_config(rounds=1, clients={"count": 3}, runtime=IN_PROCESS),
        "runs": [{"name": "flame", "set": {}}, {"name": "fedavg", "set": {"algorithm": {"name": "fedavg"}}}],
    }
    path = tmp_path / "suite.yaml"
    path.write_text(yaml.safe_dump(suite))
    result = raysim.run_suite(path, "rounds=2", progress=False, tracking_uri=store)
    assert list(result.runs["run"]) == ["flame", "fedavg"] and (result.runs["status"] == "finished").all()
    assert result.failed.empty
    assert list(result.history.index.names) == ["run", "seed", "round"]
    client = MlflowClient(store)
    for row in result.runs.itertuples():
        child = client.get_run(row.run_id)
        assert child.data.tags["mlflow.parentRunId"] == result.parent_run_id
        logged = {m.step: m.value for m in client.get_metric_history(row.run_id, "pm/acc")}
        assert (
            result.history.loc[(row.run, 7), "pm/acc"].to_dict() == logged == {0: logged[0], 1: logged[1], 2: logged[2]}
        )
        assert result.runs.set_index("run").loc[row.run, "final/pm/acc"] == logged[2]


BROKEN = """
from typing import Literal

from raysim.algorithms import ALGORITHMS
from raysim.algorithms.fedavg import FedAvg, FedAvgSettings


class BrokenSettings(FedAvgSettings):
    name: Literal["broken_server"] = "broken_server"


@ALGORITHMS.register()
class BrokenServer(FedAvg):
    name = "broken_server"
    Settings = BrokenSettings

    def server_step(self, server, total, num_selected):
        raise ZeroDivisionError("the server's step divided by zero")
"""


def test_a_run_that_fails_while_it_runs_is_one_short_exception_naming_its_run_and_full_report(store, tmp_path):
    """A plugin's bug in round 1: raysim.run raises RunFailed, one line naming the run (marked FAILED), what failed
    and where, and the file that holds the whole traceback; nothing of the chain is printed with it."""
    plugin = tmp_path / "broken.py"
    plugin.write_text(BROKEN)
    tree = tiny_config(algorithm={"name": "broken_server", "lr": 0.05}, rounds=2, runtime=IN_PROCESS)
    with pytest.raises(raysim.RunFailed) as caught:
        raysim.run(tree, plugins=[str(plugin)], progress=False, tracking_uri=store)
    failure = caught.value
    message = str(failure)
    line = BROKEN.splitlines().index('        raise ZeroDivisionError("the server\'s step divided by zero")') + 1
    assert "\n" not in message and len(message) < 400, message
    assert message.startswith(f"run {failure.run_id} failed: ZeroDivisionError: the server's step divided by zero")
    assert f"(in broken.py:{line} in server_step); full report: {failure.log}" in message
    assert failure.__cause__ is None and failure.__suppress_context__  # `raise ... from None`: no chain printed
    assert isinstance(failure.cause, ZeroDivisionError)
    report = failure.log.read_text()
    assert report.startswith("Traceback") and f'broken.py", line {line}, in server_step' in report
    run = MlflowClient(store).get_run(failure.run_id)
    assert run.info.status == "FAILED" and run.data.tags["raysim.error"] == "the server's step divided by zero"
