"""Server optimizers (raysim.algorithms.families.server_optimizers) and the methods that are FedAvg with one
(FedAvgM, FedOpt): each kind's step against Reddi et al.'s Algorithm 2 written out in float64, their special cases
(no momentum at eta = 1 is FedAvg; a round without change leaves the model), running statistics averaged plainly,
and the settings' errors."""

from __future__ import annotations

import numpy as np
import pytest

from raysim.algorithms.families.server_optimizers import (
    ServerOptimizerSettings,
    server_optimizer_step,
    start_server_optimizer,
)
from raysim.config import validate_config
from raysim.errors import ConfigError
from tests.support.experiments import tiny_config
from tests.support.split_models import simulate

KINDS = ("momentum", "adagrad", "adam", "yogi")


def _written_out(kind: str, lr: float, beta1: float, beta2: float, tau: float, x: np.ndarray, means: list) -> list:
    """Reddi et al. 2021, Algorithm 2 (and FedAvgM), in float64: the models after each round."""
    m, v = np.zeros_like(x), np.full_like(x, tau**2)
    models = []
    for mean in means:
        delta = mean - x
        if kind == "momentum":
            m = beta1 * m + delta
            x = x + lr * m
        else:
            m = beta1 * m + (1 - beta1) * delta
            if kind == "adagrad":
                v = v + delta**2
            elif kind == "adam":
                v = beta2 * v + (1 - beta2) * delta**2
            else:
                v = v - (1 - beta2) * delta**2 * np.sign(v - delta**2)
            x = x + lr * m / (np.sqrt(v) + tau)
        models.append(x)
    return models


@pytest.mark.parametrize("kind", KINDS)
def test_each_kind_is_algorithm_2_written_out(kind):
    settings = ServerOptimizerSettings(kind=kind, lr=0.3, beta1=0.8, beta2=0.95, tau=0.01)
    source = np.random.default_rng(0)
    x = source.normal(size=50).astype(np.float32)
    means = [(x + source.normal(scale=0.5, size=50)).astype(np.float32) for _ in range(4)]
    state, model = start_server_optimizer(settings, x), x
    got = []
    for mean in means:
        model, state = server_optimizer_step(settings, state, model, mean)
        assert model.dtype == np.float32
        got.append(model)
    want = _written_out(kind, 0.3, 0.8, 0.95, 0.01, x.astype(np.float64), [m.astype(np.float64) for m in means])
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-5)


def test_nesterov_momentum_is_torchs_sgd_with_nesterov_on_the_negative_change():
    """`nesterov: true` is FL-bench's FedAvgM: torch's SGD(momentum, nesterov=True) stepping on -Delta_t."""
    import torch

    settings = ServerOptimizerSettings(kind="momentum", lr=0.7, beta1=0.9, nesterov=True)
    source = np.random.default_rng(1)
    x = source.normal(size=20).astype(np.float32)
    means = [(x + source.normal(scale=0.5, size=20)).astype(np.float32) for _ in range(4)]
    weights = torch.nn.Parameter(torch.tensor(x, dtype=torch.float64))
    sgd = torch.optim.SGD([weights], lr=0.7, momentum=0.9, nesterov=True)
    state, model = start_server_optimizer(settings, x), x
    for mean in means:
        model, state = server_optimizer_step(settings, state, model, mean)
        sgd.zero_grad()
        weights.grad = weights.detach() - torch.tensor(mean, dtype=torch.float64)
        sgd.step()
        np.testing.assert_allclose(model, weights.detach().numpy(), rtol=1e-5, atol=1e-5)
        weights.data = torch.tensor(model, dtype=torch.float64)  # the same point for the next round's change
    heavy_ball = ServerOptimizerSettings(kind="momentum", lr=0.7, beta1=0.9)
    assert not np.allclose(
        server_optimizer_step(heavy_ball, state, x, means[0])[0], server_optimizer_step(settings, state, x, means[0])[0]
    )


@pytest.mark.parametrize("kind", KINDS)
def test_a_round_without_change_leaves_the_model_and_the_momentum(kind):
    settings = ServerOptimizerSettings(kind=kind)
    x = np.linspace(-1, 1, 7, dtype=np.float32)
    state = start_server_optimizer(settings, x)
    model, after = server_optimizer_step(settings, state, x, x.copy())
    np.testing.assert_array_equal(model, x)
    np.testing.assert_array_equal(after.m, 0.0)


def test_none_is_the_mean_itself_and_keeps_no_state():
    settings = ServerOptimizerSettings()
    mean = np.ones(3, np.float32)
    assert start_server_optimizer(settings, mean) is None
    model, state = server_optimizer_step(settings, None, np.zeros(3, np.float32), mean)
    assert model is mean and state is None


@pytest.mark.parametrize("kind", KINDS)
def test_running_statistics_take_the_mean_whatever_the_optimizer(kind):
    settings = ServerOptimizerSettings(kind=kind, lr=5.0)
    x = np.zeros(6, np.float32)
    mean = np.array([1, 2, 3, 0.5, 0.25, 4], np.float32)
    statistics = np.array([False, False, False, True, True, True])
    model, _ = server_optimizer_step(settings, start_server_optimizer(settings, x), x, mean, statistics)
    np.testing.assert_array_equal(model[statistics], mean[statistics])
    assert not np.allclose(model[~statistics], mean[~statistics])


def test_fedavgm_without_momentum_at_rate_one_is_fedavg_and_with_it_differs():
    plain = simulate({"name": "fedavg", "epochs": 1}, rounds=3)
    flat = {"kind": "momentum", "beta1": 0.0, "lr": 1.0}
    no_momentum = simulate({"name": "fedavgm", "epochs": 1, "server_optimizer": flat}, rounds=3)
    np.testing.assert_allclose(no_momentum.coordinator.global_model(), plain.coordinator.global_model(), atol=1e-6)
    momentum = simulate({"name": "fedavgm", "epochs": 1}, rounds=3)
    assert np.linalg.norm(momentum.coordinator.global_model() - plain.coordinator.global_model()) > 1e-3


def test_any_averaging_method_takes_a_server_optimizer():
    """FedProx with FedYogi's server: its first round moves every coordinate by at most eta (|m / (sqrt(v) + tau)|
    <= 1 for one step from v = tau^2 with beta1 = 0.9, beta2 = 0.99)."""
    optimizer = {"kind": "yogi", "lr": 0.01}
    sim = simulate({"name": "fedprox", "mu": 0.1, "epochs": 1, "server_optimizer": optimizer}, rounds=1)
    change = sim.coordinator.global_model() - sim.problem.init_params
    assert 0 < np.abs(change).max() <= 0.01 + 1e-6


def test_settings_errors_name_the_field():
    with pytest.raises(ConfigError, match="fedavgm's server optimizer is momentum"):
        validate_config(tiny_config(algorithm={"name": "fedavgm", "server_optimizer": {"kind": "adam"}}))
    with pytest.raises(ConfigError, match="fedopt's server optimizer is adagrad, adam or yogi"):
        validate_config(tiny_config(algorithm={"name": "fedopt", "server_optimizer": {"kind": "momentum"}}))
    with pytest.raises(ConfigError, match="server_optimizer.kind"):
        validate_config(tiny_config(algorithm={"name": "fedavg", "server_optimizer": {"kind": "sgd"}}))
    with pytest.raises(ConfigError, match="shared_only"):
        shared_only = {"name": "fedavg", "shared_only": True, "server_optimizer": {"kind": "adam"}}
        validate_config(tiny_config(algorithm=shared_only))
    assert validate_config(tiny_config(algorithm={"name": "fedopt"})).algorithm.server_optimizer.kind == "adam"
