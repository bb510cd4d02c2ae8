"""The fairness methods' own mathematics in process: TERM's tilted aggregation (raysim.algorithms.tilted) and AFL
(raysim.algorithms.afl). t = 0 is FedAvg with equal weights; a round of either is its paper's step written out
from the clients' recomputed requests; AFL's mixture stays on the simplex and moves towards the clients with the
higher loss. q-FFL: tests/unit/test_qffl.py; the fairness claims on raysim's metrics:
tests/integration/test_fairness.py."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from raysim.algorithms.afl import project_to_simplex
from raysim.config import validate_config
from tests.support.experiments import tiny_config
from tests.support.inprocess import InProcess
from tests.support.split_models import simulate, step_results

ALL_FOUR = {"clients": {"count": 4, "per_round": 4}}


def _afl(rounds: int, per_round: int = 4) -> InProcess:
    """AFL (gamma_w = 0.2, gamma_lambda = 0.5) on tiny_config's data, 4 clients, after `rounds` rounds."""
    algorithm = {"name": "afl", "lr": 0.2, "lambda_lr": 0.5}
    sim = InProcess(validate_config(tiny_config(algorithm=algorithm, clients={"count": 4, "per_round": per_round})))
    for round_index in range(rounds):
        sim.round(round_index)
    return sim


def test_term_with_no_tilt_is_fedavg_with_equal_weights():
    term = simulate({"name": "term", "tilt": 0.0, "epochs": 2}, rounds=3)
    fedavg = simulate({"name": "fedavg", "aggregation": "uniform", "epochs": 2}, rounds=3)
    np.testing.assert_allclose(term.coordinator.global_model(), fedavg.coordinator.global_model(), atol=1e-6)


@pytest.mark.parametrize("tilt", [-2.0, 3.0])
def test_a_term_round_is_the_tilted_mean_of_the_local_models(tilt):
    sim = simulate({"name": "term", "tilt": tilt, "epochs": 1}, rounds=1, **ALL_FOUR)
    w = sim.coordinator.broadcast()
    models, weights = [], []
    for client in range(4):
        (trained, at_w) = step_results(sim, client, w).results
        models.append(np.asarray(trained.params, np.float64))
        weights.append(math.exp(tilt * at_w.loss))
    want = np.average(models, axis=0, weights=weights)
    sim.round(1)
    np.testing.assert_allclose(sim.coordinator.global_model(), want, rtol=1e-5, atol=1e-6)
    assert max(weights) / min(weights) > 1.01  # the clients' losses differ: the tilt matters


def test_an_afl_round_is_algorithm_1_written_out():
    sim = _afl(rounds=0)  # from the uniform mixture
    received = sim.coordinator.broadcast()
    gradients, losses = [], []
    for client in range(4):
        (at_w,) = step_results(sim, client, received).results
        gradients.append(received.mixture[client] * np.asarray(at_w.grad, np.float64))
        losses.append(at_w.loss)
    sim.round(0)
    np.testing.assert_allclose(sim.coordinator.global_model(), received.w - 0.2 * np.sum(gradients, axis=0), atol=1e-6)
    mixture = sim.server.mixture
    np.testing.assert_allclose(mixture, project_to_simplex(received.mixture + 0.5 * np.array(losses)), atol=1e-12)
    for i in range(4):  # the worse off a client, the more it weighs
        assert all(mixture[i] >= mixture[j] for j in range(4) if losses[i] > losses[j])
    assert mixture.max() > 0.25


def test_afl_scales_a_partial_rounds_sums_by_m_over_the_selected():
    sim = _afl(rounds=1, per_round=2)
    received = sim.coordinator.broadcast()
    sim.round(1, [0, 3])
    (at_0,) = step_results(sim, 0, received).results
    (at_3,) = step_results(sim, 3, received).results
    mixture = received.mixture
    direction = mixture[0] * np.asarray(at_0.grad, np.float64) + mixture[3] * np.asarray(at_3.grad, np.float64)
    np.testing.assert_allclose(sim.coordinator.global_model(), received.w - 0.2 * 2 * direction, atol=1e-6)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(-5, 5, allow_nan=False), min_size=1, max_size=12))
def test_the_simplex_projection_is_the_closest_point_of_the_simplex(values):
    """On the simplex; a fixed point for a point of the simplex; x = max(v - theta, 0) for one theta (KKT)."""
    v = np.array(values)
    x = project_to_simplex(v)
    assert (x >= 0).all() and math.isclose(x.sum(), 1.0, abs_tol=1e-9)
    np.testing.assert_allclose(project_to_simplex(x), x, atol=1e-12)
    positive = x > 0
    thetas = (v - x)[positive]
    assert np.ptp(thetas) < 1e-9 and (v[~positive] <= thetas[0] + 1e-9).all()
