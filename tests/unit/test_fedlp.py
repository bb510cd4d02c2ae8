"""FedLP (raysim.algorithms.fedlp; augfl.md 4.4, 7.1 item 9): its initial global model is the pretrained model
(PM) bit for bit, and after that it is FedAvg started from the PM, round for round."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from raysim.config import validate_config
from raysim.errors import ConfigError
from raysim.runtime.problem import prepare
from tests.support.experiments import tiny_config
from tests.support.inprocess import InProcess
from tests.support.weights import weights_file

META = {"scheme": "meta", "shots": 20, "reserved": 300, "server_samples": 64}
SGD = {"lr": 0.1, "batch_size": 16, "epochs": 2}


def _config(name: str, **algorithm):
    settings = {"name": name, **SGD, **algorithm}
    return validate_config(tiny_config(algorithm=settings, partition=META, clients={"count": 5, "per_round": 3}))


def test_the_initial_global_model_is_the_pretrained_model_and_then_it_is_fedavg(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYSIM_CACHE", str(tmp_path))
    fedlp = InProcess(_config("fedlp", teacher_epochs=2))
    pm = fedlp.problem.server_data
    assert list(tmp_path.glob("teacher/*-mlr-*.npz"))  # the clients' architecture, pretrained and cached
    assert fedlp.coordinator.broadcast().tobytes() == pm.tobytes()
    assert not np.array_equal(pm, fedlp.problem.init_params)
    # FedAvg from the same PM: the same clients, data and draws, round for round
    plain = prepare(_config("fedavg"))
    fedavg = InProcess(_config("fedavg"), dataclasses.replace(plain, init_params=pm.copy()))
    for round_index in range(3):
        metrics = fedlp.round(round_index)
        reference = fedavg.round(round_index)
        assert metrics["global_change"] > 0
        np.testing.assert_array_equal(fedlp.coordinator.broadcast(), fedavg.coordinator.broadcast())
        assert metrics["global_change"] == reference["global_change"]


def test_a_given_pm_file_is_used_as_it_is_and_must_fit_the_clients_model(tmp_path):
    config = _config("fedavg")
    size = prepare(config).init_params.size
    path = weights_file(tmp_path / "pm.npz", config, np.linspace(-1, 1, size, dtype=np.float32))
    sim = InProcess(_config("fedlp", teacher_weights=str(path)))
    assert sim.coordinator.broadcast().tobytes() == np.linspace(-1, 1, size, dtype=np.float32).tobytes()
    other = validate_config(tiny_config(algorithm={"name": "fedavg"}, partition=META, model={"name": "mlp"}))
    mlp = weights_file(tmp_path / "mlp.npz", other, np.zeros(prepare(other).init_params.size))
    with pytest.raises(ConfigError, match=rf"^algorithm\.teacher_weights: {mlp}.* model mlp, not mlr"):
        prepare(_config("fedlp", teacher_weights=str(mlp)))


def test_settings_refuse_a_shared_only_run():
    with pytest.raises(ConfigError, match="shared_only"):
        _config("fedlp", shared_only=True, preset="output")
