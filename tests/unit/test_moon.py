"""MOON (raysim.algorithms.moon): its model-contrastive loss against eq. 3 written out, its special cases (mu = 0
is FedAvg; a model equal to both references has l_con = log 2 and no contrastive gradient), and one round's state
and upload."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch.nn import functional

from raysim.algorithms.interface import ClientInfo
from raysim.algorithms.moon import ModelContrast, Moon, MoonSettings
from raysim.config import validate_config
from raysim.execution.drivers import run_client_step
from raysim.models.flat import FlatModel
from raysim.training.local import ClientData, LocalTrainer
from tests.support.experiments import IN_PROCESS, tiny_config
from tests.support.features import CLASSES, DIM
from tests.support.inprocess import InProcess


def _batch(seed: int = 0) -> tuple[FlatModel, torch.Tensor, torch.Tensor, torch.Tensor, np.ndarray, np.ndarray]:
    """A model, a point, a batch, and two reference models (other initializations)."""
    source = np.random.default_rng(seed)
    model = FlatModel("mlp", (DIM,), CLASSES)
    x = torch.from_numpy(source.normal(size=(12, DIM)).astype(np.float32))
    y = torch.from_numpy(source.integers(0, CLASSES, 12))
    point = torch.from_numpy(model.initial_parameters(seed))
    return model, point, x, y, model.initial_parameters(seed + 1), model.initial_parameters(seed + 2)


def test_a_model_equal_to_both_references_has_l_con_log_2_and_only_the_task_gradient():
    model, point, x, y, _, _ = _batch()
    same = point.numpy().copy()
    loss, grad = ModelContrast(same, same, mu=2.0, temperature=0.5).loss_and_grad(model, point, x, y, None)
    plain_loss, plain_grad = model.loss_and_grad(point, x, y)
    assert loss == pytest.approx(float(plain_loss) + 2.0 * math.log(2), abs=1e-5)
    torch.testing.assert_close(grad, plain_grad, atol=1e-5, rtol=0)


@pytest.mark.parametrize(("mu", "temperature"), [(1.0, 0.5), (5.0, 0.1)])
def test_the_loss_is_eq_3_and_its_gradient_the_derivative(mu, temperature):
    """l = CE + mu * -log(e^{s_g/tau} / (e^{s_g/tau} + e^{s_p/tau})) with s the cosine similarities of the features
    (numpy, float64), and the gradient against central differences along random directions."""
    model, point, x, y, global_model, previous = _batch(1)
    term = ModelContrast(global_model, previous, mu, temperature)
    loss, grad = term.loss_and_grad(model, point, x, y, None)

    def definition(at: torch.Tensor) -> float:
        with torch.no_grad():
            z, logits = (t.double().numpy() for t in model.features(at, x))
            z_g = model.features(torch.from_numpy(global_model), x)[0].double().numpy()
            z_p = model.features(torch.from_numpy(previous), x)[0].double().numpy()

        def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
            return (a * b).sum(1) / np.maximum(np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1), 1e-8)

        s_g, s_p = cosine(z, z_g) / temperature, cosine(z, z_p) / temperature
        contrast = np.mean(-s_g + np.logaddexp(s_g, s_p))
        task = float(functional.cross_entropy(torch.from_numpy(logits), y))
        return task + mu * contrast

    assert loss == pytest.approx(definition(point), rel=1e-5)
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):
        direction = torch.randn(point.shape, generator=generator)
        direction /= direction.norm()
        slope = (definition(point + 1e-2 * direction) - definition(point - 1e-2 * direction)) / 2e-2
        assert float(grad @ direction) == pytest.approx(slope, rel=2e-2, abs=1e-4)


def test_a_round_keeps_the_trained_model_as_the_previous_one_and_uploads_it_weighted():
    model, point, x, y, global_model, _ = _batch(2)
    empty = np.array([], np.int64)
    data = ClientData(x.numpy(), y.numpy(), np.arange(len(y)), empty, empty)
    algorithm = Moon(MoonSettings(lr=0.1, batch_size=4), model.spec)
    client = ClientInfo(0, len(y), 1.0, 1)
    state = algorithm.init_client(client, point.numpy())
    trainer = LocalTrainer(model)
    update = run_client_step(
        algorithm, client, state, global_model, lambda r: trainer.run(r, data, np.random.default_rng(0))
    )
    assert not np.array_equal(update.state.previous, global_model)
    np.testing.assert_array_equal(update.upload.weighted, len(y) * update.state.previous)
    assert float(update.upload.weight) == len(y)


def test_mu_zero_is_fedavg():
    """Without the contrastive term MOON's rounds are FedAvg's (the task loss through the features' path, so to
    float rounding)."""
    runs = {}
    for name, extra in (("moon", {"mu": 0.0}), ("fedavg", {})):
        config = tiny_config(
            algorithm={"name": name, "lr": 0.1, "batch_size": 16, **extra},
            rounds=2,
            runtime={**IN_PROCESS, "client_training": "sequential"},
        )
        sim = InProcess(validate_config(config))
        for round_index in range(2):
            sim.round(round_index)
        runs[name] = sim.coordinator.global_model()
    np.testing.assert_allclose(runs["moon"], runs["fedavg"], atol=1e-5)
