"""pFedHN (raysim.algorithms.pfedhn): the hypernetwork's gradient is the vector-Jacobian product of eq. 4 (against
finite differences, float64); its optimizer steps are torch's (SGD with momentum, weight decay, the embeddings'
own rate and gradient clipping; Adam); the round's VJPs are taken at the phi that generated the models (sequential
steps with lr/k are one mean step with lr); a hypernetwork that outputs a constant theta_0 sends it to everyone and,
with lr 1, is FedAvg with equal weights; one model down and one up; a tiny run whose state checkpoints."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raysim.algorithms import build_algorithm
from raysim.algorithms.pfedhn import Hypernetwork, PfedhnServerState, PfedhnSettings, PfedhnUpload
from raysim.config import validate_config
from raysim.errors import ConfigError
from raysim.models.spec import ParamSpec
from raysim.runtime.checkpoint import load_tree, save_tree
from tests.support.experiments import tiny_config
from tests.support.inprocess import InProcess
from tests.support.split_models import SGD, simulate

N = 5
SPEC = ParamSpec(("w",), ((N,),), (0,))
PLAIN = {"server_momentum": 0.0, "server_weight_decay": 0.0, "grad_clip": None}
"""Plain SGD on the hypernetwork: a step is phi - lr * gradient."""


def _algorithm(**settings):
    return build_algorithm(
        PfedhnSettings(name="pfedhn", embedding_dim=2, hidden_dim=4, hidden_layers=1, **settings), SPEC
    )


def _server(algorithm, clients: int = 3, seed: int = 2) -> PfedhnServerState:
    """A float64 hypernetwork with random parameters (with this seed, every client has active and inactive ReLUs)."""
    network = algorithm.network(clients)
    params = np.random.default_rng(seed).normal(size=network.size)
    second = np.zeros(network.size if algorithm.settings.server_optimizer == "adam" else 0)
    return PfedhnServerState(params, np.zeros(network.size), second, clients)


def _messages(clients, seed: int = 1) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {client: rng.normal(size=N) for client in clients}


def test_the_hypernetworks_gradient_is_the_vjp_of_eq_4():
    """One client's step with plain SGD, lr 1: phi - phi' = (d theta_i / d phi)^T (theta_i - theta~_i), the
    gradient of <h(v_i; phi), -dtheta_i>, by central finite differences over every coordinate of phi; the other
    clients' embeddings get none."""
    algorithm = _algorithm(server_lr=1.0, **PLAIN)
    server = _server(algorithm)
    network = algorithm.network(3)
    delta = _messages([1])[1]
    after, metrics = algorithm.server_step_by_client(server, None, 1, {1: delta})
    gradient = server.params - after.params

    def surrogate(phi):
        return float(network.generate(phi, [1])[0] @ -delta)

    step, numeric = 1e-6, np.zeros(network.size)
    for k in range(network.size):
        bump = np.zeros(network.size)
        bump[k] = step
        numeric[k] = (surrogate(server.params + bump) - surrogate(server.params - bump)) / (2 * step)
    np.testing.assert_allclose(gradient, numeric, rtol=1e-6, atol=1e-9)
    embeddings = network.split(gradient)[0]
    assert not embeddings[[0, 2]].any() and embeddings[1].any()
    assert metrics["hn_grad_norm"] == pytest.approx(np.linalg.norm(numeric), rel=1e-6)
    assert after.steps == 1


def test_sequential_steps_take_every_vjp_at_the_rounds_phi():
    """With plain SGD the k sequential steps at lr/k are the mean step at lr: every gradient is taken at the phi
    that generated the round's models, not at the one the previous step left."""
    messages = _messages([0, 1, 2])
    sequential = _algorithm(server_lr=0.1 / 3, **PLAIN)
    mean = _algorithm(server_lr=0.1, server_update="mean", **PLAIN)
    server = _server(sequential)
    one_by_one = sequential.server_step_by_client(server, None, 3, messages)[0]
    at_once = mean.server_step_by_client(server, None, 3, messages)[0]
    np.testing.assert_allclose(one_by_one.params, at_once.params, rtol=0, atol=1e-12)
    assert (one_by_one.steps, at_once.steps) == (3, 1)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_the_optimizer_steps_are_torchs(optimizer):
    """Two rounds of two messages against the authors' torch.optim (SGD: momentum, weight decay, the embeddings
    in their own parameter group with their own rate; Adam) after clip_grad_norm_, on the same VJPs."""
    settings = {"server_optimizer": optimizer, "server_lr": 0.05, "embedding_lr": 0.2, "grad_clip": 0.5}
    algorithm = _algorithm(server_momentum=0.9, server_weight_decay=1e-2, **settings)
    server = _server(algorithm)
    network = algorithm.network(3)
    embeddings = torch.tensor(server.params[: network.embedding_size], requires_grad=True)
    weights = torch.tensor(server.params[network.embedding_size :], requires_grad=True)
    groups = [{"params": [weights]}, {"params": [embeddings], "lr": 0.2}]
    if optimizer == "sgd":
        reference: torch.optim.Optimizer = torch.optim.SGD(groups, lr=0.05, momentum=0.9, weight_decay=1e-2)
    else:
        reference = torch.optim.Adam(groups, lr=0.05, weight_decay=1e-2)
    for round_index in range(2):
        messages = _messages([2, 0], seed=10 + round_index)
        for client in sorted(messages):
            phi = torch.tensor(server.params, requires_grad=True)  # the round's phi: the state before the round
            theta = network.generate(phi, [client])[0]
            (gradient,) = torch.autograd.grad(theta, phi, grad_outputs=torch.tensor(-messages[client]))
            embeddings.grad = gradient[: network.embedding_size].clone()
            weights.grad = gradient[network.embedding_size :].clone()
            torch.nn.utils.clip_grad_norm_([weights, embeddings], 0.5)
            reference.step()
        server = algorithm.server_step_by_client(server, None, 2, messages)[0]
        expected = torch.cat([embeddings, weights]).detach().numpy()
        np.testing.assert_allclose(server.params, expected, rtol=1e-10, atol=1e-12)


def _constant_hypernetwork(sim: InProcess) -> PfedhnServerState:
    """Every weight 0, the output layer's bias theta_0: h(v_i; phi) = theta_0 for every client."""
    algorithm = sim.coordinator.algorithm
    server = sim.coordinator.state
    network = algorithm.network(server.num_clients)
    params = np.zeros(network.size, np.float32)
    network.split(params)[1][-1][1][:] = sim.problem.init_params
    return PfedhnServerState(params, np.zeros_like(params), server.second, server.num_clients)


def _pfedhn(**settings) -> InProcess:
    algorithm = {"name": "pfedhn", **SGD, "momentum": 0.0, "weight_decay": 0.0, "local_steps": None, **settings}
    config = tiny_config(algorithm=algorithm, model={"name": "mlp"}, clients={"count": 5, "per_round": 3})
    sim = InProcess(validate_config(config))
    sim.coordinator.state = _constant_hypernetwork(sim)
    return sim


def test_a_constant_hypernetwork_with_lr_0_sends_everyone_theta_0():
    sim = _pfedhn(server_lr=0.0, epochs=2)
    theta0 = sim.problem.init_params
    for round_index in range(3):
        broadcast = sim.coordinator.broadcast()
        assert np.array_equal(broadcast.models, np.tile(theta0, (5, 1)))
        metrics = sim.round(round_index)
        assert metrics["update_norm"] > 0  # the clients trained, and the hypernetwork did not move
    np.testing.assert_array_equal(sim.coordinator.global_model(), theta0)
    for state in sim.states.values():
        np.testing.assert_array_equal(state.personal, theta0)


@pytest.mark.parametrize("update", ["mean", "sequential"])
def test_a_constant_hypernetwork_with_lr_1_is_fedavg_with_equal_weights(update):
    """Only the output bias b has a gradient (theta_i - theta~_i: the features are 0 and so is the output weight),
    so b <- b - (1/k) sum_i (b - theta~_i) = the mean of the local models, round after round (sequentially at lr
    1/k, as every VJP is taken at the round's phi); everything else stays 0."""
    pfedhn = _pfedhn(server_lr=1.0 if update == "mean" else 1.0 / 3, server_update=update, epochs=2, **PLAIN)
    for round_index in range(3):
        pfedhn.round(round_index)
    fedavg = simulate({"name": "fedavg", "aggregation": "uniform", "epochs": 2}, rounds=3)
    np.testing.assert_allclose(pfedhn.coordinator.global_model(), fedavg.coordinator.global_model(), atol=1e-5)
    network = pfedhn.coordinator.algorithm.network(5)
    bias = network.split(pfedhn.server.params)[1][-1][1]
    assert np.count_nonzero(pfedhn.server.params) == np.count_nonzero(bias)
    assert np.linalg.norm(bias - pfedhn.problem.init_params) > 1e-2


def test_each_client_receives_and_sends_one_model():
    sim = simulate({"name": "pfedhn", "local_steps": 3}, rounds=1)
    algorithm = sim.host.algorithm
    n = algorithm.params.size
    broadcast = sim.coordinator.broadcast()
    assert broadcast.models.shape == (5, n)
    assert algorithm.downlink_bytes(broadcast) == 4 * n
    assert algorithm.uplink_bytes(PfedhnUpload(np.zeros(n))) == 4 * n
    assert not algorithm.Upload.carries_message()  # attacks and robust rules are refused
    assert algorithm.reads_messages(algorithm.settings)


def test_the_authors_layout_and_defaults():
    settings = PfedhnSettings(name="pfedhn")
    algorithm = build_algorithm(settings, SPEC)
    network = algorithm.network(50)
    assert network == Hypernetwork(50, 13, 100, 3, N)  # embedding int(1 + m/4) = 13 for the paper's 50 clients
    assert network.shapes == [(100, 13), (100, 100), (100, 100), (100, 100), (N, 100)]
    assert (settings.local_steps, settings.lr, settings.batch_size, settings.server_lr) == (50, 5e-3, 64, 1e-2)
    with pytest.raises(ConfigError, match="random_epochs"):
        validate_config(tiny_config(algorithm={"name": "pfedhn", "random_epochs": True}))


def test_a_tiny_run_personalizes_and_its_state_checkpoints(tmp_path):
    """The PM of a selected client is the model it was sent; `score_current` scores the current hypernetwork's
    model too; the server state (numpy arrays in dataclasses) survives a checkpoint."""
    sim = simulate({"name": "pfedhn", "local_steps": 5, "score_current": True}, rounds=2)
    broadcast = sim.coordinator.broadcast()
    sim.round(2, [1, 4])
    for client in (1, 4):
        np.testing.assert_array_equal(sim.states[client].personal, broadcast.models[client])
    assert not np.array_equal(sim.coordinator.broadcast().models[1], broadcast.models[1])
    context = sim.coordinator.evaluation_context()
    extra = sim.host.algorithm.extra_models(sim.states[4], sim.coordinator.global_model(), context)
    np.testing.assert_array_equal(extra["current"], sim.coordinator.broadcast().models[4])
    np.testing.assert_allclose(sim.coordinator.global_model(), context.mean(axis=0), atol=1e-5)
    save_tree(tmp_path / "server.npz", sim.server)
    restored = load_tree(tmp_path / "server.npz")
    assert restored.steps == sim.server.steps > 0 and restored.num_clients == 5
    np.testing.assert_array_equal(restored.params, sim.server.params)
    np.testing.assert_array_equal(restored.first, sim.server.first)
