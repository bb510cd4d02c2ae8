"""APFL on the convex linear-regression problem: alpha = 0 is FedAvg with PM = GM, alpha = 1 is local training, the
adaptive alpha's gradient (eq. 10) is the derivative of the loss along the mixture; communication, settings, and
both executors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raysim.algorithms.apfl import alpha_gradient, mixture
from raysim.config import validate_config
from raysim.errors import ConfigError
from raysim.execution.drivers import drive
from raysim.models.flat import FlatModel
from tests.support.convex import orthogonal_regression
from tests.support.executors import assert_close_runs, run_executor
from tests.support.experiments import tiny_config
from tests.support.inprocess import InProcess

B, N, D = [1.0, 2.0, 3.0], 40, 4
b = np.array(B)[:, None]


def _sim(algorithm: dict, rounds: int, seed: int = 5):
    problem, theta_hat = orthogonal_regression(B, N, D, seed=seed)
    config = validate_config(tiny_config(algorithm=algorithm, clients={"count": 3}, model={"name": "linear"}))
    sim = InProcess(config, problem)
    for round_index in range(rounds):
        sim.round(round_index)
    return sim, theta_hat


def test_alpha_zero_is_fedavg_and_its_pm_the_gm():
    """The w path is FedAvg's local SGD (full batches: the same steps); with alpha = 0 the PM alpha v + (1 - alpha) w
    is the global model itself."""
    apfl, _ = _sim({"name": "apfl", "alpha": 0.0, "lr": 0.2, "batch_size": N, "local_steps": 3}, 3)
    fedavg, _ = _sim({"name": "fedavg", "lr": 0.2, "batch_size": N, "epochs": 3}, 3)
    np.testing.assert_allclose(apfl.server.w, fedavg.server.w, atol=1e-6)
    gm = apfl.coordinator.global_model()
    for state in apfl.states.values():
        assert np.array_equal(apfl.coordinator.algorithm.evaluated_model(state, gm), gm)


def test_alpha_one_makes_v_plain_local_training():
    """grad_v f(alpha v + (1 - alpha) w) = grad f(v) at alpha = 1: v_i is Local's model, round after round."""
    apfl, _ = _sim({"name": "apfl", "alpha": 1.0, "lr": 0.2, "batch_size": N, "local_steps": 2}, 3)
    local, _ = _sim({"name": "local", "lr": 0.2, "batch_size": N, "epochs": 2}, 3)
    for client, state in apfl.states.items():
        np.testing.assert_allclose(state.v, local.states[client].theta, atol=1e-6)


def test_alpha_gradient_is_the_derivative_along_the_mixture():
    """<v - w, grad f(v_bar)> = d/d alpha f(alpha v + (1 - alpha) w), checked by central differences of a real
    model's loss on a quadratic (least squares: f is quadratic in alpha, so the difference quotient is exact up to
    rounding for any step)."""
    model = FlatModel("linear", (6,), 1, "regression")
    generator = np.random.default_rng(0)
    x = torch.from_numpy(generator.normal(size=(20, 6)).astype(np.float32))
    y = torch.from_numpy(generator.normal(size=20).astype(np.float32))
    v, w = (generator.normal(size=model.size).astype(np.float32) for _ in range(2))

    def loss(alpha: float) -> tuple[float, np.ndarray]:
        value, grad = model.loss_and_grad(torch.from_numpy(mixture(v, w, alpha)), x, y)
        return value, grad.numpy()

    alpha, eps = 0.3, 0.1
    analytic = alpha_gradient(v, w, loss(alpha)[1])
    numeric = (loss(alpha + eps)[0] - loss(alpha - eps)[0]) / (2 * eps)
    assert abs(analytic) > 0.1
    np.testing.assert_allclose(analytic, numeric, rtol=1e-5)


def test_adaptive_alpha_takes_the_eq_10_step():
    """Two full-batch steps from v = w = 0 (so the first leaves alpha): v_1 = eta alpha b th, w_1 = eta b th, then
    alpha_2 = alpha - eta_alpha <v_1 - w_1, b (v_bar_1 - th)>, v_bar_1 = alpha v_1 + (1 - alpha) w_1."""
    alpha, eta, eta_alpha = 0.5, 0.2, 0.3
    algorithm = {
        "name": "apfl",
        "alpha": alpha,
        "adaptive_alpha": True,
        "alpha_lr": eta_alpha,
        "lr": eta,
        "batch_size": N,
        "local_steps": 2,
    }
    sim, theta_hat = _sim(algorithm, 1)
    for i, state in sim.states.items():
        v1, w1 = eta * alpha * B[i] * theta_hat[i], eta * B[i] * theta_hat[i]
        mixed = alpha * v1 + (1 - alpha) * w1
        expected = np.clip(alpha - eta_alpha * np.dot(v1 - w1, B[i] * (mixed - theta_hat[i])), 0, 1)
        np.testing.assert_allclose(state.alpha, expected, atol=1e-5)
        assert state.alpha != alpha


def test_communication_is_w_only():
    """Up: w and its weight; down: w (v_i never leaves the client: FedSLR's "2 models" counts parameters)."""
    sim = InProcess(validate_config(tiny_config(algorithm={"name": "apfl"})))
    algorithm, size = sim.coordinator.algorithm, sim.problem.params.size
    assert algorithm.downlink_bytes(sim.coordinator.broadcast()) == 4 * size
    update = drive(
        algorithm.client_step(sim.host.info[0], sim.host.states[0], sim.coordinator.broadcast()),
        sim.host.steps.client_executor(0, 0),
    )
    assert algorithm.uplink_bytes(update.upload) == 4 * size + 4


@pytest.mark.parametrize(("field", "value"), [("alpha", 1.5), ("lr", 0.0), ("alpha_lr", -1.0), ("local_steps", 0)])
def test_settings_are_validated(field, value):
    with pytest.raises(ConfigError, match=f"algorithm.{field}"):
        validate_config(tiny_config(algorithm={"name": "apfl", field: value}))


def test_sequential_and_vectorized_executors_agree():
    algorithm = {"name": "apfl", "lr": 0.05, "batch_size": 16, "adaptive_alpha": True}
    sections = {"model": {"name": "mlp"}, "clients": {"count": 5, "per_round": 4}}
    assert_close_runs(
        run_executor(algorithm, "sequential", **sections), run_executor(algorithm, "vectorized", **sections)
    )
