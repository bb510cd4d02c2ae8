"""LG-FedAvg (raysim.algorithms.lg_fedavg) in process: the whole model global is FedAvg; the local layers never
leave the client (only the global layers are sent, unselected clients keep theirs, the server averages the selected
clients' global layers); the split of each model; it stacks; its settings' errors."""

from __future__ import annotations

import numpy as np
import pytest

from raysim.algorithms import build_algorithm
from raysim.algorithms.interface import payload_bytes
from raysim.algorithms.lg_fedavg import LgFedAvgSettings
from raysim.config import validate_config
from raysim.errors import ConfigError
from raysim.execution.drivers import run_client_step
from raysim.models.flat import FlatModel
from tests.support.executors import assert_close_runs, run_executor
from tests.support.experiments import tiny_config
from tests.support.split_models import SGD, check_round, simulate


def test_the_whole_model_global_is_fedavg():
    lg = simulate({"name": "lg_fedavg", "global_layers": ["*"], "epochs": 2})
    fedavg = simulate({"name": "fedavg", "aggregation": "uniform", "epochs": 2})
    np.testing.assert_allclose(lg.coordinator.global_model(), fedavg.coordinator.global_model(), atol=1e-6)
    assert np.linalg.norm(fedavg.coordinator.global_model() - fedavg.problem.init_params) > 1e-2


@pytest.mark.parametrize(
    ("model", "input_shape", "shared_layers"),
    [("cnn", (1, 28, 28), ("7", "9")), ("cnn_femnist", (1, 28, 28), ("7",)), ("mlp", (1, 28, 28), ("5",))],
)
def test_the_linear_layers_are_global_and_the_rest_local(model, input_shape, shared_layers):
    """fedslr.md 6.4: convolutions personal, linear layers shared; a model without convolutions shares its last."""
    spec = FlatModel(model, input_shape, 10).spec
    algorithm = build_algorithm(LgFedAvgSettings(name="lg_fedavg"), spec)
    for name in spec.names:
        shared = algorithm.shared[spec.slice(name)]
        assert shared.all() if name.split(".")[0] in shared_layers else not shared.any(), name
    assert (algorithm.personal == ~algorithm.shared).all()


def test_the_local_layers_never_leave_the_client():
    sim, expected = check_round({"name": "lg_fedavg"}, [1, 3, 4])
    algorithm = sim.host.algorithm
    shared = int(algorithm.shared.sum())
    assert shared == 64 * 4 + 4 and algorithm.personal.sum() > 0  # mlp: the last layer global (4 classes here)
    for update in expected:
        assert update.upload.weighted.shape == (shared,) and update.upload.weight == 1.0
        assert algorithm.uplink_bytes(update.upload) == payload_bytes(update.upload) == 4 * (shared + 1)
    assert algorithm.downlink_bytes(sim.coordinator.broadcast()) == 4 * shared
    np.testing.assert_allclose(sim.server.shared, np.mean([u.upload.weighted for u in expected], axis=0), atol=1e-6)
    pm = algorithm.evaluated_model(sim.states[3], sim.coordinator.global_model())
    np.testing.assert_array_equal(pm[algorithm.personal], sim.states[3].personal)
    np.testing.assert_array_equal(pm[algorithm.shared], sim.server.shared)


def test_one_joint_phase_from_the_clients_local_layers_and_the_received_global_ones():
    sim = simulate({"name": "lg_fedavg", "epochs": 3}, rounds=1)
    algorithm, host = sim.host.algorithm, sim.host
    requests = []
    execute = host.steps.client_executor(2, 1)
    state, broadcast = sim.states[2], sim.coordinator.broadcast()
    run_client_step(algorithm, host.info[2], state, broadcast, lambda r: requests.append(r) or execute(r))
    (request,) = requests
    assert request.mask is None and request.epochs == 3
    np.testing.assert_array_equal(request.start[algorithm.personal], state.personal)
    np.testing.assert_array_equal(request.start[algorithm.shared], broadcast)


def test_vectorized_runs_match_sequential_runs():
    algorithm = {"name": "lg_fedavg", "aggregation": "samples", **SGD}
    sections = {"model": {"name": "mlp"}, "clients": {"count": 5, "per_round": 3}}
    sequential = run_executor(algorithm, "sequential", **sections)
    assert_close_runs(sequential, run_executor(algorithm, "vectorized", **sections))


def test_settings_errors_name_the_field():
    spec = FlatModel("mlp", (1, 28, 28), 10).spec
    with pytest.raises(ConfigError, match=r"algorithm.global_layers=\['conv\*'\] shares no parameter"):
        build_algorithm(LgFedAvgSettings(name="lg_fedavg", global_layers=("conv*",)), spec)
    with pytest.raises(ConfigError, match="algorithm.global_preset='input' is not defined for model 'mlp'"):
        build_algorithm(LgFedAvgSettings(name="lg_fedavg", global_preset="input"), spec)
    with pytest.raises(ConfigError, match="algorithm.aggregation"):
        validate_config(tiny_config(algorithm={"name": "lg_fedavg", "aggregation": "median"}))
