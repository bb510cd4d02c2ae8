"""FedDyn's mathematics (Acar et al. 2021, Alg. 1): the client's stationarity invariant, the fixed point on a convex
problem, what alpha -> 0 does (the client step is FedAvg's, the server model is not), and the identity with FedSLR's
Phase I and server at lambda = mu = 0 (one shared implementation)."""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from raysim.algorithms import ClientInfo
from raysim.algorithms.families.averaging import WeightedUpload
from raysim.algorithms.feddyn import FedDyn, FedDynSettings
from raysim.config import validate_config
from raysim.execution import run_client_step
from tests.support.convex import SPEC, Quadratic
from tests.support.experiments import tiny_config
from tests.support.inprocess import InProcess


def _round(algorithm: FedDyn, problem: Quadratic, server, states: dict, selected, m: int):
    broadcast, weighted, count = algorithm.broadcast(server), 0.0, 0.0
    for i in selected:
        update = run_client_step(algorithm, ClientInfo(i, 10, 1 / m, m), states[i], broadcast, problem.executor(i))
        states[i] = update.state
        weighted, count = weighted + update.upload.weighted.astype(np.float64), count + float(update.upload.weight)
    return algorithm.server_step(server, WeightedUpload(weighted, count), len(selected))


def _start(algorithm: FedDyn, m: int, w0: np.ndarray):
    return algorithm.init_server(w0, m), {i: algorithm.init_client(ClientInfo(i, 10, 1 / m, m), w0) for i in range(m)}


def test_client_stationarity_invariant_at_an_exact_local_solve():
    """Alg. 1 line 6's first-order condition grad L_k(theta_k) - g_k + alpha (theta_k - theta) = 0 with g_k the
    previous gradient state, and line 7 makes the new state grad L_k(theta_k)."""
    m, alpha = 4, 0.3
    problem = Quadratic(m, SPEC.size, seed=1)
    algorithm = FedDyn(FedDynSettings(alpha=alpha), SPEC)
    server, states = _start(algorithm, m, np.random.default_rng(2).normal(size=SPEC.size).astype(np.float32))
    for selected in ([0, 1], [1, 2, 3], [0, 3], [2]):
        theta = server.w.astype(np.float64)
        previous = {i: states[i].gamma.astype(np.float64) for i in selected}
        server, _ = _round(algorithm, problem, server, states, selected, m)
        for i in selected:
            theta_i = theta - (states[i].gamma - previous[i]) / alpha  # invert line 7
            residual = problem.grad(i, theta_i) - previous[i] + alpha * (theta_i - theta)
            np.testing.assert_allclose(residual, 0.0, atol=1e-4)
            np.testing.assert_allclose(states[i].gamma, problem.grad(i, theta_i), atol=1e-4)
        np.testing.assert_allclose(server.h, np.mean([s.gamma for s in states.values()], axis=0), atol=1e-6)


@pytest.mark.parametrize("per_round", [4, 2])
def test_fixed_point_is_the_minimizer_of_the_sum_of_the_client_losses(per_round):
    """On f_k = h_k/2 ||x - a_k||^2 the server model tends to argmin sum_k f_k = sum h_k a_k / sum h_k (the paper's
    claim: FedDyn's fixed point is a stationary point of the global loss), with partial participation too, and the
    gradient states sum to zero; FedAvg's exact local solves (a_k) would average to mean a_k instead."""
    m = 4
    problem = Quadratic(m, SPEC.size, seed=3)
    algorithm = FedDyn(FedDynSettings(alpha=1.0), SPEC)
    server, states = _start(algorithm, m, np.zeros(SPEC.size, np.float32))
    generator = np.random.default_rng(4)
    for _ in range(300):
        selected = sorted(generator.choice(m, per_round, replace=False))
        server, metrics = _round(algorithm, problem, server, states, selected, m)
    optimum = (problem.h[:, None] * problem.a).sum(axis=0) / problem.h.sum()
    np.testing.assert_allclose(server.w, optimum, atol=1e-4)
    assert np.abs(problem.a.mean(axis=0) - optimum).max() > 0.05  # the plain mean of the a_k is not the optimum
    np.testing.assert_allclose(np.sum([s.gamma for s in states.values()], axis=0), 0.0, atol=1e-3)
    assert metrics["global_change"] < 1e-4


def _sim(algorithm: dict) -> InProcess:
    sections = {"clients": {"count": 5, "per_round": 3}}
    return InProcess(validate_config(tiny_config(algorithm={"lr": 0.05, "batch_size": 16, **algorithm}, **sections)))


def test_alpha_to_zero_trains_fedavgs_local_models_but_the_server_keeps_its_correction():
    """At alpha -> 0 the linear and proximal terms vanish: the selected clients' uploads are FedAvg's local models
    and their mean FedAvg's (uniform) model. The server's h/alpha does not vanish: after round 0 theta^1 =
    avg + (|S|/m)(avg - theta^0), so FedDyn's global model is not FedAvg's (the issue's "alpha -> 0 is FedAvg" holds
    for the client step only)."""
    feddyn = _sim({"name": "feddyn", "alpha": 1e-7, "epochs": 1, "lr_decay": 1.0})
    fedavg = _sim({"name": "fedavg", "aggregation": "uniform"})
    w0 = feddyn.coordinator.global_model().astype(np.float64)
    feddyn.round(0), fedavg.round(0)
    average = fedavg.coordinator.global_model().astype(np.float64)
    selected, m = 3, 5
    np.testing.assert_allclose(feddyn.coordinator.global_model(), average + selected / m * (average - w0), atol=1e-5)
    np.testing.assert_allclose(feddyn.server.h / 1e-7, -(selected / m) * (average - w0), atol=1e-5)
    assert np.abs(average - w0).max() > 1e-3


def test_lambda_mu_zero_fedslr_is_feddyn_on_real_training():
    """FedSLR with lambda = mu = 0 and no Phase II runs the same Phase I, duals and server mean (one implementation,
    raysim.algorithms.feddyn): the same global model and duals after three rounds of real local SGD."""
    common = {"lr": 0.05, "batch_size": 16, "epochs": 2, "lr_decay": 0.9}
    feddyn = _sim({"name": "feddyn", "alpha": 0.25, **common})
    fedslr = _sim({"name": "fedslr", "eta_g": 4.0, "lambda": 0.0, "mu": 0.0, "phase2_epochs": 0, **common})
    for round_index in range(3):
        feddyn.round(round_index), fedslr.round(round_index)
        np.testing.assert_allclose(feddyn.coordinator.global_model(), fedslr.coordinator.global_model(), atol=1e-6)
        np.testing.assert_allclose(feddyn.server.h, fedslr.server.gamma_mean, atol=1e-7)
    for client, state in feddyn.states.items():
        np.testing.assert_allclose(state.gamma, fedslr.states[client].gamma, atol=1e-7)
    assert np.any(feddyn.server.h)


def test_settings_and_traffic():
    with pytest.raises(ValidationError, match="alpha"):
        FedDynSettings(alpha=0)
    settings = FedDynSettings()
    assert (settings.alpha, settings.eta_g, settings.epochs, settings.batch_size) == (0.1, 10.0, 2, 20)
    algorithm = FedDyn(settings, SPEC)
    w = np.zeros(SPEC.size, np.float32)
    assert algorithm.downlink_bytes(algorithm.broadcast(algorithm.init_server(w, 2))) == 4 * (SPEC.size + 1)
    assert algorithm.uplink_bytes(WeightedUpload(w, 1.0)) == 4 * (SPEC.size + 1)
