"""The ADMM convergence diagnostics (raysim.algorithms.families.consensus, `diagnostics: true`) on the convex
linear-regression problem of flame.md App. B-A, where f_i(theta) = 1/(2N) ||X_i theta - y_i||^2 with
X_i^T X_i = N b_i I, so grad f_i(theta) = b_i (theta - theta_hat_i) and full-batch steps solve each theta-step to
float32 accuracy: the logged values equal the same quantities computed from the states, and behave as the papers
prove (FLAME's Lemma 1 and Theorem 1; FedADMM's KKT point)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from raysim.algorithms.families.consensus import AdmmDiagnosticUpload
from raysim.config import validate_config
from raysim.errors import ConfigError
from raysim.evaluation.summaries import mean_client_metrics
from raysim.models.flat import ModelSpec
from tests.support.convex import orthogonal_regression
from tests.support.experiments import tiny_config
from tests.support.inprocess import InProcess

N, D = 40, 4


def _simulation(algorithm: dict, b: list[float]) -> tuple[InProcess, np.ndarray]:
    problem, theta_hat = orthogonal_regression(b, N, D, seed=3)
    config = validate_config(
        tiny_config(algorithm={**algorithm, "diagnostics": True}, clients={"count": len(b)}, model={"name": "linear"})
    )
    return InProcess(config, problem), theta_hat


def _round(sim: InProcess, round_index: int, selected: list[int] | None = None) -> dict[str, float]:
    """One round as the driver logs it: the server's metrics (`server/...`) and the clients' (`update/...`)."""
    selected = list(range(sim.problem.num_training)) if selected is None else selected
    partial, records = sim.host.train(round_index, selected, sim.coordinator.broadcast())
    server = sim.coordinator.aggregate(partial)
    return {f"server/{k}": v for k, v in server.items()} | mean_client_metrics(records)


def _losses(sim: InProcess, thetas: dict[int, np.ndarray]) -> dict[int, float]:
    """f_i(theta_i) = 1/(2N) ||X_i theta_i - y_i||^2 over each client's training split, in float64."""
    losses = {}
    for info, split in sim.problem.clients:
        x, y = sim.problem.x[split.train].astype(np.float64), sim.problem.y[split.train].astype(np.float64)
        losses[info.id] = float(0.5 * np.mean((x @ thetas[info.id] - y) ** 2))
    return losses


def _flame_lagrangian(sim: InProcess, lam: float, rho: float) -> float:
    """(10) from the states and the server's w: sum_i alpha_i (f_i(theta_i) + lambda/2 ||theta_i - w_i||^2)
    + <pi_i, w_i - w> + rho/2 ||w_i - w||^2."""
    states, w = sim.states, sim.server.w.astype(np.float64)
    losses = _losses(sim, {i: s.theta.astype(np.float64) for i, s in states.items()})
    total = 0.0
    for i, s in states.items():
        theta, w_i, pi = (np.asarray(v, np.float64) for v in (s.theta, s.w, s.pi))
        alpha = 1 / len(states)
        total += alpha * (losses[i] + lam / 2 * np.sum((theta - w_i) ** 2)) + pi @ (w_i - w)
        total += rho / 2 * np.sum((w_i - w) ** 2)
    return total


def test_flame_lyapunov_descends_and_residuals_vanish_under_lemma_1():
    """Lemma 1 and Theorem 1 (flame.md 5) under (c1)-(c3): with L = max b_i = 0.03, alpha_i = 1/3 and rho = 0.1,
    the window lambda alpha_i in (0.02357, 0.02371) holds (c1) and (c3), and rho >= lambda alpha_i is (c2). The
    theta-steps are solved exactly (epsilon = 0), so the Lyapunov function (21) is L(P^t) itself: it must never
    increase; the residuals go to zero. The logged Lagrangian is (10) of the states and the server's model, and
    ||sum_i pi_i|| the norm of the clients' duals' sum."""
    b, lam, rho = [0.01, 0.02, 0.03], 3 * 0.02364, 0.1
    lr = 1 / (max(b) + lam)  # GD on a quadratic with curvature b_i + lambda <= 1/lr contracts every epoch
    algorithm = {"name": "flame", "lambda": lam, "rho": rho, "lr": lr, "batch_size": N, "epochs": 15}
    sim, _ = _simulation(algorithm, b)
    logged = []
    for round_index in range(40):
        logged.append(_round(sim, round_index))
        if round_index in (0, 39):
            assert logged[-1]["server/lagrangian"] == pytest.approx(_flame_lagrangian(sim, lam, rho), rel=1e-6)
            dual_sum = sum(np.asarray(s.pi, np.float64) for s in sim.states.values())
            assert logged[-1]["server/dual_sum_norm"] == pytest.approx(np.linalg.norm(dual_sum), rel=1e-5, abs=1e-9)
            norms = [np.linalg.norm(s.pi) for s in sim.states.values()]
            assert logged[-1]["update/dual_norm_max"] == pytest.approx(max(norms), rel=1e-6)
    lagrangian = np.array([m["server/lagrangian"] for m in logged])
    assert np.all(np.diff(lagrangian) <= 1e-7 * np.abs(lagrangian[1:])), np.diff(lagrangian)
    assert lagrangian[-1] < lagrangian[0]
    # Lemma 1's sufficient descent L(P^t) - L(P^{t+1}) >= D_1 Delta Gamma^{t+1}, from L(P^0) = sum_i alpha_i f_i(w^0)
    lam_alpha = lam / len(b)
    d1 = min(rho / 2, (lam_alpha + rho) / 2 - lam_alpha**2 * (1 + rho) / rho**2)
    start = np.mean(list(_losses(sim, dict.fromkeys(range(len(b)), np.zeros(D))).values()))
    descent = -np.diff(np.concatenate([[start], lagrangian]))
    successive = np.array([m["server/successive_change"] for m in logged])
    assert d1 > 0 and np.all(descent >= d1 * successive - 1e-7 * np.abs(lagrangian)), descent - d1 * successive
    for key in ("update/primal_residual_max", "server/dual_sum_norm", "server/successive_change"):
        assert logged[-1][key] < 0.25 * logged[1][key], (key, logged[1][key], logged[-1][key])
    assert max(m["update/stationarity_max"] for m in logged) < 1e-6  # exact theta-steps: (17) with epsilon = 0


def test_fedadmm_diagnostics_reach_the_kkt_point():
    """FedADMM (flame.md 2.2) with exact theta-steps (stationarity residual at rounding level) converges to the KKT
    point of (19): primal residuals and sum_i pi_i go to zero and the augmented Lagrangian to the optimum
    sum_i alpha_i f_i(w*), w* = sum_i b_i theta_hat_i / sum_i b_i (tests/unit/test_fedadmm.py)."""
    b = [1.0, 2.0, 3.0]
    algorithm = {"name": "fedadmm", "rho": 0.5, "lr": 0.2, "batch_size": N, "epochs": 20, "start": "local"}
    sim, theta_hat = _simulation(algorithm, b)
    logged = [_round(sim, round_index) for round_index in range(60)]
    w_star = (np.array(b)[:, None] * theta_hat).sum(0) / sum(b)
    optimum = np.mean(list(_losses(sim, dict.fromkeys(range(3), w_star)).values()))
    assert logged[-1]["server/lagrangian"] == pytest.approx(optimum, rel=1e-5)
    assert abs(logged[0]["server/lagrangian"] - optimum) > 0.1  # from below: the duals start at zero
    for key in ("update/primal_residual_max", "server/dual_sum_norm", "server/successive_change"):
        assert logged[-1][key] < 1e-4 < logged[0][key], (key, logged[0][key], logged[-1][key])
    assert max(m["update/stationarity_max"] for m in logged) < 1e-5  # exact theta-steps
    norms = [np.linalg.norm(s.pi) for s in sim.states.values()]
    assert logged[-1]["update/dual_norm"] == pytest.approx(np.mean(norms), rel=1e-5) and min(norms) > 0.1


def test_fedapm_lyapunov_descends_under_its_conditions():
    """FedAPM's Lemma 1 / Lemma 12 (fedapm.md 3.2-3.3) on f_i(v_i, u) = 1/(2N) ||X_i u + v_i - y_i||^2 with the
    bias v_i personal: L_u = b_i <= 3, L_v = 1, alpha_i = 1/3, so rho = 6 meets max(3 alpha L_u, 3 alpha L_uv) <= rho
    and rho >= 2 L_u, and sigma = 4 meets rho <= 15/8 sigma and sigma >= alpha L_v. Full-batch steps solve both
    sub-problems exactly (Definition 2's residual at rounding level, xi = 0), so the Lyapunov function (17) is the
    augmented Lagrangian (4), which must never increase; the primal residuals and sum_i pi_i go to zero. The
    logged Lagrangian is (4) of the states and the server's u."""
    b, rho = [1.0, 2.0, 3.0], 6.0
    problem, _ = orthogonal_regression(b, N, D, seed=3)
    problem = dataclasses.replace(
        problem,
        model_spec=ModelSpec("mlr", (D,), 1, "regression"),  # x -> <u, x> + v: u = `1.weight`, v = `1.bias`
        init_params=np.zeros(D + 1, np.float32),
        params=None,  # derived from the model again
    )
    algorithm = {
        "name": "fedapm",
        "rho": rho,
        "sigma": 4.0,
        "lr": 1 / 7,
        "batch_size": N,
        "epochs": 20,
        "personal": ["1.bias"],
        "diagnostics": True,
    }
    config = validate_config(tiny_config(algorithm=algorithm, clients={"count": 3}, model={"name": "mlr"}))
    sim = InProcess(config, problem)
    logged = [_round(sim, round_index) for round_index in range(20)]
    states, u = sim.states, sim.server.u.astype(np.float64)
    losses = {}
    for info, split in problem.clients:
        x, y = problem.x[split.train].astype(np.float64), problem.y[split.train].astype(np.float64)
        params = states[info.id].params.astype(np.float64)
        losses[info.id] = 0.5 * np.mean((x @ params[:D] + params[D] - y) ** 2)
    direct = sum(
        losses[i] / 3 + s.pi @ (s.params[:D] - u) + rho / 2 * np.sum((s.params[:D].astype(np.float64) - u) ** 2)
        for i, s in states.items()
    )
    assert logged[-1]["server/lagrangian"] == pytest.approx(direct, rel=1e-6)
    lagrangian = np.array([m["server/lagrangian"] for m in logged])
    assert np.all(np.diff(lagrangian) <= 1e-7 * np.abs(lagrangian[1:])), np.diff(lagrangian)
    assert lagrangian[-1] < lagrangian[0]
    # Lemma 1's sufficient descent with a = min(rho/60, sigma/2 - 4 rho/15) and Sigma_p = sum_i (||dv_i||^2 +
    # ||du_i||^2 + ||du||^2), from L(P^0) = sum_i alpha_i f_i(0) (v_i = u_i = u = 0, pi_i = 0)
    a = min(rho / 60, 4.0 / 2 - 4 * rho / 15)
    start = sum(0.5 * np.mean(problem.y[split.train].astype(np.float64) ** 2) / 3 for _, split in problem.clients)
    descent = -np.diff(np.concatenate([[start], lagrangian]))
    successive = np.array([m["server/successive_change"] for m in logged])
    assert np.all(descent >= a * successive - 1e-7 * np.abs(lagrangian)), descent - a * successive
    assert max(m["update/stationarity_max"] for m in logged) < 1e-5
    for key in ("update/primal_residual_max", "server/dual_sum_norm"):
        assert logged[-1][key] < 0.2 * logged[0][key], (key, logged[0][key], logged[-1][key])


def _flame_successive_change(before: dict, after: dict, w_before: np.ndarray, w_after: np.ndarray) -> float:
    """Delta Gamma = sum_i (||w^{t+1} - w^t||^2 + ||w_i^{t+1} - w_i^t||^2 + ||theta_i^{t+1} - theta_i^t||^2), from
    the states and global models before and after a round (flame.md 1.6)."""
    squared = lambda a, b: float(np.sum((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2))  # noqa: E731
    moved = sum(squared(after[i].theta, before[i].theta) + squared(after[i].w, before[i].w) for i in after)
    return moved + len(after) * squared(w_after, w_before)


def test_partial_participation_keeps_the_totals_over_all_clients():
    """sum_i pi_i and the augmented Lagrangian are running totals over ALL m clients (the unselected keep their
    duals and terms; only w moves theirs): the Lagrangian is logged from the round in which the last client first
    reports, and then equals (10) computed from every client's state at the new w, round after round; Delta Gamma
    counts the selected clients' moves and m times the global model's."""
    algorithm = {"name": "flame", "lambda": 1.0, "rho": 0.5, "lr": 0.1, "batch_size": N, "epochs": 5}
    sim, _ = _simulation(algorithm, [1.0, 2.0, 3.0])
    for round_index, selected in enumerate([[0, 1], [1], [2], [0, 2], [1]]):
        before, w_before = {i: dataclasses.replace(s) for i, s in sim.states.items()}, sim.server.w.copy()
        logged = _round(sim, round_index, selected)
        if round_index < 2:
            assert "server/lagrangian" not in logged  # client 2 has not reported yet
        else:
            assert logged["server/lagrangian"] == pytest.approx(_flame_lagrangian(sim, 1.0, 0.5), rel=1e-6)
        dual_sum = sum(np.asarray(s.pi, np.float64) for s in sim.states.values())
        assert logged["server/dual_sum_norm"] == pytest.approx(np.linalg.norm(dual_sum), rel=1e-5)
        expected = _flame_successive_change(before, sim.states, w_before, sim.server.w)
        assert logged["server/successive_change"] == pytest.approx(expected, rel=1e-6)


def test_diagnostics_cost_no_uplink_change_no_training_and_agree_stacked():
    """The diagnostic fields are not communication, and the extra pass draws no randomness: a run with
    `diagnostics: true` trains exactly as one without, and its upload counts as the message change alone. A chunk's
    stacked step (client_training: vectorized) reports the same diagnostics as one client at a time."""
    models, logged = [], {}
    for client_training in ("sequential", "vectorized"):
        for diagnostics in (False, True):
            algorithm = {"name": "flame", "epochs": 1, "diagnostics": diagnostics}
            runtime = {"num_hosts": 1, "client_training": client_training}
            sim = InProcess(validate_config(tiny_config(algorithm=algorithm, runtime=runtime)))
            metrics = [_round(sim, round_index) for round_index in range(2)]
            models.append(sim.server.w)
            if diagnostics:
                logged[client_training] = metrics[-1]
    np.testing.assert_array_equal(models[0], models[1])
    np.testing.assert_array_equal(models[2], models[3])
    keys = (
        "server/lagrangian",
        "server/dual_sum_norm",
        "server/successive_change",
        "update/stationarity_max",
        "update/dual_norm_max",
    )
    for key in keys:
        assert logged["vectorized"][key] == pytest.approx(logged["sequential"][key], rel=1e-4), key
    change = np.ones(7, np.float32)
    assert sim.host.algorithm.uplink_bytes(AdmmDiagnosticUpload(change, change, 1.0, 1.0, 1.0, 1.0)) == 4 * 7


def test_fedslr_phase2_gradient_mapping_and_dual_sum():
    """FedSLR (fedslr.md 2.5, Thm 3) on f_i(x) = h_i/2 ||x - a_i||^2 with every local solve exact: Phase II's
    p_i = argmin f_i(w_t + p) + mu ||p||_1 is a fixed point of the proximal-gradient map, so the gradient mapping
    G = (p - S_{mu eta}(p - eta grad f_i(w_t + p))) / eta is zero at it for any eta; without Phase II the p_i^0 = 0
    left in place is not, and G is that formula. ||sum_i gamma_i|| over all M clients is the server's mirror."""
    from raysim.algorithms import ClientInfo
    from raysim.algorithms.families.lowrank import LowRankUpload
    from raysim.algorithms.fedslr import FedSlr, FedSlrSettings
    from raysim.algorithms.prox import soft_threshold
    from raysim.algorithms.requests import FullGradient, GradientResult
    from raysim.execution import run_client_step
    from tests.support.convex import SPEC, Quadratic

    m, mu, lr = 4, 0.3, 0.1
    problem = Quadratic(m, SPEC.size, seed=9)

    def executor(i: int):
        solve = problem.executor(i)

        def execute(request):
            if isinstance(request, FullGradient):
                return GradientResult(problem.grad(i, request.point).astype(np.float32), 0.0)
            return solve(request)

        return execute

    for phase2_epochs in (1, 0):
        settings = {"lambda": 0.05, "mu": mu, "eta_g": 0.4, "lr": lr, "lr_decay": 1.0}
        algorithm = FedSlr(FedSlrSettings(**settings, phase2_epochs=phase2_epochs, diagnostics=True), SPEC)
        w0 = np.zeros(SPEC.size, np.float32)
        server = algorithm.init_server(w0, m)
        states = {i: algorithm.init_client(ClientInfo(i, 10, 1 / m, m), w0) for i in range(m)}
        for selected in ([0, 1], [1, 2, 3]):
            broadcast, total, stationarity = algorithm.broadcast(server), None, {}
            for i in selected:
                update = run_client_step(algorithm, ClientInfo(i, 10, 1 / m, m), states[i], broadcast, executor(i))
                states[i], stationarity[i] = update.state, update.metrics["stationarity"]
                total = update.upload.w.astype(np.float64) if total is None else total + update.upload.w
            w_t = broadcast.model.params(SPEC)
            server, metrics = algorithm.server_step(server, LowRankUpload(total, float(len(selected))), len(selected))
            dual_sum = sum(np.asarray(s.gamma, np.float64) for s in states.values())
            assert metrics["dual_sum_norm"] == pytest.approx(np.linalg.norm(dual_sum), rel=1e-5)
            for i in selected:
                p = states[i].p.astype(np.float64)
                mapping = (p - soft_threshold(p - lr * problem.grad(i, w_t + p), mu * lr)) / lr
                assert stationarity[i] == pytest.approx(np.linalg.norm(mapping), rel=1e-4, abs=1e-5)
                assert (stationarity[i] < 1e-4) if phase2_epochs else (stationarity[i] > 0.1)


def test_fedslr_potential_is_def_1_and_descends_under_lemma_3():
    """FedSLR's potential D_{eta_g} (fedslr.md 3, Def. 1, eq. 10) on f_i(x) = h_i/2 ||x - a_i||^2 with Phase I
    solved exactly and full participation: the logged `potential` is (10) computed from the clients' w_i, gamma_i
    and f_i and the server's x = w_{t+1} (R(x) = lambda sum_l ||X_l||_*), and with eta_g <= 1/(2L), L = max h_i,
    Lemma 3 makes it non-increasing; a round that not every client reports logs none."""
    from raysim.algorithms import ClientInfo
    from raysim.algorithms.fedslr import FedSlr, FedSlrSettings
    from raysim.algorithms.prox import layer_spectra
    from raysim.algorithms.requests import FullGradient, GradientResult
    from raysim.execution import run_client_step
    from tests.support.convex import SPEC, Quadratic

    m = 4
    problem = Quadratic(m, SPEC.size, seed=5)
    lam, eta_g = 0.05, 1 / (2 * problem.h.max())

    def executor(i: int):
        solve = problem.executor(i)

        def execute(request):
            if isinstance(request, FullGradient):
                gap = np.asarray(request.point, np.float64) - problem.a[i]
                return GradientResult((problem.h[i] * gap).astype(np.float32), float(problem.h[i] / 2 * gap @ gap))
            return solve(request)

        return execute

    settings = {"lambda": lam, "mu": 0.1, "eta_g": eta_g, "lr": 0.1, "lr_decay": 1.0, "diagnostics": True}
    algorithm = FedSlr(FedSlrSettings(**settings), SPEC)
    w0 = np.random.default_rng(2).normal(size=SPEC.size).astype(np.float32)
    server = algorithm.init_server(w0, m)
    states = {i: algorithm.init_client(ClientInfo(i, 10, 1 / m, m), w0) for i in range(m)}
    potentials = []
    for selected in [list(range(m))] * 12 + [[0, 2]]:
        broadcast, uploads = algorithm.broadcast(server), {}
        for i in selected:
            update = run_client_step(algorithm, ClientInfo(i, 10, 1 / m, m), states[i], broadcast, executor(i))
            states[i], uploads[i] = update.state, update.upload
        summed = {
            f.name: sum(np.asarray(getattr(u, f.name), np.float64) for u in uploads.values())
            for f in dataclasses.fields(next(iter(uploads.values())))
        }
        total = type(next(iter(uploads.values())))(**summed)
        server, metrics = algorithm.server_step(server, total, len(selected))
        if len(selected) < m:
            assert "potential" not in metrics
            continue
        x = server.w.astype(np.float64)
        direct = lam * sum(values.sum() for values in layer_spectra(server.w, SPEC).values())
        for i, upload in uploads.items():
            y, gamma = upload.w.astype(np.float64), states[i].gamma.astype(np.float64)
            loss = problem.h[i] / 2 * np.sum((y - problem.a[i]) ** 2)
            direct += (loss + gamma @ (x - y) + np.sum((x - y) ** 2) / (2 * eta_g)) / m
        assert metrics["potential"] == pytest.approx(direct, rel=1e-5)
        potentials.append(metrics["potential"])
    assert np.all(np.diff(potentials) <= 1e-6 * np.abs(potentials[1:])), np.diff(potentials)
    assert potentials[-1] < potentials[0]


def test_diagnostics_with_byzantine_clients_that_skip_training_are_refused():
    """Their extra pass has no loss to report (NaN), so their uploads would be refused: a one-line config error."""
    attack = {"kind": "same_value", "fraction": 0.25, "training": "skip"}
    config = tiny_config(algorithm={"name": "flame", "diagnostics": True}, attack=attack)
    with pytest.raises(ConfigError, match="algorithm.diagnostics: true needs attack.training train"):
        validate_config(config)
    validate_config({**config, "attack": {**attack, "training": "train"}})
