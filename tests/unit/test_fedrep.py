"""FedRep (raysim.algorithms.fedrep) on the real host and coordinator in process: an empty head is FedAvg; a round
trains the head then the body, keeps the unselected clients' heads, and averages the selected clients' bodies;
only the body is sent; it stacks; its settings' errors."""

from __future__ import annotations

import numpy as np
import pytest

from raysim.algorithms import build_algorithm
from raysim.algorithms.fedrep import FedRepSettings
from raysim.algorithms.interface import payload_bytes
from raysim.algorithms.requests import LocalSGD
from raysim.config import validate_config
from raysim.errors import ConfigError
from raysim.execution.drivers import run_client_step
from raysim.models.flat import FlatModel
from tests.support.executors import assert_close_runs, run_executor
from tests.support.experiments import tiny_config
from tests.support.split_models import SGD, check_round, simulate


def test_an_empty_head_is_fedavg():
    """personal: [] leaves nothing personal: one request on the whole model from the broadcast, the uniform mean."""
    fedrep = simulate({"name": "fedrep", "personal": []})
    fedavg = simulate({"name": "fedavg", "aggregation": "uniform"})
    np.testing.assert_allclose(fedrep.coordinator.global_model(), fedavg.coordinator.global_model(), atol=1e-6)
    assert np.linalg.norm(fedavg.coordinator.global_model() - fedavg.problem.init_params) > 1e-2


@pytest.mark.parametrize("aggregation", ["uniform", "samples"])
def test_a_round_keeps_unselected_heads_and_averages_the_selected_bodies(aggregation):
    sim, expected = check_round({"name": "fedrep", "head_epochs": 2, "aggregation": aggregation}, [0, 2, 3])
    algorithm = sim.host.algorithm
    weights = np.array([u.upload.weight for u in expected], np.float64)
    bodies = np.array([u.upload.weighted / u.upload.weight for u in expected])
    if aggregation == "samples":
        assert sorted(weights) == sorted(float(sim.host.info[c].num_train) for c in (0, 2, 3))
    else:
        assert (weights == 1).all()
    want = (weights[:, None] * bodies).sum(0) / weights.sum()
    np.testing.assert_allclose(sim.server.shared, want, atol=1e-6)
    global_model = sim.coordinator.global_model()
    np.testing.assert_array_equal(global_model[algorithm.personal], sim.problem.init_params[algorithm.personal])
    pm = algorithm.evaluated_model(sim.states[2], global_model)
    np.testing.assert_array_equal(pm[algorithm.personal], sim.states[2].personal)
    np.testing.assert_array_equal(pm[algorithm.shared], sim.server.shared)


def test_the_head_trains_with_the_body_frozen_then_the_body_with_the_new_head():
    sim = simulate({"name": "fedrep", "head_epochs": 3, "epochs": 2}, rounds=0)
    algorithm, host = sim.host.algorithm, sim.host
    requests: list[LocalSGD] = []
    execute = host.steps.client_executor(0, 0)
    state, broadcast = sim.states[0], sim.coordinator.broadcast()
    update = run_client_step(algorithm, host.info[0], state, broadcast, lambda r: requests.append(r) or execute(r))
    head, body = requests
    assert (head.epochs, body.epochs) == (3, 2)
    np.testing.assert_array_equal(head.mask, algorithm.personal)
    np.testing.assert_array_equal(body.mask, algorithm.shared)
    assert algorithm.personal.sum() == 64 * 4 + 4  # the mlp's last layer is the head (4 classes here)
    np.testing.assert_array_equal(head.start[algorithm.shared], broadcast)
    np.testing.assert_array_equal(head.start[algorithm.personal], state.personal)
    np.testing.assert_array_equal(body.start[algorithm.shared], broadcast)  # the body was frozen in the head phase
    np.testing.assert_array_equal(body.start[algorithm.personal], update.state.personal)  # and the head is now
    assert not np.array_equal(update.state.personal, state.personal)
    assert not np.allclose(update.upload.weighted / update.upload.weight, broadcast)
    assert "head_train_loss" in update.metrics


def test_only_the_body_is_sent():
    spec = FlatModel("mlp", (1, 28, 28), 10).spec
    algorithm = build_algorithm(FedRepSettings(name="fedrep"), spec)
    assert int(algorithm.shared.sum()) == spec.size - (64 * 10 + 10)
    sim = simulate({"name": "fedrep", "head_epochs": 1}, rounds=0)
    fedrep = sim.host.algorithm
    body = int(fedrep.shared.sum())
    update = run_client_step(
        fedrep, sim.host.info[1], sim.states[1], sim.coordinator.broadcast(), sim.host.steps.client_executor(1, 0)
    )
    assert fedrep.uplink_bytes(update.upload) == 4 * (body + 1) == payload_bytes(update.upload)
    assert fedrep.downlink_bytes(sim.coordinator.broadcast()) == 4 * body


def test_joint_phases_train_the_whole_model_once():
    sim = simulate({"name": "fedrep", "phases": "joint", "epochs": 2}, rounds=0)
    requests: list[LocalSGD] = []
    execute = sim.host.steps.client_executor(0, 0)
    run_client_step(
        sim.host.algorithm,
        sim.host.info[0],
        sim.states[0],
        sim.coordinator.broadcast(),
        lambda r: requests.append(r) or execute(r),
    )
    assert len(requests) == 1 and requests[0].mask is None and requests[0].epochs == 2


def test_vectorized_runs_match_sequential_runs():
    algorithm = {"name": "fedrep", "head_epochs": 2, **SGD}
    sections = {"model": {"name": "mlp"}, "clients": {"count": 5, "per_round": 3}}
    sequential = run_executor(algorithm, "sequential", **sections)
    assert_close_runs(sequential, run_executor(algorithm, "vectorized", **sections))


def test_settings_errors_name_the_field():
    spec = FlatModel("mlp", (1, 28, 28), 10).spec
    with pytest.raises(ConfigError, match=r"algorithm.personal=\['\*'\] makes the whole model the personal head"):
        build_algorithm(FedRepSettings(name="fedrep", personal=("*",)), spec)
    one_layer = FlatModel("mlr", (1, 28, 28), 10).spec
    with pytest.raises(ConfigError, match="algorithm.preset='last_layer' makes the whole model the personal head"):
        build_algorithm(FedRepSettings(name="fedrep"), one_layer)
    with pytest.raises(ConfigError, match="algorithm.preset='input' is not defined for model 'mlp'"):
        build_algorithm(FedRepSettings(name="fedrep", preset="input"), spec)
    with pytest.raises(ConfigError, match="algorithm.head_epochs"):
        validate_config(tiny_config(algorithm={"name": "fedrep", "head_epochs": -1}))
    with pytest.raises(ConfigError, match="algorithm.phases"):
        validate_config(tiny_config(algorithm={"name": "fedrep", "phases": "body_first"}))
