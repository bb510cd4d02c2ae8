"""FedALA (raysim.algorithms.fedala; arXiv:2212.01197): with eta = 0 it is FedAvg; the gradient of the loss in the
aggregation weights W is grad f(theta) (.) (w - theta_i), as central differences on a quadratic give; W stays in
[0, 1]; the start phase learns W for several epochs and later rounds one; layer_idx 0 takes every tensor as the
authors' [-0:]; FullGradient's `indices` and `fraction`."""

from __future__ import annotations

import numpy as np
import pytest

from raysim.algorithms.requests import FullGradient
from raysim.config import validate_config
from raysim.errors import ConfigError
from tests.support.convex import orthogonal_regression
from tests.support.experiments import tiny_config
from tests.support.inprocess import InProcess

SGD = {"lr": 0.05, "batch_size": 16, "epochs": 1}


def _sim(name: str = "fedala", per_round: int = 3, **algorithm) -> InProcess:
    settings = {"name": name, **SGD, **algorithm}
    config = tiny_config(algorithm=settings, model={"name": "mlp"}, clients={"count": 4, "per_round": per_round})
    return InProcess(validate_config(config))


def _records(sim: InProcess, round_index: int) -> dict[int, dict]:
    """Each selected client's metrics of a round (and the server step run)."""
    selected = sorted(sim.states)[:4]
    partial, records = sim.host.train(round_index, selected, sim.coordinator.broadcast())
    sim.coordinator.aggregate(partial)
    table = records.to_pydict()
    return {c: {k: v[i] for k, v in table.items()} for i, c in enumerate(table["client_id"])}


def test_with_eta_zero_the_weights_stay_one_and_it_is_fedavg():
    """W = 1 gives theta = w on every layer (eq. 4), so the local training and the server are FedAvg's."""
    fedala, fedavg = _sim(eta=0.0), _sim("fedavg")
    for round_index in range(4):
        fedala.round(round_index)
        fedavg.round(round_index)
        np.testing.assert_allclose(fedala.coordinator.broadcast(), fedavg.coordinator.broadcast(), atol=1e-6)
    assert all(np.all(s.weights == 1) for s in fedala.states.values())
    assert max(s.participations for s in fedala.states.values()) >= 2  # ALA ran (from the second participation)


def test_the_weight_gradient_matches_central_differences_on_a_quadratic():
    """Linear regression: f(theta(W)) is quadratic in W, so central differences are exact up to rounding."""
    problem, _ = orthogonal_regression([1.0, 2.0], 40, 4, seed=3)
    config = validate_config(tiny_config(algorithm={"name": "fedala"}, clients={"count": 2}, model={"name": "linear"}))
    sim = InProcess(config, problem)
    algorithm, data, trainer = sim.host.algorithm, sim.host.data[0], sim.host.steps.executor.trainer
    generator = np.random.default_rng(0)
    local, w = generator.normal(size=(2, 4)).astype(np.float32)
    weights = generator.uniform(0.2, 0.8, size=4).astype(np.float32)

    def loss(at: np.ndarray) -> tuple[float, np.ndarray]:
        result = trainer.full_gradient(FullGradient(algorithm.mix(local, w, at.astype(np.float32))), data, None)
        return result.loss, result.grad

    analytic = algorithm.weight_gradient(loss(weights)[1], local, w)
    h = 1e-2
    numeric = [(loss(weights + h * e)[0] - loss(weights - h * e)[0]) / (2 * h) for e in np.eye(4)]
    np.testing.assert_allclose(analytic, numeric, rtol=2e-3, atol=1e-4)
    assert np.linalg.norm(analytic) > 0.1


def test_the_weights_stay_in_the_unit_box_and_learn_until_the_losses_settle_then_one_epoch():
    sim = _sim(per_round=4, eta=50.0, threshold=0.5, num_pre_loss=3, max_start_epochs=40)
    epochs = [_records(sim, r) for r in range(3)]
    assert all(e["ala_epochs"] == 0 for e in epochs[0].values())  # no local model yet: start from w
    assert all(e["ala_epochs"] > 3 for e in epochs[1].values())  # the start phase: until the std settles
    assert all(e["ala_epochs"] == 1 for e in epochs[2].values())  # then one epoch per round
    weights = np.concatenate([s.weights for s in sim.states.values()])
    assert weights.min() >= 0 and weights.max() <= 1
    assert (weights == 0).any() and (weights < 1).any()  # learned, and clipped at the box
    top = sim.host.algorithm.top
    assert top.start > 0 and weights.size == 4 * (sim.problem.init_params.size - top.start)  # the last layer only


def test_layer_idx_zero_mixes_every_tensor_as_the_authors_slice():
    every = _sim(layer_idx=0).host.algorithm
    tensors = len(every.params.offsets)
    assert every.top == _sim(layer_idx=tensors).host.algorithm.top == slice(0, every.params.size)
    assert _sim(layer_idx=1).host.algorithm.top.start == every.params.offsets[-1]


def test_full_gradient_on_positions_and_on_a_random_share():
    sim = _sim()
    data, trainer = sim.host.data[0], sim.host.steps.executor.trainer
    point = sim.problem.init_params
    n = len(data.train)
    some = np.array([3, 0, 5])
    picked = trainer.full_gradient(FullGradient(point, indices=some), data, None)
    model = sim.host.model
    import torch

    x, y = (torch.from_numpy(a) for a in data.batch(data.train[some]))
    loss, grad = model.loss_and_grad(torch.from_numpy(point.copy()), x, y)
    np.testing.assert_array_equal(picked.grad, grad.numpy())
    assert picked.indices is None
    drawn = trainer.full_gradient(FullGradient(point, fraction=0.8), data, np.random.default_rng(1))
    assert len(drawn.indices) == int(0.8 * n) == len(set(drawn.indices.tolist()))
    again = trainer.full_gradient(FullGradient(point, indices=drawn.indices), data, None)
    np.testing.assert_array_equal(again.grad, drawn.grad)
    with pytest.raises(ValueError, match="generator"):
        trainer.full_gradient(FullGradient(point, fraction=0.5), data, None)
    with pytest.raises(ValueError, match="fraction"):
        FullGradient(point, fraction=0.0)


def test_settings_outside_their_range_are_refused():
    with pytest.raises(ConfigError, match="rand_percent"):
        _sim(rand_percent=0)
    with pytest.raises(ConfigError, match="layer_idx"):
        _sim(layer_idx=-1)
