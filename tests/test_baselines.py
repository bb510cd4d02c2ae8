"""pFedMe, Ditto, FedProx and Local on the convex linear-regression problem: each reaches its own fixed point.

Clients have f_i(theta) = 1/(2N) ||X_i theta - y_i||^2 with X_i^T X_i = N b_i I (flame.md App. B-A), so
grad f_i(theta) = b_i (theta - theta_hat_i). Full-batch steps make every local solve exact or a known map.
"""

from __future__ import annotations

import numpy as np

from raysim.config import validate_config
from tests.conftest import tiny_config
from tests.inprocess import InProcess
from tests.test_flame import _orthogonal_regression

B, N, D = [1.0, 2.0, 3.0], 40, 4
b = np.array(B)[:, None]


def _run(algorithm: dict, rounds: int):
    problem, theta_hat = _orthogonal_regression(B, N, D, seed=5)
    config = validate_config(tiny_config(algorithm=algorithm, clients={"count": 3}, model={"name": "linear"}))
    sim = InProcess(config, problem)
    for round_index in range(rounds):
        sim.round(round_index)
    return sim, theta_hat


def test_pfedme_reaches_the_moreau_envelope_stationary_point():
    """With H = 1 full-batch step per round: theta_i <- theta_i - eta (b_i (theta_i - th_i) + lambda (theta_i - w)),
    w_i = w - eta_2 lambda (w - theta_i), and w = mean_i w_i. A fixed point needs b_i (theta_i - th_i) +
    lambda (theta_i - w) = 0 and mean_i (w - theta_i) = 0: theta_i* = (b_i th_i + lambda w*)/(b_i + lambda) with
    w* = mean_i theta_i*, the stationary point of (6), i.e. FLAME's closed form (eq. 136). atol 1e-4."""
    lam = 1.0
    sim, theta_hat = _run(
        {"name": "pfedme", "lambda": lam, "global_lr": 0.5, "lr": 0.2, "batch_size": N, "epochs": 1}, 200
    )
    w_star = (b * theta_hat / (b + lam)).sum(0) / (b / (b + lam)).sum()
    theta_star = (b * theta_hat + lam * w_star) / (b + lam)
    np.testing.assert_allclose(sim.server.w, w_star, atol=1e-4)
    for i, state in sim.states.items():
        np.testing.assert_allclose(state.theta, theta_star[i], atol=1e-4)


def test_ditto_global_is_the_consensus_optimum_and_personal_models_its_prox():
    """Ditto's global part is FedAvg; with one full-batch step per round its fixed point solves
    sum_i b_i (w - th_i) = 0, so w* = sum_i b_i th_i / sum_i b_i (no client drift with a single step). The
    personal model minimizes f_i(v) + lambda/2 ||v - w*||^2: v_i* = (b_i th_i + lambda w*)/(b_i + lambda)."""
    lam = 2.0
    sim, theta_hat = _run({"name": "ditto", "lambda": lam, "lr": 0.2, "batch_size": N, "epochs": 1}, 150)
    w_star = (b * theta_hat).sum(0) / b.sum()
    np.testing.assert_allclose(sim.server.w, w_star, atol=1e-4)
    for i, state in sim.states.items():
        np.testing.assert_allclose(state.v, (B[i] * theta_hat[i] + lam * w_star) / (B[i] + lam), atol=1e-4)


def test_fedprox_reaches_its_biased_fixed_point():
    """With the local problem f_i(theta) + mu/2 ||theta - w||^2 solved exactly, theta_i(w) = (b_i th_i + mu w) /
    (b_i + mu) and the uniform server mean gives w* = sum_i [b_i th_i/(b_i+mu)] / sum_i [b_i/(b_i+mu)]: not the
    consensus optimum sum_i b_i th_i / sum_i b_i when the b_i differ (FedProx's known bias), which the test
    also checks. 60 full-batch steps at lr 0.2 contract the local error by at least 0.6^60."""
    mu = 1.0
    algorithm = {"name": "fedprox", "mu": mu, "aggregation": "uniform", "lr": 0.2, "batch_size": N, "epochs": 60}
    sim, theta_hat = _run(algorithm, 40)
    w_star = (b * theta_hat / (b + mu)).sum(0) / (b / (b + mu)).sum()
    np.testing.assert_allclose(sim.server.w, w_star, atol=1e-4)
    assert np.linalg.norm(sim.server.w - (b * theta_hat).sum(0) / b.sum()) > 1e-2


def test_local_reaches_each_clients_own_least_squares_and_sends_nothing():
    """Local minimizes f_i alone: theta_i -> th_i = (X_i^T X_i)^-1 X_i^T y_i; the global model stays the initial
    one and the upload is empty (zero bytes)."""
    sim, theta_hat = _run({"name": "local", "lr": 0.2, "batch_size": N, "epochs": 5}, 20)
    for i, state in sim.states.items():
        np.testing.assert_allclose(state.theta, theta_hat[i], atol=1e-4)
    np.testing.assert_array_equal(sim.server.w, sim.problem.init_params)
    algorithm = sim.host.algorithm
    assert algorithm.uplink_bytes(algorithm.Upload()) == 0
    assert algorithm.downlink_bytes(algorithm.broadcast(sim.server)) == 0
