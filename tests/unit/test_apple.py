"""APPLE (raysim.algorithms.apple): with p_i one-hot on the client and eta_2 = 0 it is local training; its steps on a
hand-made quadratic are the chain rule through pm_i = sum_j p_ij theta_j (torch's autograd and SGD, momentum too),
the DR gradient a derivative along p_j; the loss scheduler; the server step on hand-made messages; what goes up
and down."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from raysim.algorithms import ClientInfo, build_algorithm
from raysim.algorithms.apple import (
    Apple,
    AppleBroadcast,
    AppleClientState,
    AppleServerState,
    AppleSettings,
    loss_weight,
    personalized,
    relationship_gradient,
)
from raysim.algorithms.requests import BatchGradients, BatchGradientsResult
from raysim.config import validate_config
from raysim.errors import ConfigError
from raysim.execution import run_client_step
from raysim.models.spec import ParamSpec
from tests.support.convex import orthogonal_regression
from tests.support.experiments import tiny_config
from tests.support.inprocess import InProcess
from tests.support.split_models import simulate, step_results

SPEC = ParamSpec(("w", "b"), ((2, 2), (2,)), (0, 4))
"""A 2 x 2 weight and a bias: 6 parameters in two tensors."""

B, N, D = [1.0, 2.0, 3.0], 40, 4


def _algorithm(**settings) -> Apple:
    algorithm = build_algorithm(AppleSettings(name="apple", **settings), SPEC)
    assert isinstance(algorithm, Apple)
    return algorithm


class Quadratic:
    """f(x) = (x - c)^T A (x - c) / 2 with A symmetric positive definite: g = A (x - c). Answers BatchGradients
    requests exactly (every batch the whole objective) and records the points asked."""

    def __init__(self, size: int, seed: int):
        generator = np.random.default_rng(seed)
        q = generator.normal(size=(size, size))
        self.a = q @ q.T / size + np.eye(size)
        self.c = generator.normal(size=size)
        self.points: list[np.ndarray] = []

    def loss(self, x: np.ndarray) -> float:
        d = np.asarray(x, np.float64) - self.c
        return float(d @ self.a @ d / 2)

    def __call__(self, request: BatchGradients) -> BatchGradientsResult:
        points = np.asarray(request.points, np.float64)
        self.points += list(points)
        grads = (points - self.c) @ self.a
        return BatchGradientsResult(grads.astype(np.float32), np.array([self.loss(x) for x in points]))


def _hand_made(m: int = 3, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """m core models and a prior p_0 (not uniform) on SPEC."""
    generator = np.random.default_rng(seed)
    models = generator.normal(size=(m, SPEC.size)).astype(np.float32)
    weights = generator.uniform(0.5, 2.0, size=m)
    return models, weights / weights.sum()


def test_with_p_one_hot_on_itself_and_no_p_learning_it_is_local_training():
    """pm_i = theta_i and the step theta_i - eta p_ii g = theta_i - eta grad f_i(theta_i): Local's model round after
    round (full batches, so that BatchGradients' batch and Local's pass are the same), the PM the core model; the
    other clients' core models never enter."""
    problem, _ = orthogonal_regression(B, N, D, seed=5)
    rounds, steps, lr = 3, 2, 0.2
    apple_config = {"name": "apple", "lr": lr, "batch_size": N, "local_steps": steps, "p_lr": 0.0, "mu": 5.0}
    apple = InProcess(
        validate_config(tiny_config(algorithm=apple_config, clients={"count": 3}, model={"name": "linear"})), problem
    )
    for client in range(3):
        apple.host.states[client] = AppleClientState(np.eye(3)[client], np.zeros(0, np.float32))
    local_config = {"name": "local", "lr": lr, "batch_size": N, "epochs": steps}
    local = InProcess(
        validate_config(tiny_config(algorithm=local_config, clients={"count": 3}, model={"name": "linear"})), problem
    )
    for round_index in range(rounds):
        apple.round(round_index)
        local.round(round_index)
    server = apple.server
    assert isinstance(server, AppleServerState)
    for client, state in apple.states.items():
        theta = local.states[client].theta
        np.testing.assert_array_equal(state.p, np.eye(3)[client])
        np.testing.assert_allclose(state.personal, theta, atol=1e-6)
        np.testing.assert_allclose(server.models[client], theta, atol=1e-6)
        assert np.linalg.norm(theta) > 0.5


def test_the_step_on_a_quadratic_is_autograd_through_the_combination():
    """K steps of torch.optim.SGD (momentum 0.9, the authors' optimizer) on f(sum_j p_j theta_j) + lambda mu / 2
    ||p - p_0||^2 with only theta_i and p trainable: the same theta_i, p and, from them, pm_i."""
    models, prior = _hand_made()
    i, lr, p_lr, mu, momentum, round_index, decay, steps = 1, 0.05, 0.02, 0.7, 0.9, 2, 5, 4
    algorithm = _algorithm(
        lr=lr, p_lr=p_lr, mu=mu, momentum=momentum, decay_rounds=decay, local_steps=steps, batch_size=8
    )
    quadratic = Quadratic(SPEC.size, seed=1)
    state = AppleClientState(np.zeros(0), np.zeros(0, np.float32))
    client = ClientInfo(i, 10, 1 / 3, 3)
    update = run_client_step(algorithm, client, state, AppleBroadcast(models, prior, round_index), quadratic)

    pull = loss_weight(round_index, decay, "cosine") * mu
    cores = [torch.tensor(row, dtype=torch.float64) for row in models]
    cores[i].requires_grad_(True)
    p = torch.tensor(prior, dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.SGD([{"params": [cores[i]], "lr": lr}, {"params": [p], "lr": p_lr}], momentum=momentum)
    a, c = torch.tensor(quadratic.a), torch.tensor(quadratic.c)
    for _ in range(steps):
        optimizer.zero_grad()
        pm = sum(p[j] * cores[j] for j in range(3))
        loss = (pm - c) @ a @ (pm - c) / 2 + pull / 2 * torch.sum((p - torch.tensor(prior)) ** 2)
        loss.backward()
        optimizer.step()
    assert len(quadratic.points) == steps
    np.testing.assert_allclose(update.upload.core, cores[i].detach().numpy(), rtol=0, atol=1e-5)
    np.testing.assert_allclose(update.state.p, p.detach().numpy(), rtol=0, atol=1e-6)
    expected = models.astype(np.float64).copy()
    expected[i] = cores[i].detach().numpy()
    np.testing.assert_allclose(update.state.personal, p.detach().numpy() @ expected, atol=1e-5)
    assert np.abs(update.state.p - prior).max() > 1e-3  # p moved
    np.testing.assert_allclose(update.upload.weight, 1 / 3)


def test_one_step_written_out_the_other_core_models_stay_and_the_client_keeps_its_p():
    """From a kept p: theta_i' = theta_i - eta_1 p_ii g, p' = p - eta_2 (Theta g + lambda mu (p - p_0)), g the
    gradient at pm = p Theta; the server's copies of the others are the client's too."""
    models, prior = _hand_made(4, seed=3)
    p = np.array([0.1, 0.6, -0.2, 0.5])
    algorithm = _algorithm(lr=0.1, p_lr=0.01, mu=2.0, decay_rounds=4, scheduler="exponential", local_steps=1)
    quadratic = Quadratic(SPEC.size, seed=4)
    state = AppleClientState(p.copy(), np.zeros(0, np.float32))
    update = run_client_step(algorithm, ClientInfo(2, 5, 0.25, 4), state, AppleBroadcast(models, prior, 1), quadratic)
    pm = p @ models.astype(np.float64)
    np.testing.assert_allclose(quadratic.points[0], pm, atol=1e-6)
    g = quadratic.a @ (pm - quadratic.c)
    pull = 2.0 * 1e-3 ** (1 / 4)
    np.testing.assert_allclose(update.state.p, p - 0.01 * (models @ g + pull * (p - prior)), atol=1e-6)
    np.testing.assert_allclose(update.upload.core, models[2] - 0.1 * p[2] * g, atol=1e-6)
    moved = models.astype(np.float64).copy()
    moved[2] = update.upload.core
    np.testing.assert_allclose(update.state.personal, update.state.p @ moved, atol=1e-6)
    assert update.metrics["self_weight"] == pytest.approx(update.state.p[2])


def test_the_dr_gradient_is_the_derivative_along_p_j_and_layer_mean_is_pfllibs():
    """<grad f(pm), theta_j> = d/d p_j f(sum_k p_k theta_k), by central differences (f quadratic: exact up to
    rounding); `layer_mean`: the mean over the two tensors of mean(g * theta_j) over each."""
    models, prior = _hand_made(4, seed=6)
    quadratic = Quadratic(SPEC.size, seed=7)
    p = prior + np.array([0.2, -0.1, 0.05, 0.3])
    grad = quadratic.a @ (p @ models.astype(np.float64) - quadratic.c)
    exact = relationship_gradient(models, grad, SPEC)
    eps = 1e-3
    for j in range(4):
        step = eps * np.eye(4)[j]
        numeric = (quadratic.loss((p + step) @ models) - quadratic.loss((p - step) @ models)) / (2 * eps)
        assert exact[j] == pytest.approx(numeric, rel=1e-6)
    layer_mean = relationship_gradient(models, grad, SPEC, "layer_mean")
    products = models.astype(np.float64) * grad
    np.testing.assert_allclose(layer_mean, (products[:, :4].mean(axis=1) + products[:, 4:].mean(axis=1)) / 2)


def test_the_loss_scheduler_falls_from_1_to_0_at_round_L():
    assert loss_weight(0, 10, "cosine") == 1.0
    assert loss_weight(5, 10, "cosine") == pytest.approx(0.5)
    assert loss_weight(2, 10, "cosine") == pytest.approx((math.cos(math.pi / 5) + 1) / 2)
    assert loss_weight(0, 10, "exponential") == 1.0
    assert loss_weight(5, 10, "exponential") == pytest.approx(math.sqrt(1e-3))
    for kind in ("cosine", "exponential"):
        values = [loss_weight(r, 10, kind) for r in range(10)]
        assert all(a > b > 0 for a, b in zip(values, values[1:], strict=False))
        assert loss_weight(10, 10, kind) == loss_weight(25, 10, kind) == 0.0


def test_the_pull_follows_the_broadcast_round_and_ends_at_L():
    """With g = 0 (theta at the quadratic's minimum) only the pull moves p: p' - p_0 = (1 - eta_2 lambda(r) mu)
    (p - p_0); from round L on p stays."""
    prior = np.full(3, 1 / 3)
    c = np.random.default_rng(8).normal(size=SPEC.size).astype(np.float32)
    quadratic = Quadratic(SPEC.size, seed=9)
    quadratic.c = c.astype(np.float64)
    models = np.zeros((3, SPEC.size), np.float32)
    models[0] = c
    p = np.array([1.0, 0.0, 0.0])
    algorithm = _algorithm(p_lr=0.1, mu=2.0, decay_rounds=4, local_steps=1)
    for round_index in range(6):
        state = AppleClientState(p.copy(), np.zeros(0, np.float32))
        broadcast = AppleBroadcast(models, prior, round_index)
        update = run_client_step(algorithm, ClientInfo(0, 5, 1 / 3, 3), state, broadcast, quadratic)
        shrink = 1 - 0.1 * 2.0 * loss_weight(round_index, 4, "cosine")
        np.testing.assert_allclose(update.state.p - prior, shrink * (p - prior), atol=1e-12)
        np.testing.assert_array_equal(update.upload.core, c)
    assert shrink == 1.0


def test_the_server_keeps_every_clients_latest_core_model_and_weight():
    """Uploads replace their rows, the others stay; p_0 is the weights normalized, the GM sum_j p_0j theta_j; the
    round counts on."""
    models, _ = _hand_made(4, seed=10)
    algorithm = _algorithm()
    server = algorithm.init_server(np.ones(SPEC.size, np.float32), 4)
    np.testing.assert_array_equal(algorithm.broadcast(server).prior, np.full(4, 0.25))
    messages = {1: np.append(models[1], 0.4), 3: np.append(models[3], 0.1)}
    new, metrics = algorithm.server_step_by_client(server, None, 2, messages)
    np.testing.assert_array_equal(new.models[[1, 3]], models[[1, 3]])
    np.testing.assert_array_equal(new.models[[0, 2]], np.ones((2, SPEC.size), np.float32))
    weights = np.array([0.25, 0.4, 0.25, 0.1])
    broadcast = algorithm.broadcast(new)
    np.testing.assert_allclose(broadcast.prior, weights / weights.sum())
    assert broadcast.round == new.round == 1
    np.testing.assert_allclose(algorithm.global_model(new), broadcast.prior @ new.models, atol=1e-6)
    assert metrics["global_change"] > 0


def test_with_samples_weighting_p_0_becomes_n_j_over_n_once_every_client_has_uploaded():
    """Round 0 pulls towards 1/m (no weight heard yet); the clients' messages carry alpha_j = n_j / n (as float32)."""
    sim = simulate({"name": "apple", "local_steps": 2}, rounds=0, clients={"count": 5, "weighting": "samples"})
    np.testing.assert_array_equal(sim.coordinator.broadcast().prior, np.full(5, 0.2))
    sim.round(0)
    sizes = np.array([info.num_train for info in sim.host.info.values()], np.float64)
    assert len(set(sizes)) > 1
    prior = sim.coordinator.broadcast().prior
    np.testing.assert_allclose(prior, sizes / sizes.sum(), rtol=1e-7)


def test_a_client_deploys_the_gm_until_it_trains_then_its_own_combination():
    sim = simulate({"name": "apple", "p_lr": 0.01, "local_steps": 2}, rounds=0)
    algorithm = sim.host.algorithm
    assert all(algorithm.personalized_model(state) is None for state in sim.states.values())
    broadcast = sim.coordinator.broadcast()
    update = step_results(sim, 2, broadcast).update
    copies = np.array(broadcast.models, np.float32)
    copies[2] = update.upload.core
    np.testing.assert_allclose(update.state.personal, personalized(update.state.p, copies), atol=1e-6)
    np.testing.assert_array_equal(algorithm.personalized_model(update.state), update.state.personal)


def test_each_client_receives_the_other_core_models_and_p_0_and_sends_its_core_model_and_weight():
    sim = simulate({"name": "apple", "local_steps": 2}, rounds=2)
    algorithm = sim.host.algorithm
    n = algorithm.params.size
    broadcast = sim.coordinator.broadcast()
    assert isinstance(broadcast, AppleBroadcast) and broadcast.models.shape == (5, n)
    assert algorithm.downlink_bytes(broadcast) == 4 * (4 * n + 5)
    update = step_results(sim, 0, broadcast).update
    assert algorithm.uplink_bytes(update.upload) == 4 * (n + 1)
    np.testing.assert_array_equal(algorithm.message(update), np.append(update.upload.core, 0.2))
    assert not algorithm.Upload.carries_message()  # attacks and robust rules are refused
    server = sim.server
    assert isinstance(server, AppleServerState) and server.round == 2
    for client, state in sim.states.items():  # a trained client's p, and the server's copy of its core model
        if state.p.size:
            assert not np.array_equal(server.models[client], sim.problem.init_params)


@pytest.mark.parametrize(("field", "value"), [("p_lr", -0.1), ("decay_rounds", 0), ("momentum", 1.0), ("mu", -1)])
def test_settings_are_validated(field, value):
    with pytest.raises(ConfigError, match=f"algorithm.{field}"):
        validate_config(tiny_config(algorithm={"name": "apple", field: value}))
