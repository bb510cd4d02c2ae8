"""SCAFFOLD's mathematics (Karimireddy et al. 2020, Alg. 1 Option II): round 0 is FedAvg, the control variate is the
mean gradient along the local path, the server's c is the mean of all c_i, and its traffic is twice the model."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from pydantic import ValidationError

from raysim.algorithms import ClientInfo
from raysim.algorithms.families.averaging import WeightedUpload
from raysim.algorithms.fedavg import FedAvg, FedAvgSettings
from raysim.algorithms.requests import LocalSGD, SGDResult
from raysim.algorithms.scaffold import Scaffold, ScaffoldSettings, ScaffoldUpload
from raysim.algorithms.terms import Linear
from raysim.config import validate_config
from raysim.execution import run_client_step
from raysim.models.spec import ParamSpec
from tests.support.experiments import tiny_config
from tests.support.inprocess import InProcess

SPEC = ParamSpec(names=("w", "b"), shapes=((3, 4), (3,)), offsets=(0, 12))


def _sim(algorithm: dict) -> InProcess:
    sections = {"clients": {"count": 5, "per_round": 3}}
    return InProcess(validate_config(tiny_config(algorithm={"lr": 0.05, "batch_size": 16, **algorithm}, **sections)))


def test_round_zero_with_zero_control_variates_is_fedavg_and_later_rounds_are_not():
    scaffold, fedavg = _sim({"name": "scaffold"}), _sim({"name": "fedavg", "aggregation": "uniform"})
    scaffold.round(0), fedavg.round(0)
    np.testing.assert_allclose(scaffold.coordinator.global_model(), fedavg.coordinator.global_model(), atol=1e-6)
    assert scaffold.coordinator.global_model().dtype == np.float32
    assert any(np.any(state.c) for state in scaffold.states.values())  # the selected clients' c_i moved
    scaffold.round(1), fedavg.round(1)
    gap = np.abs(scaffold.coordinator.global_model() - fedavg.coordinator.global_model()).max()
    assert gap > 1e-4  # the correction c - c_i acts from round 1 on


class Quadratic:
    """f_i(y) = h_i/2 ||y - a_i||^2; a LocalSGD request runs `epochs` full-batch gradient steps (plus its linear
    term), so K = epochs and the path is known exactly."""

    def __init__(self, m: int, size: int, seed: int):
        generator = np.random.default_rng(seed)
        self.h = generator.uniform(0.5, 2.0, size=m)
        self.a = generator.normal(size=(m, size))

    def grad(self, i: int, y: np.ndarray) -> np.ndarray:
        return self.h[i] * (y - self.a[i])

    def executor(self, i: int):
        def execute(r: LocalSGD) -> SGDResult:
            y = np.asarray(r.start, np.float64).copy()
            for _ in range(r.epochs):
                linear = r.term(Linear)
                y = y - r.lr * (self.grad(i, y) + (0.0 if linear is None else linear.vector))
            return SGDResult(y.astype(np.float32), 0.0, r.epochs)

        return execute


def _total(uploads: list[ScaffoldUpload]) -> ScaffoldUpload:
    """The runtime's field-by-field sum of the selected clients' uploads."""
    u0 = uploads[0]
    return ScaffoldUpload(
        **{f.name: sum(np.asarray(getattr(u, f.name), np.float64) for u in uploads) for f in dataclasses.fields(u0)}
    )


def test_option_ii_control_variate_is_the_mean_gradient_along_the_local_path():
    """c_i+ = c_i - c + (x - y_K)/(K eta_l) = (1/K) sum_k g_i(y_k) for y_{k+1} = y_k - eta_l (g_i(y_k) - c_i + c);
    with c = c_i the path is plain GD, whose mean gradient is h (x - a)(1 - (1 - eta h)^K)/(K eta h)."""
    m, size, lr, steps = 3, SPEC.size, 0.1, 7
    problem = Quadratic(m, size, seed=1)
    algorithm = Scaffold(ScaffoldSettings(lr=lr, epochs=steps), SPEC)
    generator = np.random.default_rng(2)
    x = generator.normal(size=size).astype(np.float32)
    c = generator.normal(size=size).astype(np.float32)
    server = dataclasses.replace(algorithm.init_server(x, m), c=c.astype(np.float64))
    broadcast = algorithm.broadcast(server)
    info = ClientInfo(0, 10, 1 / m, m)
    c_i = generator.normal(size=size).astype(np.float32)
    update = run_client_step(
        algorithm, info, dataclasses.replace(algorithm.init_client(info, x), c=c_i), broadcast, problem.executor(0)
    )
    y, grads = x.astype(np.float64), []
    for _ in range(steps):
        grads.append(problem.grad(0, y))
        y = y - lr * (grads[-1] - c_i + c)
    np.testing.assert_allclose(update.state.c, np.mean(grads, axis=0), atol=1e-5)
    np.testing.assert_allclose(update.upload.delta_c, update.state.c - c_i, atol=1e-6)
    plain = run_client_step(
        algorithm, info, dataclasses.replace(algorithm.init_client(info, x), c=c), broadcast, problem.executor(0)
    )
    h = problem.h[0]
    closed = h * (x - problem.a[0]) * (1 - (1 - lr * h) ** steps) / (steps * lr * h)
    np.testing.assert_allclose(plain.state.c, closed, atol=1e-5)


def test_server_control_variate_is_the_mean_of_all_client_control_variates():
    """c += (|S|/N) mean_S Delta c_i keeps c = (1/N) sum_i c_i over ALL N clients, under full and partial
    participation."""
    m, size = 5, SPEC.size
    problem = Quadratic(m, size, seed=3)
    algorithm = Scaffold(ScaffoldSettings(lr=0.05, epochs=4), SPEC)
    x0 = np.zeros(size, np.float32)
    server = algorithm.init_server(x0, m)
    states = {i: algorithm.init_client(ClientInfo(i, 10, 1 / m, m), x0) for i in range(m)}
    for selected in (range(m), [0, 2], [1, 2, 4], range(m)):
        broadcast, uploads = algorithm.broadcast(server), []
        for i in selected:
            update = run_client_step(algorithm, ClientInfo(i, 10, 1 / m, m), states[i], broadcast, problem.executor(i))
            states[i] = update.state
            uploads.append(update.upload)
        server, metrics = algorithm.server_step(server, _total(uploads), len(uploads))
        np.testing.assert_allclose(server.c, np.mean([s.c for s in states.values()], axis=0), atol=1e-6)
        assert metrics["control_norm"] == pytest.approx(np.linalg.norm(server.c))
    assert np.any(server.c)


def test_server_learning_rate_scales_the_mean_model_change():
    m, size = 2, SPEC.size
    problem = Quadratic(m, size, seed=4)
    x0 = np.random.default_rng(5).normal(size=size).astype(np.float32)
    models = {}
    for eta_g in (1.0, 0.5):
        algorithm = Scaffold(ScaffoldSettings(lr=0.1, epochs=3, eta_g=eta_g), SPEC)
        server = algorithm.init_server(x0, m)
        uploads = [
            run_client_step(
                algorithm,
                ClientInfo(i, 10, 0.5, m),
                algorithm.init_client(ClientInfo(i, 10, 0.5, m), x0),
                algorithm.broadcast(server),
                problem.executor(i),
            ).upload
            for i in range(m)
        ]
        models[eta_g] = algorithm.server_step(server, _total(uploads), m)[0].w
    np.testing.assert_allclose(models[0.5] - x0, 0.5 * (models[1.0] - x0), atol=1e-6)


def test_uplink_and_downlink_are_twice_fedavgs():
    """fedslr.md 6.5: "SCAFFOLD doubles this": (y_i, Delta c_i) up and (x, c) down, float32 (+ FedAvg's weight)."""
    n = SPEC.size
    x = np.zeros(n, np.float32)
    scaffold, fedavg = Scaffold(ScaffoldSettings(), SPEC), FedAvg(FedAvgSettings(), SPEC)
    assert scaffold.downlink_bytes(scaffold.broadcast(scaffold.init_server(x, 3))) == 2 * 4 * n
    assert fedavg.downlink_bytes(fedavg.broadcast(fedavg.init_server(x, 3))) == 4 * n
    assert scaffold.uplink_bytes(ScaffoldUpload(x, 1.0, x)) == 2 * 4 * n + 4
    assert fedavg.uplink_bytes(WeightedUpload(x, 1.0)) == 4 * n + 4


def test_settings_are_validated():
    with pytest.raises(ValidationError, match="eta_g"):
        ScaffoldSettings(eta_g=0)
    with pytest.raises(ValidationError, match="name"):
        ScaffoldSettings(name="fedavg")
