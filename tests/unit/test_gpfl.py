"""GPFL (raysim.algorithms.gpfl; the feature valve of raysim.models.gated): the PM's vector and forward, the loss
against a computation by hand, the two guidance terms on a hand-made batch, the identity valve, the special case that
coincides with FedPer, the server step on hand-made uploads and the communication accounting."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from raysim.algorithms import ClientInfo, build_algorithm
from raysim.algorithms.gpfl import (
    GPFLLoss,
    GPFLServerState,
    GPFLSettings,
    GPFLUpload,
    angle_guidance,
    conditional_valve,
    magnitude_guidance,
    valve_numpy,
    valve_size,
)
from raysim.config import validate_config
from raysim.errors import ConfigError
from raysim.models.composed import FeatureValve
from raysim.models.flat import FlatModel
from tests.support.experiments import tiny_config
from tests.support.features import CLASSES, DIM, labelled_problem
from tests.support.inprocess import InProcess

FEATURES = 64
"""d: the features of tests.support.features' mlp (DIM-128-64-CLASSES: Flatten, Linear 1, ReLU, Linear 3, ReLU,
head 5)."""


def _network() -> FlatModel:
    return FlatModel("mlp", (DIM,), CLASSES)


def _features(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """The mlp's features z = f(x) from its named parameters."""
    return torch.relu(torch.relu(x @ p["1.weight"].T + p["1.bias"]) @ p["3.weight"].T + p["3.bias"])


def _valve_by_hand(cov: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gamma(v), beta(v): per branch LayerNorm(ReLU(A v + a)) with its weight and bias, written out."""
    d, out = FEATURES, []
    for branch in range(2):
        part = cov[branch * (d * d + 3 * d) : (branch + 1) * (d * d + 3 * d)]
        hidden = torch.relu(part[: d * d].reshape(d, d) @ v + part[d * d : d * d + d])
        normalized = (hidden - hidden.mean()) / torch.sqrt(hidden.var(unbiased=False) + 1e-5)
        out.append(normalized * part[d * d + d : d * d + 2 * d] + part[d * d + 2 * d :])
    return out[0], out[1]


def _cov(seed: int) -> torch.Tensor:
    """A random CoV vector (LayerNorm weights around 1)."""
    d, draws = FEATURES, np.random.default_rng(seed)
    branches = []
    for _ in range(2):
        linear = draws.uniform(-0.125, 0.125, d * d + d)
        branches.append(np.concatenate([linear, 1 + 0.1 * draws.normal(size=d), 0.1 * draws.normal(size=d)]))
    return torch.from_numpy(np.concatenate(branches).astype(np.float32))


def test_the_valve_model_is_the_network_then_a_then_c_and_scores_w_relu_of_the_affine_features():
    """FeatureValve's layout is the network's, then a and c (d each); its logits are W ReLU(a * z + c) + b; with
    a = 1 and c = 0 on the mlp's post-ReLU features it is the plain network."""
    network = _network()
    model = network.composed(FeatureValve())
    assert model.spec.names == (*(f"network.{n}" for n in network.spec.names), "valve.scale", "valve.shift")
    assert model.spec.size == network.size + FeatureValve().valve_size(FEATURES)
    assert network.composed(FeatureValve()) is model
    draws = np.random.default_rng(0)
    point = network.initial_parameters(1)
    a, c = draws.normal(1.0, 0.5, FEATURES), draws.normal(0.0, 0.5, FEATURES)
    vector = np.concatenate([point, a, c]).astype(np.float32)
    x = draws.normal(size=(9, DIM)).astype(np.float32)
    p = network.spec.unflatten(torch.from_numpy(point))
    z = _features(p, torch.from_numpy(x))
    expected = torch.relu(z * torch.from_numpy(a).float() + torch.from_numpy(c).float()) @ p["5.weight"].T + p["5.bias"]
    np.testing.assert_allclose(model.predict(vector, x), expected.numpy(), atol=1e-5)
    identity = np.concatenate([point, np.ones(FEATURES), np.zeros(FEATURES)]).astype(np.float32)
    np.testing.assert_allclose(model.predict(identity, x), network.predict(point, x), atol=1e-6)


def test_the_guidance_terms_on_a_hand_made_batch():
    """e_0 = (1, 0), e_1 = (0, 2); z_g = (3, 0) of class 0 and (1, 1) of class 1: cosines (1, 0) and (1/sqrt 2,
    1/sqrt 2), so the angle-level loss is (log(1 + e^-1) + log 2) / 2; the differences from E_y are (2, 0) and
    (1, -1): the batch's norm sqrt 6, the samples' mean distance (2 + sqrt 2) / 2."""
    embeddings = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    features = torch.tensor([[3.0, 0.0], [1.0, 1.0]])
    y = torch.tensor([0, 1])
    assert angle_guidance(features, embeddings, y).item() == pytest.approx(
        (math.log(1 + math.exp(-1)) + math.log(2)) / 2, rel=1e-6
    )
    anchors = embeddings[y]
    assert magnitude_guidance(features, anchors, per_sample=False).item() == pytest.approx(math.sqrt(6), rel=1e-6)
    assert magnitude_guidance(features, anchors, per_sample=True).item() == pytest.approx(
        (2 + math.sqrt(2)) / 2, rel=1e-6
    )


def test_the_loss_is_the_code_s_formula_by_hand():
    """CE(h(z_p), y) + angle + lambda ||Z_g - E_y|| + (mu/2)(||CoV||^2 + ||E||^2), z_p and z_g through the valve of
    p_i and g: value and gradient against autograd through the named parts; the received anchors get no gradient."""
    network = _network()
    draws = np.random.default_rng(2)
    point = torch.from_numpy(network.initial_parameters(3))
    cov = _cov(4)
    embeddings = torch.from_numpy(draws.normal(size=CLASSES * FEATURES).astype(np.float32))
    anchors = draws.normal(size=(CLASSES, FEATURES)).astype(np.float32)
    generic, personal = (draws.normal(size=FEATURES).astype(np.float32) for _ in range(2))
    x = torch.from_numpy(draws.normal(size=(10, DIM)).astype(np.float32))
    y = torch.from_numpy(np.array([0, 0, 1, 2, 2, 1, 0, 1, 2, 0]))
    lam, mu, angle = 0.3, 0.1, 0.7
    term = GPFLLoss(generic, personal, anchors, angle, lam, mu)
    vector = torch.cat([point, cov, embeddings])
    value, grad = term.loss_and_grad(network, vector, x, y, None)

    leaf = vector.clone().requires_grad_(True)
    size, cov_size = network.size, valve_size(FEATURES)
    p = network.spec.unflatten(leaf[:size])
    z = _features(p, x)
    gamma_p, beta_p = _valve_by_hand(leaf[size : size + cov_size], torch.from_numpy(personal))
    gamma_g, beta_g = _valve_by_hand(leaf[size : size + cov_size], torch.from_numpy(generic))
    z_p, z_g = torch.relu(z * (1 + gamma_p) + beta_p), torch.relu(z * (1 + gamma_g) + beta_g)
    e = leaf[size + cov_size :].reshape(CLASSES, FEATURES)
    cosines = (z_g / z_g.norm(dim=1, keepdim=True)) @ (e / e.norm(dim=1, keepdim=True)).T
    total = (
        torch.nn.functional.cross_entropy(z_p @ p["5.weight"].T + p["5.bias"], y)
        + angle * torch.nn.functional.cross_entropy(cosines, y)
        + lam * torch.sqrt(((z_g - torch.from_numpy(anchors)[y]) ** 2).sum())
        + mu / 2 * ((leaf[size:] ** 2).sum())
    )
    (expected,) = torch.autograd.grad(total, leaf)
    assert value == pytest.approx(total.item(), rel=1e-5)
    torch.testing.assert_close(grad, expected, atol=2e-5, rtol=1e-4)
    assert grad[size : size + cov_size].abs().max() > 0 and grad[size + cov_size :].abs().max() > 0


def test_an_identity_valve_without_guidance_is_the_networks_own_loss():
    """LayerNorm weights and biases 0 give gamma = beta = 0 whatever the input, so z_p = ReLU(z) = z on the mlp's
    features: with no guidance and no regularizer the loss and its gradient in the network are the network's."""
    network = _network()
    draws = np.random.default_rng(5)
    point = torch.from_numpy(network.initial_parameters(6))
    cov = _cov(7)
    d = FEATURES
    for branch in range(2):
        cov[branch * (d * d + 3 * d) + d * d + d : (branch + 1) * (d * d + 3 * d)] = 0.0
    gamma, beta = conditional_valve(cov, torch.from_numpy(draws.normal(size=d).astype(np.float32)), d)
    assert gamma.abs().max() == 0 and beta.abs().max() == 0
    embeddings = torch.from_numpy(draws.normal(size=CLASSES * d).astype(np.float32))
    x = torch.from_numpy(draws.normal(size=(8, DIM)).astype(np.float32))
    y = torch.from_numpy(draws.integers(0, CLASSES, 8))
    context = draws.normal(size=d).astype(np.float32)
    anchors = draws.normal(size=(CLASSES, d)).astype(np.float32)
    term = GPFLLoss(context, context, anchors, angle_weight=0.0, lam=0.0, mu=0.0)
    value, grad = term.loss_and_grad(network, torch.cat([point, cov, embeddings]), x, y, None)
    plain, plain_grad = network.loss_and_grad(point, x, y)
    assert value == pytest.approx(plain, abs=1e-6)
    torch.testing.assert_close(grad[: network.size], plain_grad, atol=1e-6, rtol=0)
    assert grad[network.size + valve_size(d) :].abs().max() == 0  # the GCE is not used


def _config(clients: int, **algorithm):
    settings = {"name": "gpfl", "lr": 0.1, "batch_size": 8, "epochs": 2, **algorithm}
    return validate_config(tiny_config(algorithm=settings, clients={"count": clients}, model={"name": "mlp"}))


def test_without_valve_and_guidance_it_is_fedper():
    """valve: false (z_p = z_g = z, the CoV frozen), angle_weight 0, lambda 0 and mu 0: each client trains body and
    head together on plain CE from the received body and the server averages the bodies by samples, FedPer
    (same batches); the CoV and the GCE never move."""
    problem = labelled_problem(3, 6, seed=8, held=[[0, 1], [1, 2], [0, 1, 2]])
    gp = InProcess(_config(3, valve=False, angle_weight=0.0, mu=0.0, **{"lambda": 0.0}), problem)
    per = InProcess(
        validate_config(
            tiny_config(
                algorithm={"name": "fedper", "lr": 0.1, "batch_size": 8, "epochs": 2, "aggregation": "samples"},
                clients={"count": 3},
                model={"name": "mlp"},
            )
        ),
        problem,
    )
    algorithm = gp.coordinator.algorithm
    shared_before = gp.coordinator.state.shared.copy()
    for round_index in range(2):
        gp.round(round_index)
        per.round(round_index)
    body = ~algorithm.network_head
    gm = algorithm.global_model(gp.coordinator.state)
    np.testing.assert_allclose(gm[body], per.coordinator.state.shared, atol=1e-5)
    assert np.abs(gm[body] - problem.init_params[body]).max() > 1e-3
    for client in range(3):
        np.testing.assert_allclose(gp.states[client].head, per.states[client].personal, atol=1e-5)
        pm = algorithm.evaluated_model(gp.states[client], gm)
        np.testing.assert_allclose(pm, per.coordinator.algorithm.evaluated_model(per.states[client], gm), atol=1e-5)
    extra = gp.coordinator.state.shared[int(body.sum()) :]
    np.testing.assert_allclose(extra, shared_before[int(body.sum()) :], rtol=0, atol=1e-9)


def test_the_pm_the_hosts_score_is_the_valve_of_the_clients_conditional_input():
    """After a round: alpha_i is the client's class shares, p_i = sum_c alpha_ic e_c of the current GCE, and the PM
    is the current body with the client's head and the valve (1 + gamma(p_i), beta(p_i)) of the current CoV; the
    host scores exactly it."""
    problem = labelled_problem(2, 6, seed=9, held=[[0, 1], [1, 2]])
    sim = InProcess(_config(2), problem)
    sim.round(0)
    algorithm = sim.coordinator.algorithm
    state = sim.states[1]
    np.testing.assert_allclose(state.class_share, [0.0, 0.5, 0.5])
    context = sim.coordinator.evaluation_context()
    gm = sim.coordinator.global_model()
    pm = algorithm.composed_model(state, gm, context)
    composite = algorithm.assemble(state.head, context)
    e = composite[algorithm.embeddings].reshape(CLASSES, FEATURES)
    gamma, beta = conditional_valve(
        torch.from_numpy(composite[algorithm.valve]), torch.from_numpy(0.5 * e[1] + 0.5 * e[2]), FEATURES
    )
    network = pm[: problem.params.size]
    np.testing.assert_array_equal(network[~algorithm.network_head], gm[~algorithm.network_head])
    np.testing.assert_array_equal(network[algorithm.network_head], state.head)
    np.testing.assert_allclose(pm[problem.params.size :], torch.cat([1 + gamma, beta]).numpy(), atol=1e-5)
    model = problem.model_spec.build().composed(algorithm.personalized_network())
    test = problem.clients[1][1].test
    logits = model.predict(pm, problem.x[test])
    table = sim.host.evaluate(gm, context).to_pydict()
    assert table["pm_test_acc"][1] == pytest.approx(float(np.mean(logits.argmax(axis=1) == problem.y[test])))
    assert table["pm_test_loss"] != table["gm_test_loss"]


def test_the_valve_in_numpy_is_the_torch_one():
    cov, v = _cov(10), np.random.default_rng(11).normal(size=FEATURES).astype(np.float32)
    gamma, beta = valve_numpy(cov.numpy(), v, FEATURES)
    expected = conditional_valve(cov, torch.from_numpy(v), FEATURES)
    np.testing.assert_allclose(gamma, expected[0].numpy(), atol=1e-5)
    np.testing.assert_allclose(beta, expected[1].numpy(), atol=1e-5)


def test_the_server_averages_body_valve_and_embeddings_by_weight():
    """sum_i a_i x_i / sum_i a_i on hand-made uploads; an empty sum (no weight) leaves the state as it was."""
    network = _network()
    algorithm = build_algorithm(GPFLSettings(), network.spec)
    server = algorithm.init_server(network.initial_parameters(0), 2)
    width = server.shared.size
    assert width == network.size - network.spec.head_size + valve_size(FEATURES) + CLASSES * FEATURES
    one, two = np.full(width, 1.0), np.full(width, 4.0)
    total = GPFLUpload(10 * one + 30 * two, 40.0)
    new, metrics = algorithm.server_step(server, total, 2)
    np.testing.assert_allclose(new.shared, np.full(width, 3.25), rtol=1e-6)
    np.testing.assert_array_equal(new.template_head, server.template_head)
    assert metrics["global_change"] > 0
    same, _ = algorithm.server_step(server, GPFLUpload(np.zeros(width), 0.0), 0)
    assert same is server and isinstance(same, GPFLServerState)


def test_it_sends_body_valve_and_embeddings_and_keeps_the_head():
    """Uplink: body, CoV (2 d^2 + 6 d) and GCE (C d) and the weight; downlink the same without the weight; the head
    (the head's size) and alpha_i (C) stay."""
    problem = labelled_problem(2, 4, seed=12)
    sim = InProcess(_config(2), problem)
    algorithm = sim.coordinator.algorithm
    shared = problem.params.size - problem.params.head_size + 2 * FEATURES**2 + 6 * FEATURES + CLASSES * FEATURES
    _partial, records = sim.host.train(0, [0, 1], sim.coordinator.broadcast())
    assert records.column("uplink_bytes").to_pylist() == [4.0 * (shared + 1)] * 2
    assert sim.coordinator.broadcast_bytes() == 4 * shared
    assert sim.states[0].head.size == problem.params.head_size
    assert not algorithm.Upload.carries_message()
    info = ClientInfo(0, 10, 0.5, 2)
    assert algorithm.init_client(info, problem.init_params).class_share.tolist() == pytest.approx([1 / 3] * 3)


@pytest.mark.parametrize(("key", "value"), [("lambda", -1.0), ("mu", -0.1), ("magnitude", "mean")])
def test_invalid_settings_are_refused_naming_the_field(key, value):
    with pytest.raises(ConfigError, match=rf"algorithm\.{key}"):
        validate_config(tiny_config(algorithm={"name": "gpfl", key: value}))
