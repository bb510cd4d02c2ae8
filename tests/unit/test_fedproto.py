"""FedProto (raysim.algorithms.fedproto): its feature loss, its server's prototype average, the special cases that
coincide with local training, and its communication accounting."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raysim.algorithms.fedproto import FedProtoBroadcast, FedProtoSettings, PrototypePull, PrototypeUpload
from raysim.config import validate_config
from raysim.errors import ConfigError
from raysim.evaluation.batched import Scorer
from raysim.evaluation.columns import client_evaluations
from raysim.models.flat import FlatModel
from raysim.training.local import ClientData, LocalTrainer
from tests.support.experiments import tiny_config
from tests.support.features import CLASSES, DIM, labelled_problem
from tests.support.inprocess import InProcess


def _batch(seed: int = 0) -> tuple[FlatModel, torch.Tensor, torch.Tensor, torch.Tensor]:
    source = np.random.default_rng(seed)
    model = FlatModel("mlp", (DIM,), CLASSES)
    x = torch.from_numpy(source.normal(size=(12, DIM)).astype(np.float32))
    y = torch.from_numpy(np.tile(np.arange(CLASSES), 4))
    return model, torch.from_numpy(model.initial_parameters(seed)), x, y


def pull(targets: np.ndarray, present: np.ndarray, weight: float) -> PrototypePull:
    return PrototypePull(targets, present, weight)


def test_the_pull_without_weight_is_the_plain_loss():
    model, point, x, y = _batch()
    plain_loss, plain_grad = model.loss_and_grad(point, x, y)
    nowhere = np.zeros((CLASSES, 64), np.float32)
    loss, grad = pull(nowhere, np.ones(CLASSES, bool), 0.0).loss_and_grad(model, point, x, y, None)
    assert loss == pytest.approx(plain_loss, abs=1e-6)
    torch.testing.assert_close(grad, plain_grad, atol=1e-6, rtol=0)


def test_prototype_term_is_the_per_sample_mse_to_the_class_targets():
    """lambda * sum_b ||z_b - C[y_b]||^2 / (B d) over the samples whose class has a target (eq. 8, the authors'
    mse_loss), checked against its value from the features; its gradient is the finite difference of the loss."""
    model, point, x, y = _batch(1)
    targets = np.random.default_rng(2).normal(size=(CLASSES, 64)).astype(np.float32)
    present = np.array([True, False, True])
    lam = 0.7
    loss = pull(targets, present, lam)
    value, grad = loss.loss_and_grad(model, point, x, y, None)
    with torch.no_grad():
        z, logits = model.features(point, x)
    kept = present[y.numpy()]
    squares = ((z.numpy() - targets[y.numpy()]) ** 2)[kept].sum()
    expected = torch.nn.functional.cross_entropy(logits, y).item() + lam * squares / (len(y) * 64)
    assert value == pytest.approx(expected, rel=1e-5)
    direction = torch.from_numpy(np.random.default_rng(3).normal(size=point.shape).astype(np.float32))
    direction /= direction.norm()
    step = 1e-3
    plus, _ = loss.loss_and_grad(model, point + step * direction, x, y, None)
    minus, _ = loss.loss_and_grad(model, point - step * direction, x, y, None)
    assert float(grad @ direction) == pytest.approx((plus - minus) / (2 * step), rel=2e-2)


def test_class_means_are_the_mean_features_per_class():
    model, point, x, y = _batch(4)
    counts, means = model.class_means(point.numpy(), x.numpy(), y.numpy(), CLASSES)
    with torch.no_grad():
        z, _ = model.features(point, x)
    for c in range(CLASSES):
        np.testing.assert_allclose(means[c], z.numpy()[y.numpy() == c].mean(axis=0), atol=1e-6)
    np.testing.assert_array_equal(counts, [4.0, 4.0, 4.0])
    counts, none = model.class_means(None, x.numpy(), y.numpy()[:5], CLASSES)
    assert none is None and counts.tolist() == [2.0, 2.0, 1.0]


def _fedproto(problem, rounds: int, count: int, **settings) -> InProcess:
    algorithm = {"name": "fedproto", "lr": 0.1, "batch_size": 8, "epochs": 2, **settings}
    config = validate_config(tiny_config(algorithm=algorithm, clients={"count": count}, model={"name": "mlp"}))
    sim = InProcess(config, problem)
    for round_index in range(rounds):
        sim.round(round_index)
    return sim


def _local(problem, rounds: int, count: int) -> InProcess:
    algorithm = {"name": "local", "lr": 0.1, "batch_size": 8, "epochs": 2}
    config = validate_config(tiny_config(algorithm=algorithm, clients={"count": count}, model={"name": "mlp"}))
    sim = InProcess(config, problem)
    for round_index in range(rounds):
        sim.round(round_index)
    return sim


def test_lambda_zero_is_local_training_exactly():
    """lambda = 0: every client trains on CE alone from its own model, as raysim's Local, bit for bit."""
    problem = labelled_problem(3, 10, seed=5, held=[[0, 1], [1, 2], [0, 2]])
    proto, local = _fedproto(problem, 3, 3, **{"lambda": 0.0}), _local(problem, 3, 3)
    for client, state in local.states.items():
        np.testing.assert_array_equal(proto.states[client].theta, state.theta)
    assert proto.server.prototypes.present.all()  # the prototypes are still computed and averaged


def test_one_client_first_round_is_local_training_and_its_prototypes_are_the_global_ones():
    """Round 0 has no global prototype yet: local training exactly. With one client the global prototypes are its
    own class means at its trained model (after round 0 the pull towards them is a within-class variance term, not
    zero, so later rounds differ from local training)."""
    problem = labelled_problem(1, 12, seed=6)
    proto, local = _fedproto(problem, 1, 1), _local(problem, 1, 1)
    theta = proto.states[0].theta
    np.testing.assert_array_equal(theta, local.states[0].theta)
    model = problem.model_spec.build()
    train = problem.clients[0][1].train
    _counts, means = model.class_means(theta, problem.x[train], problem.y[train], CLASSES)
    np.testing.assert_allclose(proto.server.prototypes.prototypes, means, atol=1e-6)
    later = _fedproto(problem, 2, 1)
    assert np.abs(later.states[0].theta - _local(problem, 2, 1).states[0].theta).max() > 1e-4


@pytest.mark.parametrize("aggregation", ["samples", "clients"])
def test_global_prototype_is_the_count_weighted_mean_of_the_local_ones(aggregation):
    """eq. 7: per class, the prototypes of the clients holding it, weighted by their counts (or equally, the
    authors' code), from the clients' trained models; a class nobody holds has none."""
    held = [[0, 1], [1], [0, 1]]
    problem = labelled_problem(3, 4, seed=7, held=held)
    sim = _fedproto(problem, 1, 3, aggregation=aggregation)
    model = problem.model_spec.build()
    sums, weights = np.zeros((CLASSES, 64)), np.zeros(CLASSES)
    for info, split in problem.clients:
        counts, means = model.class_means(
            sim.states[info.id].theta, problem.x[split.train], problem.y[split.train], CLASSES
        )
        weight = counts if aggregation == "samples" else (counts > 0).astype(float)
        sums += weight[:, None] * means
        weights += weight
    assert weights.tolist() == ([8.0, 12.0, 0.0] if aggregation == "samples" else [2.0, 3.0, 0.0])
    broadcast = sim.server.prototypes
    assert broadcast.present.tolist() == [True, True, False]
    np.testing.assert_allclose(broadcast.prototypes[:2], sums[:2] / weights[:2, None], atol=1e-6)
    np.testing.assert_array_equal(broadcast.prototypes[2], 0.0)


def test_uneven_counts_weight_the_average():
    """A hand-made sum of two clients' uploads: class 0 held 3:1, so its prototype is 3/4 of the way to the first."""
    problem = labelled_problem(1, 2, seed=8)
    algorithm = _fedproto(problem, 0, 1).coordinator.algorithm
    first, second = np.full((CLASSES, 64), 1.0), np.full((CLASSES, 64), 5.0)
    counts_first, counts_second = np.array([3.0, 0.0, 1.0]), np.array([1.0, 0.0, 1.0])
    total = PrototypeUpload(
        counts_first[:, None] * first + counts_second[:, None] * second, counts_first + counts_second
    )
    server, metrics = algorithm.server_step(algorithm.init_server(problem.init_params, 2), total, 2)
    np.testing.assert_allclose(server.prototypes.prototypes[0], 2.0)
    np.testing.assert_allclose(server.prototypes.prototypes[2], 3.0)
    assert server.prototypes.present.tolist() == [True, False, True]
    assert metrics["prototype_classes"] == 2.0


def test_communication_is_prototypes_only():
    """Uplink: a prototype (d = 64, the MLP's last hidden layer) and a count per class held; downlink: classes x d
    of the global prototypes; never the model (109k parameters)."""
    problem = labelled_problem(2, 4, seed=9, held=[[0, 1], [2]])
    sim = _fedproto(problem, 1, 2)
    algorithm = sim.coordinator.algorithm
    held = PrototypeUpload(np.zeros((CLASSES, 64)), np.array([4.0, 4.0, 0.0]))
    assert algorithm.uplink_bytes(held) == 4 * 2 * (64 + 1)
    assert algorithm.downlink_bytes(algorithm.broadcast(sim.server)) == 4 * CLASSES * 64
    assert algorithm.downlink_bytes(algorithm.broadcast(algorithm.init_server(problem.init_params, 2))) == 0


def _softmax(logits: np.ndarray) -> np.ndarray:
    shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
    return shifted / shifted.sum(axis=1, keepdims=True)


def test_proto_model_is_inference_by_the_nearest_global_prototype():
    """`proto` (extra model): on every sample, its softmax is that of the negative mean squared distances of the
    client's features to the global prototypes (the authors' test_inference_new_het_lt), so it predicts the nearest
    one; a class without a prototype is never predicted. The host scores it as `proto` on each client's test split
    given the coordinator's context, and without a context there is none."""
    problem = labelled_problem(3, 10, seed=12, held=[[0, 1], [1, 2], [0, 2]])
    sim = _fedproto(problem, 2, 3)
    algorithm, server = sim.coordinator.algorithm, sim.server
    context = algorithm.evaluation_context(server)
    assert context.present.all()
    model = problem.model_spec.build()
    x = torch.from_numpy(problem.x)
    missing = FedProtoBroadcast(context.prototypes, np.array([True, True, False]))
    for state in sim.states.values():
        for prototypes in (context, missing):
            proto = algorithm.extra_models(state, server.w, prototypes)["proto"]
            with torch.no_grad():
                z, _ = model.features(torch.from_numpy(state.theta), x)
                _, logits = model.features(torch.from_numpy(proto), x)
            distances = ((z.numpy()[:, None, :] - prototypes.prototypes[None]) ** 2).mean(axis=2)
            distances[:, ~prototypes.present] = np.inf
            np.testing.assert_array_equal(logits.numpy().argmax(axis=1), distances.argmin(axis=1))
            if prototypes is context:
                np.testing.assert_allclose(_softmax(logits.numpy()), _softmax(-distances), atol=1e-5)
                body = ~model.spec.head_mask()
                np.testing.assert_array_equal(proto[body], state.theta[body])
    evaluations = client_evaluations(sim.host.evaluate(server.w, context))
    for (info, split), evaluation in zip(problem.clients, evaluations, strict=True):
        proto = algorithm.extra_models(sim.states[info.id], server.w, context)["proto"]
        assert (
            evaluation.extra["proto"].test_acc
            == Scorer(model).evaluate(proto, problem.x[split.test], problem.y[split.test])[1]
        )
    assert all(not e.extra for e in client_evaluations(sim.host.evaluate(server.w)))


@pytest.mark.parametrize(("key", "value"), [("lambda", -1.0), ("aggregation", "median")])
def test_invalid_settings_are_refused_naming_the_field(key, value):
    with pytest.raises(ConfigError, match=rf"algorithm\.{key}"):
        validate_config(tiny_config(algorithm={"name": "fedproto", key: value}))


def test_settings_defaults():
    settings = FedProtoSettings()
    assert (settings.lam, settings.aggregation) == (1.0, "samples")


def test_a_regression_model_is_refused():
    model = FlatModel("linear", (DIM,), 1, "regression")
    x, y = torch.zeros((2, DIM)), torch.zeros(2)
    with pytest.raises(ValueError, match="needs a classifier"):
        pull(np.zeros((CLASSES, 64), np.float32), np.ones(CLASSES, bool), 1.0).loss_and_grad(
            model, torch.zeros(model.size), x, y, None
        )


def test_the_trainer_runs_a_feature_loss_request():
    """LocalTrainer.sgd with the pull term equals the same steps taken by hand with its loss_and_grad."""
    model, point, x, y = _batch(10)
    empty = np.array([], np.int64)
    data = ClientData(x.numpy(), y.numpy(), np.arange(len(y)), empty, empty)
    targets = np.random.default_rng(11).normal(size=(CLASSES, 64)).astype(np.float32)
    loss = pull(targets, np.ones(CLASSES, bool), 0.5)
    request = FedProtoSettings(lr=0.1, batch_size=len(y), epochs=3).local_sgd(point.numpy(), terms=(loss,))
    result = LocalTrainer(model).sgd(request, data, np.random.default_rng(0))
    expected = point.clone()
    for _ in range(3):  # one full batch per epoch: the shuffle does not change the mean
        _value, grad = loss.loss_and_grad(model, expected, x, y, None)
        expected -= 0.1 * grad
    np.testing.assert_allclose(result.params, expected.numpy(), atol=1e-5)
    assert result.steps == 3
