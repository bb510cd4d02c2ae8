"""The final models a finished run saves (tracking.save_models): real runs (their hosts in process), read back from
a sqlite MLflow store as a reader would, without raysim: the global model through mlflow.pytorch.load_model, the
clients' models from client_models.npz. One run saves everything and is checked bit for bit and by the scores it
logged; three more show what `global` and `none` leave out and what a client without a PM is stored with."""

from __future__ import annotations

import mlflow
import mlflow.pytorch
import numpy as np
import pandas as pd
import pytest
import torch
from mlflow.tracking import MlflowClient

import raysim
from raysim.tracking.models import global_module
from tests.support.experiments import IN_PROCESS, tiny_config


def _accuracy(network: torch.nn.Module, inputs: torch.Tensor, labels: torch.Tensor) -> float:
    with torch.no_grad():
        return (network(inputs).argmax(dim=1) == labels).double().mean().item()


def _run(store: str, save_models: str, max_mb: float = 1024.0, **sections) -> raysim.Result:
    tracking = {
        "experiment": "saved",
        "system_metrics": False,
        "save_models": save_models,
        "client_models_max_mb": max_mb,
    }
    config = tiny_config(tracking=tracking, rounds=2, **{"runtime": IN_PROCESS, **sections})
    return raysim.run(config, progress=False, tracking_uri=store)


def _artifacts(store: str, run_id: str) -> set[str]:
    """The run's artifacts and the names of its READY logged models (the global model is one)."""
    client = MlflowClient(store)
    models = client.search_logged_models([client.get_run(run_id).info.experiment_id])
    ready = {model.name for model in models if model.source_run_id == run_id and model.status == "READY"}
    return {artifact.path for artifact in client.list_artifacts(run_id)} | ready


def test_a_run_saves_its_final_models_for_a_reader(mlflow_uri, monkeypatch):
    """`all` (FLAME, whose clients have PMs): `global_model` opens with load_model and holds the final global model
    bit for bit, client_models.npz holds each client's final PM bit for bit in client-id order, and both score each
    client's test split as clients.parquet says. FedAvg's clients are stored with the global model they are scored
    with; `global` saves no npz, nor does `all` over tracking.client_models_max_mb; `none` saves neither."""
    # load_model("runs:/...") reads MLflow's current tracking URI: this test's store, restored afterwards
    monkeypatch.setattr(mlflow.tracking._tracking_service.utils, "_tracking_uri", mlflow_uri)
    result = _run(mlflow_uri, "all")
    assert {"global_model", "client_models.npz", "clients.parquet"} <= _artifacts(mlflow_uri, result.run_id)

    client = MlflowClient(mlflow_uri)
    run = client.get_run(result.run_id)
    (model,) = client.search_logged_models([run.info.experiment_id], filter_string="name = 'global_model'")
    assert model.source_run_id == result.run_id and model.status == "READY"  # the Models column's LoggedModel
    assert [output.model_id for output in run.outputs.model_outputs] == [model.model_id]
    assert model.params == run.data.params
    final = result.history.index.max()  # the run's last round: its metrics are the model's
    logged = result.history.loc[final].dropna().to_dict()
    assert {m.key: (m.step, m.value) for m in model.metrics} == {key: (final, value) for key, value in logged.items()}
    for key in logged:  # MLflow writes a model's metrics to its run too: the run's history keeps one point a step
        steps = [point.step for point in client.get_metric_history(result.run_id, key)]
        assert len(steps) == len(set(steps)), (key, steps)
    assert "global_model" not in {artifact.path for artifact in client.list_artifacts(result.run_id)}  # the model's
    assert {"MLmodel", "data"} <= {artifact.path for artifact in client.list_logged_model_artifacts(model.model_id)}
    table = client.load_table(
        run.info.experiment_id, "clients.json", run_ids=[result.run_id]
    )  # mlflow.log_table's per-client table
    expected = pd.read_parquet(
        mlflow.artifacts.download_artifacts(run_id=result.run_id, artifact_path="clients.parquet")
    )
    pd.testing.assert_frame_equal(table, expected, check_dtype=False)

    network = mlflow.pytorch.load_model(f"runs:/{result.run_id}/global_model")
    assert network is not None and mlflow.pytorch.load_model(f"models:/{model.model_id}") is not None
    loaded = dict(network.named_parameters())
    assert loaded.keys() == result.global_model.keys()
    assert all(torch.equal(loaded[name].detach(), tensor) for name, tensor in result.global_model.items())

    path = mlflow.artifacts.download_artifacts(run_id=result.run_id, artifact_path="client_models.npz")
    with np.load(path) as saved:
        client_ids, params = saved["client_id"], saved["params"]
    assert client_ids.dtype == np.int64 and params.dtype == np.float32
    assert client_ids.tolist() == list(range(result.config.clients.count))
    for client_id, row in zip(client_ids.tolist(), params, strict=True):
        personal = result.personalized_models[client_id]
        assert np.array_equal(row, torch.cat([t.reshape(-1) for t in personal.values()]).numpy())

    clients = pd.read_parquet(
        mlflow.artifacts.download_artifacts(run_id=result.run_id, artifact_path="clients.parquet")
    )
    clients = clients.set_index("client_id")
    for client_id, row in zip(client_ids.tolist(), params, strict=True):
        x, y = result.test_data(client_id)
        assert _accuracy(network, x, y) == pytest.approx(clients.loc[client_id, "gm_test_acc"], abs=1e-12)
        pm = global_module(result.model_spec, row)
        assert _accuracy(pm, x, y) == pytest.approx(clients.loc[client_id, "pm_test_acc"], abs=1e-12)

    fedavg = _run(mlflow_uri, "all", algorithm={"name": "fedavg", "lr": 0.05, "batch_size": 32})
    path = mlflow.artifacts.download_artifacts(run_id=fedavg.run_id, artifact_path="client_models.npz")
    with np.load(path) as saved:
        gm = torch.cat([t.reshape(-1) for t in fedavg.global_model.values()]).numpy()
        assert all(np.array_equal(row, gm) for row in saved["params"])

    only_global = _artifacts(mlflow_uri, _run(mlflow_uri, "global").run_id)
    assert "global_model" in only_global and "client_models.npz" not in only_global
    over_the_cap = _artifacts(mlflow_uri, _run(mlflow_uri, "all", max_mb=1e-6).run_id)  # a cap of 1 byte
    assert "global_model" in over_the_cap and "client_models.npz" not in over_the_cap
    assert not {"global_model", "client_models.npz"} & _artifacts(mlflow_uri, _run(mlflow_uri, "none").run_id)


def test_a_batchnorm_models_saved_global_model_holds_its_running_statistics(mlflow_uri, monkeypatch):
    """The running statistics are part of the final global model (FedAvg averages them with the parameters): the
    saved network holds them as its buffers, in eval mode, and scores each client's test split as the hosts did."""
    monkeypatch.setattr(mlflow.tracking._tracking_service.utils, "_tracking_uri", mlflow_uri)
    result = _run(
        mlflow_uri, "global", algorithm={"name": "fedavg", "lr": 0.05, "batch_size": 8}, model={"name": "mlp_bn"}
    )
    network = mlflow.pytorch.load_model(f"runs:/{result.run_id}/global_model")
    assert not network.training
    buffers = dict(network.named_buffers())
    statistics = [name for name in result.global_model if name.endswith(("running_mean", "running_var"))]
    assert statistics and all(torch.equal(buffers[name], result.global_model[name]) for name in statistics)
    assert not torch.equal(result.global_model[statistics[0]], torch.zeros_like(result.global_model[statistics[0]]))
    clients = pd.read_parquet(
        mlflow.artifacts.download_artifacts(run_id=result.run_id, artifact_path="clients.parquet")
    ).set_index("client_id")
    for client_id in range(result.config.clients.count):
        x, y = result.test_data(client_id)
        assert _accuracy(network, x, y) == pytest.approx(clients.loc[client_id, "gm_test_acc"], abs=1e-12)
