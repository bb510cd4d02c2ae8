"""FedAMP (raysim.algorithms.fedamp): the attention of eq. 8 and HeurFedAMP's on hand-made models (rows summing to
1, the cloud models written out); with no attention (sigma -> 0) u_i = w_i and, with lambda = 0, it is Local; a
fixed point on a convex problem is stationary for sum_i f_i + (lambda / 2) sum_{i<j} A; one model each way."""

from __future__ import annotations

import math

import numpy as np
import pytest

from raysim.algorithms import ClientInfo, SGDResult, build_algorithm
from raysim.algorithms.fedamp import FedAmp, FedAmpBroadcast, FedAmpServerState, FedAmpSettings, attention
from raysim.algorithms.terms import Prox
from raysim.execution import run_client_step
from raysim.models.spec import ParamSpec
from tests.support.split_models import simulate, step_results

SPEC = ParamSpec(("w",), ((3,),), (0,))
THREE = np.array([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [1.0, 1.0, 0.5]], np.float32)


def _algorithm(**settings) -> FedAmp:
    algorithm = build_algorithm(FedAmpSettings(name="fedamp", **settings), SPEC)
    assert isinstance(algorithm, FedAmp)
    return algorithm


def _server_step(algorithm: FedAmp, models: np.ndarray, messages: dict[int, np.ndarray]) -> FedAmpServerState:
    server = FedAmpServerState(models.copy(), models.copy())
    return algorithm.server_step_by_client(server, None, len(messages), messages)[0]


def test_the_cloud_models_of_three_hand_made_clients_are_eq_8():
    alpha, sigma = 0.3, 2.0
    algorithm = _algorithm(alpha_k=alpha, sigma=sigma)
    server = _server_step(algorithm, np.zeros((3, 3), np.float32), {i: THREE[i] for i in range(3)})

    def weight(i: int, j: int) -> float:  # alpha_k A'(||w_i - w_j||^2), A'(x) = exp(-x / sigma) / sigma
        return alpha * math.exp(-float(np.sum((THREE[i] - THREE[j]) ** 2)) / sigma) / sigma

    for i in range(3):
        others = [j for j in range(3) if j != i]
        expected = (1 - sum(weight(i, j) for j in others)) * THREE[i] + sum(weight(i, j) * THREE[j] for j in others)
        np.testing.assert_allclose(server.clouds[i], expected, rtol=0, atol=1e-6)
    np.testing.assert_array_equal(server.models, THREE)
    np.testing.assert_allclose(algorithm.global_model(server), THREE.mean(axis=0), atol=1e-7)


def test_the_cosine_attention_is_heurfedamps_softmax_with_a_fixed_self_weight():
    sigma, self_weight = 5.0, 0.3
    xi = attention(THREE, np.ones(3, bool), FedAmpSettings(attention="cosine", sigma=sigma, self_weight=self_weight))

    def cosine(i: int, j: int) -> float:
        return float(THREE[i] @ THREE[j] / (np.linalg.norm(THREE[i]) * np.linalg.norm(THREE[j])))

    for i in range(3):
        others = [j for j in range(3) if j != i]
        total = sum(math.exp(sigma * cosine(i, h)) for h in others)
        assert xi[i, i] == pytest.approx(self_weight)
        for j in others:
            assert xi[i, j] == pytest.approx((1 - self_weight) * math.exp(sigma * cosine(i, j)) / total)


@pytest.mark.parametrize("kind", ["paper", "cosine"])
def test_every_row_of_xi_sums_to_1_and_a_client_without_peers_keeps_its_model(kind):
    models = np.random.default_rng(0).normal(size=(6, 4))
    settings = FedAmpSettings(attention=kind, alpha_k=0.1, sigma=3.0)
    np.testing.assert_allclose(attention(models, np.ones(6, bool), settings).sum(axis=1), 1.0, atol=1e-12)
    peers = np.array([True, False, False, True, False, False])
    xi = attention(models, peers, settings)
    np.testing.assert_allclose(xi.sum(axis=1), 1.0, atol=1e-12)
    assert np.all(xi[:, ~peers] == np.diag(np.diag(xi))[:, ~peers])  # no one attends to a non-peer
    assert xi[1, 0] > 0 and xi[0, 3] > 0 and xi[0, 0] < 1
    alone = attention(models[:1], np.ones(1, bool), settings)
    assert alone.tolist() == [[1.0]]


def test_peers_selected_attends_only_to_the_last_rounds_uploads():
    models = np.random.default_rng(1).normal(size=(4, 3)).astype(np.float32)
    algorithm = _algorithm(peers="selected", alpha_k=0.2)
    server = _server_step(algorithm, models, {0: THREE[0], 2: THREE[2]})
    expected = models.copy()
    expected[0], expected[2] = THREE[0], THREE[2]
    xi = attention(expected, np.array([True, False, True, False]), algorithm.settings)
    np.testing.assert_allclose(server.clouds, (xi @ expected.astype(np.float64)).astype(np.float32), atol=1e-7)
    assert xi[0, 1] == xi[0, 3] == xi[1, 3] == 0.0 and xi[1, 0] > 0


def test_identical_clients_get_that_model_as_their_cloud_whatever_the_attention():
    model = np.array([0.5, -2.0, 3.0], np.float32)
    for kind in ("paper", "cosine"):
        server = _server_step(_algorithm(attention=kind, alpha_k=5.0), np.zeros((4, 3), np.float32), {})
        np.testing.assert_array_equal(server.clouds, np.zeros((4, 3), np.float32))
        server = _server_step(_algorithm(attention=kind, alpha_k=5.0), np.tile(model, (4, 1)), {1: model})
        np.testing.assert_allclose(server.clouds, np.tile(model, (4, 1)), atol=1e-5)


def test_with_sigma_near_0_there_is_no_attention_and_u_i_is_w_i():
    models = np.random.default_rng(2).normal(size=(5, 3)).astype(np.float32)
    server = _server_step(_algorithm(sigma=1e-6), models, {i: models[i] for i in range(5)})
    np.testing.assert_array_equal(server.clouds, models)


def test_without_attention_each_client_trains_from_and_towards_its_own_model_and_with_lambda_0_it_is_local():
    sim = simulate({"name": "fedamp", "sigma": 1e-6, "lambda": 1.0}, rounds=2)
    broadcast = sim.coordinator.broadcast()
    for client in range(5):
        (request,) = step_results(sim, client, broadcast).requests
        np.testing.assert_allclose(request.start, sim.states[client].personal, atol=1e-6)
        (prox,) = request.terms
        assert isinstance(prox, Prox) and prox.weight == 1.0
        np.testing.assert_allclose(prox.center, sim.states[client].personal, atol=1e-6)
    fedamp = simulate({"name": "fedamp", "sigma": 1e-6, "lambda": 0.0}, rounds=3)
    local = simulate({"name": "local"}, rounds=3)
    for client in range(5):
        np.testing.assert_allclose(fedamp.states[client].personal, local.states[client].theta, atol=1e-6)


def test_start_personal_trains_from_the_clients_own_model_towards_its_cloud():
    sim = simulate({"name": "fedamp", "start": "personal", "alpha_k": 0.5, "lambda": 2.0}, rounds=2)
    broadcast = sim.coordinator.broadcast()
    (request,) = step_results(sim, 1, broadcast).requests
    np.testing.assert_array_equal(request.start, sim.states[1].personal)
    assert request.terms[0].weight == 4.0  # lambda / alpha_k
    np.testing.assert_array_equal(request.terms[0].center, broadcast.clouds[1])


def _quadratic_rounds(algorithm: FedAmp, optima: np.ndarray, rounds: int) -> FedAmpServerState:
    """Full participation on f_i(w) = ||w - c_i||^2 / 2, eq. 9 solved exactly: w_i = (c_i + mu u_i) / (1 + mu)."""
    clients = [ClientInfo(i, 10, 1.0 / len(optima), len(optima)) for i in range(len(optima))]
    server = algorithm.init_server(np.zeros(optima.shape[1], np.float32), len(optima))
    for _ in range(rounds):
        broadcast, messages = algorithm.broadcast(server), {}
        for client in clients:

            def solve(request, c=optima[client.id]):
                (prox,) = request.terms
                return SGDResult((c + prox.weight * prox.center) / (1 + prox.weight), mean_loss=0.0, steps=1)

            state = algorithm.init_client(client, server.models[client.id])
            update = run_client_step(algorithm, client, state, broadcast, solve)
            messages[client.id] = algorithm.message(update)
        server = algorithm.server_step_by_client(server, None, len(clients), messages)[0]
    return server


def test_a_fixed_point_on_a_convex_problem_is_stationary_for_the_attention_penalty_whatever_alpha_k():
    """grad f_i(w_i) + lambda sum_j A'(||w_i - w_j||^2)(w_i - w_j) = 0: two near clusters pull together."""
    optima = np.array([[0.0, 0.0], [0.3, 0.0], [2.0, 2.0], [2.0, 2.4]], np.float32)
    lam, sigma = 1.0, 1.0
    fixed = []
    for alpha in (0.1, 0.3):
        w = _quadratic_rounds(_algorithm(alpha_k=alpha, sigma=sigma, **{"lambda": lam}), optima, 300).models
        w64 = w.astype(np.float64)
        for i in range(4):
            pull = sum(
                math.exp(-float(np.sum((w64[i] - w64[j]) ** 2)) / sigma) / sigma * (w64[i] - w64[j])
                for j in range(4)
                if j != i
            )
            np.testing.assert_allclose((w64[i] - optima[i]) + lam * pull, 0.0, atol=1e-5)
        fixed.append(w)
    np.testing.assert_allclose(fixed[0], fixed[1], atol=1e-5)
    assert np.linalg.norm(fixed[0][0] - fixed[0][1]) < 0.3 * 0.9  # the pair moved towards each other
    same = _quadratic_rounds(_algorithm(alpha_k=0.2), np.tile(optima[2], (4, 1)), 200)  # w -> c at rate 5/6
    np.testing.assert_allclose(same.models, np.tile(optima[2], (4, 1)), atol=1e-6)
    np.testing.assert_allclose(same.clouds, np.tile(optima[2], (4, 1)), atol=1e-6)


def test_each_client_receives_its_own_cloud_model_and_sends_its_model():
    sim = simulate({"name": "fedamp"}, rounds=2)
    broadcast = sim.coordinator.broadcast()
    algorithm = sim.host.algorithm
    assert isinstance(broadcast, FedAmpBroadcast) and broadcast.clouds.shape == (5, algorithm.params.size)
    assert algorithm.downlink_bytes(broadcast) == 4 * algorithm.params.size
    update = step_results(sim, 0, broadcast).update
    assert algorithm.uplink_bytes(update.upload) == 4 * algorithm.params.size
    np.testing.assert_array_equal(algorithm.message(update), update.state.personal)
    assert not algorithm.Upload.carries_message()  # attacks and robust rules are refused
    server = sim.server
    assert isinstance(server, FedAmpServerState)
    for client, state in sim.states.items():  # the server holds every client's latest model
        np.testing.assert_array_equal(server.models[client], state.personal)
