"""kNN-Per (raysim.algorithms.knnper): the neighbours' kernel weights and the kNN vote on hand-made points, the
mixture with the global model (lambda = 0 is the global model, lambda = 1 with k = 1 on stored samples gives their
labels), the datastore's capacity, the training that is FedAvg's, the server step on hand-made uploads, the
communication accounting, and the PM's outputs from a trained global model's features as the evaluation hook would
compute them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raysim.algorithms import Algorithm, build_algorithm
from raysim.algorithms.families.averaging import AveragingServerState, WeightedUpload
from raysim.algorithms.knnper import (
    PROBABILITY_FLOOR,
    FeatureData,
    KnnPer,
    KnnPerSettings,
    datastore,
    knn_probabilities,
    knnper_outputs,
    log_softmax,
    mixture,
    neighbour_weights,
    squared_distances,
)
from raysim.config import validate_config
from raysim.evaluation.columns import model_columns
from tests.support.experiments import IN_PROCESS, tiny_config
from tests.support.inprocess import InProcess
from tests.support.split_models import simulate

KEYS = np.array([[0.0, 0.0], [1.0, 0.0], [0.0, 2.0], [3.0, 3.0]], np.float32)
LABELS = np.array([0, 1, 1, 2])


def _run(algorithm: dict, rounds: int = 2) -> InProcess:
    config = tiny_config(
        algorithm={**algorithm, "lr": 0.1, "batch_size": 16},
        rounds=rounds,
        runtime={**IN_PROCESS, "client_training": "sequential"},
    )
    sim = InProcess(validate_config(config))
    for round_index in range(rounds):
        sim.round(round_index)
    return sim


def test_the_neighbour_weights_are_the_normalized_gaussian_kernel():
    """w_j = exp(-D_j / (d sigma)) / sum_l exp(-D_l / (d sigma)), and far neighbours do not all underflow to 0."""
    distances = np.array([[0.5, 2.0, 4.5], [1.0, 1.0, 9.0]])
    dim, scale = 2, 1.5
    kernel = np.exp(-distances / (dim * scale))
    np.testing.assert_allclose(neighbour_weights(distances, dim, scale), kernel / kernel.sum(1, keepdims=True))
    far = neighbour_weights(distances + 1e6, dim, scale)
    np.testing.assert_allclose(far, kernel / kernel.sum(1, keepdims=True), rtol=1e-6)


def test_the_knn_vote_of_hand_made_points():
    """The query (0.2, 0.1) in d = 2: its 3 nearest keys are #0 (D = 0.05, label 0), #1 (D = 0.65, label 1) and
    #2 (D = 3.65, label 1); key #3 is left out by k = 3."""
    query = np.array([[0.2, 0.1]], np.float32)
    np.testing.assert_allclose(squared_distances(query, KEYS), [[0.05, 0.65, 3.65, 16.25]], rtol=1e-6)
    kernel = np.exp(-np.array([0.05, 0.65, 3.65]) / (2 * 1.0))
    expected = np.array([kernel[0], kernel[1] + kernel[2], 0.0]) / kernel.sum()
    np.testing.assert_allclose(knn_probabilities(query, KEYS, LABELS, 3, k=3, scale=1.0), [expected], rtol=1e-6)
    # k beyond the datastore: every key votes; each row is a distribution over the classes
    everything = knn_probabilities(query, KEYS, LABELS, 4, k=50, scale=1.0)
    assert everything[0, 2] > 0 and everything[0, 3] == 0
    assert everything.sum() == pytest.approx(1.0)


def test_the_mixture_of_probabilities_and_of_logits():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(5, 3)).astype(np.float32)
    knn = rng.dirichlet(np.ones(3), size=5)
    lam = 0.3
    softmax = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    outputs = mixture(knn, logits, lam)
    np.testing.assert_allclose(np.exp(outputs), lam * knn + (1 - lam) * softmax, rtol=1e-5)
    # softmax cross-entropy of the outputs is the mixture's negative log-likelihood
    y = torch.tensor([0, 1, 2, 0, 1])
    loss = torch.nn.functional.cross_entropy(torch.from_numpy(outputs), y, reduction="none").numpy()
    np.testing.assert_allclose(loss, -np.log((lam * knn + (1 - lam) * softmax)[np.arange(5), y.numpy()]), rtol=1e-5)
    np.testing.assert_allclose(mixture(knn, logits, lam, "logits"), lam * knn + (1 - lam) * logits, rtol=1e-6)


def test_lambda_zero_is_the_global_model():
    """Its predictions and its losses are the global model's, whatever the datastore says."""
    rng = np.random.default_rng(1)
    features, logits = rng.normal(size=(20, 2)).astype(np.float32), 3 * rng.normal(size=(20, 3)).astype(np.float32)
    outputs = knnper_outputs(features, logits, KEYS, LABELS, k=2, lam=0.0, scale=1.0)
    np.testing.assert_array_equal(outputs.argmax(1), logits.argmax(1))
    np.testing.assert_allclose(outputs, log_softmax(logits), rtol=1e-6)
    y = torch.from_numpy(rng.integers(0, 3, 20))
    np.testing.assert_allclose(
        torch.nn.functional.cross_entropy(torch.from_numpy(outputs), y).item(),
        torch.nn.functional.cross_entropy(torch.from_numpy(logits), y).item(),
        rtol=1e-6,
    )
    np.testing.assert_array_equal(knnper_outputs(features, logits, KEYS, LABELS, 2, 0.0, 1.0, "logits"), logits)


def test_lambda_one_with_one_neighbour_gives_the_stored_labels():
    """A stored sample is its own nearest neighbour: probability 1 on its label, PROBABILITY_FLOOR elsewhere."""
    logits = np.tile(np.array([[5.0, -5.0, 0.0]], np.float32), (4, 1))  # the global model says class 0 everywhere
    outputs = knnper_outputs(KEYS, logits, KEYS, LABELS, k=1, lam=1.0, scale=1.0)
    np.testing.assert_array_equal(outputs.argmax(1), LABELS)
    np.testing.assert_allclose(np.exp(outputs.max(1)), 1.0)
    floored = np.ones_like(outputs, bool)
    floored[np.arange(4), LABELS] = False
    np.testing.assert_allclose(outputs[floored], np.log(PROBABILITY_FLOOR))


def test_an_empty_datastore_deploys_the_global_model():
    logits = np.array([[1.0, 2.0, 0.5]], np.float32)
    empty = np.zeros((0, 2), np.float32)
    outputs = knnper_outputs(np.zeros((1, 2), np.float32), logits, empty, np.zeros(0, np.int64), 5, 1.0, 1.0)
    np.testing.assert_allclose(outputs, log_softmax(logits), rtol=1e-6)


def test_the_datastore_keeps_capacity_samples_drawn_at_random():
    features = np.arange(20, dtype=np.float32).reshape(10, 2)
    labels = np.arange(10)
    same, same_labels = datastore(features, labels, None)
    assert same is features and same_labels is labels
    assert datastore(features, labels, 10)[0] is features
    keys, kept = datastore(features, labels, 4, np.random.default_rng(3))
    assert len(set(kept.tolist())) == 4
    np.testing.assert_array_equal(keys, features[kept])  # each key keeps its label
    with pytest.raises(ValueError, match="generator"):
        datastore(features, labels, 4)


def test_the_settings_take_lambda_and_refuse_shared_only():
    assert KnnPerSettings.model_validate({"lambda": 0.25}).lam == 0.25
    assert KnnPerSettings().k == 10 and KnnPerSettings().lam == 0.5 and KnnPerSettings().mix == "probabilities"
    with pytest.raises(ValueError, match="shared_only"):
        KnnPerSettings(shared_only=True, personal=["1.weight"])


def test_training_is_fedavg():
    """kNN-Per changes nothing of training: its global model is FedAvg's, round after round."""
    runs = {name: _run({"name": name}).coordinator.global_model() for name in ("knnper", "fedavg")}
    np.testing.assert_array_equal(runs["knnper"], runs["fedavg"])
    knn = _run({"name": "knnper", "k": 1, "lambda": 1.0, "mix": "logits"}).coordinator.global_model()
    np.testing.assert_array_equal(knn, runs["fedavg"])


def test_the_server_averages_hand_made_uploads_by_their_weights():
    sim = simulate({"name": "knnper"}, rounds=0)
    algorithm = sim.host.algorithm
    assert isinstance(algorithm, KnnPer)
    size = sim.problem.init_params.size
    a, b = np.full(size, 1.0), np.full(size, 4.0)
    total = WeightedUpload(10 * a + 30 * b, 40.0)
    server, _ = algorithm.server_step(AveragingServerState(np.zeros(size, np.float32)), total, 2)
    np.testing.assert_allclose(server.w, np.full(size, 3.25))


def test_the_communication_is_fedavgs():
    sim = simulate({"name": "knnper"}, rounds=0)
    algorithm, size = sim.host.algorithm, sim.problem.init_params.size
    broadcast = sim.coordinator.broadcast()
    assert algorithm.downlink_bytes(broadcast) == 4 * size
    assert algorithm.uplink_bytes(WeightedUpload(np.zeros(size), 1.0)) == 4 * (size + 1)


def _feature_data(sim: InProcess, client: int, split: str) -> tuple[FeatureData, np.ndarray]:
    """What the evaluation hook would hand `feature_outputs` for the client's `split` at the current global model,
    computed with the host's network (FlatModel.features), and the split's labels."""
    model, data = sim.host.model, sim.host.data[client]
    point = torch.from_numpy(np.asarray(sim.coordinator.global_model(), np.float32))

    def forward(indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        with torch.no_grad():
            features, logits = model.features(point, torch.from_numpy(data.inputs.rows(data.x, indices)))
        return features.reshape(len(indices), -1).numpy(), logits.numpy()

    memory, _ = forward(data.train)
    features, logits = forward(getattr(data, split))
    labels = data.y[getattr(data, split)]
    return FeatureData(memory, data.y[data.train], features, logits, np.random.default_rng(0)), labels


def test_the_pm_outputs_from_the_global_models_features():
    """On a trained mlp: lambda = 0 predicts as the global model on the test split; lambda = 1 with k = 1 on the
    training split recovers its labels (each training sample is its own nearest neighbour)."""
    sim = simulate({"name": "knnper", "lambda": 0.0}, rounds=2)
    client = 1
    test, test_labels = _feature_data(sim, client, "test")
    info = sim.host.info[client]
    global_outputs = sim.host.algorithm.feature_outputs(info, sim.states[client], test)
    np.testing.assert_array_equal(global_outputs.argmax(1), test.logits.argmax(1))
    assert len(test_labels) == len(global_outputs)

    memorizing = build_algorithm(KnnPerSettings(k=1, lam=1.0), sim.host.model.spec)
    train, train_labels = _feature_data(sim, client, "train")
    outputs = memorizing.feature_outputs(info, sim.states[client], train)
    assert len(np.unique(train.memory_features, axis=0)) == len(train_labels)  # no two samples share features
    np.testing.assert_array_equal(outputs.argmax(1), train_labels)


@pytest.mark.skipif(
    not hasattr(Algorithm, "scores_from_features"), reason="the evaluation hook (Algorithm.feature_outputs) is absent"
)
def test_the_host_scores_the_mixture_as_the_pm():
    """Through ClientHost.evaluate: with lambda = 0 every client's PM scores are its GM's; with lambda = 1 and k = 1
    its training loss is that of the stored labels themselves, -log 1 = 0."""
    for lam, k in ((0.0, 10), (1.0, 1)):
        sim = simulate({"name": "knnper", "lambda": lam, "k": k}, rounds=1)
        batch = sim.host.evaluate(sim.coordinator.global_model())
        pm, gm = model_columns(batch, "pm"), model_columns(batch, "gm")
        if lam == 0.0:
            np.testing.assert_array_equal(pm["test_acc"], gm["test_acc"])
            np.testing.assert_allclose(pm["test_loss"], gm["test_loss"], rtol=1e-5)
        else:
            np.testing.assert_allclose(pm["train_loss"], 0.0, atol=1e-6)
