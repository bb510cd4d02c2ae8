"""FedBN (raysim.algorithms.fedbn) in process: one client is FedAvg; the normalization layers (affine parameters
and running statistics) never leave the client while the rest is averaged; each client's statistics are its own
data's; a model without normalization layers is refused with the models that have them."""

from __future__ import annotations

import numpy as np
import pytest

from raysim.algorithms import build_algorithm
from raysim.algorithms.fedbn import FedBNSettings
from raysim.algorithms.interface import payload_bytes
from raysim.errors import ConfigError
from raysim.models.flat import FlatModel
from tests.support.split_models import check_round, simulate


def test_with_one_client_fedbn_is_fedavg():
    """The mean over one client is its model, so keeping its normalization layers or receiving them back is the
    same: FedBN and FedAvg (uniform) end at the same global non-normalization part and the same client model."""
    one = {"clients": {"count": 1, "per_round": 1}}
    fedbn = simulate({"name": "fedbn", "epochs": 2}, rounds=3, model="mlp_bn", **one)
    fedavg = simulate({"name": "fedavg", "aggregation": "uniform", "epochs": 2}, rounds=3, model="mlp_bn", **one)
    algorithm = fedbn.host.algorithm
    pm = algorithm.evaluated_model(fedbn.states[0], fedbn.coordinator.global_model())
    np.testing.assert_allclose(pm, fedavg.coordinator.global_model(), atol=1e-6)
    assert np.linalg.norm(pm - fedbn.problem.init_params) > 1e-2


def test_the_normalization_layers_and_their_statistics_never_leave_the_client():
    sim, expected = check_round({"name": "fedbn"}, [0, 2, 4], model="mlp_bn")
    algorithm, spec = sim.host.algorithm, sim.host.algorithm.params
    personal = {name for name in spec.names if algorithm.personal[spec.slice(name)].all()}
    assert personal == {
        f"{layer}.{part}" for layer in ("2", "5") for part in ("weight", "bias", "running_mean", "running_var")
    }
    shared = int(algorithm.shared.sum())
    for update in expected:
        assert update.upload.weighted.shape == (shared,) and update.upload.weight == 1.0
        assert algorithm.uplink_bytes(update.upload) == payload_bytes(update.upload) == 4 * (shared + 1)
    assert algorithm.downlink_bytes(sim.coordinator.broadcast()) == 4 * shared
    np.testing.assert_allclose(sim.server.shared, np.mean([u.upload.weighted for u in expected], axis=0), atol=1e-6)
    pm = algorithm.evaluated_model(sim.states[2], sim.coordinator.global_model())
    np.testing.assert_array_equal(pm[algorithm.personal], sim.states[2].personal)
    np.testing.assert_array_equal(pm[algorithm.shared], sim.server.shared)
    gm = sim.coordinator.global_model()  # no global normalization: the GM keeps the initial layers
    np.testing.assert_array_equal(gm[algorithm.personal], sim.problem.init_params[algorithm.personal])


def test_each_clients_running_statistics_are_its_own_datas():
    """After training, the clients' running statistics differ from each other and from the initial ones (mean 0,
    variance 1), and a client that was never selected keeps the initial ones."""
    sim = simulate({"name": "fedbn", "epochs": 2}, rounds=2, model="mlp_bn", clients={"count": 5, "per_round": 5})
    algorithm, spec = sim.host.algorithm, sim.host.algorithm.params
    statistics = spec.statistics_mask()[algorithm.personal]
    rows = np.stack([sim.states[c].personal[statistics] for c in range(5)])
    initial = sim.problem.init_params[spec.statistics_mask()]
    assert all(not np.allclose(row, initial) for row in rows)
    assert all(not np.allclose(rows[i], rows[j]) for i in range(5) for j in range(i + 1, 5))
    never = simulate({"name": "fedbn"}, rounds=1, model="mlp_bn", clients={"count": 5, "per_round": 1})
    untouched = [
        c for c in range(5) if np.array_equal(never.states[c].personal, never.problem.init_params[algorithm.personal])
    ]
    assert len(untouched) == 4


def test_a_model_without_normalization_layers_is_refused_naming_those_that_have_them():
    with pytest.raises(ConfigError, match=r"model 'mlp' has none: choose a model with BatchNorm \(mlp_bn, cnn_bn"):
        build_algorithm(FedBNSettings(name="fedbn"), FlatModel("mlp", (1, 28, 28), 10).spec)
    assert build_algorithm(FedBNSettings(name="fedbn"), FlatModel("resnet8x4", (3, 8, 8), 10).spec).personal.any()
