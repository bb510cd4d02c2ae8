"""pFedLA (raysim.algorithms.pfedla): the layers a weight covers; the aggregation theta-bar_i^l = sum_j alpha_ij^l
theta_j^l on hand-made client models; the hypernetwork's gradient is the VJP through the aggregation (against
finite differences, float64, both normalizations, running statistics left out); its SGD with momentum is torch's;
with every client's weights one-hot on itself pFedLA is Local; one model down and one up; a tiny run whose state
checkpoints."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raysim.algorithms import build_algorithm
from raysim.algorithms.pfedla import LayerHypernetwork, Pfedla, PfedlaServerState, PfedlaSettings, layer_slices
from raysim.config import validate_config
from raysim.models.spec import ParamSpec
from raysim.runtime.checkpoint import load_tree, save_tree
from tests.support.experiments import tiny_config
from tests.support.inprocess import InProcess
from tests.support.split_models import SGD, simulate

SPEC = ParamSpec(
    names=("a.weight", "a.bias", "b.weight", "a.running_mean"),
    shapes=((2, 2), (2,), (3,), (2,)),
    offsets=(0, 4, 6, 9),
    statistics=("a.running_mean",),
)
"""Two layers: module a (weight, bias and a running statistic) and module b."""
A, B = np.r_[0:6, 9:11], np.r_[6:9]
SMALL = {"embedding_dim": 2, "hidden_dim": 4, "hidden_layers": 2}


def _algorithm(spec: ParamSpec = SPEC, **settings) -> Pfedla:
    algorithm = build_algorithm(PfedlaSettings(name="pfedla", **{**SMALL, **settings}), spec)
    assert isinstance(algorithm, Pfedla)
    return algorithm


def _weights_as_biases(network: LayerHypernetwork, alphas: np.ndarray) -> np.ndarray:
    """Hypernetworks [m, size] whose every weight is 0 and whose heads' biases are log alpha_i: softmax gives
    alpha_i [L, m] back whatever the embedding."""
    params = np.zeros((network.clients, network.size))
    for client, alpha in enumerate(alphas):
        network.split(params[client])[1][-1][1][:] = np.log(alpha).ravel()
    return params


def test_a_layer_is_a_modules_tensors_or_each_tensor():
    assert layer_slices(SPEC, "module") == ((slice(0, 6), slice(9, 11)), (slice(6, 9),))
    assert layer_slices(SPEC, "tensor") == ((slice(0, 4), slice(9, 11)), (slice(4, 6),), (slice(6, 9),))
    flat = ParamSpec(("w", "b"), ((3,), (1,)), (0, 3))
    assert layer_slices(flat, "module") == ((slice(0, 3),), (slice(3, 4),))


def test_the_aggregation_is_layer_wise_on_hand_made_clients():
    """theta-bar_i takes module a from the clients with alpha_i^a and module b with alpha_i^b (its statistic with
    module a); the broadcast holds each client's theta-bar_i."""
    algorithm = _algorithm()
    models = np.arange(33, dtype=np.float64).reshape(3, 11) ** 1.5
    alphas = np.array(
        [
            [[0.5, 0.25, 0.25], [1 / 3, 1 / 3, 1 / 3]],
            [[0.1, 0.8, 0.1], [0.0001, 0.0001, 0.9998]],
            [[0.2, 0.3, 0.5], [0.6, 0.3, 0.1]],
        ]
    )
    network = algorithm.network(3)
    hypernetworks = _weights_as_biases(network, alphas)
    for client in range(3):
        np.testing.assert_allclose(network.weights(hypernetworks[client], client), alphas[client], rtol=1e-12)
        expected = np.empty(11)
        expected[A] = alphas[client, 0] @ models[:, A]
        expected[B] = alphas[client, 1] @ models[:, B]
        np.testing.assert_allclose(algorithm.aggregate(alphas[client], models), expected, rtol=1e-12)
    server = PfedlaServerState(models, hypernetworks, np.zeros((3, 0)))
    sent = algorithm.broadcast(server).models
    for client in range(3):
        expected = np.empty(11)
        expected[A] = alphas[client, 0] @ models[:, A]
        expected[B] = alphas[client, 1] @ models[:, B]
        np.testing.assert_allclose(sent[client], expected, rtol=1e-6)
    tensor = _algorithm(layers="tensor")
    weights = np.array([[1.0, 0.0], [0.0, 1.0], [0.5, 0.5]])  # a.weight (+ statistic), a.bias, b.weight
    mixed = tensor.aggregate(weights, models[:2])
    np.testing.assert_array_equal(mixed[np.r_[0:4, 9:11]], models[0, np.r_[0:4, 9:11]])
    np.testing.assert_array_equal(mixed[4:6], models[1, 4:6])
    np.testing.assert_allclose(mixed[B], models[:2, B].mean(axis=0))


def _server(algorithm: Pfedla, seed: int = 3) -> PfedlaServerState:
    """Random float64 models and hypernetworks for 3 clients (with this seed, every client has active and inactive
    ReLUs, and with `relu` positive and clipped weights)."""
    rng = np.random.default_rng(seed)
    network = algorithm.network(3)
    return PfedlaServerState(rng.normal(size=(3, 11)), rng.normal(size=(3, network.size)), np.zeros((3, 0)))


@pytest.mark.parametrize("weights", ["softmax", "relu"])
def test_the_hypernetworks_gradient_is_the_vjp_through_the_aggregation(weights):
    """One client's step with plain SGD at lr 1: phi - phi' = (d theta-bar_i / d phi_i)^T (-dtheta_i), the gradient
    of <theta-bar_i(phi_i), -dtheta_i> with the running statistic's coordinates left out, by central finite
    differences over every coordinate of phi_i (embedding included); the other clients' hypernetworks and models
    stay; the server keeps theta_i = theta-bar_i + dtheta_i."""
    algorithm = _algorithm(weights=weights, hn_lr=1.0)
    server = _server(algorithm)
    network = algorithm.network(3)
    delta = np.random.default_rng(4).normal(size=11)
    after, metrics = algorithm.server_step_by_client(server, None, 1, {1: delta})
    gradient = server.hypernetworks[1] - after.hypernetworks[1]
    trained = np.ones(11, bool)
    trained[9:] = False

    def surrogate(phi: np.ndarray) -> float:
        return float(algorithm.aggregate(network.weights(phi, 1), server.models)[trained] @ -delta[trained])

    phi, step, numeric = server.hypernetworks[1], 1e-6, np.zeros(network.size)
    for k in range(network.size):
        bump = np.zeros(network.size)
        bump[k] = step
        numeric[k] = (surrogate(phi + bump) - surrogate(phi - bump)) / (2 * step)
    np.testing.assert_allclose(gradient, numeric, rtol=1e-6, atol=1e-9)
    assert np.abs(numeric[: network.embedding_dim]).min() > 0  # v_i has a gradient
    np.testing.assert_array_equal(after.hypernetworks[[0, 2]], server.hypernetworks[[0, 2]])
    np.testing.assert_array_equal(after.models[[0, 2]], server.models[[0, 2]])
    sent = algorithm.aggregate(network.weights(server.hypernetworks[1], 1), server.models)
    np.testing.assert_array_equal(after.models[1], sent + delta)
    np.testing.assert_allclose(algorithm.broadcast(server).models[1], sent, rtol=1e-6)  # sent as float32
    assert metrics["hn_grad_norm"] == pytest.approx(np.linalg.norm(numeric), rel=1e-6)
    alpha = network.weights(server.hypernetworks[1], 1)
    assert np.all(alpha >= 0) and np.allclose(alpha.sum(axis=1), 1.0)
    assert (weights == "relu") == bool(np.any(alpha == 0))


def test_relu_weights_fall_back_to_the_clients_own_model_and_start_as_fl_benchs():
    algorithm = _algorithm(weights="relu")
    network = algorithm.network(3)
    params = np.zeros(network.size)
    network.split(params)[1][-1][1][:] = [-1.0, -2.0, 0.0, 0.0, 3.0, 1.0]  # layer a all clipped, layer b not
    np.testing.assert_array_equal(network.weights(params, 2), [[0.0, 0.0, 1.0], [0.0, 0.75, 0.25]])
    torch_weights = network.weights(torch.tensor(params), 2).numpy()
    np.testing.assert_array_equal(torch_weights, [[0.0, 0.0, 1.0], [0.0, 0.75, 0.25]])
    server = algorithm.init_server(np.zeros(11, np.float32), 3)
    heads = network.split(server.hypernetworks[0])[1][-1]
    assert heads[0].min() >= 0 and heads[0].max() <= 1 and not heads[1].any()
    np.testing.assert_array_equal(server.hypernetworks[0, 2:], server.hypernetworks[2, 2:])  # one shared copy
    assert not np.array_equal(server.hypernetworks[0, :2], server.hypernetworks[2, :2])  # own embeddings


def test_the_momentum_steps_are_torchs_sgd():
    """Two rounds for client 0 with momentum 0.9 against torch.optim.SGD on the same VJPs."""
    algorithm = _algorithm(hn_lr=0.05, hn_momentum=0.9)
    server = _server(algorithm)
    server.momentum = np.zeros_like(server.hypernetworks)
    network = algorithm.network(3)
    phi = torch.tensor(server.hypernetworks[0], requires_grad=True)
    reference = torch.optim.SGD([phi], lr=0.05, momentum=0.9)
    rng = np.random.default_rng(5)
    for _ in range(2):
        delta = rng.normal(size=11)
        cotangent = torch.tensor(np.where(np.arange(11) < 9, -delta, 0.0))
        models = torch.tensor(server.models)
        alpha = network.weights(phi, 0)
        theta = torch.empty(11, dtype=torch.float64)
        theta[A] = alpha[0] @ models[:, A]
        theta[B] = alpha[1] @ models[:, B]
        (phi.grad,) = torch.autograd.grad(theta, phi, grad_outputs=cotangent)
        reference.step()
        server = algorithm.server_step_by_client(server, None, 1, {0: delta})[0]
        np.testing.assert_allclose(server.hypernetworks[0], phi.detach().numpy(), rtol=1e-12, atol=1e-14)


def _one_hot_on_self(sim: InProcess) -> PfedlaServerState:
    """Every weight 0, each head's bias 1e4 on the client itself and 0 elsewhere: softmax gives exactly 1 to the
    client's own model and 0 to every other, and no gradient."""
    server = sim.coordinator.state
    network = sim.coordinator.algorithm.network(len(server.models))
    params = np.zeros_like(server.hypernetworks)
    for client in range(network.clients):
        bias = network.split(params[client])[1][-1][1].reshape(network.layers, network.clients)
        bias[:, client] = 1e4
    return PfedlaServerState(server.models, params, server.momentum)


def test_with_weights_one_hot_on_the_client_itself_it_is_local_training():
    config = tiny_config(
        algorithm={"name": "pfedla", **SGD, "hn_lr": 1.0}, model={"name": "mlp"}, clients={"count": 5, "per_round": 3}
    )
    sim = InProcess(validate_config(config))
    sim.coordinator.state = _one_hot_on_self(sim)
    start = sim.server.hypernetworks.copy()
    for round_index in range(3):
        sent = sim.coordinator.broadcast().models
        np.testing.assert_array_equal(sent, sim.server.models)  # theta-bar_i = theta_i
        sim.round(round_index)
    local = simulate({"name": "local"}, rounds=3)
    for client in range(5):
        np.testing.assert_allclose(sim.server.models[client], local.states[client].theta, atol=1e-6)
    np.testing.assert_array_equal(sim.server.hypernetworks, start)
    assert any(np.linalg.norm(sim.server.models[c] - sim.problem.init_params) > 1e-2 for c in range(5))


def test_each_client_receives_and_sends_one_model():
    sim = simulate({"name": "pfedla"}, rounds=1)
    algorithm = sim.host.algorithm
    n = algorithm.params.size
    broadcast = sim.coordinator.broadcast()
    assert broadcast.models.shape == (5, n)
    assert algorithm.downlink_bytes(broadcast) == 4 * n
    update = sim.host.algorithm.Upload(np.zeros(n))
    assert algorithm.uplink_bytes(update) == 4 * n
    assert not algorithm.Upload.carries_message()  # attacks and robust rules are refused
    assert algorithm.reads_messages(algorithm.settings)


def test_fl_benchs_defaults_and_layout():
    settings = PfedlaSettings(name="pfedla")
    assert (settings.embedding_dim, settings.hidden_dim, settings.hn_lr, settings.hn_momentum) == (100, 100, 5e-3, 0)
    mlp = simulate({"name": "pfedla"}, rounds=0).host.algorithm.params  # 784-128-64-10 on the tiny data's inputs
    network = build_algorithm(settings, mlp).network(50)
    assert network.shapes == [(100, 100), (100, 100), (100, 100), (3 * 50, 100)]
    assert network.size == 100 + 3 * 10100 + 150 * 101
    assert build_algorithm(PfedlaSettings(layers="tensor"), mlp).network(50).layers == 6


def test_a_tiny_run_personalizes_and_its_state_checkpoints(tmp_path):
    """The PM of a selected client is the theta-bar_i it was sent; `score_current` scores the current one; the GM
    is the mean of the clients' latest models; the server state survives a checkpoint."""
    sim = simulate({"name": "pfedla", "score_current": True, "hn_lr": 0.5, "hn_momentum": 0.5}, rounds=2)
    broadcast = sim.coordinator.broadcast()
    metrics = sim.round(2, [1, 4])
    assert 0 < metrics["self_weight"] < 1 and metrics["hn_grad_norm"] > 0
    for client in (1, 4):
        np.testing.assert_array_equal(sim.states[client].personal, broadcast.models[client])
    assert not np.array_equal(sim.coordinator.broadcast().models[1], broadcast.models[1])
    context = sim.coordinator.evaluation_context()
    extra = sim.host.algorithm.extra_models(sim.states[4], sim.coordinator.global_model(), context)
    np.testing.assert_array_equal(extra["current"], sim.coordinator.broadcast().models[4])
    np.testing.assert_allclose(sim.coordinator.global_model(), sim.server.models.mean(axis=0), atol=1e-6)
    save_tree(tmp_path / "server.npz", sim.server)
    restored = load_tree(tmp_path / "server.npz")
    for name in ("models", "hypernetworks", "momentum"):
        np.testing.assert_array_equal(getattr(restored, name), getattr(sim.server, name))
