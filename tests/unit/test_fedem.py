"""FedEM (raysim.algorithms.fedem): with one component it is FedAvg; the E-step's posterior (E) on hand-made
losses and pi's M-step (M1) as the trainer runs it; the components' q-weighted loss (M2); the server's
per-component average; the mixture PM's outputs; M models each way."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import raysim.models.composed
from raysim.algorithms import build_algorithm
from raysim.algorithms.fedem import (
    FedEM,
    FedEMServerState,
    FedEMSettings,
    FedEMUpload,
    Responsibilities,
    WeightedComponents,
    initial_components,
    responsibilities,
)
from raysim.algorithms.requests import LocalSGD
from raysim.errors import ConfigError
from raysim.models.flat import FlatModel
from raysim.models.spec import ParamSpec
from tests.support.split_models import simulate, step_results

SPEC = ParamSpec(("w", "b"), ((2, 3), (2,)), (0, 6))
SCORED = pytest.mark.skipif(
    not hasattr(raysim.models.composed, "ComponentMixture"), reason="the house does not score FedEM's mixture yet"
)


def _algorithm(params: ParamSpec = SPEC, **settings) -> FedEM:
    algorithm = build_algorithm(FedEMSettings(name="fedem", **settings), params)
    assert isinstance(algorithm, FedEM)
    return algorithm


def _posterior(weights: np.ndarray, losses: np.ndarray) -> np.ndarray:
    """q_s(m) = pi_m exp(-l_m(s)) / sum_k pi_k exp(-l_k(s)), written out: [M, B]."""
    joint = weights[:, None] * np.exp(-losses)
    return joint / joint.sum(axis=0, keepdims=True)


def test_with_one_component_it_is_fedavg():
    fedem = simulate({"name": "fedem", "components": 1}, rounds=3)
    fedavg = simulate({"name": "fedavg"}, rounds=3)
    np.testing.assert_allclose(fedem.coordinator.global_model(), fedavg.coordinator.global_model(), atol=1e-5)
    (request,) = step_results(fedem, 0, fedem.coordinator.broadcast()).requests  # no E-step: pi = 1
    assert isinstance(request.terms[0], WeightedComponents)
    assert all(state.weights.tolist() == [1.0] for state in fedem.states.values())


def test_the_posterior_of_hand_made_losses_is_eq_4():
    weights = np.array([0.5, 0.3, 0.2])
    losses = np.array([[0.1, 2.0, 5.0, 0.0], [0.3, 0.1, 5.0, 9.0], [3.0, 1.0, 0.2, 0.0]])
    q = responsibilities(torch.tensor(np.log(weights)), torch.tensor(losses)).numpy()
    np.testing.assert_allclose(q, _posterior(weights, losses), rtol=1e-12)
    np.testing.assert_allclose(q.sum(axis=0), 1.0)
    equal = responsibilities(torch.tensor(np.log(weights)), torch.zeros(3, 2)).numpy()  # no evidence: the prior
    np.testing.assert_allclose(equal, np.tile(weights[:, None], (1, 2)))
    huge = responsibilities(torch.tensor(np.log(weights)), torch.tensor([[1000.0], [1001.0], [1003.0]])).numpy()
    np.testing.assert_allclose(huge[:, 0], _posterior(weights, np.array([[0.0], [1.0], [3.0]]))[:, 0])  # shifted


def _linear_problem():
    """A 3-feature, 2-class MLR and three components: zero (loss log 2 everywhere), one right and one wrong."""
    model = FlatModel("mlr", (3,), 2)
    x = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [1.0, 1.0, 0.0], [0.0, 0.0, 1.0], [2.0, 0.0, 1.0]])
    y = torch.tensor([0, 1, 0, 1, 0])
    right = np.zeros(model.size, np.float32)
    right[:6] = [2.0, -1.0, -1.0, -2.0, 1.0, 1.0]  # the weight [2, 3] (then the bias, 0)
    components = np.stack([np.zeros(model.size, np.float32), right, -right])
    logits = np.einsum("bf,mcf->mbc", x.numpy(), components[:, :6].reshape(3, 2, 3))
    losses = -np.take_along_axis(logits - np.log(np.exp(logits).sum(2, keepdims=True)), y.numpy()[None, :, None], 2)
    return model, x, y, components, losses[..., 0]


def test_the_e_step_term_lands_on_the_mean_posterior_whatever_the_batches():
    model, x, y, components, losses = _linear_problem()
    weights = np.array([0.2, 0.5, 0.3])
    q = _posterior(weights, losses)
    term = Responsibilities(components, np.log(weights).astype(np.float32), samples=5)
    v = torch.zeros(3)
    for batch in ([0, 3], [1, 2], [4]):  # one pass of SGD of rate 1: v <- v - grad
        _, grad = term.loss_and_grad(model, v, x[batch], y[batch], None)
        np.testing.assert_allclose(grad.numpy(), -q[:, batch].sum(axis=1) / 5, rtol=1e-5)
        v = v - grad
    np.testing.assert_allclose(v.numpy(), q.mean(axis=1), rtol=1e-5)  # (M1)
    assert v.numpy().argmax() == 1 and v.numpy().argmin() == 2


def test_the_components_loss_weights_each_samples_loss_by_its_posterior():
    model, x, y, components, losses = _linear_problem()
    weights = np.array([0.2, 0.5, 0.3])
    q = torch.tensor(_posterior(weights, losses), dtype=torch.float32)
    term = WeightedComponents(components, np.log(weights).astype(np.float32))
    point = torch.tensor(components.reshape(-1) + 0.1)  # away from the received components
    value, grad = term.loss_and_grad(model, point, x, y, None)
    expected, grads = 0.0, []
    for m, theta in enumerate(point.reshape(3, -1)):
        theta = theta.clone().requires_grad_(True)
        weighted = (q[m] * torch.nn.functional.cross_entropy(model.forward(theta, x), y, reduction="none")).mean()
        grads.append(torch.autograd.grad(weighted, theta)[0])
        expected += weighted.item()
    assert value == pytest.approx(expected, rel=1e-5)
    np.testing.assert_allclose(grad.numpy(), torch.cat(grads).numpy(), atol=1e-6)


def test_a_client_step_computes_pi_then_trains_the_components_from_the_received_ones():
    sim = simulate({"name": "fedem", "components": 3}, rounds=2)
    broadcast = sim.coordinator.broadcast()
    client = 1
    before = sim.states[client].weights.copy()
    e_step, training = step_results(sim, client, broadcast).requests
    assert isinstance(e_step, LocalSGD) and (e_step.lr, e_step.epochs, e_step.momentum) == (1.0, 1, 0.0)
    np.testing.assert_array_equal(e_step.start, np.zeros(3, np.float32))
    np.testing.assert_array_equal(training.start, broadcast.reshape(-1))
    (term,) = training.terms
    np.testing.assert_array_equal(term.components, broadcast)
    np.testing.assert_allclose(term.log_weights, np.log(before), rtol=1e-6)
    data = sim.host.data[client]
    x, y = (torch.from_numpy(a) for a in data.arrays("train"))
    model = sim.host.model
    losses = np.stack(
        [torch.nn.functional.cross_entropy(model.forward(torch.tensor(c), x), y, reduction="none") for c in broadcast]
    )
    update = step_results(sim, client, broadcast).update
    np.testing.assert_allclose(update.state.weights, _posterior(before, losses).mean(axis=1), atol=1e-5)
    assert update.state.weights.sum() == pytest.approx(1.0)


def test_the_server_averages_each_component_and_the_gm_is_the_most_weighted():
    algorithm = _algorithm(components=2)
    thetas = [np.arange(16, dtype=np.float32).reshape(2, 8), -np.ones((2, 8), np.float32)]
    sizes, pis = [10.0, 30.0], [np.array([0.9, 0.1]), np.array([0.2, 0.8])]
    uploads = [
        FedEMUpload(n * t.reshape(-1).astype(np.float64), n, n * p) for n, t, p in zip(sizes, thetas, pis, strict=True)
    ]
    total = FedEMUpload(*(sum(getattr(u, name) for u in uploads) for name in ("weighted", "weight", "mass")))
    start = FedEMServerState(np.zeros((2, 8), np.float32), np.ones(2))
    server, metrics = algorithm.server_step(start, total, 2)
    np.testing.assert_allclose(server.components, (10 * thetas[0] + 30 * thetas[1]) / 40, rtol=1e-6)
    np.testing.assert_allclose(server.mass, [10 * 0.9 + 30 * 0.2, 10 * 0.1 + 30 * 0.8])
    np.testing.assert_array_equal(algorithm.global_model(server), server.components[1])
    assert metrics["dominant_share"] == pytest.approx(25 / 40)
    np.testing.assert_array_equal(algorithm.evaluation_context(server), server.components)


def test_uniform_aggregation_weighs_every_client_alike():
    sim = simulate({"name": "fedem", "components": 2, "aggregation": "uniform"}, rounds=1)
    update = step_results(sim, 2, sim.coordinator.broadcast()).update
    assert update.upload.weight == 1.0
    np.testing.assert_allclose(update.upload.mass, update.state.weights)


def test_the_initial_components_permute_each_tensor_of_the_initial_model():
    init = np.arange(8, dtype=np.float32)
    components = initial_components(init, SPEC, 3, seed=0)
    np.testing.assert_array_equal(components[0], init)
    for row in components[1:]:
        for part in (slice(0, 6), slice(6, 8)):  # each tensor's entries, permuted within it
            np.testing.assert_array_equal(np.sort(row[part]), init[part])
    assert not np.array_equal(components[1], components[2])
    server = _algorithm(components=3, init_seed=0).init_server(init, 4)
    np.testing.assert_array_equal(server.components, components)
    np.testing.assert_array_equal(_algorithm(components=3).init_client(None, init).weights, np.full(3, 1 / 3))


@SCORED
def test_the_pm_is_the_mixture_of_the_components_predictions():
    network = FlatModel("mlp", (4,), 3)
    mixture = network.composed(raysim.models.composed.ComponentMixture(3))
    assert mixture.size == 3 + 3 * network.size and mixture.spec.names[0] == "weights"
    rng = np.random.default_rng(0)
    thetas = [network.initial_parameters(seed) for seed in range(3)]
    weights = np.array([0.6, 0.1, 0.3], np.float32)
    algorithm = _algorithm(network.spec, components=3)
    vector = algorithm.composed_model(algorithm.init_client(None, thetas[0]), thetas[0], np.stack(thetas))
    np.testing.assert_array_equal(vector[:3], np.full(3, 1 / 3, np.float32))
    vector[:3] = weights
    x = torch.tensor(rng.normal(size=(7, 4)), dtype=torch.float32)
    outputs = mixture.forward(torch.tensor(vector), x)
    probabilities = sum(
        w * torch.softmax(network.forward(torch.tensor(t), x), 1) for w, t in zip(weights, thetas, strict=True)
    )
    np.testing.assert_allclose(outputs.exp().numpy(), probabilities.numpy(), rtol=1e-5)
    one = np.concatenate([[0.0, 1.0, 0.0], np.concatenate(thetas)]).astype(np.float32)  # one component: its own
    expected = torch.log_softmax(network.forward(torch.tensor(thetas[1]), x), 1)
    np.testing.assert_allclose(mixture.forward(torch.tensor(one), x).numpy(), expected.numpy(), atol=1e-6)
    assert algorithm.personalized_network() == raysim.models.composed.ComponentMixture(3)


def test_m_models_go_each_way_and_attacks_are_refused():
    sim = simulate({"name": "fedem", "components": 3}, rounds=1)
    algorithm = sim.host.algorithm
    broadcast = sim.coordinator.broadcast()
    n = algorithm.params.size
    assert broadcast.shape == (3, n) and algorithm.downlink_bytes(broadcast) == 4 * 3 * n
    update = step_results(sim, 0, broadcast).update
    assert algorithm.uplink_bytes(update.upload) == 4 * (3 * n + 1)  # n_i Theta_i and n_i; pi_i is not sent
    assert not algorithm.Upload.carries_message()


def test_models_with_running_statistics_are_refused():
    with pytest.raises(ConfigError, match="model.name: .*running statistics"):
        _algorithm(FlatModel("mlp_bn", (4,), 3).spec)


@SCORED
def test_the_hosts_score_each_clients_mixture():
    sim = simulate({"name": "fedem", "components": 2}, rounds=2)
    context = sim.coordinator.evaluation_context()
    batch = sim.host.evaluate(sim.coordinator.global_model(), context).to_pydict()
    assert all(np.isfinite(batch["pm_test_acc"])) and batch["pm_test_acc"] != batch["gm_test_acc"]
