"""ADMM-based Lp-Proj-2 on the convex linear-regression problem: its dual identity, FLAME's updates when P = I, the
closed-form fixed point of (183); the projected proximal term of LocalSGD on both trainers; GM, communication,
settings, and both executors."""

from __future__ import annotations

import numpy as np
import pytest

from raysim.algorithms.lp_proj import gaussian_projection
from raysim.algorithms.requests import LocalSGD
from raysim.algorithms.terms import ProjectedProx
from raysim.config import validate_config
from raysim.errors import ConfigError
from raysim.models.flat import FlatModel
from raysim.training.local import LocalTrainer
from raysim.training.vectorized import VectorizedTrainer
from tests.support.convex import orthogonal_regression
from tests.support.executors import assert_close_runs, client_data, run_executor
from tests.support.experiments import tiny_config
from tests.support.inprocess import InProcess

B, N, D = [1.0, 2.0, 3.0], 40, 4


def _sim(algorithm: dict, seed: int = 3, identity: bool = False) -> tuple[InProcess, np.ndarray]:
    problem, theta_hat = orthogonal_regression(B, N, D, seed=seed)
    config = validate_config(tiny_config(algorithm=algorithm, clients={"count": 3}, model={"name": "linear"}))
    sim = InProcess(config, problem)
    if identity:  # P = I (d_sub = d); w^0 = P theta^0 = 0 for either P, so the initial states are already right
        for algorithm_instance in (sim.coordinator.algorithm, sim.host.algorithm):
            algorithm_instance.projection = np.eye(D, dtype=np.float32)
    return sim, theta_hat


def test_the_dual_is_lambda_alpha_times_the_projected_gap():
    """(186) gives lambda alpha_i P theta_i = (lambda alpha_i + rho) w_i - rho w + pi_i^old, and (187) makes the
    right side lambda alpha_i w_i + pi_i^new: so pi_i = lambda alpha_i (P theta_i - w_i) after every update (FLAME's
    Lemma 3 with P theta_i), for every client that has trained, whatever the data."""
    lam = 2.0
    sim, _ = _sim({"name": "lp_proj", "lambda": lam, "rho": 0.3, "d_sub": 2, "lr": 0.1, "batch_size": 16})
    algorithm = sim.host.algorithm
    for round_index in range(4):
        metrics = sim.round(round_index)
        for state in sim.states.values():
            expected = lam / 3 * (algorithm.project(state.theta) - state.w)
            np.testing.assert_allclose(state.pi, expected, atol=1e-6)
            assert np.linalg.norm(state.pi) > 1e-3
    assert all(np.isfinite(v) for v in metrics.values())


def test_identity_projection_is_flame():
    """With P = I the projected prox lambda P^T (P theta - w_i) is FLAME's lambda (theta - w_i) and (186)-(188) are
    (12)-(14): the same states and global model as FLAME's, round after round (mini-batches, both prox centres)."""
    for center in ("local", "global"):
        settings = {"lambda": 1.5, "rho": 0.4, "lr": 0.1, "batch_size": 16, "epochs": 2, "prox_center": center}
        lp, _ = _sim({"name": "lp_proj", "d_sub": D, **settings}, identity=True)
        flame, _ = _sim({"name": "flame", **settings})
        for round_index in range(3):
            lp.round(round_index)
            flame.round(round_index)
        np.testing.assert_allclose(lp.server.w, flame.server.w, atol=1e-6)
        for client, state in lp.states.items():
            for field in ("theta", "w", "pi"):
                np.testing.assert_allclose(getattr(state, field), getattr(flame.states[client], field), atol=1e-6)


def test_converges_to_the_closed_form_fixed_point():
    """f_i(theta) = b_i/2 ||theta - th_i||^2 + c. Stationarity of (183) with w_i = w: b_i (theta_i - th_i) +
    lambda P^T (P theta_i - w) = 0, i.e. theta_i = M_i^{-1} (b_i th_i + lambda P^T w) with M_i = b_i I + lambda P^T P,
    and w = (1/m) sum_i P theta_i (alpha_i = 1/m), a linear system for w in R^{d_sub}; at it sum_i pi_i = 0."""
    lam, d_sub = 1.0, 2
    sim, theta_hat = _sim(
        {"name": "lp_proj", "lambda": lam, "rho": 0.5, "d_sub": d_sub, "lr": 0.1, "batch_size": N, "epochs": 40}
    )
    for round_index in range(150):
        sim.round(round_index)
    p = sim.host.algorithm.projection.astype(np.float64)
    inverses = [np.linalg.inv(b_i * np.eye(D) + lam * p.T @ p) for b_i in B]
    system = np.eye(d_sub) - lam / 3 * sum(p @ m @ p.T for m in inverses)
    pulled = sum(p @ m @ (b_i * t) for m, b_i, t in zip(inverses, B, theta_hat, strict=True))
    w_star = np.linalg.solve(system, pulled / 3)
    np.testing.assert_allclose(sim.server.w, w_star, atol=1e-4)
    for i, state in sim.states.items():
        np.testing.assert_allclose(state.theta, inverses[i] @ (B[i] * theta_hat[i] + lam * p.T @ w_star), atol=1e-4)
        np.testing.assert_allclose(state.w, w_star, atol=1e-4)
    np.testing.assert_allclose(sum(s.pi for s in sim.states.values()), 0.0, atol=1e-4)


def test_projection_has_unit_rows_and_is_the_same_everywhere():
    p = gaussian_projection(10, 500, seed=4)
    assert p.shape == (10, 500) and p.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(p, axis=1), 1.0, atol=1e-6)
    assert np.array_equal(p, gaussian_projection(10, 500, seed=4))
    assert not np.array_equal(p, gaussian_projection(10, 500, seed=5))


def test_gm_is_the_least_norm_lift_and_messages_are_d_sub_numbers():
    """The logged GM is P^+ w (P P^+ w = w, least norm); w, u_i and the broadcast are d_sub numbers."""
    sim = InProcess(validate_config(tiny_config(algorithm={"name": "lp_proj", "d_sub": 3, "lr": 0.05})))
    for round_index in range(2):
        sim.round(round_index)
    algorithm, w = sim.coordinator.algorithm, sim.server.w
    gm = sim.coordinator.global_model()
    assert gm.shape == (sim.problem.params.size,) and w.shape == (3,)
    np.testing.assert_allclose(algorithm.project(gm), w, atol=1e-5)
    p = algorithm.projection.astype(np.float64)
    np.testing.assert_allclose(gm, p.T @ np.linalg.lstsq(p.T, gm, rcond=None)[0], atol=1e-6)  # in P's row space
    assert algorithm.downlink_bytes(sim.coordinator.broadcast()) == 4 * 3
    state = sim.states[0]
    assert algorithm.uplink_bytes(type(algorithm).Upload(np.zeros_like(state.w))) == 4 * 3


def test_projected_prox_agrees_between_trainers():
    """LocalSGD's projected proximal term: grad += weight P^T (P x - c), on LocalTrainer and stacked
    (VectorizedTrainer), with momentum and a per-client centre."""
    model = FlatModel("mlp", (2, 3, 4), 5)
    clients = client_data([9, 14, 5], seed=1)
    projection = gaussian_projection(4, model.size, seed=0)
    centers = np.random.default_rng(2).normal(size=(3, 4)).astype(np.float32)
    starts = np.stack([model.initial_parameters(s) for s in range(3)])
    requests = [
        LocalSGD(
            starts[i],
            2,
            0.1,
            4,
            momentum=0.5,
            terms=(ProjectedProx(projection, centers[i], 3.0),),
        )
        for i in range(3)
    ]
    jobs = [(r, c, np.random.default_rng(i)) for i, (r, c) in enumerate(zip(requests, clients, strict=True))]
    want = [LocalTrainer(model).sgd(r, c, np.random.default_rng(i)) for i, (r, c, _) in enumerate(jobs)]
    got = VectorizedTrainer(model).sgd(jobs)
    for w, g in zip(want, got, strict=True):
        np.testing.assert_allclose(g.params, w.params, atol=1e-5)
    plain = LocalTrainer(model).sgd(LocalSGD(starts[0], 2, 0.1, 4, momentum=0.5), clients[0], np.random.default_rng(0))
    assert np.linalg.norm(plain.params - want[0].params) > 1e-3  # the term acts


def test_a_projected_prox_needs_its_matrix_and_centre():
    with pytest.raises(TypeError, match="projection.*center"):
        ProjectedProx(weight=1.0)  # type: ignore[call-arg]


@pytest.mark.parametrize(("field", "value"), [("d_sub", 0), ("lambda", 0.0), ("rho", -1.0), ("prox_center", "w")])
def test_settings_are_validated(field, value):
    with pytest.raises(ConfigError, match=f"algorithm.{field}"):
        validate_config(tiny_config(algorithm={"name": "lp_proj", field: value}))


def test_sequential_and_vectorized_executors_agree():
    algorithm = {"name": "lp_proj", "lambda": 1.0, "rho": 0.25, "lr": 0.05, "batch_size": 32, "momentum": 0.5}
    sections = {"model": {"name": "mlp"}, "clients": {"count": 6, "per_round": 4}}
    assert_close_runs(
        run_executor(algorithm, "sequential", **sections), run_executor(algorithm, "vectorized", **sections)
    )


def _envelope_gradient(p: np.ndarray, lam: float, b_i: float, a_i: np.ndarray, w: np.ndarray) -> np.ndarray:
    """grad F_i(w) for F_i(w) = min_theta b_i/2 ||theta - a_i||^2 + lambda/2 ||w - P theta||^2, the infimal
    convolution of two quadratics: F_i(w) = 1/2 (w - P a_i)^T K_i (w - P a_i), K_i = (I/lambda + P P^T/b_i)^{-1}."""
    k = np.linalg.inv(np.eye(len(p)) / lam + p @ p.T / b_i)
    return k @ (w - p @ a_i)


def test_lin_et_al_local_rounds_are_gradient_steps_on_the_envelope():
    """`solver: lin` (Lin et al.): with the theta-step solved exactly (full batch, 150 epochs from theta^0), each
    w_i-step w_i - eta lambda (w_i - P theta_i) is a gradient step on F_i, whose gradient is the closed form above;
    after R = 2 local rounds from w^0 = 0 the server's w is the mean of the three w_i, pi_i stays 0, and the message
    is w_i."""
    lam, eta, d_sub = 1.0, 0.3, 2
    settings = {"name": "lp_proj", "solver": "lin", "lambda": lam, "w_lr": eta, "local_rounds": 2, "d_sub": d_sub}
    sim, theta_hat = _sim({**settings, "lr": 0.2, "batch_size": N, "epochs": 150})
    p = sim.host.algorithm.projection.astype(np.float64)
    w = sim.server.w.astype(np.float64)
    expected = []
    for b_i, a_i in zip(B, theta_hat, strict=True):
        w_i = w.copy()
        for _ in range(2):
            w_i = w_i - eta * _envelope_gradient(p, lam, b_i, a_i, w_i)
        expected.append(w_i)
    sim.round(0, [0, 1, 2])
    np.testing.assert_allclose(sim.server.w, np.mean(expected, axis=0), atol=1e-5)
    for i, state in sim.states.items():
        np.testing.assert_allclose(state.w, expected[i], atol=1e-5)
        assert not state.pi.any()
    assert np.linalg.norm(sim.server.w - w) > 0.05


def test_lin_et_al_and_admm_reach_the_same_minimizer_of_the_envelopes():
    """Both solvers minimize sum_i F_i (alpha_i = 1/m). With one local round (R = 1) Lin et al.'s server step is
    w - eta mean_i grad F_i(w), whose fixed point is the zero of sum_i grad F_i, solved here in closed form from the
    envelope gradients, sum_i K_i (w - P a_i) = 0; it is the ADMM reading's fixed point
    (test_converges_to_the_closed_form_fixed_point). (R > 1 local steps drift from it, as FedAvg's do.)"""
    lam, d_sub = 1.0, 2
    sim, theta_hat = _sim(
        {
            "name": "lp_proj",
            "solver": "lin",
            "lambda": lam,
            "w_lr": 1.0,
            "local_rounds": 1,
            "d_sub": d_sub,
            "lr": 0.2,
            "batch_size": N,
            "epochs": 40,
        }
    )
    for round_index in range(60):
        sim.round(round_index, [0, 1, 2])
    p = sim.host.algorithm.projection.astype(np.float64)
    ks = [np.linalg.inv(np.eye(d_sub) / lam + p @ p.T / b_i) for b_i in B]
    w_star = np.linalg.solve(sum(ks), sum(k @ p @ a for k, a in zip(ks, theta_hat, strict=True)))
    np.testing.assert_allclose(sim.server.w, w_star, atol=1e-4)
    inverses = [np.linalg.inv(b_i * np.eye(D) + lam * p.T @ p) for b_i in B]  # the ADMM reading's fixed point
    system = np.eye(d_sub) - lam / 3 * sum(p @ m @ p.T for m in inverses)
    pulled = sum(p @ m @ (b_i * t) for m, b_i, t in zip(inverses, B, theta_hat, strict=True))
    np.testing.assert_allclose(np.linalg.solve(system, pulled / 3), w_star, atol=1e-10)
