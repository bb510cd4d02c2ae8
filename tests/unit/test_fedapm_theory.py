"""FedAPM's theory mode (fedapm.md 1.2, 3.2-3.3; `stop_rule: tolerance`): the tolerances xi_i and their stop rule,
the Lyapunov function (17) with its xi term, the primal residual over all m clients, and convergence to the analytic
optimum of (2) on a convex federated problem.

The problem is f_i(v_i, u) = 1/(2N) ||X_i u + v_i - y_i||^2 (a linear model whose bias v_i is personal, its weight u
shared) on flame.md App. B-A's orthogonal design, alpha_i = 1/3. One full-batch step per pass (epochs 1, batch N)
solves neither sub-problem exactly, so the stop rule decides how many passes a round takes."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from raysim.algorithms.fedapm import FedApmSettings
from raysim.config import validate_config
from raysim.errors import ConfigError
from raysim.evaluation.summaries import mean_client_metrics
from raysim.models.flat import ModelSpec
from raysim.runtime.problem import Problem
from tests.support.convex import orthogonal_regression
from tests.support.experiments import tiny_config
from tests.support.inprocess import InProcess

N, D, B = 40, 4, [1.0, 2.0, 3.0]
RHO, SIGMA, MU = 3.0, 2.0, 0.5
"""Lemma 1's conditions (fedapm.md 3.2): rho = 3 >= max(3 alpha L_u, 3 alpha L_uv) with L_u = b_i <= 3, L_uv <= 3,
alpha = 1/3; sigma = 2 >= 8 rho / 15 and >= alpha L_v (L_v = 1)."""


def _problem() -> Problem:
    problem, _ = orthogonal_regression(B, N, D, seed=3)
    return dataclasses.replace(
        problem,
        model_spec=ModelSpec("mlr", (D,), 1, "regression"),  # x -> <u, x> + v: u = `1.weight`, v = `1.bias`
        init_params=np.zeros(D + 1, np.float32),
        params=None,
    )


def _theory(**settings) -> InProcess:
    algorithm = {
        "name": "fedapm",
        "rho": RHO,
        "sigma": SIGMA,
        "lr": 0.4,
        "batch_size": N,
        "epochs": 1,
        "personal": ["1.bias"],
        "stop_rule": "tolerance",
        "tolerance": 1.0,
        "tolerance_decay": MU,
        "max_passes": 60,
        "diagnostics": True,
        **settings,
    }
    config = validate_config(tiny_config(algorithm=algorithm, clients={"count": 3}, model={"name": "mlr"}))
    return InProcess(config, _problem())


def _round(sim: InProcess, round_index: int, selected: list[int]) -> dict[str, float]:
    partial, records = sim.host.train(round_index, selected, sim.coordinator.broadcast())
    server = sim.coordinator.aggregate(partial)
    return {f"server/{k}": v for k, v in server.items()} | mean_client_metrics(records)


def _optimum(problem: Problem) -> tuple[np.ndarray, np.ndarray]:
    """argmin over (v_1..v_m, u) of sum_i alpha_i f_i(v_i, u): v_i(u) = mean(y_i - X_i u) eliminates v_i, leaving
    least squares on the centred data, sum_i Xc_i^T Xc_i u = sum_i Xc_i^T yc_i (alpha_i = 1/m cancels)."""
    gram, moment, parts = np.zeros((D, D)), np.zeros(D), []
    for _, split in problem.clients:
        x, y = problem.x[split.train].astype(np.float64), problem.y[split.train].astype(np.float64)
        parts.append((x, y))
        xc, yc = x - x.mean(0), y - y.mean()
        gram += xc.T @ xc
        moment += xc.T @ yc
    u = np.linalg.solve(gram, moment)
    return u, np.array([np.mean(y - x @ u) for x, y in parts])


def test_theory_mode_reaches_the_analytic_optimum_with_the_lyapunov_function_non_increasing():
    """Full participation, 60 rounds: u is within 1e-3 of the analytic u* and every v_i of v_i*(u*) (the distance
    falls by about 0.88 a round under these constants, from 0.8 at round 0); the logged
    Lyapunov function (17) L + 29/(rho (1 - mu)) sum_i xi_i never increases (Lemma 1 / Lemma 12), it equals the
    logged Lagrangian plus that term with sum_i xi_i = 3 mu^(t+1), and the primal residual over all clients falls."""
    sim = _theory()
    logged = [_round(sim, t, [0, 1, 2]) for t in range(60)]
    u_star, v_star = _optimum(sim.problem)
    u = sim.server.u.astype(np.float64)
    assert np.linalg.norm(u - u_star) < 1e-3, (u, u_star)
    for i, state in sim.states.items():
        np.testing.assert_allclose(state.params[:D], u_star, atol=1e-3)
        assert abs(state.params[D] - v_star[i]) < 2e-3
    weight = 29 / (RHO * (1 - MU))
    lyapunov = np.array([m["server/lyapunov"] for m in logged])
    for t, metrics in enumerate(logged):
        expected = metrics["server/lagrangian"] + weight * 3 * MU ** (t + 1)
        assert metrics["server/lyapunov"] == pytest.approx(expected, rel=1e-7)
    assert np.all(np.diff(lyapunov) <= 1e-7 * np.abs(lyapunov[1:])), np.diff(lyapunov)
    residual = np.array([m["server/primal_residual"] for m in logged])
    assert residual[-1] < 1e-3 * residual[0]


def test_the_stop_rule_meets_each_rounds_tolerance_and_shrinks_it_only_for_the_selected():
    """xi_i^{t+1} = mu xi_i^t (10) for a selected client, unchanged for the others (14); at the end of its u-step
    Definition 2's squared residual, recomputed here from the state and the model's gradient, is at most
    xi_i^{t+1}; tighter tolerances take more passes."""
    sim = _theory(tolerance=1e-3)
    plan = [[0, 1], [1, 2], [0, 1], [1, 2], [0, 2]]
    passes = []
    for t, selected in enumerate(plan):
        before = {i: (s.xi, s.params.copy(), s.pi.copy()) for i, s in sim.states.items()}
        u_t = sim.server.u.astype(np.float64)
        metrics = _round(sim, t, selected)
        passes.append(metrics["update/stop_passes"])
        for i, state in sim.states.items():
            xi_before = 1e-3 if np.isnan(before[i][0]) else before[i][0]
            if i not in selected:
                assert np.isnan(state.xi) == np.isnan(before[i][0]) and np.array_equal(state.params, before[i][1])
                continue
            assert state.xi == pytest.approx(MU * xi_before)
            _, split = sim.problem.clients[i]
            x, y = sim.problem.x[split.train].astype(np.float64), sim.problem.y[split.train].astype(np.float64)
            params = state.params.astype(np.float64)
            grad_u = x.T @ (x @ params[:D] + params[D] - y) / N
            residual = grad_u / 3 + before[i][2] + RHO * (params[:D] - u_t)
            assert residual @ residual <= state.xi * (1 + 1e-3) + 1e-10
        assert metrics["update/stop_residual_max"] <= metrics["update/tolerance_max"]
    assert passes[-1] > passes[0] >= 1


def test_primal_residual_is_over_all_clients_stale_ones_included():
    """sqrt(sum_i ||u_i - u||^2) over ALL m clients from the server's running sums equals the states' value under
    partial participation, where the selected clients' own residuals (`update/primal_residual`) miss the others."""
    sim = _theory()
    for t, selected in enumerate([[0], [1, 2], [2]]):
        metrics = _round(sim, t, selected)
        u = sim.server.u.astype(np.float64)
        direct = np.sqrt(sum(np.sum((s.params[:D].astype(np.float64) - u) ** 2) for s in sim.states.values()))
        assert metrics["server/primal_residual"] == pytest.approx(direct, rel=1e-6, abs=1e-9)


def test_epochs_mode_keeps_xi_at_zero_and_the_lyapunov_function_is_the_lagrangian():
    """The experiments' fixed epochs: no stop rule runs, xi stays 0, so (17) is L and nothing else is logged."""
    sim = _theory(stop_rule="epochs")
    metrics = _round(sim, 0, [0, 1, 2])
    assert metrics["server/lyapunov"] == metrics["server/lagrangian"]
    assert "update/stop_passes" not in metrics and all(np.isnan(s.xi) for s in sim.states.values())


def test_theory_mode_with_the_whole_model_synced_is_one_line_naming_the_fields():
    with pytest.raises(ValueError, match="algorithm.stop_rule=tolerance.*reset_personal=true"):
        FedApmSettings(stop_rule="tolerance", reset_personal=True)
    with pytest.raises(ConfigError, match="tolerance_decay"):
        validate_config(tiny_config(algorithm={"name": "fedapm", "tolerance_decay": 1.0}))
