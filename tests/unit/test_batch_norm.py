"""Running statistics (BatchNorm) as part of a client's vector (raysim.models.spec.ParamSpec.statistics): laid out
after the parameters, trained as torch trains a BatchNorm network, scored as torch scores it in eval mode, never
moved by a gradient, a term or a frozen mask, and personal under the `normalization` preset (FedBN)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from raysim.algorithms.families.split import SplitSettings, allowed_presets, personal_mask
from raysim.algorithms.requests import LocalSGD
from raysim.algorithms.terms import Prox
from raysim.models import MODELS
from raysim.models.flat import FlatModel
from raysim.training.local import LocalTrainer
from raysim.training.vectorized import VectorizedTrainer
from tests.support.executors import CLASSES, INPUT, client_data

SHAPES = {
    "mlp_bn": INPUT,
    "cnn_bn": (3, 8, 8),
    "resnet8x4_bn": (3, 8, 8),
    "resnet32x4_bn": (3, 8, 8),
    "resnet18_bn": (3, 8, 8),
}
"""Each BatchNorm model of the zoo on a small input it takes."""


def _with_running_statistics() -> list[str]:
    """The registered models whose networks have BatchNorm, read from the networks themselves."""
    found = []
    for name in MODELS.names():
        if name in SHAPES:
            found.append(name)
        elif name.endswith("_bn"):
            raise AssertionError(f"{name}: add its input shape to SHAPES")
    return found


@pytest.mark.parametrize("name", _with_running_statistics())
def test_a_batchnorm_models_vector_carries_its_running_statistics_after_its_parameters(name):
    model = FlatModel(name, SHAPES[name], CLASSES)
    module = model.module
    running = [(n, b) for n, b in module.named_buffers() if b.is_floating_point()]
    assert running and model.has_statistics
    assert model.spec.statistics == tuple(n for n, _ in running)
    assert model.spec.names[-len(running) :] == model.spec.statistics
    assert model.spec.parameter_count == sum(p.numel() for p in module.parameters())
    assert model.spec.size == model.spec.parameter_count + sum(b.numel() for _, b in running)
    vector = model.initial_parameters(3)
    statistics = model.spec.unflatten(vector)
    for buffer_name, buffer in running:  # as built: mean 0, variance 1
        np.testing.assert_array_equal(statistics[buffer_name], buffer.numpy())
    assert not FlatModel(
        name.removesuffix("_bn") + ("_gn" if name == "resnet18_bn" else ""), SHAPES[name], 5
    ).has_statistics


def _torch_loop(model: FlatModel, start: np.ndarray, x: np.ndarray, y: np.ndarray, batches, lr, momentum):
    """The same steps as plain torch: the module in training mode, torch.optim.SGD, the given batches."""
    module = model.module
    module.load_state_dict({k: torch.tensor(v) for k, v in model.spec.unflatten(start).items()}, strict=False)
    module.train()
    optimizer = torch.optim.SGD(module.parameters(), lr=lr, momentum=momentum)
    for batch in batches:
        optimizer.zero_grad()
        nn.functional.cross_entropy(module(torch.from_numpy(x[batch])), torch.from_numpy(y[batch])).backward()
        optimizer.step()
    module.eval()
    state = module.state_dict()
    return np.concatenate([state[name].detach().numpy().reshape(-1) for name in model.spec.names])


@pytest.mark.parametrize("name", ["mlp_bn", "cnn_bn"])
def test_local_sgd_on_a_batchnorm_model_is_torchs_own_training_loop(name):
    """Parameters and running statistics after two epochs of SGD with momentum agree with torch's loop over the same
    batches: batch statistics while training, the running ones updated with momentum 0.1 by each batch."""
    shape = SHAPES[name]
    model = FlatModel(name, shape, CLASSES)
    source = np.random.default_rng(0)
    x = source.normal(1.0, 2.0, size=(40, *shape)).astype(np.float32)
    y = source.integers(0, CLASSES, 40).astype(np.int64)
    from raysim.training.local import ClientData, training_batches

    data = ClientData(x, y, np.arange(40), np.array([], np.int64), np.array([], np.int64))
    start = model.initial_parameters(1)
    request = LocalSGD(start, 2, 0.05, 8, momentum=0.9)
    got = LocalTrainer(model).sgd(request, data, np.random.default_rng(7)).params
    batches = list(training_batches(request, data.train, np.random.default_rng(7)))
    want = _torch_loop(FlatModel(name, shape, CLASSES), start, x, y, batches, 0.05, 0.9)
    statistics = model.spec.statistics_mask()
    assert not np.allclose(got[statistics], start[statistics])  # they moved
    np.testing.assert_allclose(got[statistics], want[statistics], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got[~statistics], want[~statistics], rtol=1e-4, atol=1e-5)


def test_scores_use_the_running_statistics_as_torchs_eval_mode():
    model = FlatModel("mlp_bn", INPUT, CLASSES)
    vector = model.initial_parameters(2)
    statistics = model.spec.statistics_mask()
    vector[statistics] = np.random.default_rng(0).uniform(0.5, 2.0, int(statistics.sum()))
    x = np.random.default_rng(1).normal(size=(6, *INPUT)).astype(np.float32)
    module = FlatModel("mlp_bn", INPUT, CLASSES).module
    module.load_state_dict({k: torch.tensor(v) for k, v in model.spec.unflatten(vector).items()}, strict=False)
    np.testing.assert_allclose(model.predict(vector, x), module.eval()(torch.from_numpy(x)).detach().numpy(), atol=1e-6)


def test_no_gradient_term_or_frozen_mask_moves_the_statistics_and_a_frozen_layer_keeps_them():
    """A prox term pulls every coordinate it is given towards its center, but the statistics are set by the batches
    alone (one step: both runs take their batch at the same parameters); coordinates frozen by a mask (a
    partial-personalization phase) keep their statistics too."""
    model = FlatModel("mlp_bn", INPUT, CLASSES)
    (data,) = client_data([30], seed=0)
    start = model.initial_parameters(1)
    statistics = model.spec.statistics_mask()
    plain = LocalTrainer(model).sgd(LocalSGD(start, 1, 0.1, 30), data, np.random.default_rng(3)).params
    center = np.full_like(start, 5.0)
    pulled = LocalSGD(start, 1, 0.1, 30, terms=(Prox(center, 1.0),))
    with_term = LocalTrainer(model).sgd(pulled, data, np.random.default_rng(3)).params
    assert not np.allclose(with_term[~statistics], plain[~statistics])
    np.testing.assert_array_equal(with_term[statistics], plain[statistics])
    assert not np.allclose(plain[statistics], start[statistics])
    frozen = np.zeros_like(statistics)
    frozen[model.spec.slice("7.weight")] = True  # only the head trains
    head_only = LocalTrainer(model).sgd(LocalSGD(start, 1, 0.1, 10, mask=frozen), data, np.random.default_rng(3))
    np.testing.assert_array_equal(head_only.params[~frozen], start[~frozen])


def test_a_batch_of_one_sample_is_normalized_by_the_running_statistics_and_leaves_them():
    """torch refuses BatchNorm1d training on one sample; the last batch of an epoch can be one."""
    model = FlatModel("mlp_bn", INPUT, CLASSES)
    (data,) = client_data([5], seed=2)
    start = model.initial_parameters(1)
    statistics = model.spec.statistics_mask()
    one_by_one = LocalTrainer(model).sgd(LocalSGD(start, 1, 0.1, 1), data, np.random.default_rng(0)).params
    np.testing.assert_array_equal(one_by_one[statistics], start[statistics])
    assert not np.allclose(one_by_one[~statistics], start[~statistics])


def test_the_vectorized_executor_trains_a_batchnorm_model_one_client_at_a_time_with_the_same_results():
    model = FlatModel("mlp_bn", INPUT, CLASSES)
    trainer = VectorizedTrainer(model, 4)
    assert trainer.mode == "sequential" and "running statistics" in trainer.unavailable
    clients = client_data([12, 20, 9], seed=1)
    requests = [LocalSGD(model.initial_parameters(i), 1, 0.1, 4) for i in range(3)]
    jobs = [(r, d, np.random.default_rng(i)) for i, (r, d) in enumerate(zip(requests, clients, strict=True))]
    together = trainer.sgd(jobs)
    alone = [LocalTrainer(model).sgd(r, d, np.random.default_rng(i)) for i, (r, d, _) in enumerate(jobs)]
    for got, want in zip(together, alone, strict=True):
        np.testing.assert_array_equal(got.params, want.params)


def test_the_normalization_preset_keeps_every_normalization_layer_personal_with_its_statistics():
    model = FlatModel("cnn_bn", SHAPES["cnn_bn"], CLASSES)
    assert "normalization" in allowed_presets(model.spec)
    mask = personal_mask(SplitSettings(name="fedbn", preset="normalization"), model.spec)
    personal = {name for name in model.spec.names if mask[model.spec.slice(name)].all()}
    assert personal == {
        f"{layer}.{part}" for layer in ("1", "5") for part in ("weight", "bias", "running_mean", "running_var")
    }
    assert "normalization" not in allowed_presets(FlatModel("mlp", INPUT, CLASSES).spec)
