"""FedCAC (raysim.algorithms.fedcac): with nothing critical it is FedAvg; with everything critical it is local
training when a client has no collaborator and FedAvg with equal weights when everyone collaborates; each tensor's
top tau share is critical; the overlaps, the rising threshold, the collaborators and the customized models on
hand-made messages; one client step's upload and message; the bytes each way."""

from __future__ import annotations

import numpy as np
import pytest

from raysim.algorithms import build_algorithm
from raysim.algorithms.fedcac import (
    FedCacBroadcast,
    FedCacServerState,
    FedCacSettings,
    FedCacUpload,
    collaboration_threshold,
    critical_mask,
    layer_critical,
    overlaps,
)
from raysim.algorithms.interface import ClientInfo
from raysim.algorithms.requests import SGDResult
from raysim.execution.drivers import run_client_step
from raysim.models.spec import ParamSpec
from tests.support.split_models import simulate

ALL = {"count": 5, "per_round": 5}


def test_with_nothing_critical_it_is_fedavg():
    fedcac = simulate({"name": "fedcac", "tau": 0.0, "epochs": 2}, rounds=3)
    fedavg = simulate({"name": "fedavg", "epochs": 2}, rounds=3)
    w = fedcac.coordinator.global_model()
    np.testing.assert_allclose(w, fedavg.coordinator.global_model(), atol=1e-6)
    assert np.linalg.norm(w - fedcac.problem.init_params) > 1e-2
    broadcast = fedcac.coordinator.broadcast()
    assert not broadcast.critical.any()
    for client in range(5):
        np.testing.assert_array_equal(broadcast.start(client), w)  # everyone starts from the global model


def test_with_everything_critical_and_no_collaborator_it_is_local_training():
    """A lone client a round has nobody to collaborate with: with every parameter critical it starts from its own
    model (a client that never trained starts from the global model, the last lone client's)."""
    one = {"count": 5, "per_round": 1}
    fedcac = simulate({"name": "fedcac", "tau": 1.0, "epochs": 2}, rounds=0, clients=one)
    local = simulate({"name": "local", "epochs": 2}, rounds=0, clients=one)
    for round_index in range(4):
        fedcac.round(round_index, [2])
        local.round(round_index, [2])
    theta = fedcac.states[2].theta
    np.testing.assert_allclose(theta, local.states[2].theta, atol=1e-6)
    assert np.linalg.norm(theta - fedcac.problem.init_params) > 1e-2
    fedcac.round(4, [3])
    broadcast = fedcac.coordinator.broadcast()
    np.testing.assert_array_equal(broadcast.start(2), theta)
    np.testing.assert_array_equal(broadcast.start(3), fedcac.states[3].theta)
    np.testing.assert_array_equal(broadcast.start(0), fedcac.coordinator.global_model())


def test_with_everything_critical_and_every_client_it_is_fedavg_with_equal_weights():
    """Identical critical sets: every overlap is 1, the threshold 1, and each client's customized model, which is
    all its start, is the plain mean of the round's models."""
    fedcac = simulate({"name": "fedcac", "tau": 1.0, "aggregation": "uniform"}, rounds=3, clients=ALL)
    fedavg = simulate({"name": "fedavg", "aggregation": "uniform"}, rounds=3, clients=ALL)
    w = fedavg.coordinator.global_model()
    np.testing.assert_allclose(fedcac.coordinator.global_model(), w, atol=1e-6)
    broadcast = fedcac.coordinator.broadcast()
    for client in range(5):
        np.testing.assert_allclose(broadcast.start(client), w, atol=1e-6)


def test_each_tensor_marks_its_top_tau_share():
    spec = ParamSpec(("w", "b", "running_mean"), ((2, 3), (4,), (2,)), (0, 6, 10), statistics=("running_mean",))
    old = np.zeros(12, np.float32)
    new = np.array([1, -3, 2, 0.5, -5, 4, 0.3, 0.1, -0.3, 0.3, 9, 9], np.float32)  # s = new^2 from 0
    mask = critical_mask(spec, new, old, 0.5)
    assert np.flatnonzero(mask).tolist() == [1, 4, 5, 6, 8]  # w: 3 of 6; b: 2 of 4, a tie to the lower index
    assert not mask[10:].any()  # running statistics are never critical
    moved = old + 1.0  # s = |new (new - old)| weighs the update by the parameter itself
    s = np.abs(new * (new - moved)).astype(np.float64)
    np.testing.assert_array_equal(critical_mask(spec, new, moved, 0.5)[:6], layer_critical(s[:6], 0.5))
    assert np.flatnonzero(layer_critical(s[:6], 0.5)).tolist() == [1, 4, 5]  # of 0, 12, 2, 0.25, 30, 12
    assert not critical_mask(spec, new, old, 0.0).any()
    assert critical_mask(spec, new, old, 1.0)[:10].all()
    assert layer_critical(np.ones(7), 0.5).sum() == 3  # floor(tau n)


def test_the_authors_selection_takes_ties_and_a_vanishing_threshold_takes_every_moved_parameter():
    ties = np.array([0.3, 0.1, 0.3, 0.3, 0.2])
    assert np.flatnonzero(layer_critical(ties, 0.4, "authors")).tolist() == [0, 2, 3]
    assert np.flatnonzero(layer_critical(ties, 0.4, "top_k")).tolist() == [0, 2]
    still = np.array([0.0, 0.0, 1e-12, 0.0, 0.5, 0.0])  # the 3rd largest is 0: every s > 1e-20 instead
    assert np.flatnonzero(layer_critical(still, 0.5, "authors")).tolist() == [2, 4]
    assert not layer_critical(still, 0.0, "authors").any()


# Four clients' masks of 4 critical parameters out of 8: 0 and 1 share 3, 2 and 3 share 3, the others 1 or 0.
MASKS = np.array(
    [
        [1, 1, 1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 1, 0, 0, 0],
        [0, 0, 0, 0, 1, 1, 1, 1],
        [0, 0, 0, 1, 1, 1, 1, 0],
    ],
    bool,
)
MODELS = np.arange(32, dtype=np.float32).reshape(4, 8) / 8


def test_overlaps_and_the_threshold_rising_from_the_mean_to_the_largest_overlap():
    overlap = overlaps(MASKS)
    expected = np.array([[1, 0.75, 0, 0.25], [0.75, 1, 0.25, 0.25], [0, 0.25, 1, 0.75], [0.25, 0.25, 0.75, 1]])
    np.testing.assert_allclose(overlap, expected)
    mean = 0.375  # (0.75 + 0 + 0.25 + 0.25 + 0.25 + 0.75) / 6
    assert collaboration_threshold(overlap, 1, 4.0) == pytest.approx(mean + 0.25 * (0.75 - mean))
    assert collaboration_threshold(overlap, 4, 4.0) == pytest.approx(0.75)
    assert collaboration_threshold(overlap[:1, :1], 1, 4.0) == np.inf
    empty = overlaps(np.array([[0, 0, 0], [0, 0, 0], [1, 0, 0]], bool))  # no critical parameter: (tau = 0)
    np.testing.assert_array_equal(empty[0], [1, 1, 0])


def _server_step(round_index: int, beta: float = 2.0):
    """Clients 0-3 of 5 selected with MASKS and MODELS, weights 1..4; client 4 kept its state of an earlier round."""
    algorithm = build_algorithm(FedCacSettings(beta=beta), ParamSpec(("w",), ((8,),), (0,)))
    server = algorithm.init_server(np.zeros(8, np.float32), 5)
    server.customized[4], server.critical[4] = 7.0, np.arange(8) < 2
    server = FedCacServerState(server.w, server.customized, server.critical, round_index)
    weights = np.arange(1.0, 5.0)
    total = FedCacUpload(weights @ MODELS.astype(np.float64), float(weights.sum()), MASKS.sum(axis=0).astype(float))
    messages = {c: np.concatenate([MODELS[c], MASKS[c].astype(np.float32)]) for c in range(4)}
    return algorithm, *algorithm.server_step_by_client(server, total, 4, messages)


def test_critical_parameters_are_averaged_among_collaborators_and_the_others_among_all():
    algorithm, server, metrics = _server_step(0)  # t = 1, beta = 2: threshold 0.5625, pairs {0, 1} and {2, 3}
    w = np.arange(1.0, 5.0) @ MODELS.astype(np.float64) / 10
    np.testing.assert_allclose(server.w, w, rtol=1e-6)
    for client, partner in [(0, 1), (1, 0), (2, 3), (3, 2)]:
        np.testing.assert_allclose(server.customized[client], (MODELS[client] + MODELS[partner]) / 2, rtol=1e-6)
        np.testing.assert_array_equal(server.critical[client], MASKS[client])
    np.testing.assert_array_equal(server.customized[4], 7.0)  # not selected: its last round's
    np.testing.assert_array_equal(server.critical[4], np.arange(8) < 2)
    assert server.round == 1
    assert metrics["collaborators"] == 1.0 and metrics["overlap"] == pytest.approx(0.375)
    assert metrics["overlap_threshold"] == pytest.approx(0.5625)
    broadcast = algorithm.broadcast(server)
    start = broadcast.start(0)  # eq. 9: critical from {0, 1}, the rest from everyone
    np.testing.assert_allclose(start[:4], (MODELS[0, :4] + MODELS[1, :4]) / 2, rtol=1e-6)
    np.testing.assert_allclose(start[4:], w[4:], rtol=1e-6)
    np.testing.assert_array_equal(broadcast.start(4)[:2], 7.0)
    np.testing.assert_allclose(broadcast.start(4)[2:], w[2:], rtol=1e-6)


def test_once_the_threshold_passes_the_largest_overlap_critical_parameters_stay_local():
    _, at_beta, metrics = _server_step(1)  # t = beta: the threshold is the largest overlap, the pairs stay
    assert metrics["collaborators"] == 1.0
    _, after, metrics = _server_step(2)  # t > beta: nobody
    assert metrics["collaborators"] == 0.0
    np.testing.assert_allclose(after.customized[:4], MODELS, rtol=1e-6)


def test_a_client_step_trains_from_its_start_and_sends_its_model_and_mask():
    spec = ParamSpec(("w", "b"), ((2, 2), (2,)), (0, 4))
    algorithm = build_algorithm(FedCacSettings(tau=0.5, lr=0.1, batch_size=4, epochs=3), spec)
    critical = np.zeros((2, 6), bool)
    critical[1, [0, 4]] = True
    customized = np.full((2, 6), 5.0, np.float32)
    received = FedCacBroadcast(np.ones(6, np.float32), customized, critical)
    step = np.array([0.5, -0.1, 0.2, 0.05, 0.3, -0.01], np.float32)
    requests = []

    def train(request):
        requests.append(request)
        return SGDResult(request.start + step, mean_loss=0.25, steps=3)

    client = ClientInfo(1, num_train=20, weight=0.5, num_clients=2)
    update = run_client_step(algorithm, client, algorithm.init_client(client, received.w), received, train)
    (request,) = requests
    np.testing.assert_array_equal(request.start, [5, 1, 1, 1, 5, 1])  # eq. 9
    assert request.epochs == 3 and request.lr == 0.1
    theta = request.start + step
    np.testing.assert_array_equal(update.state.theta, theta)
    assert update.state.client == 1
    # s = |theta * step|: w's 2 largest of 4 are 0 (2.75) and 2 (0.24); b's 1 of 2 is 4 (1.59)
    np.testing.assert_array_equal(update.upload.critical, [1, 0, 1, 0, 1, 0])
    assert update.upload.weight == 20.0
    np.testing.assert_allclose(update.upload.weighted, 20 * theta)
    np.testing.assert_array_equal(algorithm.message(update), np.concatenate([theta, update.upload.critical]))
    assert update.metrics["critical_share"] == pytest.approx(0.5)
    assert algorithm.personalized_model(update.state) is update.state.theta
    context = algorithm.evaluation_context(FedCacServerState(received.w, customized, critical))
    global_model = np.full(6, 2.0, np.float32)
    np.testing.assert_array_equal(
        algorithm.extra_models(update.state, global_model, context)["aggregated"], [5, 2, 2, 2, 5, 2]
    )


def test_one_model_and_a_bit_a_parameter_up_one_model_down():
    sim = simulate({"name": "fedcac"}, rounds=2)
    algorithm = sim.host.algorithm
    n = algorithm.params.size
    update = FedCacUpload(np.zeros(n, np.float32), 1.0, np.zeros(n, np.float32))
    assert algorithm.uplink_bytes(update) == 4 * (n + 1) + (n + 7) // 8
    assert algorithm.downlink_bytes(sim.coordinator.broadcast()) == 4 * n
    assert not algorithm.Upload.carries_message()  # attacks and robust rules are refused
    assert sim.coordinator.broadcast().critical.any(axis=1).sum() >= 3  # the selected clients' masks are kept
