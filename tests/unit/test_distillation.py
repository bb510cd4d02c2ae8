"""The Distillation term (raysim.algorithms.terms): its loss and gradient against their definitions, its special
cases, and both executors training a request with it alike."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.nn import functional

from raysim.algorithms.settings import SGDSettings
from raysim.algorithms.terms import Distillation
from raysim.models.flat import FlatModel
from raysim.training.local import ClientData, LocalTrainer
from raysim.training.vectorized import VectorizedTrainer
from tests.support.features import CLASSES, DIM


def _batch(seed: int = 0) -> tuple[FlatModel, torch.Tensor, torch.Tensor, torch.Tensor, np.ndarray]:
    """A model, a student point, a batch and a teacher (another initialization)."""
    source = np.random.default_rng(seed)
    model = FlatModel("mlp", (DIM,), CLASSES)
    x = torch.from_numpy(source.normal(size=(12, DIM)).astype(np.float32))
    y = torch.from_numpy(source.integers(0, CLASSES, 12))
    return model, torch.from_numpy(model.initial_parameters(seed)), x, y, model.initial_parameters(seed + 100)


def test_weight_zero_is_cross_entropy_value_and_gradient():
    model, point, x, y, teacher = _batch()
    loss, grad = Distillation(teacher, weight=0.0).loss_and_grad(model, point, x, y, None)
    plain_loss, plain_grad = model.loss_and_grad(point, x, y)
    assert loss == pytest.approx(float(plain_loss), abs=1e-6)
    torch.testing.assert_close(grad, plain_grad, atol=1e-6, rtol=0)


def test_a_student_equal_to_its_teacher_has_no_distillation_loss_or_gradient():
    """KL(p || p) = 0 with gradient 0 at the teacher: with weight 1 nothing moves the student."""
    model, point, x, y, _ = _batch(1)
    loss, grad = Distillation(point.numpy().copy(), weight=1.0, temperature=3.0).loss_and_grad(model, point, x, y, None)
    assert loss == pytest.approx(0.0, abs=1e-6)
    assert float(grad.abs().max()) < 1e-6


@pytest.mark.parametrize(("weight", "temperature"), [(0.5, 1.0), (0.9, 4.0)])
def test_the_loss_is_the_definition_and_its_gradient_the_derivative(weight, temperature):
    """(1 - a) CE + a T^2 KL(softmax(t/T) || softmax(s/T)), written out with sums over classes, and the gradient
    against central differences of that loss along random directions."""
    model, point, x, y, teacher = _batch(2)
    term = Distillation(teacher, weight, temperature)
    loss, grad = term.loss_and_grad(model, point, x, y, None)

    def definition(at: torch.Tensor) -> float:
        with torch.no_grad():
            s, t = model.forward(at, x).double(), model.forward(torch.from_numpy(teacher), x).double()
            p_t = torch.softmax(t / temperature, 1)
            kl = (p_t * (torch.log(p_t) - torch.log_softmax(s / temperature, 1))).sum(1).mean()
            return float((1 - weight) * functional.cross_entropy(s, y) + weight * temperature**2 * kl)

    assert loss == pytest.approx(definition(point), rel=1e-5)
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):
        direction = torch.randn(point.shape, generator=generator)
        direction /= direction.norm()
        step = 1e-2
        slope = (definition(point + step * direction) - definition(point - step * direction)) / (2 * step)
        assert float(grad @ direction) == pytest.approx(slope, rel=2e-2, abs=1e-4)


def test_both_executors_train_a_distillation_request_alike():
    """The term is not batched: the vectorized trainer trains its request alone, exactly as LocalTrainer does, next
    to a plain request it stacks."""
    model, point, x, y, teacher = _batch(3)
    empty = np.array([], np.int64)
    data = ClientData(x.numpy(), y.numpy(), np.arange(len(y)), empty, empty)
    settings = SGDSettings(name="distillation-test", lr=0.1, batch_size=4, epochs=2)
    requests = [
        settings.local_sgd(point.numpy(), terms=(Distillation(teacher, 0.7, 2.0),)),
        settings.local_sgd(point.numpy()),
    ]
    together = VectorizedTrainer(model, 4).sgd([(r, data, np.random.default_rng(i)) for i, r in enumerate(requests)])
    alone = LocalTrainer(model).sgd(requests[0], data, np.random.default_rng(0))
    np.testing.assert_array_equal(together[0].params, alone.params)
    assert np.abs(together[0].params - together[1].params).max() > 1e-4  # the teacher pulled it elsewhere
