"""Per-FedAvg on the convex linear-regression problem: alpha = 0 is FedAvg, the FO and HF steps match their closed
forms, the PM is one gradient step from the received model; communication, settings, and both executors."""

from __future__ import annotations

import numpy as np
import pytest

from raysim.algorithms import build_algorithm
from raysim.algorithms.interface import ClientInfo
from raysim.algorithms.requests import BatchGradients
from raysim.config import validate_config
from raysim.errors import ConfigError
from raysim.execution.drivers import drive
from raysim.models.flat import FlatModel
from raysim.training.local import ClientData, LocalTrainer
from raysim.training.vectorized import VectorizedTrainer
from tests.support.convex import B, D, N, b, orthogonal_regression
from tests.support.convex import run_orthogonal as _sim
from tests.support.executors import assert_close_runs, client_data, run_executor
from tests.support.experiments import tiny_config
from tests.support.inprocess import InProcess


def test_alpha_zero_is_fedavg_with_lr_beta():
    """With alpha = 0, temp = w and each step is w - beta grad f_i(w; D'): with full batches, FedAvg's epochs of
    full-batch steps at lr beta, to float rounding."""
    perfedavg, _ = _sim({"name": "perfedavg", "alpha": 0.0, "lr": 0.2, "batch_size": N, "local_steps": 3}, 3)
    fedavg, _ = _sim({"name": "fedavg", "lr": 0.2, "batch_size": N, "epochs": 3}, 3)
    np.testing.assert_allclose(perfedavg.server.w, fedavg.server.w, atol=1e-6)
    assert np.linalg.norm(perfedavg.server.w) > 0.1  # it moved


@pytest.mark.parametrize("hessian", ["first_order", "finite_difference"])
def test_one_step_matches_the_closed_form_meta_gradient(hessian):
    """f_i(x) = b_i/2 ||x - th_i||^2 + c: grad f_i(x - alpha grad f_i(x)) = b_i (1 - alpha b_i)(x - th_i), the FO
    direction; the exact MAML gradient (I - alpha H) of it, b_i (1 - alpha b_i)^2 (x - th_i), is what HF's
    finite differences give on a quadratic (exact up to rounding). One full-batch step per client from w^0 = 0,
    then the server's mean (equal sample counts)."""
    alpha, beta = 0.1, 0.2
    algorithm = {
        "name": "perfedavg",
        "alpha": alpha,
        "lr": beta,
        "batch_size": N,
        "local_steps": 1,
        "hessian": hessian,
        "delta": 0.1,
    }
    sim, theta_hat = _sim(algorithm, 1)
    power = 1 if hessian == "first_order" else 2
    local = beta * b * (1 - alpha * b) ** power * theta_hat  # w^0 = 0: w - beta g = beta b (1 - alpha b)^k th
    np.testing.assert_allclose(sim.server.w, local.mean(0), atol=2e-5)
    for i, state in sim.states.items():  # PM: one full-batch step of lr alpha from the received w^0 = 0
        np.testing.assert_allclose(state.personal, alpha * B[i] * theta_hat[i], atol=1e-5)


def test_a_heldout_client_adapts_the_current_global_model():
    """`adapt`: one gradient step of lr alpha on its training split from the given global model."""
    problem, theta_hat = orthogonal_regression(B, N, D, seed=5)
    config = validate_config(
        tiny_config(algorithm={"name": "perfedavg", "alpha": 0.1}, clients={"count": 3}, model={"name": "linear"})
    )
    algorithm = build_algorithm(config.algorithm, problem.params)
    model = FlatModel("linear", (D,), 1, "regression")
    info, split = problem.clients[1]
    data = ClientData(problem.x, problem.y, split.train, split.test, split.val)
    w = np.ones(D, np.float32)
    heldout = ClientInfo(3, N, 0.0, 3)
    adapted = drive(algorithm.adapt(heldout, w), lambda request: LocalTrainer(model).full_gradient(request, data, None))
    np.testing.assert_allclose(adapted, w - 0.1 * B[1] * (w - theta_hat[1]), atol=1e-5)


def test_batch_gradients_agree_between_the_trainers():
    """The vectorized trainer's BatchGradients rows are LocalTrainer's, batch for batch (same draws)."""
    model = FlatModel("mlp", (2, 3, 4), 5)
    clients = client_data([7, 12, 3], seed=2, noisy=1)
    points = np.stack([np.stack([model.initial_parameters(s), model.initial_parameters(s + 10)]) for s in range(3)])
    request = BatchGradients(points, batch_size=5)
    want = [
        LocalTrainer(model).batch_gradients(BatchGradients(points[i], 5), c, np.random.default_rng(i))
        for i, c in enumerate(clients)
    ]
    got = VectorizedTrainer(model).batch_gradients_rows(request, clients, [np.random.default_rng(i) for i in range(3)])
    np.testing.assert_allclose(got.grads, np.stack([r.grads for r in want]), atol=1e-6)
    np.testing.assert_allclose(got.losses, np.stack([r.losses for r in want]), rtol=1e-6)


def test_communication_is_the_model_both_ways():
    """Down: w; up: the local model and its weight (FedAvg's accounting)."""
    config = validate_config(tiny_config(algorithm={"name": "perfedavg"}))
    sim = InProcess(config)
    algorithm, size = sim.coordinator.algorithm, sim.problem.params.size
    assert algorithm.downlink_bytes(sim.coordinator.broadcast()) == 4 * size
    steps = sim.host.steps  # a real client step's upload
    info = sim.host.info[0]
    result = drive(
        algorithm.client_step(info, sim.host.states[0], sim.coordinator.broadcast()), steps.client_executor(0, 0)
    )
    assert algorithm.uplink_bytes(result.upload) == 4 * size + 4


@pytest.mark.parametrize(
    ("field", "value"), [("lr", 0.0), ("alpha", -0.1), ("hessian", "autograd"), ("local_steps", 0)]
)
def test_settings_are_validated(field, value):
    with pytest.raises(ConfigError, match=f"algorithm.{field}"):
        validate_config(tiny_config(algorithm={"name": "perfedavg", field: value}))


@pytest.mark.parametrize("hessian", ["first_order", "finite_difference"])
def test_sequential_and_vectorized_executors_agree(hessian):
    algorithm = {"name": "perfedavg", "alpha": 0.05, "lr": 0.1, "batch_size": 16, "hessian": hessian}
    sections = {"model": {"name": "mlp"}, "clients": {"count": 5, "per_round": 4}}
    assert_close_runs(
        run_executor(algorithm, "sequential", **sections), run_executor(algorithm, "vectorized", **sections)
    )
