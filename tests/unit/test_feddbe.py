"""FedDBE (raysim.algorithms.feddbe): the PRBM before the head and the PM that folds it into the head's bias, MR's
gradient on a hand-made batch (and its running mean), the consensus the server makes once from the initialization
round's mean representations, the special case that coincides with FedAvg, and the communication accounting."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raysim.algorithms import ClientInfo, build_algorithm
from raysim.algorithms.feddbe import (
    DomainBiasLoss,
    FedDBEServerState,
    FedDBESettings,
    FedDBEUpload,
)
from raysim.errors import ConfigError
from raysim.execution.drivers import run_client_step
from raysim.models.flat import FlatModel
from raysim.models.spec import ParamSpec
from raysim.runtime.problem import sample_clients
from tests.support.features import CLASSES, DIM
from tests.support.split_models import simulate, step_results

FEATURES = 64
"""d: the features of the tests' mlp (DIM-128-64-CLASSES: Flatten, Linear 1, ReLU, Linear 3, ReLU, head 5)."""


def _batch(seed: int = 0) -> tuple[FlatModel, torch.Tensor, torch.Tensor, torch.Tensor]:
    source = np.random.default_rng(seed)
    model = FlatModel("mlp", (DIM,), CLASSES)
    x = torch.from_numpy(source.normal(size=(10, DIM)).astype(np.float32))
    y = torch.from_numpy(np.array([0, 0, 0, 0, 0, 0, 1, 1, 1, 2]))
    return model, torch.from_numpy(model.initial_parameters(seed)), x, y


def _memory(seed: int, scale: float = 0.5) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).normal(0.0, scale, FEATURES).astype(np.float32))


def test_the_prbm_is_added_to_the_features_before_the_head():
    """Without MR the loss is CE(h(z + zbar^p), y), value and gradient, against autograd through the named layers;
    and at zbar^p = 0 it is the network's own loss and gradient."""
    model, point, x, y = _batch(1)
    memory = _memory(2)
    loss, grad = DomainBiasLoss(np.zeros(FEATURES, np.float32), kappa=0.0).loss_and_grad(
        model, torch.cat([point, memory]), x, y, None
    )
    leaf = torch.cat([point, memory]).requires_grad_(True)
    p = model.spec.unflatten(leaf[: model.size])
    z = torch.relu(torch.relu(x @ p["1.weight"].T + p["1.bias"]) @ p["3.weight"].T + p["3.bias"])
    expected = torch.nn.functional.cross_entropy((z + leaf[model.size :]) @ p["5.weight"].T + p["5.bias"], y)
    expected.backward()
    assert leaf.grad is not None
    assert loss == pytest.approx(expected.item(), rel=1e-6)
    torch.testing.assert_close(grad, leaf.grad, atol=1e-6, rtol=0)
    zero_loss, zero_grad = DomainBiasLoss(np.zeros(FEATURES, np.float32), kappa=0.0).loss_and_grad(
        model, torch.cat([point, torch.zeros(FEATURES)]), x, y, None
    )
    plain_loss, plain_grad = model.loss_and_grad(point, x, y)
    assert zero_loss == pytest.approx(plain_loss, abs=1e-6)
    torch.testing.assert_close(zero_grad[: model.size], plain_grad, atol=1e-6, rtol=0)


def _mr_gradient(model, point, memory, x, y, global_mean, kappa, momentum, calls=1) -> torch.Tensor:
    """MR's part of the gradient: the term's gradient minus that of the same term without MR (at the `calls`-th
    call of one term on the batch)."""
    term = DomainBiasLoss(global_mean, kappa, momentum)
    for _ in range(calls):
        _loss, grad = term.loss_and_grad(model, torch.cat([point, memory]), x, y, None)
    _plain, without = DomainBiasLoss(global_mean, 0.0).loss_and_grad(model, torch.cat([point, memory]), x, y, None)
    return grad - without


def test_the_mean_regularization_gradient_on_a_hand_made_batch():
    """kappa/(2d) ||mean_b z_b - zbar^g||^2 with z = ReLU(u), u = A h + c: its gradient in c is
    kappa/d (mean_b z_b - zbar^g) * mean_b 1[u_b > 0], coordinate by coordinate; it reaches neither the head nor
    zbar^p (MR acts on the features before the PRBM)."""
    model, point, x, y = _batch(3)
    memory, kappa = _memory(4), 50.0
    global_mean = np.random.default_rng(5).uniform(0.0, 0.5, FEATURES).astype(np.float32)
    mr = _mr_gradient(model, point, memory, x, y, global_mean, kappa, 1.0)
    p = model.spec.unflatten(point)
    with torch.no_grad():
        u = torch.relu(x @ p["1.weight"].T + p["1.bias"]) @ p["3.weight"].T + p["3.bias"]
        z = torch.relu(u)
        expected = kappa / FEATURES * (z.mean(0) - torch.from_numpy(global_mean)) * (u > 0).float().mean(0)
    torch.testing.assert_close(mr[model.spec.slice("3.bias")], expected, atol=1e-5, rtol=1e-4)
    assert expected.abs().max() > 1e-2
    head = torch.from_numpy(model.spec.head_mask())
    assert mr[: model.size][head].abs().max() < 1e-6 and mr[model.size :].abs().max() < 1e-6


def test_the_running_mean_follows_the_momentum_across_a_requests_steps():
    """With m < 1 the first step's mean is m * mean_b z_b (the running mean starts at 0: gradient m times the
    distance's); the second's m * mean_b z_b + (1 - m) * the first's (detached)."""
    model, point, x, y = _batch(6)
    memory, kappa, m = _memory(7), 20.0, 0.25
    global_mean = np.random.default_rng(8).uniform(0.0, 0.5, FEATURES).astype(np.float32)
    p = model.spec.unflatten(point)
    with torch.no_grad():
        u = torch.relu(x @ p["1.weight"].T + p["1.bias"]) @ p["3.weight"].T + p["3.bias"]
        mean, active = torch.relu(u).mean(0), (u > 0).float().mean(0)
    target = torch.from_numpy(global_mean)
    for calls, running in [(1, m * mean), (2, m * mean + (1 - m) * m * mean)]:
        mr = _mr_gradient(model, point, memory, x, y, global_mean, kappa, m, calls)
        expected = kappa / FEATURES * (running - target) * m * active
        torch.testing.assert_close(mr[model.spec.slice("3.bias")], expected, atol=1e-5, rtol=1e-4)


def test_the_pm_folds_the_prbm_into_the_heads_bias():
    """PM(x) = h(f(x) + zbar^p) = W f(x) + b + W zbar^p: the network whose bias is b + W zbar^p; zero PRBM: PM = GM."""
    model, point, x, _y = _batch(9)
    algorithm = build_algorithm(FedDBESettings(), model.spec)
    memory = _memory(10)
    state = algorithm.init_client(ClientInfo(0, 10, 1.0, 1), point.numpy())
    np.testing.assert_array_equal(algorithm.evaluated_model(state, point.numpy()), point.numpy())
    state.memory = memory.numpy()
    pm = algorithm.evaluated_model(state, point.numpy())
    with torch.no_grad():
        z, _logits = model.features(point, x)
        p = model.spec.unflatten(point)
        expected = (z + memory) @ p["5.weight"].T + p["5.bias"]
    np.testing.assert_allclose(model.predict(pm, x.numpy()), expected.numpy(), atol=1e-5)


def test_the_server_makes_the_consensus_once_from_the_initialization_rounds_means():
    """Round 0: w = sum a_i theta_i / sum a_i and zbar^g = sum n_i zbar_i / sum n_i; later uploads carry no mean and
    leave zbar^g as it is (it is fixed, even were a mean sent again)."""
    spec = ParamSpec(("w", "b"), ((2, 3), (2,)), (0, 6), head=("w", "b"))
    algorithm = build_algorithm(FedDBESettings(), spec)
    thetas = [np.arange(8.0), -np.arange(8.0), np.ones(8)]
    means = [np.array([1.0, 0.0, 2.0]), np.array([3.0, 1.0, 0.0]), np.array([0.0, 0.0, 0.0])]
    n = [10.0, 30.0, 0.0]  # the third client has no data: it sends no mean
    total = FedDBEUpload(
        sum(a * t for a, t in zip(n, thetas, strict=True)),
        sum(n),
        sum(a * zbar for a, zbar in zip(n, means, strict=True)),
        sum(n),
    )
    server, metrics = algorithm.server_step(FedDBEServerState(np.zeros(8, np.float32)), total, 3)
    np.testing.assert_allclose(server.w, (10 * thetas[0] + 30 * thetas[1]) / 40, atol=1e-6)
    np.testing.assert_allclose(server.global_mean, [2.5, 0.75, 0.5], atol=1e-6)
    assert metrics["consensus_norm"] == pytest.approx(np.linalg.norm([2.5, 0.75, 0.5]), rel=1e-6)
    later = FedDBEUpload(4.0 * np.ones(8), 4.0, 4.0 * np.array([9.0, 9.0, 9.0]), 4.0)
    again, _metrics = algorithm.server_step(server, later, 1)
    np.testing.assert_allclose(again.w, np.ones(8))
    np.testing.assert_array_equal(again.global_mean, server.global_mean)
    none = FedDBEUpload(np.ones(8), 1.0, np.zeros(3), 0.0)  # no client sent a mean: no consensus yet
    assert algorithm.server_step(FedDBEServerState(np.zeros(8, np.float32)), none, 1)[0].global_mean is None


def test_the_initialization_round_uploads_the_mean_representation_at_the_trained_model():
    """A round-0 client trains as FedAvg (its PRBM untouched) and sends n_i times the mean of its features over its
    training split at its trained model; the server's consensus is the sample-weighted mean of the round's; a
    later round sends no mean and trains the PRBM."""
    sim = simulate({"name": "feddbe"}, rounds=1)
    algorithm, problem, server = sim.host.algorithm, sim.problem, sim.server
    assert isinstance(server, FedDBEServerState) and server.global_mean is not None
    model = problem.model_spec.build()
    config = sim.config
    selected = sample_clients(config.seed, 0, problem.num_training, config.clients.per_round_count())
    first = algorithm.broadcast(FedDBEServerState(problem.init_params))
    sums, count = np.zeros(FEATURES), 0.0
    for client in selected:  # round 0 again, with its own draws
        execute = sim.host.steps.client_executor(client, 0)
        update = run_client_step(algorithm, sim.host.info[client], sim.states[client], first, execute)
        upload, split = update.upload, problem.clients[client][1]
        trained = torch.from_numpy((upload.weighted / upload.weight).astype(np.float32))
        with torch.no_grad():
            z, _logits = model.features(trained, torch.from_numpy(problem.x[split.train]))
        assert upload.mean_weight == len(split.train)
        np.testing.assert_allclose(upload.mean_weighted / upload.mean_weight, z.double().mean(0).numpy(), atol=1e-5)
        assert not update.state.memory.any()
        sums, count = sums + upload.mean_weighted, count + upload.mean_weight
    np.testing.assert_allclose(server.global_mean, sums / count, atol=1e-6)
    later = step_results(sim, 0, algorithm.broadcast(server)).update
    assert later.upload.mean_weight == 0.0 and not later.upload.mean_weighted.any()
    assert np.abs(later.state.memory).max() > 1e-5


def test_without_mr_and_prbm_it_is_fedavg():
    """kappa = 0 and the PRBM frozen at 0: the loss is CE of the network itself, so the GM is FedAvg's round after
    round (same batches, same steps), and every PRBM stays 0."""
    dbe = simulate({"name": "feddbe", "kappa": 0.0, "prbm": False, "epochs": 2}, rounds=3)
    fedavg = simulate({"name": "fedavg", "epochs": 2}, rounds=3)
    np.testing.assert_allclose(dbe.coordinator.global_model(), fedavg.coordinator.global_model(), atol=1e-5)
    assert all(not state.memory.any() for state in dbe.states.values())
    full = simulate({"name": "feddbe", "epochs": 2}, rounds=3)
    assert np.abs(full.coordinator.global_model() - fedavg.coordinator.global_model()).max() > 1e-4


def test_communication_is_the_model_plus_the_mean_once_and_the_consensus():
    """Uplink: the model and its weight, plus d + 1 in the initialization round; downlink: the model, plus zbar^g
    (d) once it exists. The PRBM (d) never leaves the client."""
    sim = simulate({"name": "feddbe"}, rounds=1)
    algorithm, size = sim.host.algorithm, sim.problem.params.size
    first = FedDBEUpload(np.zeros(size), 5.0, np.zeros(FEATURES), 5.0)
    later = FedDBEUpload(np.zeros(size), 5.0, np.zeros(FEATURES), 0.0)
    assert algorithm.uplink_bytes(first) == 4 * (size + 1 + FEATURES + 1)
    assert algorithm.uplink_bytes(later) == 4 * (size + 1)
    start = FedDBEServerState(sim.problem.init_params)
    assert algorithm.downlink_bytes(algorithm.broadcast(start)) == 4 * size
    assert algorithm.downlink_bytes(algorithm.broadcast(sim.server)) == 4 * (size + FEATURES)
    assert algorithm.Upload.carries_message()


def test_a_head_without_a_bias_is_refused():
    spec = ParamSpec(("w",), ((2, 3),), (0,), model="bias_free", head=("w",))
    with pytest.raises(ConfigError, match="feddbe"):
        build_algorithm(FedDBESettings(), spec)
