"""FedSpa (raysim.algorithms.fedspa): masks keep their density exactly through prune and regrow; the regrown
coordinates are the largest-gradient inactive ones; density 1 is FedAvg; the server adds the mean sparse update;
unselected clients keep their masks; the traffic scales with the density; the cosine schedule; it stacks."""

from __future__ import annotations

import numpy as np
import pytest

from raysim.algorithms import build_algorithm
from raysim.algorithms.fedspa import FedSpaSettings, FedSpaUpload
from raysim.config import validate_config
from raysim.errors import ConfigError
from raysim.models.flat import FlatModel
from raysim.models.spec import ParamSpec
from tests.support.executors import assert_close_runs, run_executor
from tests.support.experiments import tiny_config
from tests.support.split_models import SGD, check_round, simulate

HAND = ParamSpec(("w", "b"), ((2, 4), (2,)), (0, 8))
"""A 2x4 weight (sparse) and a bias (dense)."""


def test_density_is_kept_exactly_through_the_rounds_and_unselected_masks_stay():
    sim, _ = check_round({"name": "fedspa", "density": 0.3, "prune_rate": 0.5}, [0, 1, 4])
    algorithm = sim.host.algorithm
    spec = algorithm.params
    for client, state in sim.states.items():
        assert state.mask.dtype == bool
        for name, shape in zip(spec.names, spec.shapes, strict=True):
            part = state.mask[spec.slice(name)]
            want = round(0.3 * part.size) if len(shape) > 1 else part.size
            assert part.sum() == want, (client, name)
        assert state.mask.sum() == algorithm.active_count


def test_the_regrown_coordinates_are_the_largest_gradient_inactive_ones():
    algorithm = build_algorithm(FedSpaSettings(name="fedspa", density=0.5), HAND)
    mask = np.array([1, 1, 0, 0, 1, 0, 1, 0, 1, 1], bool)  # 4 of the weight's 8 active, the bias dense
    weights = np.array([0.1, -5.0, 0.0, 0.0, -0.2, 0.0, 3.0, 0.0, 0.01, 0.02], np.float32)
    grad = np.array([9.0, 0.0, 0.5, 2.0, 8.0, 1.0, 0.0, 7.0, 100.0, 100.0], np.float32)
    new, swapped = algorithm.next_mask(mask, weights, grad, rate=0.5)
    # Drops the 2 smallest active |w| (entries 0 and 4), then grows the 2 largest |grad| among the now inactive
    # {0, 2, 3, 4, 5, 7}: entries 0 (9.0, dropped and regrown) and 4 (8.0) beat 7 (7.0) and 3 (2.0).
    np.testing.assert_array_equal(new, mask)
    assert swapped == 2
    grad[0], grad[4] = 0.0, 0.0
    new, _ = algorithm.next_mask(mask, weights, grad, rate=0.5)
    np.testing.assert_array_equal(new, [0, 1, 0, 1, 0, 0, 1, 1, 1, 1])  # 7 (7.0) and 3 (2.0) regrown
    assert new[:8].sum() == 4 and new[8:].all()
    rows, _ = algorithm.next_mask(np.stack([mask, mask]), np.stack([weights, -weights]), np.stack([grad, grad]), 0.5)
    np.testing.assert_array_equal(rows[0], new)
    np.testing.assert_array_equal(rows[1], new)
    unchanged, swapped = algorithm.next_mask(mask, weights, grad, rate=0.2)  # floor(0.2 * 4) = 0 swaps
    assert swapped == 0 and (unchanged == mask).all()


def test_density_one_is_fedavg_with_equal_weights():
    fedspa = simulate({"name": "fedspa", "density": 1.0, "epochs": 2})
    fedavg = simulate({"name": "fedavg", "aggregation": "uniform", "epochs": 2})
    np.testing.assert_allclose(fedspa.coordinator.global_model(), fedavg.coordinator.global_model(), atol=1e-6)
    assert np.linalg.norm(fedavg.coordinator.global_model() - fedavg.problem.init_params) > 1e-2
    assert all(state.mask.all() for state in fedspa.states.values())


@pytest.mark.parametrize("aggregation", ["selected", "holders"])
def test_the_server_adds_the_mean_sparse_update(aggregation):
    sequential = {"num_hosts": 2, "client_training": "sequential"}
    sim = simulate({"name": "fedspa", "aggregation": aggregation}, rounds=1, runtime=sequential)
    w_t = sim.coordinator.global_model().copy()
    masks = {c: sim.states[c].mask.copy() for c in (0, 2, 3)}
    sim, expected = check_round({"name": "fedspa", "aggregation": aggregation}, [0, 2, 3])
    changes = np.array([u.upload.change for u in expected])
    held = np.array([masks[c] for c in (0, 2, 3)])
    assert (changes[~held] == 0).all()  # nothing moves outside the mask a client trained on
    divisor = 3 if aggregation == "selected" else np.maximum(held.sum(0), 1)
    np.testing.assert_allclose(sim.coordinator.global_model(), w_t + changes.sum(0) / divisor, atol=1e-6)
    state = sim.states[2]
    pm = sim.host.algorithm.evaluated_model(state, sim.coordinator.global_model())
    assert (pm[~state.mask] == 0).all() and (pm[state.mask] == sim.coordinator.global_model()[state.mask]).all()


def test_holders_average_the_clients_values_per_coordinate():
    algorithm = build_algorithm(FedSpaSettings(name="fedspa", aggregation="holders"), HAND)
    server = algorithm.init_server(np.arange(10, dtype=np.float32), 2)
    holders = np.array([2, 1, 0, 2, 1, 0, 2, 1, 2, 2], np.float64)
    new, _ = algorithm.server_step(server, FedSpaUpload(np.where(holders > 0, 6.0, 0.0), holders, 2.0), 2)
    np.testing.assert_allclose(new.w, np.arange(10) + np.array([3, 6, 0, 3, 6, 0, 3, 6, 3, 3]))
    assert new.round == 1


@pytest.mark.parametrize("density", [0.25, 0.5, 1.0])
def test_the_traffic_is_the_masked_coordinates(density):
    spec = FlatModel("cnn", (1, 28, 28), 10).spec
    algorithm = build_algorithm(FedSpaSettings(name="fedspa", density=density), spec)
    vectors = sum(int(np.prod(shape)) for shape in spec.shapes if len(shape) == 1)
    matrices = spec.size - vectors
    assert abs(algorithm.active_count - (vectors + density * matrices)) <= len(spec.names)
    server = algorithm.init_server(np.zeros(spec.size, np.float32), 4)
    upload = FedSpaUpload(np.zeros(spec.size), np.zeros(spec.size))
    assert algorithm.uplink_bytes(upload) == 4 * algorithm.active_count
    assert algorithm.downlink_bytes(algorithm.broadcast(server)) == 4 * (algorithm.active_count + 1)
    if density == 1.0:
        assert algorithm.active_count == spec.size
    if density == 0.5:
        assert 0.5 < algorithm.uplink_bytes(upload) / (4 * spec.size) < 0.51  # FedSLR: FedSpa sends half


def test_the_prune_rate_is_annealed_by_a_cosine():
    algorithm = build_algorithm(FedSpaSettings(name="fedspa", prune_rate=0.4, anneal_rounds=100), HAND)
    assert algorithm.prune_rate(0) == pytest.approx(0.4)
    assert algorithm.prune_rate(50) == pytest.approx(0.2)
    assert algorithm.prune_rate(25) == pytest.approx(0.2 * (1 + np.cos(np.pi / 4)))
    assert algorithm.prune_rate(100) == pytest.approx(0.0) and algorithm.prune_rate(500) == pytest.approx(0.0)


def test_initial_masks_differ_between_clients_and_not_between_hosts():
    first, second = simulate({"name": "fedspa"}, rounds=0), simulate({"name": "fedspa"}, rounds=0)
    masks = [s.mask for s in first.states.values()]
    assert not np.array_equal(masks[0], masks[1])
    for client, state in second.states.items():
        np.testing.assert_array_equal(state.mask, first.states[client].mask)


def test_vectorized_runs_match_sequential_runs():
    algorithm = {"name": "fedspa", "density": 0.4, **SGD}
    sections = {"model": {"name": "mlp"}, "clients": {"count": 5, "per_round": 3}}
    sequential = run_executor(algorithm, "sequential", **sections)
    assert_close_runs(sequential, run_executor(algorithm, "vectorized", **sections))


def test_settings_errors_name_the_field():
    for field, value in (("density", 0.0), ("density", 1.5), ("prune_rate", -0.1), ("anneal_rounds", 0)):
        with pytest.raises(ConfigError, match=f"algorithm.{field}"):
            validate_config(tiny_config(algorithm={"name": "fedspa", field: value}))
