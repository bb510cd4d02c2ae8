"""KD only (augfl/kd_only.py; augfl.md 4.4, Fig. 7): clients send and receive nothing and their data never
reach the model; the server objective R_h decreases; its step is AugFL's server step (eq. 13) with clients that
never trained."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from raysim.algorithms.augfl.algorithm import AugFlUpload
from raysim.config import validate_config
from raysim.errors import ConfigError
from raysim.runtime.problem import prepare
from tests.support.experiments import tiny_config
from tests.support.inprocess import InProcess

META = {"scheme": "meta", "shots": 20, "reserved": 300, "server_samples": 128}
CRD = {"regularizer": "crd", "transfer": {"negatives": 32, "batch_size": 32}, "teacher_epochs": 1}


def _config(name: str = "kd_only", **algorithm):
    settings = {"name": name, "alpha": 0.1, "rho": 0.7, "lambda": 5.0, **algorithm}
    clients = {"count": 5, "heldout": 0.2}
    return validate_config(tiny_config(algorithm=settings, partition=META, clients=clients, model={"name": "mlp"}))


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYSIM_CACHE", str(tmp_path))  # the pretrained teacher's


def test_clients_send_nothing_and_their_data_never_change_the_model():
    config = _config(**CRD)
    sim = InProcess(config)
    problem = sim.problem
    generator = np.random.default_rng(0)
    other = InProcess(config, dataclasses.replace(problem, x=generator.permutation(problem.x), y=problem.y[::-1]))
    for round_index in range(3):
        partial, records = sim.host.train(round_index, [0, 1, 2, 3], sim.coordinator.broadcast())
        sim.coordinator.aggregate(partial)
        other.round(round_index, [0, 1, 2, 3])
        assert records.to_pydict()["uplink_bytes"] == [0.0] * 4
        assert sim.coordinator.global_model().tobytes() == other.coordinator.global_model().tobytes()
    algorithm = sim.coordinator.algorithm
    assert algorithm.downlink_bytes(sim.coordinator.broadcast()) == 0
    assert not np.array_equal(sim.coordinator.global_model(), problem.init_params)  # the server moved it


def test_the_server_objective_decreases():
    """l2: ||theta - theta_p||^2 shrinks by (1 - 2 lambda/(m rho))^2 per step; crd: the transfer loss falls."""
    sim = InProcess(_config(regularizer="l2", rho=5.0))
    teacher = sim.problem.server_data.pretrained
    distances = [np.linalg.norm(sim.coordinator.global_model() - teacher)]
    for round_index in range(4):
        sim.round(round_index, [0])
        distances.append(np.linalg.norm(sim.coordinator.global_model() - teacher))
    factor = 1 - 2 * 5.0 / (4 * 5.0)
    np.testing.assert_allclose(np.array(distances[1:]) / distances[:-1], abs(factor), rtol=1e-4)
    crd = InProcess(_config(**CRD))
    losses = [crd.round(r, [0])["transfer_loss"] for r in range(8)]
    assert losses[-1] < losses[0]


def test_the_step_is_augfl_server_step_with_clients_that_never_trained():
    """Eq. 13 with sum_i (y_i + rho theta_i) = m rho theta^t: AugFL's own server step, bit for bit (CRD state too)."""
    kd, augfl = InProcess(_config(**CRD)), InProcess(_config("augfl", **CRD))
    kd_server, augfl_server = kd.coordinator.state, augfl.coordinator.state
    assert kd_server.theta.tobytes() == augfl_server.theta.tobytes()
    m, rho = augfl_server.num_clients, 0.7
    agreed = dataclasses.replace(augfl_server, total=m * rho * augfl_server.theta.astype(np.float64))
    zero = np.zeros(augfl_server.theta.shape, np.float64)
    expected, expected_metrics = augfl.coordinator.algorithm.server_step(agreed, AugFlUpload(zero, zero), 4)
    new, metrics = kd.coordinator.algorithm.server_step(kd_server, kd.coordinator.algorithm.Upload(), 4)
    assert new.theta.tobytes() == expected.theta.tobytes() and metrics == expected_metrics
    assert new.transfer.heads.tobytes() == expected.transfer.heads.tobytes()
    step = expected.theta.astype(np.float64) - augfl_server.theta
    assert np.linalg.norm(step) > 0


def test_held_out_clients_adapt_as_in_augfl():
    kd, augfl = InProcess(_config(**CRD)), InProcess(_config("augfl", **CRD))
    theta = kd.coordinator.global_model()
    kd_scores = kd.host.evaluate(theta).to_pydict()
    augfl_scores = augfl.host.evaluate(theta).to_pydict()
    heldout = kd_scores["client_id"].index(4)
    keys = [key for key in kd_scores if key.startswith(("pm", "gm"))]
    assert "pm_test_acc" in keys
    np.testing.assert_array_equal([kd_scores[k][heldout] for k in keys], [augfl_scores[k][heldout] for k in keys])


def test_settings():
    with pytest.raises(ConfigError, match="lambda"):
        _config(**{"lambda": 0.0})
    with pytest.raises(ConfigError, match="regularizer"):
        _config(regularizer="none")
    assert prepare(_config(**CRD)).server_data.pretrained_model == "mlp"  # AugFL's teacher: the next larger model


def test_raysim_pretrain_prepares_augfl_teacher():
    """`raysim pretrain` on a KD-only config pretrains AugFL's teacher (mlr clients: an MLP), not the clients' model."""
    from raysim.algorithms.augfl.teacher import pretraining
    from raysim.runtime.problem import server_context

    config = validate_config(tiny_config(algorithm={"name": "kd_only", "teacher_epochs": 1}, partition=META))
    request = next(pretraining(config.algorithm, server_context(config, config.dataset.load(config.seed))))
    assert (request.model, request.epochs) == ("mlp", 1)
