"""FedNTD (raysim.algorithms.fedntd) and FedLC (raysim.algorithms.fedlc), FedAvg with a new local loss each, written
as a term beside the method: each loss against its paper's equation written out in float64 with its gradient
against central differences; their special cases (beta = 0 and tau = 0 are FedAvg; a model equal to the global one
distils nothing); FedLC's counts are the client's stored labels."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.nn import functional

from raysim.algorithms.fedlc import ABSENT, LogitCalibration
from raysim.algorithms.fedntd import NotTrueDistillation, not_true
from raysim.algorithms.requests import ClassMeans, LocalSGD
from raysim.config import validate_config
from raysim.models.flat import FlatModel
from tests.support.experiments import IN_PROCESS, tiny_config
from tests.support.features import CLASSES, DIM
from tests.support.inprocess import InProcess
from tests.support.split_models import simulate, step_results


def _batch(seed: int = 0) -> tuple[FlatModel, torch.Tensor, torch.Tensor, torch.Tensor, np.ndarray]:
    """A model, a point, a batch with every class, and another model (a global one)."""
    source = np.random.default_rng(seed)
    model = FlatModel("mlp", (DIM,), CLASSES)
    x = torch.from_numpy(source.normal(size=(12, DIM)).astype(np.float32))
    y = torch.from_numpy(np.arange(12) % CLASSES)
    return model, torch.from_numpy(model.initial_parameters(seed)), x, y, model.initial_parameters(seed + 1)


def _check_gradient(definition, point: torch.Tensor, grad: torch.Tensor) -> None:
    """The slope along the gradient itself (|grad|, to 2%) and along random unit directions against central
    differences of the float64 definition (its float32 forward pass leaves an error of about 1e-4 in a quotient)."""
    generator = torch.Generator().manual_seed(0)
    directions = [grad / grad.norm()] + [torch.randn(point.shape, generator=generator) for _ in range(2)]
    for direction in directions:
        direction = direction / direction.norm()
        slope = (definition(point + 1e-2 * direction) - definition(point - 1e-2 * direction)) / 2e-2
        assert float(grad @ direction) == pytest.approx(slope, abs=2e-2 * float(grad.norm()))


def test_not_true_drops_each_samples_true_class_and_keeps_the_others_in_order():
    logits = torch.arange(12.0).reshape(3, 4)
    assert not_true(logits, torch.tensor([0, 2, 3])).tolist() == [[1, 2, 3], [4, 5, 7], [8, 9, 10]]


@pytest.mark.parametrize(("beta", "tau"), [(1.0, 1.0), (0.5, 3.0)])
def test_the_not_true_distillation_is_eq_3_and_4_written_out(beta, tau):
    model, point, x, y, global_model = _batch(1)
    loss, grad = NotTrueDistillation(global_model, beta, tau).loss_and_grad(model, point, x, y, None)

    def definition(at: torch.Tensor) -> float:
        with torch.no_grad():
            local = model.forward(at, x).double().numpy()
            taught = model.forward(torch.from_numpy(global_model), x).double().numpy()
        labels = y.numpy()
        total = 0.0
        for row, label in enumerate(labels):
            others = [c for c in range(CLASSES) if c != label]
            p_g = np.exp(taught[row, others] / tau) / np.exp(taught[row, others] / tau).sum()
            p_l = np.exp(local[row, others] / tau) / np.exp(local[row, others] / tau).sum()
            total += float(np.sum(p_g * np.log(p_g / p_l)))
        task = float(functional.cross_entropy(torch.from_numpy(local), y))
        return task + beta * tau**2 * total / len(labels)

    assert loss == pytest.approx(definition(point), rel=1e-5)
    _check_gradient(definition, point, grad)


def test_a_model_equal_to_the_global_one_distils_nothing():
    model, point, x, y, _ = _batch(2)
    loss, grad = NotTrueDistillation(point.numpy().copy(), 1.0, 2.0).loss_and_grad(model, point, x, y, None)
    plain_loss, plain_grad = model.loss_and_grad(point, x, y)
    assert loss == pytest.approx(plain_loss, abs=1e-6)
    torch.testing.assert_close(grad, plain_grad, atol=1e-6, rtol=0)


@pytest.mark.parametrize("tau", [1.0, 0.3])
def test_the_calibrated_loss_is_eq_9_written_out(tau):
    model, point, x, y, _ = _batch(3)
    counts = np.array([5.0, 0.0, 20.0])
    loss, grad = LogitCalibration(counts, tau).loss_and_grad(model, point, x, y, None)

    def definition(at: torch.Tensor) -> float:
        with torch.no_grad():
            logits = model.forward(at, x).double().numpy()
        shifted = logits - tau * np.maximum(counts, ABSENT) ** -0.25
        picked = shifted[np.arange(len(y)), y.numpy()]
        return float(np.mean(np.log(np.exp(shifted).sum(axis=1)) - picked))

    assert loss == pytest.approx(definition(point), rel=1e-5)
    _check_gradient(definition, point, grad)


@pytest.mark.parametrize(("name", "neutral"), [("fedntd", {"beta": 0.0}), ("fedlc", {"tau": 0.0})])
def test_the_neutral_setting_is_fedavg(name, neutral):
    runs = {}
    for algorithm in ({"name": name, **neutral}, {"name": "fedavg"}):
        config = tiny_config(
            algorithm={**algorithm, "lr": 0.1, "batch_size": 16},
            rounds=2,
            runtime={**IN_PROCESS, "client_training": "sequential"},
        )
        sim = InProcess(validate_config(config))
        for round_index in range(2):
            sim.round(round_index)
        runs[algorithm["name"]] = sim.coordinator.global_model()
    np.testing.assert_allclose(runs[name], runs["fedavg"], atol=1e-5)
    assert np.linalg.norm(runs[name] - sim.problem.init_params) > 1e-2


def test_fedlc_calibrates_by_the_clients_stored_label_counts():
    sim = simulate({"name": "fedlc", "tau": 1.0}, rounds=1)
    update, (counting, training), _ = step_results(sim, 2, sim.coordinator.broadcast())
    assert isinstance(counting, ClassMeans) and counting.point is None and isinstance(training, LocalSGD)
    (term,) = training.terms
    _, split = sim.problem.clients[2]
    labels = sim.problem.y[split.train]
    np.testing.assert_array_equal(term.counts[: labels.max() + 1], np.bincount(labels))
    assert update.upload.weight == len(labels)
