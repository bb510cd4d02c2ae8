"""FedPer (raysim.algorithms.fedper) in process: it is FedRep's joint phase under another name (uniform weights:
the same models to float32 rounding); the personalization layers never leave the client; one joint phase from the
client's own top layers and the received base; a split that shares nothing is refused."""

from __future__ import annotations

import numpy as np
import pytest

from raysim.algorithms import build_algorithm
from raysim.algorithms.fedper import FedPerSettings
from raysim.algorithms.interface import payload_bytes
from raysim.errors import ConfigError
from raysim.execution.drivers import run_client_step
from raysim.models.flat import FlatModel
from tests.support.split_models import check_round, simulate


def test_fedper_is_fedreps_joint_phase():
    fedper = simulate({"name": "fedper", "aggregation": "uniform", "epochs": 2}, rounds=3)
    fedrep = simulate({"name": "fedrep", "phases": "joint", "epochs": 2}, rounds=3)
    np.testing.assert_allclose(fedper.coordinator.global_model(), fedrep.coordinator.global_model(), atol=1e-6)
    for client, state in fedper.states.items():
        np.testing.assert_allclose(state.personal, fedrep.states[client].personal, atol=1e-6)
    assert np.linalg.norm(fedper.coordinator.global_model() - fedper.problem.init_params) > 1e-2


def test_the_personalization_layers_never_leave_the_client():
    sim, expected = check_round({"name": "fedper"}, [0, 3])
    algorithm = sim.host.algorithm
    spec = algorithm.params
    assert {n for n in spec.names if algorithm.personal[spec.slice(n)].all()} == set(spec.head)  # the classifier
    shared = int(algorithm.shared.sum())
    for update in expected:
        assert update.upload.weighted.shape == (shared,)
        assert algorithm.uplink_bytes(update.upload) == payload_bytes(update.upload) == 4 * (shared + 1)
    assert algorithm.downlink_bytes(sim.coordinator.broadcast()) == 4 * shared
    weights = np.array([u.upload.weight for u in expected])
    assert set(weights) == {float(sim.host.info[c].num_train) for c in (0, 3)}  # n_i, the paper's FedAvg weights
    mean = sum(u.upload.weighted for u in expected) / weights.sum()
    np.testing.assert_allclose(sim.server.shared, mean, atol=1e-6)
    pm = algorithm.evaluated_model(sim.states[3], sim.coordinator.global_model())
    np.testing.assert_array_equal(pm[algorithm.personal], sim.states[3].personal)
    np.testing.assert_array_equal(pm[algorithm.shared], sim.server.shared)


def test_one_joint_phase_from_the_clients_top_layers_and_the_received_base():
    sim = simulate({"name": "fedper", "epochs": 3}, rounds=1)
    algorithm, host = sim.host.algorithm, sim.host
    requests = []
    execute = host.steps.client_executor(1, 1)
    state, broadcast = sim.states[1], sim.coordinator.broadcast()
    run_client_step(algorithm, host.info[1], state, broadcast, lambda r: requests.append(r) or execute(r))
    (request,) = requests
    assert request.mask is None and request.epochs == 3
    np.testing.assert_array_equal(request.start[algorithm.personal], state.personal)
    np.testing.assert_array_equal(request.start[algorithm.shared], broadcast)


def test_a_split_that_shares_nothing_or_keeps_nothing_is_refused():
    spec = FlatModel("mlp", (1, 28, 28), 10).spec
    with pytest.raises(ConfigError, match=r"algorithm.personal=\['\*'\] makes every parameter personal"):
        build_algorithm(FedPerSettings(name="fedper", personal=("*",)), spec)
    with pytest.raises(ConfigError, match="makes no parameter personal"):
        build_algorithm(FedPerSettings(name="fedper", personal=("conv*",)), spec)
