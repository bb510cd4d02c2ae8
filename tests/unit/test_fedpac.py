"""FedPAC (raysim.algorithms.fedpac): without alignment and collaboration it is FedRep with one head epoch; a client
step's requests and statistics (h_i, V_i at the received body); the alignment term; the quadratic program of the
heads' combination (a two-client closed form, a brute force over the simplex, its KKT conditions); the server's
averages of bodies and prototypes; the `combined` model; the communication accounting."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from raysim.algorithms import build_algorithm
from raysim.algorithms.fedpac import (
    FeatureAlignment,
    FeatureEnergy,
    FedPacSettings,
    FedPacUpload,
    combination_weights,
    simplex_qp,
)
from raysim.algorithms.requests import ClassMeans, LocalSGD
from raysim.config import validate_config
from raysim.execution.drivers import run_client_step
from raysim.models.flat import FlatModel
from raysim.models.spec import ParamSpec
from tests.support.experiments import tiny_config
from tests.support.features import CLASSES, DIM, labelled_problem
from tests.support.inprocess import InProcess
from tests.support.split_models import simulate

FEATURES = 64  # the MLP's last hidden layer
SPEC = ParamSpec(
    names=("body", "head.weight", "head.bias"),
    shapes=((3,), (2, 4), (2,)),
    offsets=(0, 3, 11),
    head=("head.weight", "head.bias"),
)  # a body of 3, a head on d = 4 features and 2 classes
HEAD = 10


def _fedpac(problem, rounds: int, count: int, **settings) -> InProcess:
    algorithm = {"name": "fedpac", "lr": 0.1, "batch_size": 8, "epochs": 2, **settings}
    config = validate_config(tiny_config(algorithm=algorithm, clients={"count": count}, model={"name": "mlp"}))
    sim = InProcess(config, problem)
    for round_index in range(rounds):
        sim.round(round_index)
    return sim


def _recorded_step(sim: InProcess, client: int):
    """Client `client`'s step from its state on the current broadcast: its update, requests and results."""
    requests, results = [], []
    execute = sim.host.steps.client_executor(client, 9)

    def run(request):
        requests.append(request)
        results.append(execute(request))
        return results[-1]

    broadcast = sim.coordinator.broadcast()
    update = run_client_step(sim.host.algorithm, sim.host.info[client], sim.states[client], broadcast, run)
    return update, requests, results, broadcast


def test_without_alignment_and_collaboration_it_is_fedrep_with_one_head_epoch():
    """lambda = 0, alpha_i = e_i: head 1 epoch then body, bodies weighted by n_i: FedRep's rounds (float rounding)."""
    fedpac = simulate({"name": "fedpac", "lambda": 0.0, "collaboration": False, "epochs": 2}, rounds=3)
    fedrep = simulate({"name": "fedrep", "head_epochs": 1, "aggregation": "samples", "epochs": 2}, rounds=3)
    global_model = fedpac.coordinator.global_model()
    np.testing.assert_allclose(global_model, fedrep.coordinator.global_model(), atol=1e-5)
    algorithm, heads = fedpac.host.algorithm, fedpac.server.heads
    for client, state in fedrep.states.items():
        np.testing.assert_allclose(fedpac.states[client].head, state.personal, atol=1e-5)
        np.testing.assert_array_equal(heads[client], fedpac.states[client].head)  # its own head, kept for it
        pm = algorithm.evaluated_model(fedpac.states[client], global_model)
        np.testing.assert_allclose(pm, fedrep.host.algorithm.evaluated_model(state, global_model), atol=1e-5)
    assert np.linalg.norm(global_model - fedpac.problem.init_params) > 1e-2


@pytest.mark.parametrize("alignment", ["squared_norm", "mse"])
def test_a_client_step_takes_its_statistics_at_the_received_body_then_trains_head_then_body(alignment):
    """Statistics at the received body and combined head (the counts and class means; E||z||^2 by a request that
    moves nothing), the head alone at head_lr, the body alone on eq. 6 towards the global prototypes (a class without
    one: the client's own mean at the received body), the prototypes at the trained body."""
    problem = labelled_problem(3, 6, seed=3, held=[[0, 1], [0, 1], [1, 2]])
    sim = _fedpac(problem, 1, 3, head_lr=0.3, head_epochs=2, alignment=alignment, **{"lambda": 0.5})
    sim.round(1, [0, 1])  # class 2's global prototype is gone: only client 2 holds it
    algorithm = sim.host.algorithm
    update, requests, results, broadcast = _recorded_step(sim, 2)
    start = algorithm.assemble(broadcast.heads[2], broadcast.body)
    at_start, energy, head, body, local = requests
    assert isinstance(at_start, ClassMeans) and isinstance(local, ClassMeans)
    np.testing.assert_array_equal(at_start.point, start)
    assert isinstance(energy.terms[0], FeatureEnergy) and not energy.mask.any()
    np.testing.assert_array_equal(results[1].params, start)  # nothing moved
    assert (head.epochs, head.lr, body.epochs, body.lr) == (2, 0.3, 2, 0.1)
    np.testing.assert_array_equal(head.mask, algorithm.head)
    np.testing.assert_array_equal(body.mask, ~algorithm.head)
    np.testing.assert_array_equal(body.start, results[2].params)
    (term,) = body.terms
    assert term.weight == (0.5 if alignment == "squared_norm" else 0.5 / FEATURES)
    assert broadcast.present.tolist() == [True, True, False]
    model = problem.model_spec.build()
    train = problem.clients[2][1].train
    x, y = problem.x[train], problem.y[train]
    counts, means = model.class_means(start, x, y, CLASSES)
    assert term.has_target.tolist() == [True, True, True]
    np.testing.assert_array_equal(term.targets[:2], broadcast.prototypes[:2])
    np.testing.assert_allclose(term.targets[2], means[2], atol=1e-6)
    np.testing.assert_array_equal(local.point, results[3].params)
    with torch.no_grad():
        z, _ = model.features(torch.from_numpy(start), torch.from_numpy(x))
    z = z.double().numpy()
    h = np.zeros((CLASSES, FEATURES))
    for c in range(CLASSES):
        if (y == c).any():
            h[c] = (y == c).mean() * z[y == c].mean(axis=0)
    variance = (z**2).sum(axis=1).mean() - (h**2).sum()  # E||z y^T - h||_F^2
    np.testing.assert_allclose(update.upload.stats[:-1], h.ravel(), atol=1e-5)
    assert update.upload.stats[-1] == pytest.approx(variance / len(train), rel=1e-5)
    assert update.metrics["feature_variance"] == pytest.approx(variance, rel=1e-5)
    assert update.upload.weight == len(train)
    np.testing.assert_array_equal(update.upload.head, results[3].params[algorithm.head])
    np.testing.assert_array_equal(update.state.head, results[3].params[algorithm.head])


def test_the_alignment_term_is_cross_entropy_plus_the_mean_squared_distance_to_the_targets():
    """eq. 6 on a batch: CE + weight * (1/B) sum_b ||z_b - c_{y_b}||^2, a class without a target adding 0."""
    source = np.random.default_rng(1)
    model = FlatModel("mlp", (DIM,), CLASSES)
    point = torch.from_numpy(model.initial_parameters(1))
    x = torch.from_numpy(source.normal(size=(12, DIM)).astype(np.float32))
    y = torch.from_numpy(np.tile(np.arange(CLASSES), 4))
    targets = source.normal(size=(CLASSES, FEATURES)).astype(np.float32)
    present = np.array([True, False, True])
    value, grad = FeatureAlignment(targets, present, 0.7).loss_and_grad(model, point, x, y, None)
    with torch.no_grad():
        z, logits = model.features(point, x)
    kept = present[y.numpy()]
    squares = ((z.numpy() - targets[y.numpy()]) ** 2)[kept].sum()
    expected = torch.nn.functional.cross_entropy(logits, y).item() + 0.7 * squares / len(y)
    assert value == pytest.approx(expected, rel=1e-5)
    plain_loss, plain_grad = model.loss_and_grad(point, x, y)
    value, grad = FeatureAlignment(targets, present, 0.0).loss_and_grad(model, point, x, y, None)
    assert value == pytest.approx(plain_loss, abs=1e-6)
    torch.testing.assert_close(grad, plain_grad, atol=1e-6, rtol=0)


def test_the_feature_energy_is_the_mean_squared_feature_norm_with_no_gradient():
    model = FlatModel("mlp", (DIM,), CLASSES)
    point = torch.from_numpy(model.initial_parameters(2))
    x = torch.from_numpy(np.random.default_rng(2).normal(size=(5000, DIM)).astype(np.float32))  # three chunks
    value, grad = FeatureEnergy().loss_and_grad(model, point, x, torch.zeros(5000, dtype=torch.int64), None)
    with torch.no_grad():
        z, _ = model.features(point, x)
    assert value == pytest.approx(float((z.double() ** 2).sum(dim=1).mean()), rel=1e-12)
    assert not grad.any()


def test_two_clients_weights_have_the_closed_form():
    """With two clients P_1 = diag(v_1, v_2 + D), D = ||h_1 - h_2||^2, so alpha_1 = (v_2 + D, v_1) / (v_1 + v_2 + D)."""
    h = np.array([[0.0, 1.0, 0.0], [1.0, 1.0, 2.0]])
    v1, v2, distance = 0.3, 0.5, 5.0
    weights = combination_weights(h, np.array([v1, v2]))
    np.testing.assert_allclose(weights[0], np.array([v2 + distance, v1]) / (v1 + v2 + distance), rtol=1e-12)
    np.testing.assert_allclose(weights[1], np.array([v2, v1 + distance]) / (v1 + v2 + distance), rtol=1e-12)
    same = combination_weights(np.zeros((2, 3)), np.array([1.0, 3.0]))  # no bias: inverse-variance weights
    np.testing.assert_allclose(same[0], [0.75, 0.25], rtol=1e-12)


def test_the_quadratic_program_is_solved_exactly_over_the_simplex():
    """Against a fine grid of the 3-client simplex, and the KKT conditions on random problems: P alpha >= lambda
    everywhere with equality on the support, lambda = alpha^T P alpha."""
    source = np.random.default_rng(4)
    grid = np.array([(a, b, 200 - a - b) for a, b in itertools.product(range(201), repeat=2) if a + b <= 200]) / 200
    for _ in range(20):
        h = source.normal(size=(3, 5))
        variances = source.uniform(0.0, 2.0, size=3)
        for i, alpha in enumerate(combination_weights(h, variances)):
            gaps = h[i] - h
            p = np.diag(variances) + gaps @ gaps.T
            assert alpha.min() >= 0 and alpha.sum() == pytest.approx(1.0)
            assert alpha @ p @ alpha <= np.einsum("gj,jk,gk->g", grid, p, grid).min() + 1e-12
    for k in (1, 4, 9):
        root = source.normal(size=(k, k))
        p = root @ root.T + 1e-3 * np.eye(k)
        p[0, 0] += 25.0  # a client of large variance: best left out
        alpha = simplex_qp(p)
        gradient = p @ alpha
        level = alpha @ gradient
        assert alpha.min() >= 0 and alpha.sum() == pytest.approx(1.0)
        assert (gradient >= level - 1e-9).all()
        np.testing.assert_allclose(gradient[alpha > 1e-9], level, rtol=1e-9)


def _message(head: np.ndarray, h: np.ndarray, variance: float, n: float) -> np.ndarray:
    return np.concatenate([head, h.ravel(), [variance, n]])


def test_the_server_combines_heads_and_averages_bodies_and_prototypes():
    """Bodies weighted by n_i; prototypes by their counts (eq. 8); each selected client's head the combination of
    the selected heads by its weights; an unselected client's combined head kept; a client without data its own."""
    algorithm = build_algorithm(FedPacSettings(name="fedpac"), SPEC)
    server = algorithm.init_server(np.arange(13, dtype=np.float32), 4)
    heads = {0: np.full(HEAD, 1.0), 2: np.full(HEAD, 3.0), 3: np.full(HEAD, 7.0)}
    h = {0: np.zeros((2, 4)), 2: np.ones((2, 4)) / np.sqrt(8), 3: np.zeros((2, 4))}  # ||h_0 - h_2||^2 = 1
    sizes, variances = {0: 10.0, 2: 30.0, 3: 0.0}, {0: 0.5, 2: 1.5, 3: 0.0}
    messages = {c: _message(heads[c], h[c], variances[c], sizes[c]) for c in heads}
    bodies = {0: np.array([1.0, 2.0, 3.0]), 2: np.array([5.0, 6.0, 7.0]), 3: np.zeros(3)}
    protos = {0: np.stack([np.full(4, 1.0), np.zeros(4)]), 2: np.stack([np.full(4, 5.0), np.full(4, 2.0)])}
    counts = {0: np.array([3.0, 0.0]), 2: np.array([1.0, 4.0])}
    total = FedPacUpload(
        sum(sizes[c] * bodies[c] for c in heads),
        sum(sizes.values()),
        sum(counts[c][:, None] * protos[c] for c in protos).ravel(),
        sum(counts.values()),
        sum(heads.values()),
        np.zeros(9),
    )
    new, metrics = algorithm.server_step_by_client(server, total, 3, messages)
    np.testing.assert_allclose(new.body, (10 * bodies[0] + 30 * bodies[2]) / 40, rtol=1e-6)
    np.testing.assert_allclose(new.prototypes, [np.full(4, 2.0), np.full(4, 2.0)], rtol=1e-6)
    assert new.present.tolist() == [True, True] and metrics["prototype_classes"] == 2.0
    alpha_0 = np.array([1.5 + 1.0, 0.5]) / 3.0  # the closed form of two clients
    alpha_2 = np.array([1.5, 0.5 + 1.0]) / 3.0
    np.testing.assert_allclose(new.heads[0], alpha_0 @ [heads[0], heads[2]], rtol=1e-6)
    np.testing.assert_allclose(new.heads[2], alpha_2 @ [heads[0], heads[2]], rtol=1e-6)
    np.testing.assert_array_equal(new.heads[3], heads[3])  # no data: its own head
    np.testing.assert_array_equal(new.heads[1], server.heads[1])  # not selected
    assert metrics["self_weight"] == pytest.approx((alpha_0[0] + alpha_2[1] + 1.0) / 3)
    clients = build_algorithm(FedPacSettings(name="fedpac", aggregation="clients", collaboration=False), SPEC)
    weights = {c: (counts[c] > 0).astype(float) for c in counts}
    total.prototypes = sum(weights[c][:, None] * protos[c] for c in protos).ravel()
    total.prototype_weight = sum(weights.values())
    new, _ = clients.server_step_by_client(server, total, 3, messages)
    np.testing.assert_allclose(new.prototypes, [np.full(4, 3.0), np.full(4, 2.0)], rtol=1e-6)
    for client in heads:
        np.testing.assert_array_equal(new.heads[client], heads[client])  # no collaboration: alpha_i = e_i


def test_a_round_combines_the_trained_heads_and_the_combined_model_uses_them():
    """In a round the server combines the heads the clients trained; the client trains its next round from its
    combined head; `combined` scores the global body with it, the PM the head the client trained."""
    problem = labelled_problem(3, 8, seed=5, held=[[0, 1], [1, 2], [0, 2]])
    sim = _fedpac(problem, 2, 3)
    algorithm, server = sim.host.algorithm, sim.server
    global_model = sim.coordinator.global_model()
    context = algorithm.evaluation_context(server)
    assert context.shape == (3, algorithm.head.sum())
    for client, state in sim.states.items():
        combined = algorithm.extra_models(state, global_model, context)["combined"]
        np.testing.assert_array_equal(combined[algorithm.head], server.heads[client])
        np.testing.assert_array_equal(combined[~algorithm.head], server.body)
        pm = algorithm.evaluated_model(state, global_model)
        np.testing.assert_array_equal(pm[algorithm.head], state.head)
    assert not np.allclose(server.heads[0], sim.states[0].head)  # the heads were combined
    _update, requests, _results, broadcast = _recorded_step(sim, 0)
    np.testing.assert_array_equal(requests[0].point[algorithm.head], server.heads[0])
    assert algorithm.extra_models(sim.states[0], global_model, None) == {}


def test_communication():
    """Uplink: body, n_i, head, (d + 1) per class held, and with collaboration h_i's rows of those classes and
    V_i / n_i; downlink: body, the client's own head and d per global prototype."""
    upload = FedPacUpload(np.zeros(3), 5.0, np.zeros(8), np.array([5.0, 0.0]), np.zeros(HEAD), np.zeros(9))
    with_collaboration = build_algorithm(FedPacSettings(name="fedpac"), SPEC)
    assert with_collaboration.uplink_bytes(upload) == 4 * (3 + 1 + HEAD + (4 + 1) + (4 + 1))
    alone = build_algorithm(FedPacSettings(name="fedpac", collaboration=False), SPEC)
    assert alone.uplink_bytes(upload) == 4 * (3 + 1 + HEAD + (4 + 1))
    server = with_collaboration.init_server(np.zeros(13, np.float32), 6)
    assert with_collaboration.downlink_bytes(with_collaboration.broadcast(server)) == 4 * (3 + HEAD)
    server.present[:] = True
    assert with_collaboration.downlink_bytes(with_collaboration.broadcast(server)) == 4 * (3 + HEAD + 2 * 4)
    assert not FedPacUpload.carries_message()  # attacks and robust rules are refused


def test_a_request_that_moves_nothing():
    request = build_algorithm(FedPacSettings(name="fedpac"), SPEC).feature_energy(np.ones(13, np.float32), 7)
    assert isinstance(request, LocalSGD) and request.batch_size == 7 and request.epochs == 1
    assert not request.mask.any() and not request.random_epochs
