"""FedAS (raysim.algorithms.fedas): with equal Fisher weights (or n_i) and no alignment it is FedPer; the server
averages the bodies by the Fisher trace or per coordinate by the diagonal Fisher; the Fisher estimate is the sum of
squared batch gradients (softmax regression, by hand); the alignment trains the received body alone towards the
client's own prototypes, by the authors' loss or FL-bench's; the PM; what is sent."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from raysim.algorithms import ClientInfo, build_algorithm
from raysim.algorithms.families.averaging import WeightedUpload
from raysim.algorithms.fedas import FedASSettings, PrototypeAlignment, fisher_information
from raysim.algorithms.interface import payload_bytes
from raysim.algorithms.requests import ClassMeans, FullGradient, GradientResult, LocalSGD, SGDResult
from raysim.errors import ConfigError
from raysim.execution.drivers import drive, run_client_step
from raysim.models.flat import FlatModel
from raysim.models.spec import ParamSpec
from tests.support.split_models import simulate, step_results

SPEC = ParamSpec(("0.weight", "1.weight", "1.bias"), ((3, 2), (2, 3), (2,)), (0, 6, 12), head=("1.weight", "1.bias"))
"""A body of 6 coordinates, a head of 8."""


def fedas(**settings) -> object:
    return build_algorithm(FedASSettings(name="fedas", **settings), SPEC)


def _rounds(settings: dict, equal_fisher: bool, selections: list[list[int]]):
    """Rounds run client by client with the host's executors (the draws of a runtime round), the uploads summed in
    float64; with `equal_fisher` every client's Fisher gradients are replaced so that its trace is 1."""
    sim = simulate(settings, rounds=0)
    algorithm, host = sim.host.algorithm, sim.host
    init = sim.problem.init_params
    server = algorithm.init_server(init, len(host.info))
    states = {c: algorithm.init_client(host.info[c], init) for c in host.info}
    for round_index, selected in enumerate(selections):
        broadcast = algorithm.broadcast(server)
        uploads = []
        for c in selected:
            execute = host.steps.client_executor(c, round_index)
            batches = max(1, host.info[c].num_train // settings.get("batch_size", 32))

            def run(request, execute=execute, batches=batches):
                if equal_fisher and isinstance(request, FullGradient):
                    grad = np.zeros(algorithm.params.size, np.float32)
                    grad[0] = np.sqrt(1.0 / batches)
                    return GradientResult(grad, 0.0)
                return execute(request)

            update = run_client_step(algorithm, host.info[c], states[c], broadcast, run)
            states[c] = update.state
            uploads.append(update.upload)
        fields = [f.name for f in dataclasses.fields(uploads[0])]
        total = type(uploads[0])(**{f: sum(np.asarray(getattr(u, f), np.float64) for u in uploads) for f in fields})
        server, _ = algorithm.server_step(server, total, len(selected))
    return algorithm, server, states


def test_with_equal_fisher_weights_and_no_alignment_it_is_fedper_with_equal_weights():
    selections = [[0, 2, 4], [1, 2, 3], [0, 3, 4]]
    ours, server, states = _rounds({"name": "fedas", "alignment": False}, True, selections)
    theirs, fedper_server, fedper_states = _rounds({"name": "fedper", "aggregation": "uniform"}, False, selections)
    np.testing.assert_array_equal(ours.head, theirs.personal)  # the same split: the classifier is personal
    np.testing.assert_allclose(server.shared, fedper_server.shared, atol=1e-6)
    for client, state in states.items():
        np.testing.assert_allclose(state.theta[ours.head], fedper_states[client].personal, atol=1e-6)
    assert np.linalg.norm(server.shared - theirs.init_server(server.template, 5).shared) > 1e-2


def test_weighted_by_samples_without_alignment_it_is_fedper_in_the_runtime():
    ours = simulate({"name": "fedas", "alignment": False, "aggregation": "samples", "epochs": 2}, rounds=3)
    theirs = simulate({"name": "fedper", "epochs": 2}, rounds=3)
    np.testing.assert_array_equal(ours.coordinator.global_model(), theirs.coordinator.global_model())
    head = ours.host.algorithm.head
    for client, state in ours.states.items():
        np.testing.assert_array_equal(state.theta[head], theirs.states[client].personal)


def _upload(algorithm, body: np.ndarray, weight) -> WeightedUpload:
    return WeightedUpload(np.asarray(weight, np.float64) * body, weight)


def test_the_server_averages_the_bodies_by_the_clients_fisher_traces():
    algorithm = fedas()
    server = algorithm.init_server(np.zeros(SPEC.size, np.float32), 3)
    bodies = np.array([[1.0, 0, 0, 2, 0, 0], [0, 1, 0, 0, 2, 0], [0, 0, 1, 0, 0, 2]])
    traces = [1.0, 3.0, 6.0]
    total = _upload(algorithm, bodies[0], traces[0])
    for body, trace in zip(bodies[1:], traces[1:], strict=True):
        upload = _upload(algorithm, body, trace)
        total = WeightedUpload(total.weighted + upload.weighted, total.weight + upload.weight)
    new, metrics = algorithm.server_step(server, total, 3)
    np.testing.assert_allclose(new.shared, np.array(traces) @ bodies / 10.0, rtol=1e-6)
    assert metrics["uninformed"] == 0.0
    np.testing.assert_allclose(algorithm.global_model(new)[algorithm.body], new.shared)
    np.testing.assert_array_equal(algorithm.global_model(new)[algorithm.head], 0.0)  # the initial head


def test_per_coordinate_the_server_normalizes_the_diagonal_fisher_and_keeps_what_no_client_informs():
    algorithm = fedas(aggregation="fisher_diagonal")
    previous = np.arange(6, dtype=np.float32)
    server = dataclasses.replace(algorithm.init_server(np.zeros(SPEC.size, np.float32), 2), shared=previous)
    fisher = np.array([[1.0, 0, 2, 0, 1, 0], [3.0, 1, 2, 0, 0, 0]])
    bodies = np.array([[10.0, 10, 10, 10, 10, 10], [20.0, 20, 20, 20, 20, 20]])
    uploads = [_upload(algorithm, b, f) for b, f in zip(bodies, fisher, strict=True)]
    total = WeightedUpload(sum(u.weighted for u in uploads), sum(u.weight for u in uploads))
    new, metrics = algorithm.server_step(server, total, 2)
    np.testing.assert_allclose(new.shared, [17.5, 20, 15, 3, 10, 5], rtol=1e-6)
    assert metrics["uninformed"] == 2.0


def test_the_fisher_estimate_is_the_squared_gradient_of_softmax_regression_by_hand():
    sim = simulate({"name": "fedavg"}, rounds=0, model="mlr")  # logits = W x + b, a convex loss
    data, n = sim.host.steps.data[2], sim.host.info[2].num_train
    theta = np.random.default_rng(0).normal(scale=0.3, size=sim.problem.init_params.size).astype(np.float32)
    classes, features = 4, 20

    def by_hand(rows: np.ndarray) -> np.ndarray:
        """The gradient of the mean cross-entropy: mean over samples of (p - e_y) x^T for W, (p - e_y) for b."""
        x, y = data.x[rows].reshape(len(rows), -1).astype(np.float64), data.y[rows]
        weight, bias = theta[: classes * features].reshape(classes, features), theta[classes * features :]
        logits = x @ weight.T + bias
        p = np.exp(logits - logits.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        p[np.arange(len(y)), y] -= 1
        return np.concatenate([(p.T @ x).ravel(), p.sum(0)]) / len(rows)

    execute = sim.host.steps.client_executor(2, 0)
    whole = drive(fisher_information(theta, n, batch_size=n + 5), execute)  # one batch: the whole split
    np.testing.assert_allclose(whole, by_hand(data.train) ** 2, rtol=1e-4, atol=1e-9)

    requests, results = [], []

    def recorded(request):
        requests.append(request)
        results.append(execute(request))
        return results[-1]

    batch = 32
    fisher = drive(fisher_information(theta, n, batch), recorded)
    assert len(requests) == n // batch and all(isinstance(r, FullGradient) for r in requests)
    expected = np.zeros_like(fisher)
    for result in results:
        assert len(result.indices) == batch and len(set(result.indices)) == batch  # B distinct samples
        expected += by_hand(data.train[result.indices]) ** 2
    np.testing.assert_allclose(fisher, expected, rtol=1e-4, atol=1e-9)
    assert drive(fisher_information(theta, 0, batch), recorded).sum() == 0.0 and len(requests) == n // batch


def test_a_client_uploads_its_body_weighted_by_its_fisher_trace():
    sim = simulate({"name": "fedas"}, rounds=1)
    algorithm = sim.host.algorithm
    record = step_results(sim, 1, sim.coordinator.broadcast())
    grads = [r.grad for q, r in zip(record.requests, record.results, strict=True) if isinstance(q, FullGradient)]
    assert len(grads) == max(1, sim.host.info[1].num_train // 32)
    trace = sum(float((g.astype(np.float64) ** 2).sum()) for g in grads)
    update = record.update
    assert update.upload.weight == pytest.approx(trace) and update.metrics["fisher_trace"] == pytest.approx(trace)
    np.testing.assert_allclose(update.upload.weighted, trace * update.state.theta[algorithm.body], rtol=1e-6)
    (trained,) = [q for q in record.requests if isinstance(q, LocalSGD) and not q.terms]
    last_fisher = [q for q in record.requests if isinstance(q, FullGradient)][0]
    np.testing.assert_array_equal(last_fisher.point, update.state.theta)  # the Fisher of the trained model
    assert trained.epochs == 1 and trained.mask is None


def test_the_alignment_trains_the_received_body_towards_the_clients_own_prototypes():
    sim = simulate({"name": "fedas", "epochs": 1}, rounds=2)
    algorithm = sim.host.algorithm
    broadcast, state = sim.coordinator.broadcast(), sim.states[1]
    assert state.trained
    record = step_results(sim, 1, broadcast)
    kinds = [type(q).__name__ for q in record.requests]
    assert kinds[:3] == ["ClassMeans", "LocalSGD", "LocalSGD"] and set(kinds[3:]) == {"FullGradient"}
    means, align, local = record.requests[:3]
    assert isinstance(means, ClassMeans) and isinstance(align, LocalSGD) and isinstance(local, LocalSGD)
    np.testing.assert_array_equal(means.point, state.theta)  # the prototypes of the client's own model
    (term,) = align.terms
    assert isinstance(term, PrototypeAlignment) and not term.class_means
    np.testing.assert_array_equal(term.targets, record.results[0].means)
    np.testing.assert_array_equal(term.has_target, record.results[0].counts > 0)
    assert (align.lr, align.epochs, align.batch_size, align.momentum) == (0.01, 1, 16, 0.0)
    np.testing.assert_array_equal(align.mask, algorithm.body)  # the head frozen
    np.testing.assert_array_equal(align.start[algorithm.body], broadcast)
    np.testing.assert_array_equal(align.start[algorithm.head], state.theta[algorithm.head])
    aligned = record.results[1].params
    np.testing.assert_array_equal(local.start, aligned)  # training starts from the aligned body and own head
    np.testing.assert_array_equal(aligned[algorithm.head], state.theta[algorithm.head])
    assert np.linalg.norm(aligned[algorithm.body] - broadcast) > 0


def test_the_alignment_loss_is_the_authors_per_sample_mse_or_fl_benchs_class_mean_mse():
    model = FlatModel("mlp", (20,), 4)
    rng = np.random.default_rng(1)
    point = torch.from_numpy(rng.normal(scale=0.3, size=model.spec.size).astype(np.float32))
    x = torch.from_numpy(rng.normal(size=(7, 20)).astype(np.float32))
    y = torch.tensor([0, 0, 1, 1, 1, 3, 2])
    d = model.spec.feature_dim
    targets = rng.normal(size=(4, d)).astype(np.float32)
    has = np.array([True, True, True, False])
    with torch.no_grad():
        z = model.features(point, x)[0].numpy().astype(np.float64)
    labels = y.numpy()
    samples = sum(((z[labels == c] - targets[c]) ** 2).sum() / ((labels == c).sum() * d) for c in (0, 1, 2))
    means = sum(((z[labels == c].mean(0) - targets[c]) ** 2).sum() / d for c in (0, 1, 2))
    for class_means, expected in ((False, samples), (True, means)):
        term = PrototypeAlignment(targets, has, class_means)
        loss, grad = term.loss_and_grad(model, point, x, y, None)
        assert loss == pytest.approx(expected, rel=1e-5)
        np.testing.assert_array_equal(grad.numpy()[model.spec.head_mask()], 0.0)  # the head is not involved
    own = PrototypeAlignment(np.stack([z[labels == c].mean(0) for c in range(4)]).astype(np.float32), has, True)
    assert own.loss_and_grad(model, point, x, y, None)[0] == pytest.approx(0.0, abs=1e-10)


def test_the_pm_is_the_clients_own_model_once_it_has_trained():
    sim = simulate({"name": "fedas"}, rounds=1)
    algorithm, gm = sim.host.algorithm, sim.coordinator.global_model()
    trained = [c for c, s in sim.states.items() if s.trained]
    untrained = [c for c, s in sim.states.items() if not s.trained]
    assert len(trained) == 3 and untrained
    assert algorithm.evaluated_model(sim.states[untrained[0]], gm) is None  # deploys the GM
    np.testing.assert_array_equal(algorithm.evaluated_model(sim.states[trained[0]], gm), sim.states[trained[0]].theta)


def test_communication_the_body_down_and_the_weighted_body_and_its_weight_up():
    body = int((~SPEC.head_mask()).sum())
    for aggregation, weights in (("fisher_trace", 1), ("samples", 1), ("fisher_diagonal", body)):
        algorithm = fedas(aggregation=aggregation, alignment=False)
        server = algorithm.init_server(np.zeros(SPEC.size, np.float32), 2)
        assert algorithm.downlink_bytes(algorithm.broadcast(server)) == 4 * body
        client = ClientInfo(0, num_train=10, weight=0.5, num_clients=2)
        theta = np.arange(SPEC.size, dtype=np.float32)

        def answer(request, theta=theta):
            if isinstance(request, FullGradient):
                return GradientResult(np.ones(SPEC.size, np.float32), 0.0)
            return SGDResult(theta, 0.0, 1)

        state = dataclasses.replace(algorithm.init_client(client, theta), trained=True)
        update = run_client_step(algorithm, client, state, algorithm.broadcast(server), answer)
        assert algorithm.uplink_bytes(update.upload) == payload_bytes(update.upload) == 4 * (body + weights)
        np.testing.assert_array_equal(algorithm.message(update), theta[algorithm.body])
        np.testing.assert_array_equal(algorithm.message_coordinates(theta), theta[algorithm.body])


def test_a_model_without_a_body_is_refused():
    spec = FlatModel("mlr", (20,), 4).spec
    with pytest.raises(ConfigError, match="needs a model with a body"):
        build_algorithm(FedASSettings(name="fedas"), spec)
