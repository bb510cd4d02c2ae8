"""FedADMM's mathematics and its limits: FLAME as lambda -> inf, FedAvg with pi = 0, rho -> 0 (flame.md 2.2-2.3)."""

from __future__ import annotations

import numpy as np
import pytest

from raysim.algorithms.fedadmm import FedAdmmSettings
from raysim.config import validate_config
from tests.support.convex import orthogonal_regression
from tests.support.experiments import tiny_config
from tests.support.inprocess import InProcess

B, N, D = [1.0, 2.0, 3.0], 40, 4


def _run_regression(algorithm: dict, rounds: int):
    problem, theta_hat = orthogonal_regression(B, N, D, seed=3)
    config = validate_config(tiny_config(algorithm=algorithm, clients={"count": 3}, model={"name": "linear"}))
    sim = InProcess(config, problem)
    for round_index in range(rounds):
        sim.round(round_index)
    return sim, theta_hat


def _consensus_optimum(theta_hat: np.ndarray) -> np.ndarray:
    """argmin_w sum_i alpha_i f_i(w) with f_i = 1/(2N) ||X_i w - y_i||^2 and X_i^T X_i = N b_i I: the gradients
    b_i (w - theta_hat_i) sum to zero, so w* = sum_i b_i theta_hat_i / sum_i b_i."""
    b = np.array(B)[:, None]
    return (b * theta_hat).sum(0) / b.sum()


def test_fedadmm_reaches_the_consensus_optimum_and_its_kkt_point():
    """Problem (19), min sum_i alpha_i f_i(theta_i) s.t. theta_i = w, has the KKT point theta_i = w = w*,
    pi_i = -alpha_i grad f_i(w*) = -alpha_i b_i (w* - theta_hat_i), sum_i pi_i = 0. With full-batch steps
    and enough local epochs the theta-step is solved to float32 accuracy, so ADMM must reach it (1e-4)."""
    algorithm = {"name": "fedadmm", "rho": 0.5, "lr": 0.2, "batch_size": N, "epochs": 20, "start": "local"}
    sim, theta_hat = _run_regression(algorithm, 60)
    w_star = _consensus_optimum(theta_hat)
    np.testing.assert_allclose(sim.server.w, w_star, atol=1e-4)
    for i, state in sim.states.items():
        np.testing.assert_allclose(state.theta, w_star, atol=1e-4)
        np.testing.assert_allclose(state.pi, -B[i] / 3 * (w_star - theta_hat[i]), atol=1e-4)
    np.testing.assert_allclose(sum(s.pi for s in sim.states.values()), 0.0, atol=1e-4)


def test_flame_with_large_lambda_approaches_fedadmm():
    """FLAME's fixed point (flame.md eq. 136) is w*_lambda = sum_i [b_i th_i/(b_i+lambda)] / sum_i [b_i/(b_i+lambda)],
    which tends to FedADMM's w* = sum_i b_i th_i / sum_i b_i as lambda -> inf with |w*_lambda - w*| = O(b/lambda).
    FLAME's rounds contract only by about 1 - b/lambda, so lambda = 20 (not 1000) keeps the test fast.
    The distance between the two runs must equal that analytic gap (about 2e-2 at lambda = 20, 0.11 at
    lambda = 1) to within the 1e-4 convergence error of each run, and shrink like 1/lambda."""
    fedadmm, theta_hat = _run_regression({"name": "fedadmm", "rho": 0.5, "lr": 0.2, "batch_size": N, "epochs": 20}, 60)
    w_star = _consensus_optimum(theta_hat)
    b = np.array(B)[:, None]
    gaps = {}
    for lam, rounds in ((1.0, 60), (20.0, 150)):
        lr = 0.9 / (max(B) + lam)  # stable full-batch steps on f_i + lambda/2 ||theta - w_i||^2
        algorithm = {"name": "flame", "lambda": lam, "rho": 0.5, "lr": lr, "batch_size": N, "epochs": 10}
        flame, _ = _run_regression(algorithm, rounds)
        w_lam = (b * theta_hat / (b + lam)).sum(0) / (b / (b + lam)).sum()
        np.testing.assert_allclose(flame.server.w, w_lam, atol=1e-4)
        gaps[lam] = float(np.linalg.norm(flame.server.w - fedadmm.server.w))
        assert abs(gaps[lam] - np.linalg.norm(w_lam - w_star)) <= 2e-4
    assert gaps[20.0] < 0.25 * gaps[1.0]  # O(b/lambda): (b/(20+b)) / (b/(1+b)) is about 0.2 for b in [1, 3]


def test_fedadmm_with_frozen_dual_and_vanishing_rho_is_fedavg():
    """With pi_i = 0 and rho -> 0 the FedADMM step is local SGD from w on f_i alone and the server mean of
    u_i = theta_i over all m clients is FedAvg's uniform average (full participation). The same seed gives the
    same mini-batches, so the models differ only by the prox term rho/alpha_i ||theta - w|| (rho = 1e-7:
    about lr * steps * 4e-7 * ||theta - w|| < 1e-6) and float32 rounding of the running sum: atol 1e-5."""
    sgd = {"lr": 0.05, "batch_size": 16, "epochs": 2}
    admm = InProcess(
        validate_config(tiny_config(algorithm={"name": "fedadmm", "rho": 1e-7, "freeze_dual": True, **sgd}))
    )
    avg = InProcess(validate_config(tiny_config(algorithm={"name": "fedavg", "aggregation": "uniform", **sgd})))
    for round_index in range(3):
        admm.round(round_index)
        avg.round(round_index)
    assert np.linalg.norm(avg.server.w - avg.problem.init_params) > 0.1
    np.testing.assert_allclose(admm.server.w, avg.server.w, atol=1e-5)
    assert all(not s.pi.any() for s in admm.states.values())


def test_zhou_li_iterations_close_the_dual_geometrically_at_a_fixed_w():
    """reading zhou_li (Zhou & Li, TPAMI 2023): one full-batch gradient g = alpha_i grad f_i(w) at the received w,
    then k0 linearized theta-steps theta = w - (g + pi)/(h + rho), each followed by pi <- pi + rho (theta - w), so
    pi^(k) + g = (h / (h + rho))^k (pi^(0) + g) and theta^(k) = w - (g + pi^(k-1)) / (h + rho) (closed forms of the
    linear recursion); on f_i = 1/(2N) ||X_i theta - y_i||^2, grad f_i(w) = b_i (w - theta_hat_i)."""
    h, rho, k0 = 0.7, 0.4, 5
    algorithm = {"name": "fedadmm", "reading": "zhou_li", "rho": rho, "curvature": h, "local_iterations": k0}
    sim, theta_hat = _run_regression(algorithm, 0)
    for round_index in range(2):
        w = sim.server.w.astype(np.float64)
        before = {i: s.pi.astype(np.float64) for i, s in sim.states.items()}
        sim.round(round_index, [0, 1, 2])
        ratio = h / (h + rho)
        for i, state in sim.states.items():
            g = B[i] / 3 * (w - theta_hat[i])
            np.testing.assert_allclose(state.pi, -g + ratio**k0 * (before[i] + g), atol=1e-5)
            previous = -g + ratio ** (k0 - 1) * (before[i] + g)
            np.testing.assert_allclose(state.theta, w - (g + previous) / (h + rho), atol=1e-5)
    assert np.abs(sim.states[0].pi).max() > 1e-2


def test_zhou_li_reaches_the_consensus_optimum():
    """Zhou & Li's inexact ADMM solves problem (19) too: w -> w* = sum_i b_i theta_hat_i / sum_i b_i, the KKT point
    with pi_i = -alpha_i grad f_i(w*) (h = 1 >= alpha_i L_i = b_i/3, k0 = 3)."""
    algorithm = {"name": "fedadmm", "reading": "zhou_li", "rho": 0.5, "curvature": 1.0, "local_iterations": 3}
    sim, theta_hat = _run_regression(algorithm, 0)
    for round_index in range(150):
        sim.round(round_index, [0, 1, 2])
    w_star = _consensus_optimum(theta_hat)
    np.testing.assert_allclose(sim.server.w, w_star, atol=1e-4)
    for i, state in sim.states.items():
        np.testing.assert_allclose(state.pi, -B[i] / 3 * (w_star - theta_hat[i]), atol=1e-4)


def test_several_local_iterations_need_the_zhou_li_reading():
    with pytest.raises(ValueError, match="algorithm.local_iterations=3: only reading zhou_li"):
        FedAdmmSettings(local_iterations=3)
